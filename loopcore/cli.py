"""Command line -> validated Config, shared by `python -m jaxloop.train` and `python -m torch_ref.train`.

Order of precedence: preset defaults < config file (--config FILE, YAML or JSON) < flags. Flags are the
dotted field paths (`--optim.peak_lr 3e-4`; `--optim.peak-lr` works too), parsed by tyro. Every error
becomes one line on stderr naming the field, the value and what is allowed, and exit status 2.
Imports no jax.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import tyro

from loopcore.config import Config, ConfigError, from_dict, preset, validate
from loopcore.errors import (  # noqa: F401  (the exceptions' home is loopcore.errors, free of tyro; kept importable here)
    EXIT_BAD_INPUT, EXIT_CHECKPOINT_WRITE, EXIT_NONFINITE, EXIT_OUT_OF_MEMORY, EXIT_SIGNAL, CheckpointWriteError,
    Interrupted, NonFiniteError, OutOfMemoryError, UsageError)


def parse_config(argv: Sequence[str], prog: str = "jaxloop.train", check_paths: bool = True) -> Config:
    """Parse and validate argv; raise ConfigError or UsageError (never SystemExit, except for --help)."""
    argv = list(argv)
    preset_name = _take_option(argv, "--preset", keep=True) or "digits"
    config_file = _take_option(argv, "--config", keep=False)
    base = preset(preset_name)
    if config_file:
        base = from_dict(_read_config_file(config_file), base)
        if base.preset != preset_name and "--preset" not in " ".join(argv):
            base = from_dict(_read_config_file(config_file), preset(base.preset))
    cfg = _tyro_parse(argv, base, prog)
    return validate(cfg, check_paths=check_paths)


def parse_or_exit(argv: Sequence[str], prog: str) -> Config:
    """parse_config for a `main()`: on bad input print one line to stderr and exit with status 2."""
    try:
        return parse_config(argv, prog)
    except (ConfigError, UsageError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT) from None


def finish(prog: str, cfg: Config, run: Callable[[], dict[str, Any]],
           announce: Callable[[], bool] = lambda: True) -> int:
    """Run `run()` (a whole training run) and map how it ended to the exit status, with one line on stderr:
    done (0), bad input (2), too many non-finite updates (1), a failed checkpoint write or a full disk (3),
    out of memory in every plan (4), a signal (130 / 143, after saving).
    `announce()`: whether to print the done line (only the process that writes the run's files does)."""
    failures = ((ConfigError, EXIT_BAD_INPUT), (NonFiniteError, EXIT_NONFINITE),
                (CheckpointWriteError, EXIT_CHECKPOINT_WRITE), (OutOfMemoryError, EXIT_OUT_OF_MEMORY))
    try:
        summary = run()
    except tuple(kind for kind, _ in failures) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return next(status for kind, status in failures if isinstance(e, kind))
    except Interrupted as e:
        print(f"{prog}: {e} received: saved and stopped", file=sys.stderr)
        return EXIT_SIGNAL[e.signum]
    if announce():
        final = ", ".join(f"{k} {v:.4f}" for k, v in summary["final"].items())
        print(f"done: {summary['final_step']} updates in {summary['wall_time_s']:.1f}s; {final}; "
              f"outputs in {cfg.run_dir}", file=sys.stderr)
    return 0


def _take_option(argv: list[str], name: str, keep: bool) -> str | None:
    """Read `name VALUE` or `name=VALUE` from argv (removing it unless keep)."""
    for i, arg in enumerate(argv):
        if arg == name:
            if i + 1 >= len(argv):
                raise UsageError(f"{name} needs a value")
            value = argv[i + 1]
            if not keep:
                del argv[i : i + 2]
            return value
        if arg.startswith(name + "="):
            if not keep:
                del argv[i]
            return arg.split("=", 1)[1]
    return None


def _read_config_file(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError("--config", path, f"a readable YAML or JSON file ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ConfigError("--config", path, f"a UTF-8 text file (byte {e.object[e.start]:#04x} at offset {e.start} "
                          "is not UTF-8)") from None
    try:
        if path.endswith(".json"):
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:  # noqa: BLE001 - any parser error is bad input
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError("--config", path, f"valid YAML or JSON ({first})") from None
    if not isinstance(data, dict):
        raise ConfigError("--config", path, "a mapping of config fields")
    return data


_BOX = re.compile(r"[╭╮╰╯│─]+")


def _first_section(boxed: str) -> str:
    """The body of tyro's first error box, wrapped lines joined: the message without its chrome."""
    body: list[str] = []
    for raw in boxed.splitlines()[1:]:
        if re.fullmatch(r"[\s│─╰╯]*", raw) or "helptext" in raw:
            if body:
                break
            continue
        body.append(_BOX.sub(" ", raw).strip())
    return " ".join(body)


def _tyro_parse(argv: list[str], base: Config, prog: str) -> Config:
    """tyro.cli with its boxed multi-line errors reduced to their first line."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return tyro.cli(Config, default=base, args=argv, prog=prog, use_underscores=True)
    except SystemExit as e:
        if e.code in (0, None):
            raise
        message = _first_section(err.getvalue()) or "invalid command line"
        raise UsageError(f"{message} (see --help)") from None
