"""The optim flags in config.json's nested form (--optim.optimizer.b1 0.95, --optim.lr_schedule.name step) read as
the flat flags they stand for (--optim.b1 0.95, --optim.schedule step), so that the paths a run stores are flags
too. A nested flag names a field of its part's chosen class or is refused, naming the flag and what that class
reads; a field given in both forms is refused. Imports no jax.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import get_type_hints

from jaxloop.config.errors import UsageError
from jaxloop.config.optimizers import OPTIMIZERS
from jaxloop.config.schedules import SCHEDULES

PARTS = {"optimizer": ("name", OPTIMIZERS), "lr_schedule": ("schedule", SCHEDULES)}
"""optim's nested keys -> (the flat flag that chooses the part's class, the classes it chooses among)."""


def nested_flags() -> set[str]:
    """Every nested optim flag, spelled with underscores: --optim.optimizer.name, --optim.optimizer.b1, ...,
    --optim.lr_schedule.patience (plateau's), booleans also as --optim.optimizer.no_nesterov."""
    flags = set()
    for part, (_, menu) in PARTS.items():
        flags.add(f"--optim.{part}.name")
        for cls in menu.values():
            hints = get_type_hints(cls)
            for f in cls.field_names():
                flags.add(f"--optim.{part}.{f}")
                if hints[f] is bool:
                    flags.add(f"--optim.{part}.no_{f}")
    return flags


def misplaced(flag: str) -> bool:
    """Whether `flag` (underscored) names under one part a field of the other (--optim.optimizer.warmup_steps):
    not a typo but a field put in the wrong place, which flatten_optim_flags explains."""
    part, dot, field = flag.removeprefix("--optim.").partition(".")
    other = next((p for p in PARTS if p != part), None) if part in PARTS and dot else None
    return other is not None and f"--optim.{other}.{field}" in nested_flags()


def _spelled(arg: str) -> tuple[str, str]:
    """(the flag with underscores for dashes, '=VALUE' or '') of an argument that starts with --."""
    name, eq, value = arg.partition("=")
    return "--" + name[2:].replace("-", "_"), eq + value


def _chosen(argv: Sequence[str], part: str, default: str) -> str:
    """The class name the command line chooses for `part` in either form, else `default`."""
    selector = PARTS[part][0]
    for i, arg in enumerate(argv):
        flag, value = _spelled(arg) if arg.startswith("--") else (arg, "")
        if flag in (f"--optim.{selector}", f"--optim.{part}.name"):
            return value[1:] if value else (argv[i + 1] if i + 1 < len(argv) else default)
    return default


def flatten_optim_flags(argv: Sequence[str], optimizer: str, schedule: str) -> list[str]:
    """argv with each nested optim flag replaced by the flat one it stands for (--optim.optimizer.X: --optim.X;
    --optim.lr_schedule.name: --optim.schedule; a plateau field: --optim.plateau.X), values untouched.
    `optimizer`, `schedule`: the classes chosen before the command line (preset, config file, saved run), unless
    it chooses others. UsageError for a nested flag that names no field of its part's chosen class, or a field
    given in both forms."""
    chosen = {"optimizer": _chosen(argv, "optimizer", optimizer), "lr_schedule": _chosen(argv, "lr_schedule", schedule)}
    out: list[str] = []
    given: dict[str, tuple[str, str]] = {}  # flat key -> (form, the flag as given) of the first flag that set it
    for arg in argv:
        flag, value = _spelled(arg) if arg.startswith("--optim.") else ("", "")
        if not flag:
            out.append(arg)
            continue
        part, dot, field = flag[len("--optim.") :].partition(".")
        if part in PARTS and dot:
            selector, menu = PARTS[part]
            cls = menu.get(chosen[part])
            if field == "name":
                flat = key = selector
            elif cls is None:  # an unknown class name: the flat flag says so (rewrite_flat)
                flat = key = field
            else:
                own = field[3:] if field.startswith("no_") and flag in nested_flags() else field
                if own not in cls.field_names():
                    other = next(p for p in PARTS if p != part)
                    elsewhere = (
                        f"; --optim.{other}.{own} is the {other.removeprefix('lr_')}'s" if misplaced(flag) else ""
                    )
                    raise UsageError(
                        f"{arg.split('=', 1)[0]}: optim.{part}.name={cls.name} has no field {own} (it reads "
                        f"{', '.join(cls.field_names()) or 'none'}){elsewhere}"
                    )
                flat, key = f"{cls.prefix}{field}", f"{cls.prefix}{own}"
            form = "nested"
            out.append(f"--optim.{flat}{value}")
        else:
            path = flag[len("--optim.") :]
            head, last = ("plateau.", path[len("plateau.") :]) if path.startswith("plateau.") else ("", path)
            key, form = head + (last[3:] if last.startswith("no_") else last), "flat"
            out.append(arg)
        if key in given and given[key][0] != form:
            raise UsageError(f"{given[key][1]} and {arg.split('=', 1)[0]} set the same field: give one of them")
        given.setdefault(key, (form, arg.split("=", 1)[0]))
    return out
