"""When a run logs, evaluates, saves and ends, and how many updates one device call runs: the rule
both loops follow (torch_ref one update at a time, jaxloop in calls of several).

Evaluation and checkpoints come every `eval_every` / `save_every` updates (0: only at the end) and at
the end; a save is also made wherever the run ends early (early stopping, a signal, a hook's stop).
The step counted here is the state's count of applied updates; skipped (non-finite) updates do not
advance it.

jaxloop dispatches `per_call` updates (K x per_call micro-batches, one lax.scan) per call: the largest
count up to a maximum that divides `steps` and the cadence of every periodic action that reads the
state (evaluation, saving, a hook of the user's), so those fall on call boundaries. Logs and hooks
that only read metrics take them from the call's per-update metrics and bound nothing. After a call
that skipped updates the loop dispatches single updates until it is back on the grid.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from jaxloop.core.config import Config

MAX_UPDATES_PER_CALL = 50
"""Default bound of updates dispatched in one call (bounds the micro-batches stacked on the device)."""


@dataclass(frozen=True)
class Cadence:
    """The log / evaluate / save / end rule of a run of `steps` updates."""

    steps: int
    log_every: int
    eval_every: int  # 0: only at the end
    save_every: int  # 0: only at the end

    @classmethod
    def of(cls, cfg: Config) -> Cadence:
        return cls(cfg.steps, cfg.log_every, cfg.eval_every, cfg.checkpoint.every)

    def logs(self, step: int) -> bool:
        return step % self.log_every == 0 or step >= self.steps

    def evaluates(self, step: int) -> bool:
        return due(self.eval_every, step) or step >= self.steps

    def saves(self, step: int, ending: bool = False) -> bool:
        """Whether the state at `step` is saved; `ending`: the run stops there (any reason)."""
        return due(self.save_every, step) or self.ends(step, ending)

    def ends(self, step: int, stopped: bool = False) -> bool:
        """Whether the run ends at `step`: all updates done, or a stop was decided (early stopping, a
        signal, a hook)."""
        return step >= self.steps or stopped


def due(every: int, step: int) -> bool:
    """Whether a periodic action of period `every` (0: none) falls on `step`."""
    return every > 0 and step % every == 0


def call_size(steps: int, periods: Iterable[int], max_per_call: int = MAX_UPDATES_PER_CALL) -> int:
    """Updates per dispatched call: the largest count up to max_per_call dividing `steps` and every period
    of an action that reads the state (0 = only at the end, which constrains nothing)."""
    g = math.gcd(steps, *periods)
    return max(d for d in range(1, min(g, max_per_call) + 1) if g % d == 0)


def next_call_size(step: int, per_call: int, steps: int) -> int:
    """How many updates the call after `step` runs: per_call on its grid, else 1 until back on it."""
    return per_call if step % per_call == 0 and step + per_call <= steps else 1
