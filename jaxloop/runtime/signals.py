"""Signals answered at once, even while the main thread is blocked in C (XLA compiling, a device wait).

A Python signal handler runs only when the main thread next runs Python code, which during a compile or
a long device call may be many seconds later. `watch_signals` also has the C-level handler write each
signal's number to a pipe (signal.set_wakeup_fd) that a watcher thread reads: `on_signal(signum)` runs
as soon as the signal arrives, and may print (an acknowledgement) or end the process (os._exit: no
traceback, no interpreter teardown racing XLA's threads).

    with watch_signals(lambda signum: ..., handler=...):    # the scope: previous handlers restored after
        ...

`CLI_SESSION` holds the command line's Session when it owns the process (`python -m jaxloop.train`):
there a Ctrl-C before the first update ends the process at once (Session.exit: the cleanups registered
with `on_abrupt_exit`, such as releasing the run_dir's lock record, run first); under research code
(jaxloop.run in a notebook) it is None and nothing ends the process. Imports no jax.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any


class Session:
    """The command line's ownership of the process: how it ends abruptly (after its cleanups)."""

    def __init__(self) -> None:
        self.cleanups: list[Callable[[], None]] = []

    def exit(self, status: int, line: str) -> None:
        """Run the cleanups (newest first; a failing one is passed over), then exit_now(status, line)."""
        for cleanup in reversed(list(self.cleanups)):
            with contextlib.suppress(Exception):
                cleanup()
        exit_now(status, line)


CLI_SESSION: contextvars.ContextVar[Session | None] = contextvars.ContextVar("jaxloop_cli_session", default=None)
"""The CLI's Session within `cli_session()` (None elsewhere): the command line, not research code, owns the
process. A watcher thread has a context of its own: read it on the main thread and keep it."""


@contextlib.contextmanager
def on_abrupt_exit(cleanup: Callable[[], None] | None) -> Iterator[None]:
    """Within: `cleanup` runs if the CLI's session ends the process at once (nothing, outside the CLI)."""
    session = CLI_SESSION.get()
    if session is None or cleanup is None:
        yield
        return
    session.cleanups.append(cleanup)
    try:
        yield
    finally:
        session.cleanups.remove(cleanup)


WATCHED = (signal.SIGINT, signal.SIGTERM)


def _ignore(signum: int, frame: Any) -> None:
    """The Python-level handler while watched: the watcher thread acts (no KeyboardInterrupt raised)."""


@contextlib.contextmanager
def watch_signals(
    on_signal: Callable[[int], None], handler: Callable[[int, Any], None] = _ignore, signals: tuple[int, ...] = WATCHED
) -> Iterator[bool]:
    """Within: `handler` is the Python-level handler of `signals` and `on_signal(signum)` runs on a watcher
    thread the moment each arrives. Yields whether the watch is on (only the main thread can set it)."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = {s: signal.signal(s, handler) for s in signals}
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def watch() -> None:
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:  # the write end closed: the scope ended
                return
            for signum in data:
                if signum in signals:
                    on_signal(signum)

    watcher = threading.Thread(target=watch, name="jaxloop-signals", daemon=True)
    watcher.start()
    try:
        yield True
    finally:
        signal.set_wakeup_fd(previous_fd)
        for s, h in previous.items():
            signal.signal(s, h)
        os.close(write_fd)
        watcher.join(timeout=5)
        os.close(read_fd)


def exit_now(status: int, line: str) -> None:
    """Print `line` on stderr and end the process at once with `status` (no cleanup that could hang or
    crash: the kernel releases the run_dir's flock; committed checkpoints are on disk)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        # on a terminal a progress bar may hold the current line without its newline: start a line of our own
        sys.stderr.write(("\n" if sys.stderr.isatty() else "") + line + "\n")
        sys.stderr.flush()
    os._exit(status)


@contextlib.contextmanager
def cli_session(prog: str) -> Iterator[None]:
    """The command line's whole run: a SIGINT or SIGTERM before the loop's own handling starts (imports,
    setup, the first compile) or after it ends prints one line and exits 130 / 143 at once."""
    from jaxloop.config.cli import EXIT_SIGNAL

    session = Session()

    def stop(signum: int) -> None:
        session.exit(
            EXIT_SIGNAL[signum],
            f"{prog}: {signal.Signals(signum).name} received outside the training "
            "loop (setup, or the summary after it): stopped at once; checkpoints already saved are kept",
        )

    token = CLI_SESSION.set(session)
    try:
        with watch_signals(stop):
            yield
    finally:
        CLI_SESSION.reset(token)
