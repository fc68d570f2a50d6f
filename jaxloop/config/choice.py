"""The base of an optimizer's and a schedule's config class: a frozen dataclass that holds only the fields
its choice reads, checks their types, and names them by their flag path (optim.momentum, optim.plateau.eps).

Jax-free and torch-free: the CLI, jaxloop and torch_ref read the same classes (jaxloop.config.optimizers,
jaxloop.config.schedules); each class's `build` imports what it builds with when it is called.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar, get_type_hints

from jaxloop.config.checks import check_type


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


def registry(*classes: type[Choice]) -> dict[str, type[Choice]]:
    """{name: class} in the order given; a name given twice is a programming error."""
    out = {c.name: c for c in classes}
    if len(out) != len(classes):
        raise AssertionError(f"duplicate names among {[c.name for c in classes]}")
    return out
