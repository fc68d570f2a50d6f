"""The optimizer, mirroring jaxloop/update/optimizer.py: torch's own optimizer class for optim.name (AdamW, Adam, SGD,
RMSprop, Adagrad; Lion from its paper, torch_ref.lion), weight decay on matrices and embeddings only,
global-norm clipping.

jaxloop chains clip_by_global_norm -> the optimizer(schedule, mask) inside optax.MultiSteps(K). Here the same
update is spelled out by the loop (torch_ref/train.py): backward of loss / K for each of K micro-batches,
then `clip_gradients`, optimizer.step(), scheduler.step().

AdamW, torch vs optax (both read from source: torch/optim/adam.py `_single_tensor_adam` with
decoupled_weight_decay=True; optax/_src/alias.py adamw = scale_by_adam -> add_decayed_weights(mask) ->
scale_by_learning_rate):

    torch:  p <- p * (1 - lr*wd);  p <- p - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    optax:  p <- p - lr * ( (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd * p )

The same algebra: decoupled weight decay scaled by the scheduled lr and applied to the pre-update
params, eps added outside the square root of the bias-corrected second moment (eps_root = 0), bias
correction by 1 - b^t with t the 1-based count of applied updates. They differ only in rounding:
operation order, and optax computes 1 - b^t in the params' dtype (float32) where torch uses Python
float64. Every hyperparameter is passed explicitly, weight decay included (torch's default is 1e-2,
optax's 1e-4). The other optimizers' conventions: jaxloop/update/transforms.py.

Clipping, torch vs optax: torch.nn.utils.clip_grad_norm_ multiplies every gradient by
min(1, clip / (norm + 1e-6)); optax.clip_by_global_norm leaves them alone when norm < clip and otherwise
computes (g / norm) * clip. `clip_gradients(..., mode="optax")` does the latter exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch

from jaxloop.config.optimizers import AdagradConfig, AdamConfig, AdamWConfig, LionConfig, RMSpropConfig, SGDConfig
from jaxloop.config.run import Config
from torch_ref.lion import Lion
from torch_ref.schedule import base_lr

ClipMode = Literal["torch", "optax"]


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: matrices and embeddings (p.dim() >= 2) decay; biases and LayerNorm scales do not.

    The same rule as jaxloop.update.optimizer.decay_mask (leaf.ndim >= 2). A tied head shares the embedding
    parameter, which named_parameters lists once.
    """
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def make_optimizer(cfg: Config, model: torch.nn.Module) -> torch.optim.Optimizer:
    """torch's class for optim.name (TORCH_OPTIMIZERS) with the config's hyperparameters, over `param_groups`;
    the base lr is the scheduler's (torch_ref.schedule.base_lr)."""
    o = cfg.optim.optimizer
    build = TORCH_OPTIMIZERS.get(type(o))
    if build is None:
        raise ValueError(f"optim.name={o.name!r}: no torch optimizer for it")
    return build(o, param_groups(model, o.weight_decay), base_lr(cfg))


TORCH_OPTIMIZERS: dict[type, Callable[[Any, list[dict], float], torch.optim.Optimizer]] = {
    AdamWConfig: lambda o, groups, lr: torch.optim.AdamW(
        groups, lr=lr, betas=(o.b1, o.b2), eps=o.eps, weight_decay=o.weight_decay, amsgrad=False
    ),
    # weight_decay: L2 added to the gradient (decoupled_weight_decay=False)
    AdamConfig: lambda o, groups, lr: torch.optim.Adam(
        groups, lr=lr, betas=(o.b1, o.b2), eps=o.eps, weight_decay=o.weight_decay, amsgrad=False
    ),
    SGDConfig: lambda o, groups, lr: torch.optim.SGD(
        groups, lr=lr, momentum=o.momentum, dampening=o.dampening, weight_decay=o.weight_decay, nesterov=o.nesterov
    ),
    RMSpropConfig: lambda o, groups, lr: torch.optim.RMSprop(
        groups, lr=lr, alpha=o.alpha, eps=o.eps, weight_decay=o.weight_decay, momentum=o.momentum, centered=o.centered
    ),
    AdagradConfig: lambda o, groups, lr: torch.optim.Adagrad(
        groups,
        lr=lr,
        lr_decay=o.lr_decay,
        weight_decay=o.weight_decay,
        eps=o.eps,
        initial_accumulator_value=o.initial_accumulator_value,
    ),
    LionConfig: lambda o, groups, lr: Lion(groups, lr=lr, betas=(o.b1, o.b2), weight_decay=o.weight_decay),
}
"""Each optimizer config class (jaxloop.config.optimizers) -> torch's optimizer built from its fields."""


def global_norm(grads: Iterable[torch.Tensor], mode: ClipMode = "torch") -> torch.Tensor:
    """The global L2 norm of the gradients, computed the way `mode` computes it.

    torch: norm of the per-tensor norms (torch.nn.utils.get_total_norm, what clip_grad_norm_ returns).
    optax: square root of the sum over tensors of the sum of squares (optax.tree.norm).
    """
    grads = list(grads)
    if mode == "torch":
        return torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    total = torch.zeros((), dtype=grads[0].dtype, device=grads[0].device)
    for g in grads:
        total = total + torch.sum(g * g)
    return torch.sqrt(total)


def clip_gradients(params: Iterable[torch.nn.Parameter], clip_norm: float, mode: ClipMode = "torch") -> torch.Tensor:
    """Clip .grad in place to the global norm clip_norm (0 = no clipping); returns the pre-clip norm.

    mode="torch": torch.nn.utils.clip_grad_norm_, i.e. g *= min(1, clip / (norm + 1e-6)), always.
    mode="optax": exactly optax.clip_by_global_norm: g unchanged when norm < clip, else (g / norm) * clip.
    """
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    if mode not in ("torch", "optax"):
        raise ValueError(f"clip mode {mode!r} is not allowed: torch or optax")
    if clip_norm == 0:
        return global_norm(grads, mode)
    if mode == "torch":
        return torch.nn.utils.clip_grad_norm_(params, max_norm=clip_norm)
    norm = global_norm(grads, mode)
    if not bool(norm < clip_norm):
        for g in grads:
            g.copy_((g / norm.to(g.dtype)) * clip_norm)
    return norm
