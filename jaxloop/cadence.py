"""When the host loop waits for the device: after every call, each call running several updates.

The loop dispatches `per_call` updates (K x per_call micro-batches, one lax.scan) per call, a count that
divides the evaluation, checkpoint and end cadences, so those fall on call boundaries; log records and
the streak of skipped updates are read from the call's per-micro-batch metrics, so they do not bound
the call. The step counted here is the state's count of applied updates; skipped (non-finite) updates
do not advance it, so after a call that skipped some, the loop dispatches single updates until it is
back on the grid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from loopcore.config import Config

MAX_UPDATES_PER_CALL = 50
"""Default bound of updates dispatched in one call (bounds the micro-batches stacked on the device)."""


@dataclass(frozen=True)
class Cadence:
    steps: int
    log_every: int
    eval_every: int  # 0: only at the end
    save_every: int  # 0: only at the end
    max_per_call: int = MAX_UPDATES_PER_CALL

    @classmethod
    def of(cls, cfg: Config) -> "Cadence":
        return cls(cfg.steps, cfg.log_every, cfg.eval_every, cfg.checkpoint.every,
                   cfg.updates_per_call or MAX_UPDATES_PER_CALL)

    @property
    def per_call(self) -> int:
        """Updates per dispatched call: the largest count up to max_per_call dividing steps and the
        evaluation and checkpoint cadences."""
        g = math.gcd(self.steps, self.eval_every, self.save_every)
        return max(d for d in range(1, min(g, self.max_per_call) + 1) if g % d == 0)

    def updates_next(self, step: int) -> int:
        """How many updates the call after `step` dispatches: per_call on its grid, else 1 until back on it."""
        n = self.per_call
        return n if step % n == 0 and step + n <= self.steps else 1

    def log(self, step: int) -> bool:
        return step % self.log_every == 0 or step >= self.steps

    def eval(self, step: int) -> bool:
        return (self.eval_every > 0 and step % self.eval_every == 0) or step >= self.steps

    def save(self, step: int) -> bool:
        return (self.save_every > 0 and step % self.save_every == 0) or step >= self.steps
