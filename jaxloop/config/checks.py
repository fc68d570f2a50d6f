"""The field checks every config class uses: each raises a ConfigError naming the field by its flag path,
the value, and what is allowed. One module, so that "an integer >= 1" or "a finite number" means the same
wherever a config checks it (the run's sections in jaxloop.config.run, an optimizer's or a schedule's class).
"""

from __future__ import annotations

import math
import os
from typing import Any, Literal, get_args

from jaxloop.config.errors import ConfigError

FLOAT32_TINY = 1.1754943508222875e-38
"""The smallest normal float32 (numpy.finfo(numpy.float32).tiny)."""


def check_type(path: str, v: Any, hint: Any) -> None:
    """ConfigError unless v is of type `hint` (ints count as floats; bools as neither)."""
    if getattr(hint, "__origin__", None) is Literal:
        if v not in get_args(hint):
            raise ConfigError(path, v, f"one of {', '.join(map(str, get_args(hint)))}")
    elif getattr(hint, "__origin__", None) is tuple:
        if not isinstance(v, tuple) or not all(is_int(x) for x in v):
            raise ConfigError(path, v, "a tuple of integers")
    elif hint is bool:
        if not isinstance(v, bool):
            raise ConfigError(path, v, "true or false")
    elif hint is int:
        if not is_int(v):
            raise ConfigError(path, v, "an integer")
    elif hint is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(path, v, "a finite number")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def at_least(path: str, v: float, low: float, allowed: str | None = None) -> None:
    if v < low:
        raise ConfigError(path, v, allowed or (f"an integer >= {low}" if is_int(v) else f"a number >= {low}"))


def within(path: str, v: float, low: float, high: float, closed_high: bool = False) -> None:
    """low <= v < high (or <= high)."""
    if not (low <= v <= high if closed_high else low <= v < high):
        raise ConfigError(path, v, f"a number in [{low:g}, {high:g}{']' if closed_high else ')'}")


def positive(path: str, v: float) -> None:
    if v <= 0:
        raise ConfigError(path, v, "an integer >= 1" if is_int(v) else "a number > 0")


def one_of(name: str, v: Any, allowed: tuple) -> None:
    if v not in allowed:
        raise ConfigError(name, v, f"one of {', '.join(allowed)}")


def finite(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(name, v, "a finite number")


def positive_float(name: str, v: Any) -> None:
    finite(name, v)
    if v <= 0:
        raise ConfigError(name, v, "a number > 0")


def nonneg_float(name: str, v: Any) -> None:
    finite(name, v)
    if v < 0:
        raise ConfigError(name, v, "a number >= 0")


def positive_int(name: str, v: Any) -> None:
    if not is_int(v) or v <= 0:
        raise ConfigError(name, v, "an integer >= 1")


def nonneg_int(name: str, v: Any) -> None:
    if not is_int(v) or v < 0:
        raise ConfigError(name, v, "an integer >= 0")


def readable_file(name: str, path: str) -> None:
    if not os.path.isfile(path):
        raise ConfigError(name, path, "an existing file")
    if not os.access(path, os.R_OK):
        raise ConfigError(name, path, "a readable file")
    if os.path.getsize(path) == 0:
        raise ConfigError(name, path, "a non-empty file")


def writable_dir(name: str, path: str) -> None:
    """The directory exists and is writable, or its nearest existing ancestor is."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(name, path, f"a writable directory ({probe} is not writable)")
