"""What Orbax reports that jaxloop reports itself (or that is noise for a run), kept off the console for a
scope only: absl's level and filters and sys.unraisablehook are process-wide, so each context manager here
puts back what it changed when its scope ends (jaxloop.checkpoint.manager enters them for a Checkpointer's life
and for one read).
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def quiet_absl(level: int = logging.NOTSET, *filters: logging.Filter) -> Iterator[None]:
    """absl's logger (Orbax's) at least as quiet as `level`, with `filters`, for the scope. On exit the
    filters are removed and the level put back, unless someone changed it meanwhile (theirs is kept)."""
    absl = logging.getLogger("absl")
    before = absl.level
    chosen = max(level, before)
    absl.setLevel(chosen)
    for f in filters:
        absl.addFilter(f)
    try:
        yield
    finally:
        for f in filters:
            absl.removeFilter(f)
        if absl.level == chosen:
            absl.setLevel(before)


@contextlib.contextmanager
def abandoned_writes_dropped() -> Iterator[None]:
    """sys.unraisablehook wrapped by DropAbandonedWrites for the scope; on exit the previous hook is put
    back, or, when another hook was installed over it meanwhile, this one only stops dropping."""
    hook = DropAbandonedWrites(sys.unraisablehook)
    sys.unraisablehook = hook
    try:
        yield
    finally:
        hook.active = False
        if sys.unraisablehook is hook:
            sys.unraisablehook = hook.previous


@contextlib.contextmanager
def quiet_checkpointing() -> Iterator[None]:
    """For a Checkpointer's life: Orbax's INFO line per save and its warning per save without validation
    metrics (by design: best tracking ranks only evaluated saves) off; its error reports of a failed write,
    and what the failed save's abandoned writes leave behind, dropped (the Checkpointer raises the failure
    itself, as one CheckpointWriteError line)."""
    with quiet_absl(logging.WARNING, NoMetricsWarning(), OrbaxErrors()), abandoned_writes_dropped():
        yield


class OrbaxErrors(logging.Filter):
    """Orbax's own error reports (absl, ERROR: a failed background write, with its traceback)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname)


class NoMetricsWarning(logging.Filter):
    """Orbax's warning that a save carries no metrics."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "did not provide metrics" not in record.getMessage()


class MessageFilter(logging.Filter):
    """Drops the records whose message contains `text`."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


class DropAbandonedWrites:
    """sys.unraisablehook that drops what the writes of a failed save leave behind: tensorstore's callbacks
    into Orbax's closed event loop (RuntimeError "Event loop is closed") and the errors of writes into an
    unfinished step (N.orbax-checkpoint-tmp) nobody retrieved; everything else (and everything once its
    scope ended) goes to the hook it wraps."""

    def __init__(self, previous: Any):
        self.previous = previous
        self.active = True

    def __call__(self, unraisable: Any) -> None:
        error = unraisable.exc_value
        if self.active and (
            isinstance(error, RuntimeError)
            and str(error) == "Event loop is closed"
            or ".orbax-checkpoint-tmp" in str(error)
        ):
            return
        self.previous(unraisable)


def close_abandoned_reads() -> None:
    """Close, here, the read coroutines a failed Orbax restore left suspended.

    Orbax reads the arrays of a step with asyncio.gather on an event loop of its own and closes that loop
    at the first error, so the other reads stay suspended. Python closes each when it is collected (at
    any later allocation, or at exit), and Orbax's read turns that GeneratorExit into an Exception, which
    Python prints as "Exception ignored in: <coroutine object _read_array_index_and_device_put>" with a
    long traceback, on a run that fell back to the previous checkpoint and ended with exit 0. Closed now,
    with what they raise dropped, they leave nothing to print. Only suspended coroutines of Orbax's files
    whose names say they read are touched: a save's writes in flight are not reads.
    """
    marker = f"{os.sep}orbax{os.sep}"
    for obj in gc.get_objects():
        if not inspect.iscoroutine(obj) or inspect.getcoroutinestate(obj) != inspect.CORO_SUSPENDED:
            continue
        code = obj.cr_code
        if marker in code.co_filename and any(word in code.co_name for word in READ_WORDS):
            with contextlib.suppress(BaseException):  # what a read raises on close is the failure restore() reports
                obj.close()


READ_WORDS = ("read", "deserializ", "restore", "load")
"""Words in the names of Orbax's read coroutines (serialization's _read_array_index_and_device_put, the
handlers' deserialize, ...); its writes are named for writing and serializing."""
