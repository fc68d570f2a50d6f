"""The plateau schedule's decision: torch.optim.lr_scheduler.ReduceLROnPlateau's rule, host-side and jax-free.

At each evaluation the loop calls `step(metric)` with checkpoint.best_metric; when it returns True the rate
of the following updates is `rate`, which the loop writes into the optimizer's state
(jaxloop.update.optimizer.set_learning_rate). Its state is saved with every checkpoint (`as_dict`, JSON) and restored
on resume. The rule, as torch 2.13's ReduceLROnPlateau.step (read from its source):

    better = metric < best * (1 - threshold)   (mode min, rel)  | metric < best - threshold   (min, abs)
             metric > best * (1 + threshold)   (mode max, rel)  | metric > best + threshold   (max, abs)
    better: best = metric, bad = 0;  else bad += 1
    in cooldown (cooldown_counter > 0): cooldown_counter -= 1, bad = 0
    bad > patience: new = max(rate * factor, min_lr); rate = new if rate - new > eps;
                    cooldown_counter = cooldown, bad = 0

All in Python float64, as torch keeps the rate, so the reductions are bit for bit torch's; the float32
rate the optimizer applies is that float64 value rounded once.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from jaxloop.config.run import Config
from jaxloop.config.schedules import PlateauConfig


@dataclass
class Plateau:
    """ReduceLROnPlateau's decision state (see the module doc); torch's names."""

    mode: str
    factor: float
    patience: int
    threshold: float
    threshold_mode: str
    cooldown: int
    min_lr: float
    eps: float
    rate: float
    best: float | None = None  # None: no evaluation yet (torch's mode_worse, +-inf)
    num_bad_epochs: int = 0
    cooldown_counter: int = 0
    last_epoch: int = 0  # evaluations seen
    reductions: int = 0

    @classmethod
    def of(cls, cfg: Config) -> Plateau:
        """The decision of a fresh run: optim.plateau's settings, checkpoint.best_mode, rate = peak_lr."""
        p = cfg.optim.lr_schedule
        if not isinstance(p, PlateauConfig):
            raise ValueError(f"Plateau.of: optim.schedule is {cfg.optim.schedule!r}, not 'plateau'")
        return cls(
            mode=cfg.checkpoint.best_mode,
            factor=p.factor,
            patience=p.patience,
            threshold=p.threshold,
            threshold_mode=p.threshold_mode,
            cooldown=p.cooldown,
            min_lr=p.min_lr,
            eps=p.eps,
            rate=float(cfg.optim.peak_lr),
        )

    def _is_better(self, a: float) -> bool:
        best = self.best if self.best is not None else (math.inf if self.mode == "min" else -math.inf)
        if self.mode == "min":
            return a < best * (1.0 - self.threshold) if self.threshold_mode == "rel" else a < best - self.threshold
        return a > best * (self.threshold + 1.0) if self.threshold_mode == "rel" else a > best + self.threshold

    def step(self, metric: float) -> bool:
        """Record an evaluation's metric; True when the rate was reduced (then `rate` is the new one)."""
        current = float(metric)
        self.last_epoch += 1
        if self._is_better(current):
            self.best, self.num_bad_epochs = current, 0
        else:
            self.num_bad_epochs += 1
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.num_bad_epochs = 0  # bad evaluations in cooldown do not count
        reduced = False
        if self.num_bad_epochs > self.patience:
            new = max(self.rate * self.factor, self.min_lr)
            if self.rate - new > self.eps:
                self.rate, reduced = new, True
                self.reductions += 1
            self.cooldown_counter, self.num_bad_epochs = self.cooldown, 0
        return reduced

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready state (a checkpoint's data item holds it)."""
        return asdict(self)

    def load(self, saved: dict[str, Any]) -> None:
        """Continue from as_dict() of a checkpointed run (the settings are the config's, checked on resume)."""
        for key in ("rate", "best", "num_bad_epochs", "cooldown_counter", "last_epoch", "reductions"):
            setattr(self, key, saved[key])
