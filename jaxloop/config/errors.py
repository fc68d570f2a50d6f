"""The exceptions both loops raise, and the exit status each ends a command with. Imports no jax, no tyro
and no torch: the loop raises them, the CLI (jaxloop.config.cli) maps them to exit statuses, and a user catches
them from `jaxloop.errors`."""

from __future__ import annotations

import signal
from typing import Any

# Exit statuses of both loops' CLIs (jaxloop.train and torch_ref.train).
EXIT_BAD_INPUT = 2
EXIT_NONFINITE = 1
EXIT_CHECKPOINT_WRITE = 3
EXIT_OUT_OF_MEMORY = 4
EXIT_SIGNAL: dict[int, int] = {signal.SIGINT: 130, signal.SIGTERM: 143}

VALUE_SHOWN = 300
"""An error message shows at most about this many characters of a value (short_repr)."""


class _Full(Exception):
    """short_repr's text reached its limit."""


def short_repr(value: Any, limit: int = VALUE_SHOWN) -> str:
    """repr(value), cut after `limit` characters: an error message's view of a value of any size (a YAML
    file's expansion, a 2**40 vocabulary, a cyclic list), built in work bounded by `limit`, not by the value."""
    out: list[str] = []
    size = 0

    def emit(text: str) -> None:
        nonlocal size
        out.append(text)
        size += len(text)
        if size > limit:
            raise _Full

    def walk(x: Any) -> None:
        if type(x) in (list, tuple, set, frozenset) and x:
            opening, closing = {list: ("[", "]"), tuple: ("(", ")"), set: ("{", "}"), frozenset: ("frozenset({", "})")}[
                type(x)
            ]
            emit(opening)
            for i, item in enumerate(x):
                emit(", " if i else "")
                walk(item)
            emit("," if type(x) is tuple and len(x) == 1 else "")
            emit(closing)
        elif type(x) is dict and x:
            emit("{")
            for i, (k, v) in enumerate(x.items()):
                emit(", " if i else "")
                walk(k)
                emit(": ")
                walk(v)
            emit("}")
        elif isinstance(x, (str, bytes)) and len(x) > limit:
            emit(repr(x[: limit + 1]))
        elif isinstance(x, int) and x.bit_length() > 4 * limit:  # repr would be over `limit` digits (or refused)
            emit(f"{'-' if x < 0 else ''}<an integer of {x.bit_length()} bits>")
        else:
            emit(repr(x))

    try:
        walk(value)
    except (_Full, RecursionError):  # RecursionError: a value nested deeper than the stack allows
        return "".join(out)[:limit] + f"... (cut at {limit} characters)"
    return "".join(out)


class ConfigError(ValueError):
    """A config value that is not allowed: names the field, the value and what is allowed (the CLI's wording
    in `cli_message`, the Python API's in str(error) where the two differ)."""

    def __init__(self, field_path: str, value: Any, allowed: str, python: str | None = None):
        self.field_path, self.value, self.allowed = field_path, value, allowed
        # where the way forward names flags, `python` words it in Config arguments for jaxloop.run's callers:
        # str(error) is that wording, and the CLI prints cli_message
        shown = short_repr(value)  # a value of any size, cut: the message stays one short line
        self.cli_message = f"{field_path}={shown} is not allowed: {allowed}"
        super().__init__(f"{field_path}={shown} is not allowed: {python}" if python else self.cli_message)


class NonFiniteError(RuntimeError):
    """Too many consecutive updates were skipped for a non-finite loss or gradient."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (a full disk, say); the message names the path, the error, the free
    space and the last good checkpoint, from which a rerun resumes."""


class OutOfMemoryError(RuntimeError):
    """The update fits the device's memory in no plan left to try (jaxloop.update.memory_plan); the message has the numbers."""


class Interrupted(Exception):
    """A SIGINT or SIGTERM arrived; the loop finished the update, saved, and stops with EXIT_SIGNAL[signum].
    `step`: the update saved; `run_dir`: the run's directory (for the line that says how to go on)."""

    def __init__(self, signum: int, step: int | None = None, run_dir: str | None = None):
        self.signum, self.step, self.run_dir = signum, step, run_dir
        super().__init__(signal.Signals(signum).name)


class UsageError(Exception):
    """A command line that cannot be parsed; its message is the one line shown to the user."""
