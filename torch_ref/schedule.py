"""The learning-rate schedule, mirroring jaxloop/update/schedules.py with torch's own scheduler classes.

| optim.schedule  | torch_ref                                                                             |
|-----------------|---------------------------------------------------------------------------------------|
| warmup_cosine   | LambdaLR of the closed form, base lr 1.0 (below)                                      |
| constant        | ConstantLR(factor=1)                                                                  |
| linear          | LinearLR(1, end_lr / peak_lr, steps - warmup)                                         |
| polynomial      | PolynomialLR(steps - warmup, power)                                                   |
| step, multistep | StepLR(step_size, gamma), MultiStepLR(milestones, gamma)                              |
| exponential     | ExponentialLR(gamma)                                                                  |
| cosine_restarts | CosineAnnealingWarmRestarts(t_0, t_mult, eta_min=end_lr)                              |
| one_cycle       | OneCycleLR(peak_lr, steps, pct_start, anneal_strategy, div_factor, final_div_factor,  |
|                 | three_phase, cycle_momentum=False: jaxloop schedules the rate only)                   |
| wsd             | LambdaLR of Hugging Face's get_wsd_schedule lambda (torch has no class)               |
| inverse_sqrt    | LambdaLR of Hugging Face's get_inverse_sqrt_schedule lambda (torch has no class)      |
| plateau         | ReduceLROnPlateau(mode=checkpoint.best_mode, optim.plateau.*), stepped at evaluations |

Warmup (warmup_steps > 0; every schedule but warmup_cosine, one_cycle, plateau) comes first as torch composes
it: SequentialLR([LinearLR(init_lr / peak_lr, 1, warmup_steps), main], milestones=[warmup_steps]); LinearLR's
start factor must be > 0, so with init_lr = 0 the warmup is LambdaLR(u / warmup_steps) (Hugging Face's
warmup) instead. Every class but the LambdaLRs and OneCycleLR steps a chained form (each rate from the
previous one); parity_tests measure its distance from jaxloop's closed forms.

warmup_cosine, written independently of optax, from the schedule's definition (no table copied from jaxloop):

    lr(u) = init + (peak - init) * u / warmup                                          for u < warmup
    lr(u) = end + (peak - end) * 0.5 * (1 + cos(pi * min(u - warmup, steps - warmup) / (steps - warmup)))

where u is the 0-based index of the optimizer update. With warmup == steps the cosine part is empty and
the rate is end_lr from u = steps on. Past `steps` the rate is held at end_lr (torch's
CosineAnnealingLR would climb back up, which is why it is not used).

torch.optim.lr_scheduler.LambdaLR sets each group's rate to base_lr * lr_lambda(u). The textbook choice,
base_lr = peak_lr with lr_lambda = lr(u) / peak_lr, costs precision: peak * (lr / peak) is one ulp off
lr in about 5% of (config, update) pairs (measured in float64 over 300 random schedules; no neighbouring
factor fixes all of them, since the products peak * f do not reach every float). So the optimizer is
built with base lr 1.0 and the lambda returns the rate itself: 1.0 * lr(u) == lr(u) exactly, and the
rate AdamW receives is the closed form bit for bit. torch's own SequentialLR(LinearLR, CosineAnnealingLR)
for the same schedule is `warmup_cosine_classes` (parity_tests report how far its chained form drifts).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch.optim import lr_scheduler as sched

from jaxloop.config.run import Config
from jaxloop.config.schedules import (
    ConstantConfig,
    CosineRestartsConfig,
    ExponentialConfig,
    InverseSqrtConfig,
    LinearConfig,
    MultiStepConfig,
    PolynomialConfig,
    StepConfig,
    WSDConfig,
)

BASE_LR = 1.0
"""warmup_cosine's base learning rate: LambdaLR multiplies it by lr(u), exactly."""


def base_lr(cfg: Config) -> float:
    """The optimizer's base lr (torch's `lr`): 1.0 for warmup_cosine's LambdaLR, peak_lr for every class."""
    return BASE_LR if cfg.optim.schedule == "warmup_cosine" else cfg.optim.peak_lr


def lr_at(cfg: Config, u: int) -> float:
    """The learning rate of the 0-based optimizer update u, in float64."""
    o, peak_lr = cfg.optim.lr_schedule, cfg.optim.peak_lr
    if u < o.warmup_steps:
        return o.init_lr + (peak_lr - o.init_lr) * u / o.warmup_steps
    if o.warmup_steps == cfg.steps:
        return o.end_lr
    decay_steps = cfg.steps - o.warmup_steps
    t = min(u - o.warmup_steps, decay_steps) / decay_steps
    return o.end_lr + (peak_lr - o.end_lr) * 0.5 * (1.0 + math.cos(math.pi * t))


def _warmup_cosine(cfg: Config, optimizer: torch.optim.Optimizer) -> sched.LambdaLR:
    """LambdaLR over the closed form; every group of the optimizer must have lr=BASE_LR."""
    for group in optimizer.param_groups:
        if group["lr"] != BASE_LR:
            raise ValueError(f"the optimizer's base lr must be {BASE_LR} (the lambda returns the rate itself)")
    return sched.LambdaLR(optimizer, lr_lambda=lambda u: lr_at(cfg, u))


def wsd_lambda(v: int, *, stable: int, decay: int, decay_type: str, min_lr_ratio: float) -> float:
    """Hugging Face transformers' _get_wsd_scheduler_lambda (optimization.py, 5.x) after its warmup, which
    SequentialLR puts in front here: 1 for `stable` updates, then `decay` updates of decay_type down to
    min_lr_ratio, held there."""
    if v < stable:
        return 1.0
    if v < stable + decay:
        progress = float(v - stable) / float(max(1, decay))
        if decay_type == "linear":
            factor = 1.0 - progress
        elif decay_type == "cosine":
            factor = 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress))
        else:  # 1-sqrt
            factor = 1.0 - math.sqrt(progress)
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    return min_lr_ratio


def inverse_sqrt_lambda(v: int, *, timescale: int) -> float:
    """Hugging Face transformers' _get_inverse_sqrt_schedule_lr_lambda after its warmup (v counted from
    there): 1 / sqrt((v + timescale) / timescale)."""
    return 1.0 / math.sqrt((v + timescale) / timescale)


def _main(cfg: Config, optimizer: torch.optim.Optimizer) -> sched.LRScheduler:
    """The schedule after the warmup, as torch's class (module doc: TORCH_AFTER_WARMUP)."""
    s = cfg.optim.lr_schedule
    build = TORCH_AFTER_WARMUP.get(type(s))
    if build is None:
        raise ValueError(f"optim.schedule={s.name!r} has no torch scheduler after a warmup")
    return build(s, optimizer, cfg.optim.peak_lr, cfg.steps - s.warmup_steps)


TORCH_AFTER_WARMUP: dict[type, Callable[[Any, torch.optim.Optimizer, float, int], sched.LRScheduler]] = {
    ConstantConfig: lambda s, opt, peak, span: sched.ConstantLR(opt, factor=1.0, total_iters=0),
    LinearConfig: lambda s, opt, peak, span: sched.LinearLR(
        opt, start_factor=1.0, end_factor=s.end_lr / peak, total_iters=span
    ),
    PolynomialConfig: lambda s, opt, peak, span: sched.PolynomialLR(opt, total_iters=span, power=s.power),
    StepConfig: lambda s, opt, peak, span: sched.StepLR(opt, step_size=s.step_size, gamma=s.gamma),
    MultiStepConfig: lambda s, opt, peak, span: sched.MultiStepLR(opt, milestones=list(s.milestones), gamma=s.gamma),
    ExponentialConfig: lambda s, opt, peak, span: sched.ExponentialLR(opt, gamma=s.gamma),
    CosineRestartsConfig: lambda s, opt, peak, span: sched.CosineAnnealingWarmRestarts(
        opt, T_0=s.t_0, T_mult=s.t_mult, eta_min=s.end_lr
    ),
    WSDConfig: lambda s, opt, peak, span: sched.LambdaLR(
        opt,
        partial(
            wsd_lambda,
            stable=span - s.decay_steps,
            decay=s.decay_steps,
            decay_type=s.decay_type,
            min_lr_ratio=s.end_lr / peak,
        ),
    ),
    InverseSqrtConfig: lambda s, opt, peak, span: sched.LambdaLR(
        opt, partial(inverse_sqrt_lambda, timescale=s.effective_timescale())
    ),  # Hugging Face's default when 0
}
"""Each schedule config class with a warmup in front (all but warmup_cosine, one_cycle, plateau: their own in
make_scheduler) -> torch's scheduler of the updates after it: (config, optimizer, peak_lr, steps - warmup)."""


def _with_warmup(cfg: Config, optimizer: torch.optim.Optimizer, main: Any) -> sched.LRScheduler:
    """SequentialLR([warmup, main], [warmup_steps]) (module doc); `main` builds the main scheduler."""
    o = cfg.optim.lr_schedule
    if o.warmup_steps == 0:
        return main(cfg, optimizer)
    if o.init_lr > 0:
        warm = sched.LinearLR(
            optimizer, start_factor=o.init_lr / cfg.optim.peak_lr, end_factor=1.0, total_iters=o.warmup_steps
        )
    else:  # LinearLR's start_factor must be > 0: Hugging Face's warmup from 0
        warm = sched.LambdaLR(optimizer, lambda u: u / o.warmup_steps)
    return sched.SequentialLR(optimizer, [warm, main(cfg, optimizer)], milestones=[o.warmup_steps])


def make_scheduler(cfg: Config, optimizer: torch.optim.Optimizer) -> Any:
    """optim.schedule's torch scheduler (module doc) over an optimizer built with base_lr(cfg).

    Call `step_per_update(scheduler)` once per applied optimizer update (never per micro-batch, never for
    a skipped update), and `after_evaluation(scheduler, metric)` after each evaluation: the rate of update
    u is then optimizer.param_groups[i]["lr"] while update u is applied.
    """
    o = cfg.optim.lr_schedule
    if o.name == "warmup_cosine":
        return _warmup_cosine(cfg, optimizer)
    if o.name == "one_cycle":
        return sched.OneCycleLR(
            optimizer,
            max_lr=cfg.optim.peak_lr,
            total_steps=cfg.steps,
            pct_start=float(o.pct_start),
            anneal_strategy=o.anneal_strategy,
            cycle_momentum=False,
            div_factor=o.div_factor,
            final_div_factor=o.final_div_factor,
            three_phase=o.three_phase,
        )
    if o.name == "plateau":
        p = o
        return sched.ReduceLROnPlateau(
            optimizer,
            mode=cfg.checkpoint.best_mode,
            factor=p.factor,
            patience=p.patience,
            threshold=p.threshold,
            threshold_mode=p.threshold_mode,
            cooldown=p.cooldown,
            min_lr=p.min_lr,
            eps=p.eps,
        )
    return _with_warmup(cfg, optimizer, _main)


def warmup_cosine_classes(cfg: Config, optimizer: torch.optim.Optimizer) -> sched.LRScheduler:
    """warmup_cosine as torch's own classes: SequentialLR(LinearLR warmup, CosineAnnealingLR(steps - warmup,
    eta_min=end_lr)) over an optimizer with base lr peak_lr (a measurement of the chained form: the runs use
    make_scheduler's exact LambdaLR)."""
    decay_span = cfg.steps - cfg.optim.lr_schedule.warmup_steps
    return _with_warmup(
        cfg,
        optimizer,
        lambda c, opt: sched.CosineAnnealingLR(opt, T_max=decay_span, eta_min=c.optim.lr_schedule.end_lr),
    )


def step_per_update(scheduler: Any) -> None:
    """The scheduler's step after an applied update (ReduceLROnPlateau steps at evaluations instead)."""
    if not isinstance(scheduler, sched.ReduceLROnPlateau):
        scheduler.step()


def after_evaluation(scheduler: Any, metric: float) -> None:
    """ReduceLROnPlateau's step with the evaluation's metric (checkpoint.best_metric); other schedulers: none."""
    if isinstance(scheduler, sched.ReduceLROnPlateau):
        scheduler.step(metric)


def lr_table(cfg: Config, updates: int | None = None, build: Any = None) -> list[float]:
    """The rate of updates 0 .. updates-1 (default: steps) as the scheduler (make_scheduler's, or `build`'s)
    hands it to the optimizer."""
    n = cfg.steps if updates is None else updates
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=base_lr(cfg) if build is None else cfg.optim.peak_lr)
    scheduler = (build or make_scheduler)(cfg, optimizer)
    rates = []
    for _ in range(n):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        step_per_update(scheduler)
    return rates
