"""The run directory: its files (config, metadata, resumes, summary) and the rules for starting or
resuming into it, the same for both loops.

Rules, checked before anything is written: resume=never needs an empty or new run_dir; resume=must
needs a checkpoint; a resumed run may not change a field that alters the trajectory (steps only with
allow_steps_change). Every resume is recorded in resumes.jsonl with the fields it changed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loopcore.config import Config, ConfigError, changed_fields, from_dict, resume_conflicts, to_dict
from loopcore.layout import CHECKPOINT_DIR, RunLayout  # noqa: F401  (CHECKPOINT_DIR: re-exported)
from loopcore.lock import is_lock_file


def ways_forward(run_dir: Path) -> str:
    """The two ways past a resume refused for a changed config: train the new settings in a new run_dir
    (from scratch, or from this run's weights), or continue this run with the settings it was saved with."""
    return (f"To train with the new settings, start a new run: --run_dir NEW_DIR (add --init_from {run_dir} to "
            f"start from this run's weights); to continue this run, resume it with its own settings: drop the "
            f"changed flags, or pass --config {RunLayout(run_dir).config}")


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
        saved = json.loads(self.layout.config.read_text()) if self.layout.config.exists() else None
        if cfg.resume == "never" and run_dir.exists() and any(not is_lock_file(p.name) for p in run_dir.iterdir()):
            raise ConfigError("resume", "never", f"an empty or new run_dir ({run_dir} is not empty; "
                              "use --resume auto to continue it or choose another --run_dir)")
        if cfg.resume == "must" and not has_checkpoint:
            raise ConfigError("resume", "must", f"a run_dir holding a checkpoint ({run_dir} has none)")
        if cfg.init_from and has_checkpoint and cfg.resume != "never":
            raise ConfigError("init_from", cfg.init_from, f"empty when the run resumes ({run_dir} holds a checkpoint; "
                              "drop --init_from to resume it, or choose another --run_dir)")
        if has_checkpoint and saved is not None:
            conflicts = resume_conflicts(saved, cfg)
            if conflicts:
                raise ConfigError("resume", cfg.resume, "a config that matches the checkpointed run; these "
                                  f"fields differ: {'; '.join(conflicts)} (steps may change with --allow_steps_change). "
                                  + ways_forward(run_dir))
        self.saved = saved if has_checkpoint else None
        return self.saved

    def start(self, metadata: dict[str, Any] | None = None) -> None:
        """Create the directory and write config.json (and metadata.json)."""
        if not self.writes:
            return
        self.path.mkdir(parents=True, exist_ok=True)
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
        path.write_text(json.dumps(obj, indent=2) + "\n")


def read_config(run_dir: str | Path | RunLayout) -> Config:
    """The Config saved with a run (its config.json): FileNotFoundError when it has none, ConfigError
    (or a JSON error, a ValueError) when the file is not a config."""
    layout = run_dir if isinstance(run_dir, RunLayout) else RunLayout.of(run_dir)
    if not layout.config.is_file():
        raise FileNotFoundError(f"{layout.root} is not a run directory (no {layout.config.name})")
    return from_dict(json.loads(layout.config.read_text()))
