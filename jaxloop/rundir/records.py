"""Metrics records as both loops write them (run_dir/metrics.jsonl) and the best-metric tracker."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxloop.rundir.atomic import TMP_SUFFIX, atomic_write_text
from jaxloop.rundir.layout import METRICS_FILE, RunLayout  # noqa: F401  (METRICS_FILE: re-exported)


def read_records(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of run_dir/metrics.jsonl (an unfinished last line, from a killed run, is ignored, as is
    a line that is not a JSON object in UTF-8: check_records names those)."""
    path = RunLayout(Path(run_dir)).metrics
    if not path.exists():
        return []
    records = []
    for line in path.read_bytes().splitlines():
        try:
            record = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


class MetricsFileError(ValueError):
    """metrics.jsonl holds a line, other than an unfinished last one, that is not a JSON record."""


def check_records(run_dir: str | Path) -> None:
    """MetricsFileError naming the first line of run_dir/metrics.jsonl, but the last (a killed run's unfinished
    write, which a resume drops), that is not a JSON object in UTF-8: a resume keeps every earlier record and
    would otherwise drop that one without a word."""
    path = RunLayout(Path(run_dir)).metrics
    if not path.exists():
        return
    lines = path.read_bytes().split(b"\n")
    for number, line in enumerate(lines[:-1], 1):  # the last element: after the final newline, or unfinished
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise MetricsFileError(
                f"{path} line {number}: byte {line[e.start]:#04x} at column {e.start + 1} is not UTF-8 text"
            ) from None
        except json.JSONDecodeError as e:
            raise MetricsFileError(f"{path} line {number} is not a JSON record ({e.msg})") from None
        if not isinstance(record, dict):
            raise MetricsFileError(f"{path} line {number} is not a JSON record (a {type(record).__name__})")


def kept_on_resume(record: dict[str, Any], start_step: int) -> bool:
    """Whether a resume at update `start_step` keeps a record: the records after the checkpoint are logged again
    by the resumed run. A skipped update's record (updated false) carries the count of updates before it, so one
    at start_step came after the checkpoint. The one rule of both loops (and of the run converter)."""
    step = record.get("step", 0)
    return step < start_step or (step == start_step and record.get("updated", True))


def rewrite_for_resume(run_dir: str | Path, start_step: int) -> list[dict[str, Any]]:
    """Keep only the records of run_dir/metrics.jsonl a resume at `start_step` keeps (kept_on_resume), replacing
    the file atomically (a kill at any instant leaves the old file or the new one whole); the kept records."""
    path = RunLayout(Path(run_dir)).metrics
    kept = [r for r in read_records(run_dir) if kept_on_resume(r, start_step)]
    for stale in path.parent.glob(f".{path.name}.*{TMP_SUFFIX}"):  # what rewrites killed before left (the
        stale.unlink(missing_ok=True)  # caller holds the run_dir: none is running)
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
    return kept


@dataclass
class BestTracker:
    """Best validation metric so far and evaluations since it improved (for early stopping)."""

    mode: str
    patience: int = 0
    best: float | None = None
    best_step: int | None = None
    since_best: int = 0

    def update(self, step: int, value: float) -> bool:
        """Record an evaluation; True when early stopping should end the run."""
        better = self.best is None or (value < self.best if self.mode == "min" else value > self.best)
        if better:
            self.best, self.best_step, self.since_best = value, step, 0
        else:
            self.since_best += 1
        return self.patience > 0 and self.since_best >= self.patience

    def as_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "since_best": self.since_best}

    def load(self, saved: dict[str, Any]) -> None:
        """Continue from as_dict() of a checkpointed run."""
        self.best, self.best_step, self.since_best = saved["best"], saved["best_step"], saved["since_best"]
