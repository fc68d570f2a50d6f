"""The base of an optimizer's and a schedule's config class: a frozen dataclass that holds only the fields
its choice reads, checks their types, and names them by their flag path (optim.momentum, optim.plateau.eps).

Jax-free and torch-free: the CLI, jaxloop and torch_ref read the same classes (jaxloop.core.optimizers_config,
jaxloop.core.schedules_config); each class's `build` imports what it builds with when it is called.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal, get_args, get_type_hints

from jaxloop.core.errors import ConfigError

FLOAT32_TINY = 1.1754943508222875e-38
"""The smallest normal float32 (numpy.finfo(numpy.float32).tiny)."""


@dataclass(frozen=True)
class Choice:
    """One entry of a menu (an optimizer or a schedule). Subclasses set `name` (the value of the flag that
    chooses them) and may set `prefix` (where their fields sit under optim.: "plateau." for plateau)."""

    name: ClassVar[str] = ""
    prefix: ClassVar[str] = ""
    selector: ClassVar[str] = ""
    """The OptimConfig flag whose value chooses the class: "name" (optimizers) or "schedule"."""

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def flag(cls, field: str) -> str:
        """The field's flag path: optim.momentum, optim.plateau.patience."""
        return f"optim.{cls.prefix}{field}"

    def check_types(self) -> None:
        """ConfigError for the first field whose value is not of its annotated type (a Literal's values,
        a finite number, an integer, true/false, a tuple of integers)."""
        hints = get_type_hints(type(self))
        for f in fields(self):
            check_type(self.flag(f.name), getattr(self, f.name), hints[f.name])


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


def registry(*classes: type[Choice]) -> dict[str, type[Choice]]:
    """{name: class} in the order given; a name given twice is a programming error."""
    out = {c.name: c for c in classes}
    if len(out) != len(classes):
        raise AssertionError(f"duplicate names among {[c.name for c in classes]}")
    return out
