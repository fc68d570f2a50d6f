"""Command line -> validated Config, shared by `python -m jaxloop.train` and `python -m torch_ref.train`.

Order of precedence: preset defaults < config file (--config FILE, YAML or JSON) < flags. Flags are the
dotted field paths (`--optim.peak_lr 3e-4`; `--optim.peak-lr` works too), parsed by tyro. A run_dir
that holds a saved config replaces the preset's defaults (resume by name: `--run_dir DIR` alone). Every
error becomes one line on stderr naming the field, the value and what is allowed (an unknown flag: the
closest known one), and exit status 2.
Imports no jax.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import io
import re
import shlex
import sys
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tyro

from jaxloop.config.argv import foreign_flag, take_flag, take_option
from jaxloop.config.errors import (  # noqa: F401  (the exceptions' home is jaxloop.config.errors, free of tyro; kept importable here)
    EXIT_BAD_INPUT,
    EXIT_CHECKPOINT_WRITE,
    EXIT_NONFINITE,
    EXIT_OUT_OF_MEMORY,
    EXIT_SIGNAL,
    VALUE_SHOWN,
    CheckpointWriteError,
    Interrupted,
    NonFiniteError,
    OutOfMemoryError,
    UsageError,
)
from jaxloop.config.file import read_config_file
from jaxloop.config.optim_flags import flatten_optim_flags, misplaced, nested_flags
from jaxloop.config.optimizers import OPTIMIZERS
from jaxloop.config.run import Config, ConfigError, OptimShared, flat_hints, from_dict, preset, rewrite_flat, validate
from jaxloop.config.schedules import SCHEDULES
from jaxloop.rundir.layout import REPORT_FILE
from jaxloop.rundir.rules import saved_config


def parse_config(
    argv: Sequence[str], prog: str = "jaxloop.train", check_paths: bool = True, description: str = ""
) -> Config:
    """Parse and validate argv; raise ConfigError or UsageError (never SystemExit, except for --help, which
    begins with `description`: the train command's DESCRIPTION unless another command gives its own).

    Resume by name: when the run_dir named (by flag, config file or preset) holds a saved config.json, that
    config is the base instead of the preset's defaults, so `--run_dir DIR` alone resumes DIR's run; the
    flags given are then checked against it as any resume's are (jaxloop.rundir.rules)."""
    argv = list(argv)
    model_remat = take_flag(argv, "--model.remat"), take_flag(argv, "--model.no_remat", "--model.no-remat")
    check_flags(argv)
    preset_flag = take_option(argv, "--preset", keep=True)
    config_file = take_option(argv, "--config", keep=False)
    file_fields = read_config_file(config_file) if config_file else {}
    wanted_preset = preset_flag or file_fields.get("preset")
    base = preset(wanted_preset or "digits")
    run_dir = (
        take_option(argv, "--run_dir", keep=True)
        or take_option(argv, "--run-dir", keep=True)
        or file_fields.get("run_dir")
        or base.run_dir
    )
    resume = take_option(argv, "--resume", keep=True) or file_fields.get("resume") or "auto"
    stored = saved_config(str(run_dir)) if resume != "never" else None
    if stored is not None and wanted_preset in (None, stored.preset):
        base = stored
    base = from_dict(file_fields, base)
    argv = flatten_optim_flags(argv, base.optim.name, base.optim.schedule)
    _model_remat_flags(argv, *model_remat, base.memory.remat)
    cfg = _tyro_parse(argv, base, prog, description or DESCRIPTION)
    return validate(cfg, check_paths=check_paths)


def _model_remat_flags(argv: list[str], on: bool, off: bool, base_remat: str) -> None:
    """The flags of the former model.remat in today's terms (config.upgrade for files): --model.remat is
    --memory.remat blocks; --model.no-remat leaves memory.remat alone unless that is blocks from the config.
    A UsageError says what to write where the two cannot be one memory.remat."""
    flag = take_option(argv, "--memory.remat", keep=True)
    remat = flag or base_remat
    if on and remat not in ("none", "blocks"):
        raise UsageError(
            f"--model.remat is --memory.remat blocks now, which cannot be combined with "
            f"memory.remat={remat}: give one --memory.remat"
        )
    if on:
        if flag is not None:
            take_option(argv, "--memory.remat")
        argv += ["--memory.remat", "blocks"]
    elif off and flag is None and base_remat == "blocks":
        raise UsageError("--model.no-remat: model.remat=true is memory.remat=blocks now; write --memory.remat none")


def check_flags(argv: Sequence[str]) -> None:
    """UsageError for the first flag that names no field: another loop's name gets jaxloop's (argv.FOREIGN_FLAGS),
    a typo the closest known flag (`did you mean`), compared without the leading dashes that every flag shares."""
    known = known_flags()
    for arg in argv:
        if not arg.startswith("--"):
            continue
        name = arg.split("=", 1)[0]
        spelled = "--" + name[2:].replace("-", "_")
        if spelled in known or misplaced(spelled):  # misplaced: flatten_optim_flags names where it belongs
            continue
        foreign = foreign_flag(name)
        if foreign:
            raise UsageError(f"unknown flag {name}; {foreign}")
        close = difflib.get_close_matches(spelled[2:], sorted(k[2:] for k in known), n=1, cutoff=0.6)
        hint = f"; did you mean --{close[0]}?" if close else " (see --help)"
        raise UsageError(f"unknown flag {name}{hint}")


def known_flags() -> set[str]:
    """Every flag the CLI takes, spelled with underscores: the dotted fields (bools also as --no_...), optim's
    also in config.json's nested form (jaxloop.config.optim_flags), --preset, --config, --help."""
    flags = {"--help", "--config", *nested_flags()}
    for path, hint in _field_paths(_cli_class()):
        flags.add(f"--{path}")
        if hint is bool:
            head, _, last = path.rpartition(".")
            flags.add(f"--{head + '.' if head else ''}no_{last}")
    return flags


def _field_paths(cls: type, prefix: str = "") -> list[tuple[str, Any]]:
    hints = typing.get_type_hints(cls)
    out: list[tuple[str, Any]] = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += _field_paths(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", hints[f.name]))
    return out


def parse_or_exit(argv: Sequence[str], prog: str) -> Config:
    """parse_config for a `main()`: on bad input print one line to stderr and exit with status 2."""
    try:
        return parse_config(argv, prog)
    except (ConfigError, UsageError) as e:
        print(f"{prog}: error: {cli_text(e)}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT) from None


def cli_text(error: BaseException) -> str:
    """An error's message in the CLI's terms (flags, not Config arguments: ConfigError.cli_message)."""
    return getattr(error, "cli_message", None) or str(error)


def resume_command(prog: str, run_dir: str) -> str:
    """The command that continues the run saved in run_dir."""
    return f"python -m {prog} --run_dir {shlex.quote(str(run_dir))}"


def finish(
    prog: str, cfg: Config, run: Callable[[], Mapping[str, Any]], announce: Callable[[], bool] = lambda: True
) -> int:
    """Run `run()` (a whole training run) and map how it ended to the exit status, with one line on stderr:
    done (0), bad input (2), too many non-finite updates (1), a failed checkpoint write or a full disk (3),
    out of memory in every plan (4), a signal (130 / 143, after saving).
    `announce()`: whether to print the done line (only the process that writes the run's files does)."""
    failures = (
        (ConfigError, EXIT_BAD_INPUT),
        (NonFiniteError, EXIT_NONFINITE),
        (CheckpointWriteError, EXIT_CHECKPOINT_WRITE),
        (OutOfMemoryError, EXIT_OUT_OF_MEMORY),
    )
    try:
        summary = run()
    except tuple(kind for kind, _ in failures) as e:
        print(f"{prog}: error: {cli_text(e)}", file=sys.stderr)
        return next(status for kind, status in failures if isinstance(e, kind))
    except Interrupted as e:
        saved = f" at update {e.step}" if e.step is not None else ""
        print(
            f"{prog}: {e} received: saved and stopped{saved}; resume with: "
            f"{resume_command(prog, e.run_dir or cfg.run_dir)}",
            file=sys.stderr,
        )
        return EXIT_SIGNAL[e.signum]
    if announce() and not summary.get("already_complete"):  # jaxloop.run says that itself
        print(done_line(summary, cfg.run_dir, process_seconds()), file=sys.stderr)
    return 0


def process_seconds() -> float:
    """Seconds since this process started (imports, data, state and compiles included: what a user waited)."""
    import time

    import psutil

    return time.time() - psutil.Process().create_time()


def done_line(summary: Mapping[str, Any], run_dir: str, process_s: float | None = None) -> str:
    """The last line of a run: the updates this invocation ran apart from the run's total, in the process's
    time (`process_s`, since it started; else the run's own), or, for a run that had already ended, that it
    is complete and where its report is."""
    final = ", ".join(f"{k} {v:.4f}" for k, v in summary["final"].items())
    total = summary["final_step"]
    if summary.get("already_complete"):
        report = Path(run_dir) / REPORT_FILE
        where = f"report: {report}" if report.exists() else f"outputs in {run_dir}"
        return f"already complete: this run ended at update {total} ({summary['stop_reason']}); {final}; {where}"
    this = summary.get("updates_this_run", total)
    count = f"{this} updates" if this == total else f"{this} updates this time ({total} in all)"
    took = (
        f"{summary['wall_time_s']:.1f}s"
        if process_s is None
        else f"{process_s:.1f}s ({summary['wall_time_s']:.1f}s of it in jaxloop.run)"
    )
    return f"done: {count} in {took}; {final}; outputs in {run_dir}"


DESCRIPTION = """Train a jaxloop run. Flags are the dotted field paths below (--optim.peak_lr 3e-4).

--config FILE  a YAML or JSON file of fields (nested mappings or the config.json a run saves); precedence:
               --preset's defaults < --config FILE < flags.
--run_dir DIR  alone resumes the run saved in DIR with its own config; flags given with it are checked
               against that config (those that would change the run are refused, naming them).
--optim.name X --optim.schedule Y --help  lists only the fields optimizer X and schedule Y read.
--optim.optimizer.F, --optim.lr_schedule.F  config.json's paths, the same as --optim.F (--optim.lr_schedule.name:
               --optim.schedule; plateau's --optim.plateau.F); F must be a field of that part's class."""

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


def _tyro_parse(argv: list[str], base: Config, prog: str, description: str = "") -> Config:
    """tyro.cli over the config with its optim section in the flags' flat form (`_cli_class`), the optim flags
    given then put onto the chosen classes (jaxloop.config.run.rewrite_flat), with tyro's boxed multi-line
    errors reduced to their first line. `--help` after --optim.name X or --optim.schedule Y lists only X's and
    Y's fields."""
    err = io.StringIO()
    cls = _cli_class(*_help_choices(argv)) if "--help" in argv or "-h" in argv else _cli_class()
    optim_cls = typing.get_type_hints(cls)["optim"]
    o, names = base.optim, {f.name for f in dataclasses.fields(optim_cls)}
    current = {"name": o.name, "schedule": o.schedule, **{k: getattr(o, k) for k in _shared()}}
    for part in (o.optimizer, o.lr_schedule):
        current.update({part.prefix.rstrip("."): part} if part.prefix else dataclasses.asdict(part))
    default = cls(
        **{f.name: getattr(base, f.name) for f in dataclasses.fields(Config) if f.name != "optim"},
        optim=optim_cls(**{k: v for k, v in current.items() if k in names}),
    )
    try:
        with contextlib.redirect_stderr(err):
            parsed = tyro.cli(
                cls, default=default, args=argv, prog=prog, use_underscores=True, description=description or DESCRIPTION
            )
    except SystemExit as e:
        if e.code in (0, None):
            raise
        message = _first_section(err.getvalue()) or "invalid command line"
        # a value tyro quotes is shown as ConfigError shows one: cut after VALUE_SHOWN characters
        message = re.sub(
            f"'[^']{{{VALUE_SHOWN + 1},}}'",
            lambda m: f"{m[0][: VALUE_SHOWN + 1]}... (cut at {VALUE_SHOWN} characters)'",
            message,
        )
        raise UsageError(f"{message} (see --help)") from None
    given = {k: getattr(parsed.optim, k) for k in _optim_flags_given(argv)}
    return Config(
        **{f.name: getattr(parsed, f.name) for f in dataclasses.fields(Config) if f.name != "optim"},
        optim=rewrite_flat(o, given),
    )


def _shared() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(OptimShared))


def _optim_flags_given(argv: list[str]) -> list[str]:
    """The flat optim keys argv's flags name (--optim.no-nesterov: nesterov; --optim.plateau.patience: plateau):
    only these are put onto the classes, so that a class chosen by --optim.name keeps its own defaults."""
    keys = []
    for arg in argv:
        if arg.startswith("--optim."):
            key = arg.split("=", 1)[0][len("--optim.") :].replace("-", "_").split(".")[0]
            keys.append(key[3:] if key.startswith("no_") and key[3:] in flat_hints() else key)
    return list(dict.fromkeys(keys))


def _help_choices(argv: list[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The optimizer and schedule named on the command line (all when none is), for --help."""
    chosen = []
    for flag, menu in (("name", OPTIMIZERS), ("schedule", SCHEDULES)):
        value = take_option(list(argv), f"--optim.{flag}", keep=True)
        chosen.append((value,) if value in menu else tuple(menu))
    return chosen[0], chosen[1]


def _cli_class(names: tuple[str, ...] = tuple(OPTIMIZERS), schedules: tuple[str, ...] = tuple(SCHEDULES)) -> type:
    """Config as tyro parses it: its optim section in the flat form (jaxloop.config.run.flat_hints), a dataclass
    whose bases are the chosen optimizer and schedule classes, so that --help shows each field with its
    class's docstring. `names`, `schedules`: the choices whose fields it holds (all, or --help's)."""
    chosen = [OPTIMIZERS[n] for n in names] + [SCHEDULES[n] for n in schedules]
    # a class another chosen one derives from is in the MRO already (and may not precede it among the bases)
    bases = [c for c in chosen if not c.prefix and not any(c is not d and issubclass(d, c) for d in chosen)]
    hints = flat_hints()

    def menu(cls_of: dict[str, Any], selector: str) -> str:
        return (
            "; ".join(f"{n}: {_first_sentence(c.__doc__ or '')}" for n, c in cls_of.items())
            + f" (--optim.{selector} X --help lists X's fields)"
        )

    name_hint, schedule_hint = hints["name"], hints["schedule"]
    own: list[tuple[str, Any, Any]] = [
        (
            "name",
            typing.Annotated[name_hint, tyro.conf.arg(help=menu(OPTIMIZERS, "name"))],
            dataclasses.field(default=names[0] if len(names) == 1 else next(iter(OPTIMIZERS))),
        ),
        (
            "schedule",
            typing.Annotated[schedule_hint, tyro.conf.arg(help=menu(SCHEDULES, "schedule"))],
            dataclasses.field(default=schedules[0] if len(schedules) == 1 else next(iter(SCHEDULES))),
        ),
    ]
    own += [(c.prefix.rstrip("."), c, dataclasses.field(default_factory=c)) for c in chosen if c.prefix]
    optim = dataclasses.make_dataclass("optim", own, bases=(OptimShared, *bases), frozen=True)
    return dataclasses.make_dataclass(
        "Config", [("optim", optim, dataclasses.field(default_factory=optim))], bases=(Config,), frozen=True
    )


def _first_sentence(doc: str) -> str:
    """A docstring's first sentence on one line, without its period (a sentence may wrap: plateau's does)."""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    return re.split(r"(?<!\.)\.(?:\s|$)", paragraph + " ", maxsplit=1)[0]
