"""Metrics records as both loops write them (run_dir/metrics.jsonl) and the best-metric tracker."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loopcore.layout import METRICS_FILE, RunLayout  # noqa: F401  (METRICS_FILE: re-exported)


def read_records(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of run_dir/metrics.jsonl (an unfinished last line, from a killed run, is ignored)."""
    path = RunLayout(Path(run_dir)).metrics
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


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
