"""The run directory: its files (config, metadata, resumes, summary) and the rules for starting or
resuming into it, the same for both loops.

Rules, checked before anything is written: a run writes only into its own directory (missing, empty, marked
with MARKER_FILE when a run started there, or an earlier version's run, made before the marker: a checkpoint
whose saved config jaxloop reads); resume=never needs an
empty or new run_dir; resume=must needs a checkpoint; a resumed run may not change a field that alters the
trajectory (steps only with allow_steps_change). Every resume is recorded in resumes.jsonl with the fields it changed.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from jaxloop.config.run import Config, ConfigError, changed_fields, from_dict, resume_conflicts, to_dict, upgrade
from jaxloop.rundir.atomic import atomic_write_text, is_temporary
from jaxloop.rundir.layout import (
    CHECKPOINT_CONFIG,
    CHECKPOINT_DIR,
    DAMAGED_DIR,
    HOOKS_DIR,
    MARKER_FILE,
    PROFILE_DIR,
    RUN_DIRS,
    RUN_FILES,
    TB_DIR,
    TORCH_CHECKPOINT,
    TORCH_CHECKPOINT_FORMAT,
    RunLayout,
)
from jaxloop.rundir.lock import is_lock_file
from jaxloop.rundir.outcome import EARLY_STOPPING
from jaxloop.rundir.records import MetricsFileError, check_records

FOREIGN_SHOWN = 4
"""A run_dir refused for holding other files names this many of them."""


def ways_forward(run_dir: Path, python: bool = False) -> str:
    """The two ways past a resume refused for a changed config: train the new settings in a new run_dir
    (from scratch, or from this run's weights), or continue this run with the settings it was saved with;
    in flags (the CLI) or, `python`, in Config arguments (jaxloop.run)."""
    if python:
        return (
            f"To train with the new settings, start a new run: Config(run_dir=NEW_DIR, ...) (add "
            f"init_from={str(run_dir)!r} to start from this run's weights); to continue this run, resume it "
            f"with its own settings: Config(run_dir={str(run_dir)!r}) alone, or keep the saved values of "
            f"the fields that differ"
        )
    return (
        f"To train with the new settings, start a new run: --run_dir NEW_DIR (add --init_from {run_dir} to "
        f"start from this run's weights); to continue this run, resume it with its own settings: "
        f"--run_dir {run_dir} alone, or drop the changed flags"
    )


def saved_config(run_dir: str) -> Config | None:
    """The config saved in run_dir (its config.json), as the base of a resume by name: its run_dir is the
    one given (the directory may have moved) and the per-launch fields (resume, allow_steps_change,
    init_from, data.allow_changed) are at their defaults. None when run_dir holds no readable config (a new run; a damaged
    file is the run_dir rules' to report)."""
    try:
        saved = from_dict(upgrade(json.loads(RunLayout(Path(run_dir).expanduser()).config.read_text()), stored=True))
    except (OSError, ValueError):  # ValueError: a JSON error or a ConfigError
        return None
    return replace(
        saved,
        run_dir=run_dir,
        resume="auto",
        allow_steps_change=False,
        init_from="",
        data=replace(saved.data, allow_changed=False),
    )


def resume_by_name(cfg: Config) -> Config:
    """Python's resume by name: `Config(run_dir=DIR)`, every other field at its default, resumes the run
    saved in DIR with its own config; any other cfg (or a DIR with no saved config) is returned as is."""
    if cfg != replace(Config(), run_dir=cfg.run_dir):
        return cfg
    return saved_config(cfg.run_dir) or cfg


class RunDir:
    """One run's directory. `writes=False` (every process but the primary) checks and writes nothing."""

    def __init__(self, cfg: Config, writes: bool = True):
        self.cfg, self.path, self.writes = cfg, Path(cfg.run_dir), writes
        self.layout = RunLayout(self.path)
        self.saved: dict[str, Any] | None = None

    @property
    def checkpoints(self) -> Path:
        return self.layout.checkpoints

    def check(self, has_checkpoint: bool) -> dict[str, Any] | None:
        """Apply the rules; the config saved with the checkpointed run being resumed, if any."""
        cfg, run_dir = self.cfg, self.path
        foreign = self.foreign_files()
        if foreign:
            shown = ", ".join(foreign[:FOREIGN_SHOWN]) + (
                f" and {len(foreign) - FOREIGN_SHOWN} more" if len(foreign) > FOREIGN_SHOWN else ""
            )
            raise ConfigError(
                "run_dir",
                str(run_dir),
                f"a missing or empty directory, or a run directory of "
                f"jaxloop's own, marked {MARKER_FILE} or holding a checkpoint jaxloop wrote ({run_dir} "
                f"holds other files: {shown}; a run writes config.json, summary.json, ... there): "
                "choose another --run_dir",
            )
        misplaced = self.misplaced()
        if misplaced:
            raise ConfigError(
                "run_dir",
                str(run_dir),
                f"a run directory whose files are files and whose "
                f"directories are directories ({'; '.join(misplaced)}): move them aside, or choose "
                "another --run_dir",
            )
        saved = self._saved_config() if has_checkpoint and cfg.resume != "never" else None
        if has_checkpoint and cfg.resume != "never":
            try:
                check_records(run_dir)
            except MetricsFileError as e:
                raise ConfigError(
                    "run_dir",
                    str(run_dir),
                    f"a run directory whose records a resume can keep ({e}; "
                    "repair or delete that line, or choose another --run_dir)",
                ) from None
        if (
            cfg.resume == "never"
            and run_dir.exists()
            and any(not is_lock_file(p.name) and p.name != MARKER_FILE for p in run_dir.iterdir())
        ):
            raise ConfigError(
                "resume",
                "never",
                f"an empty or new run_dir ({run_dir} is not empty; "
                "use --resume auto to continue it or choose another --run_dir)",
                python=f'an empty or new run_dir ({run_dir} is not empty; use resume="auto" to '
                "continue it or choose another Config(run_dir=...))",
            )
        if cfg.resume == "must" and not has_checkpoint:
            raise ConfigError("resume", "must", f"a run_dir holding a checkpoint ({run_dir} has none)")
        if cfg.init_from and has_checkpoint and cfg.resume != "never":
            raise ConfigError(
                "init_from",
                cfg.init_from,
                f"empty when the run resumes ({run_dir} holds a checkpoint; "
                "drop --init_from to resume it, or choose another --run_dir)",
                python=f"empty when the run resumes ({run_dir} holds a checkpoint; leave init_from "
                "out to resume it, or choose another Config(run_dir=...))",
            )
        if has_checkpoint and saved is not None:
            conflicts = resume_conflicts(saved, cfg)
            if conflicts:
                steps_changed = any(c.startswith("steps:") for c in conflicts)

                def steps_hint(flag: str) -> str:
                    return f" (steps may change with {flag})" if steps_changed else ""

                differ = f"a config that matches the checkpointed run; these fields differ: {'; '.join(conflicts)}"
                raise ConfigError(
                    "resume",
                    cfg.resume,
                    f"{differ}{steps_hint('--allow_steps_change')}. " + ways_forward(run_dir),
                    python=f"{differ}{steps_hint('allow_steps_change=True')}. " + ways_forward(run_dir, python=True),
                )
        self.saved = saved if has_checkpoint else None
        return self.saved

    def foreign_files(self) -> list[str]:
        """The files that make run_dir not this run's to write (sorted): none when it is missing, empty (but for
        the lock's files and atomic writes' temporaries), marked as a run's (MARKER_FILE), or a run of an earlier
        version, made before the marker (earlier_run). Files that merely look like a run's are the user's."""
        try:
            names = sorted(p.name for p in self.path.iterdir())
        except (FileNotFoundError, NotADirectoryError):
            return []
        names = [n for n in names if not is_lock_file(n) and not is_temporary(n) and not self._empty_own_dir(n)]
        if not names or MARKER_FILE in names or self.earlier_run():
            return []
        return names

    def misplaced(self) -> list[str]:
        """The run's own names that hold the wrong kind of thing (metrics.jsonl a directory, tb/ a file): a run
        would fail on them halfway, after writing; named before it writes anything."""
        wrong = [f"{self.path / n} is a directory, not a file" for n in RUN_FILES if (self.path / n).is_dir()]
        return wrong + [
            f"{self.path / n} is not a directory"
            for n in RUN_DIRS
            if (self.path / n).exists() and not (self.path / n).is_dir()
        ]

    def earlier_run(self) -> bool:
        """Whether run_dir is a run of a jaxloop from before MARKER_FILE: by evidence that jaxloop wrote it, a
        committed checkpoint (checkpoints/<update>/) whose copy of the run's config jaxloop reads as a Config;
        or torch_ref wrote it, a checkpoint file of its format beside a config.json read as a Config."""
        try:
            steps = sorted((p for p in self.checkpoints.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
        except OSError:
            return False
        if self._torch_ref_run():
            return True
        for step in reversed(steps):
            try:
                saved = json.loads((step / CHECKPOINT_CONFIG).read_bytes())
                if isinstance(saved, dict):
                    from_dict(upgrade(saved, stored=True))
                    return True
            except (OSError, ValueError, TypeError):  # ValueError: not JSON, or a ConfigError
                continue
        return False

    def _torch_ref_run(self) -> bool:
        """A run of torch_ref from before MARKER_FILE: a checkpoints/step_<update>.pt whose header line names
        torch_ref's format (read without torch), and the run's config.json read as a Config."""
        try:
            files = [p for p in self.checkpoints.iterdir() if TORCH_CHECKPOINT.match(p.name)]
            headed = False
            for path in files:
                with open(path, "rb") as f:
                    line = f.readline(4096)
                header = json.loads(line.decode("utf-8")) if line.endswith(b"\n") else None
                if isinstance(header, dict) and header.get("format") == TORCH_CHECKPOINT_FORMAT:
                    headed = True
                    break
            if not headed:
                return False
            saved = json.loads(self.layout.config.read_bytes())
            if isinstance(saved, dict):
                from_dict(upgrade(saved, stored=True))
                return True
        except (OSError, ValueError, TypeError):  # ValueError: not UTF-8 or JSON, or a ConfigError
            pass
        return False

    def _empty_own_dir(self, name: str) -> bool:
        """An empty directory of the run's layout made beforehand (checkpoints/ as a mount point, say)."""
        path = self.path / name
        return (
            name in (CHECKPOINT_DIR, DAMAGED_DIR, TB_DIR, PROFILE_DIR, HOOKS_DIR)
            and path.is_dir()
            and not any(path.iterdir())
        )

    def _saved_config(self) -> dict[str, Any] | None:
        """The config.json of the run being resumed (None if it has none); a ConfigError if it cannot be read."""
        path = self.layout.config
        if not path.exists():
            return None
        try:
            saved = json.loads(path.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            why = f"{type(e).__name__}: {e}".splitlines()[0]
            raise ConfigError(
                "run_dir",
                str(self.path),
                f"a run directory whose config.json can be read ({path} "
                f"is damaged: {why}); restore it from a copy, or choose another --run_dir",
            ) from None
        if not isinstance(saved, dict):
            raise ConfigError(
                "run_dir",
                str(self.path),
                f"a run directory whose config.json holds a config ({path} "
                f"holds a {type(saved).__name__}); restore it from a copy, or choose another --run_dir",
            )
        return saved

    def finished(self) -> dict[str, Any] | None:
        """The summary of the run saved here when it has already ended (its `steps` reached, or early
        stopping) and its newest checkpoint is that end: a re-run has nothing to do and must write nothing.
        None otherwise (a new, stopped, killed or lengthened run)."""
        cfg = self.cfg
        summary = self.layout.read_json(self.layout.summary) if cfg.resume != "never" else None
        if not isinstance(summary, dict) or not isinstance(summary.get("final_step"), int):
            return None
        end = summary["final_step"]
        steps = (
            sorted(int(p.name) for p in self.checkpoints.iterdir() if p.name.isdigit())
            if self.checkpoints.is_dir()
            else []
        )
        ended = end >= cfg.steps or summary.get("stop_reason") == EARLY_STOPPING
        return summary if ended and steps and steps[-1] == end else None

    def start(self, metadata: dict[str, Any] | None = None) -> None:
        """Create the directory, mark it as a run's (MARKER_FILE, first) and write config.json (and metadata.json)."""
        if not self.writes:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        if not self.layout.marker.exists():
            atomic_write_text(self.layout.marker, json.dumps({"created": time.time()}) + "\n")
        self.write_json(self.layout.config, to_dict(self.cfg))
        if metadata is not None:
            self.write_json(self.layout.metadata, metadata)

    def record_resume(self, step: int) -> None:
        """Append the resume at `step` and the fields this run changed to resumes.jsonl."""
        if not self.writes or self.saved is None:
            return
        with open(self.layout.resumes, "a") as f:
            f.write(json.dumps({"step": step, "changed": changed_fields(self.saved, self.cfg)}) + "\n")

    def must_have_resumed(self, restored: Any) -> None:
        """resume=must and no valid checkpoint was restored: the run cannot start."""
        if restored is None and self.cfg.resume == "must":
            raise ConfigError("resume", "must", f"a run_dir holding a valid checkpoint ({self.path} has none)")

    def write_summary(self, summary: dict[str, Any]) -> None:
        if self.writes:
            self.write_json(self.layout.summary, summary)

    def write_json(self, path: Path, obj: Any) -> None:
        """Replace a JSON file of the run atomically (jaxloop.rundir.atomic)."""
        atomic_write_text(path, json.dumps(obj, indent=2) + "\n")


def read_config(run_dir: str | Path | RunLayout) -> Config:
    """The Config saved with a run (its config.json): FileNotFoundError when it has none, ConfigError
    (or a JSON error, a ValueError) when the file is not a config."""
    layout = run_dir if isinstance(run_dir, RunLayout) else RunLayout.of(run_dir)
    if not layout.config.is_file():
        raise FileNotFoundError(f"{layout.root} is not a run directory (no {layout.config.name})")
    return from_dict(upgrade(json.loads(layout.config.read_text()), stored=True))
