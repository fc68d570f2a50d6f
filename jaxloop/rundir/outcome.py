"""How a run ends, as both loops report it: the stop reason and summary.json's fields.

The decision of when a run ends is jaxloop.config.cadence's; the exit status of each ending is jaxloop.config.cli's.
"""

from __future__ import annotations

import signal
from typing import Any

from jaxloop.rundir.records import BestTracker

COMPLETED = "completed"
EARLY_STOPPING = "early_stopping"


def signal_stop(signum: int) -> str:
    """The stop reason of a run stopped by a signal: "signal SIGTERM"."""
    return f"signal {signal.Signals(signum).name}"


def interrupted(stop_reason: str) -> bool:
    """Whether the run was stopped from outside (a signal; torch_ref's stop_after stands for one)."""
    return stop_reason.startswith("signal ") or stop_reason == "stop_after"


def final_evaluation_due(last_eval: dict[str, float], stop_reason: str) -> bool:
    """Whether the run evaluates once more for its summary: it did not evaluate in this session (it was
    resumed at its end, say) and it was not interrupted (which wants a fast exit, and writes no summary)."""
    return not last_eval and not interrupted(stop_reason)


def early_stopping_message(step: int, metric: str, patience: int) -> str:
    return f"early stopping at update {step}: no better {metric} in {patience} evaluations"


def summary(
    *,
    final_step: int,
    stop_reason: str,
    final: dict[str, float],
    tracker: BestTracker,
    metric: str,
    checkpoint_step: int | None,
    updates_per_s: float,
    skipped: int,
    digest: str,
    **extra: Any,
) -> dict[str, Any]:
    """summary.json's common fields (each loop adds its own: timings, wall time, device, ...).

    final: the last evaluation's metrics; best: the tracker's best `metric` and where it was, with the
    kept checkpoint that holds it; digest: the state digest (bit-identity of resumed runs)."""
    return {
        "final_step": int(final_step),
        "stop_reason": stop_reason,
        "final": dict(final),
        "best": {
            "metric": metric,
            "value": tracker.best,
            "step": tracker.best_step,
            "checkpoint_step": checkpoint_step,
        },
        "updates_per_s": float(updates_per_s),
        "skipped_updates": int(skipped),
        "state_digest": digest,
        **extra,
    }
