"""What Orbax reports that jaxloop reports itself (or that is noise for a run), kept off the console for a
scope only: absl's level and filters and sys.unraisablehook are process-wide, so each context manager here
puts back what it changed when its scope ends (jaxloop.checkpoint.manager enters them for a Checkpointer's life
and for one read).
"""

from __future__ import annotations

import contextlib
import gc
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


def settle_abandoned_tasks() -> None:
    """Finalize, here and quietly, the asyncio tasks a failed Orbax read or write leaves behind.

    Orbax reads (and writes) the arrays of a step with asyncio.gather, which stops at the first error; the
    others stay in reference cycles, finished with errors nobody retrieved or pending on a closed loop.
    Left to the cyclic collector they are finalized at an arbitrary later allocation, and asyncio
    logs them there; inside ast.parse (tyro parses docstrings) CPython 3.11.7 then raises SystemError
    ("AST constructor recursion depth mismatch", cpython#106905). The caller names the cause (restore()
    re-raises the read's error).
    """
    with _asyncio_reports_dropped(_AbandonedTaskReport()):
        pass


def abandoned_orbax_tasks_quiet() -> contextlib.AbstractContextManager[None]:
    """For a command's life: asyncio's reports of Orbax tasks a failed save abandoned ("exception was never
    retrieved", "destroyed but it is pending") dropped wherever the collector finalizes them, and those left
    finalized quietly at the end (the command has said what failed, in one line); every other report passes."""
    return _asyncio_reports_dropped(_AbandonedOrbaxTask())


@contextlib.contextmanager
def _asyncio_reports_dropped(report: logging.Filter) -> Iterator[None]:
    """asyncio's logger filtered by `report` for the scope, which ends with a collection: the abandoned tasks
    still in reference cycles are finalized while the filter is on, not at some later allocation."""
    asyncio_log = logging.getLogger("asyncio")
    asyncio_log.addFilter(report)
    try:
        yield
    finally:
        try:
            gc.collect()
        finally:
            asyncio_log.removeFilter(report)


class _AbandonedTaskReport(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("exception was never retrieved" in message or "destroyed but it is pending" in message)


class _AbandonedOrbaxTask(_AbandonedTaskReport):
    def filter(self, record: logging.LogRecord) -> bool:
        return super().filter(record) or "orbax" not in record.getMessage()
