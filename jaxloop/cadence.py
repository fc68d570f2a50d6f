"""When the host loop stops dispatching work to the device: to log, evaluate, save, or end.

Between those points the loop only dispatches; it dispatches `per_call` updates (K x per_call
micro-batches, one lax.scan) per call, a count that divides every cadence so each event falls on a
call boundary. The step counted here is the loop's own count of updates dispatched; skipped updates
(non-finite) do not advance the state's, so at each sync the loop takes the state's count back, and
a streak of max_bad_steps skipped updates is seen at the sync where the dispatched count reaches a
multiple of max_bad_steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from loopcore.config import Config

MAX_UPDATES_PER_CALL = 50
"""Upper bound of updates dispatched in one call (bounds the micro-batches stacked on the device)."""


@dataclass(frozen=True)
class Cadence:
    steps: int
    log_every: int
    eval_every: int  # 0: only at the end
    save_every: int  # 0: only at the end
    check_every: int  # max_bad_steps: how often a streak of skipped updates is looked at

    @classmethod
    def of(cls, cfg: Config) -> "Cadence":
        return cls(cfg.steps, cfg.log_every, cfg.eval_every, cfg.checkpoint.every, cfg.max_bad_steps)

    @property
    def per_call(self) -> int:
        """Updates per dispatched call: the largest count dividing every cadence (at most MAX_UPDATES_PER_CALL)."""
        g = math.gcd(self.steps, self.log_every, self.eval_every, self.save_every, self.check_every)
        return max(d for d in range(1, min(g, MAX_UPDATES_PER_CALL) + 1) if g % d == 0)

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

    def sync(self, step: int) -> bool:
        """Whether the host must wait for the device after `step` (an event or a streak check is due)."""
        return self.log(step) or self.eval(step) or self.save(step) or step % self.check_every == 0
