"""The run directory's layout: the one place that names its files, for every writer and reader.

    run_dir/
      config.json      the resolved config             metadata.json  what produced the run
      model.json       the trained state's structure (every leaf's path, shape, dtype; the model's class)
      metrics.jsonl    train, eval and hook records     summary.json   the end-of-run summary
      resumes.jsonl    one line per resume              vocab.json     a text source's vocabulary
      checkpoints/     Orbax (jaxloop) or torch files   checkpoints_damaged/  steps moved aside
      tb/              TensorBoard events               profile/       jax.profiler traces
      hooks/           images logged by hooks           report.md, *.png      the run report
      .lock            the run's flock (jaxloop.rundir.lock)  .lock.holder.json     who holds it, until when
      .jaxloop-run     written first, when the run starts: this directory is a run's (jaxloop.rundir.rules)

Both loops, the report, the sampler, --init_from and the converters read a run through `RunLayout`,
never through a file name of their own. Imports nothing of the project.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
METADATA_FILE = "metadata.json"
MODEL_FILE = "model.json"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
RESUMES_FILE = "resumes.jsonl"
VOCAB_FILE = "vocab.json"
LOCK_FILE = ".lock"
HOLDER_FILE = ".lock.holder.json"
CHECKPOINT_DIR = "checkpoints"
DAMAGED_DIR = "checkpoints_damaged"
TB_DIR = "tb"
PROFILE_DIR = "profile"
HOOKS_DIR = "hooks"
REPORT_FILE = "report.md"
MARKER_FILE = ".jaxloop-run"
RUN_FILES = (
    CONFIG_FILE,
    METADATA_FILE,
    MODEL_FILE,
    METRICS_FILE,
    SUMMARY_FILE,
    RESUMES_FILE,
    VOCAB_FILE,
    REPORT_FILE,
    MARKER_FILE,
)
"""The names a run writes as files."""
RUN_DIRS = (CHECKPOINT_DIR, DAMAGED_DIR, TB_DIR, PROFILE_DIR, HOOKS_DIR)
"""The names a run writes as directories."""
TORCH_CHECKPOINT = re.compile(r"^step_(\d{8,})\.pt$")
"""torch_ref's checkpoint files in checkpoints/ (jaxloop's are Orbax directories named by their update)."""
TORCH_CHECKPOINT_FORMAT = "torch_ref-checkpoint-1"
"""The `format` of the JSON header line that begins each of torch_ref's checkpoint files."""
CHECKPOINT_CONFIG = "config/metadata"
"""A checkpoint's copy of the run's config (Orbax's JSON item `config`), relative to checkpoints/<update>/."""


@dataclass(frozen=True)
class RunLayout:
    """The paths of one run directory (nothing is created or read by building one)."""

    root: Path

    @classmethod
    def of(cls, run_dir: str | Path) -> RunLayout:
        """The layout of `run_dir`, or of the run whose checkpoints/ directory `run_dir` is."""
        path = Path(run_dir)
        if path.name == CHECKPOINT_DIR and not (path / CHECKPOINT_DIR).is_dir():
            path = path.parent
        return cls(path)

    config = property(lambda self: self.root / CONFIG_FILE)
    metadata = property(lambda self: self.root / METADATA_FILE)
    model = property(lambda self: self.root / MODEL_FILE)
    metrics = property(lambda self: self.root / METRICS_FILE)
    summary = property(lambda self: self.root / SUMMARY_FILE)
    resumes = property(lambda self: self.root / RESUMES_FILE)
    vocab = property(lambda self: self.root / VOCAB_FILE)
    lock = property(lambda self: self.root / LOCK_FILE)
    holder = property(lambda self: self.root / HOLDER_FILE)
    checkpoints = property(lambda self: self.root / CHECKPOINT_DIR)
    damaged = property(lambda self: self.root / DAMAGED_DIR)
    tb = property(lambda self: self.root / TB_DIR)
    profile = property(lambda self: self.root / PROFILE_DIR)
    hooks = property(lambda self: self.root / HOOKS_DIR)
    report = property(lambda self: self.root / REPORT_FILE)
    marker = property(lambda self: self.root / MARKER_FILE)

    def plot(self, name: str) -> Path:
        """One of the report's figures (`loss`, `lr`, `throughput`): run_dir/<name>.png."""
        return self.root / f"{name}.png"

    def read_json(self, path: Path) -> Any:
        """A JSON file of the run, or None when it is missing or unreadable (a killed run's partial file)."""
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None
