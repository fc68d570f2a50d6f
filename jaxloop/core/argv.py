"""Reading the few options a command handles itself out of argv, before tyro parses the rest: the one scanner
of `python -m jaxloop.train` (--preset, --config, --run_dir, --resume), torch_ref.train (--clip) and
jaxloop.schedule (--at, --plot). Imports nothing but jaxloop.core.errors."""

from __future__ import annotations

from jaxloop.core.errors import UsageError


def take_option(argv: list[str], name: str, keep: bool = False, allowed: str = "") -> str | None:
    """The value of the first `name VALUE` or `name=VALUE` in argv (None when absent), removed from argv unless
    `keep`. `name` last with no value: a UsageError "NAME needs a value" (then `: allowed`, when given)."""
    for i, arg in enumerate(argv):
        if arg == name:
            if i + 1 >= len(argv):
                raise UsageError(f"{name} needs a value{': ' + allowed if allowed else ''}")
            value = argv[i + 1]
            if not keep:
                del argv[i : i + 2]
            return value
        if arg.startswith(name + "="):
            if not keep:
                del argv[i]
            return arg.split("=", 1)[1]
    return None


def take_flag(argv: list[str], *names: str) -> bool:
    """Whether argv holds one of the valueless flags `names` (each spelling of one flag); every occurrence is
    removed from argv."""
    found = [a for a in argv if a in names]
    argv[:] = [a for a in argv if a not in names]
    return bool(found)
