"""Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023, Algorithm 2), written from the
paper: torch has no Lion class. With decoupled weight decay as the paper's (and torch's AdamW's):

    c = b1 m + (1 - b1) g;   p <- p (1 - lr wd) - lr sign(c);   m <- b2 m + (1 - b2) g

(the paper's p <- p - lr (sign(c) + wd p), with the decay applied as torch's AdamW applies it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class Lion(torch.optim.Optimizer):
    """Lion with torch.optim's interface: lr, betas=(b1, b2), weight_decay per param group; state exp_avg (m)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ):
        if lr < 0 or not 0.0 <= betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0 or weight_decay < 0:
            raise ValueError(f"invalid Lion hyperparameters: lr={lr}, betas={betas}, weight_decay={weight_decay}")
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), wd = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                m = state["exp_avg"]
                c = m * b1 + p.grad * (1 - b1)
                if wd:
                    p.mul_(1 - lr * wd)
                p.add_(torch.sign(c), alpha=-lr)
                m.mul_(b2).add_(p.grad, alpha=1 - b2)
        return loss
