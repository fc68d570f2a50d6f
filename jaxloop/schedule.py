"""The learning-rate schedule of record: linear warmup then cosine decay (optax), by update index.

`make_schedule(cfg.optim, cfg.steps)(u)` is the rate used by the 0-based optimizer update u. The schedule advances once
per update, never per micro-batch: optax.MultiSteps only steps the inner adamw (and so its count) when
it emits an update.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import optax

from loopcore.config import Config, OptimConfig


def make_schedule(optim: OptimConfig, steps: int) -> optax.Schedule:
    """optax.warmup_cosine_decay_schedule over `steps` updates, held at end_lr past them.

    lr(0) = init_lr, lr(warmup_steps) = peak_lr, lr(steps) = end_lr. With warmup_steps == steps the
    cosine part is empty (optax rejects decay_steps=0), so the rate jumps to end_lr at u = steps.
    """
    o = optim
    if o.warmup_steps < steps:
        schedule = optax.warmup_cosine_decay_schedule(
            init_value=o.init_lr, peak_value=o.peak_lr, warmup_steps=o.warmup_steps,
            decay_steps=steps, end_value=o.end_lr,
        )
    else:
        warmup = optax.linear_schedule(o.init_lr, o.peak_lr, transition_steps=o.warmup_steps)
        schedule = optax.join_schedules([warmup, optax.constant_schedule(o.end_lr)], [o.warmup_steps])

    def at(count: Any) -> Any:
        # optax's counts are int32 and int32 / int divides in float32 even under x64: evaluate from a
        # count in the default float dtype (float64 with x64; float32, exact to 2**24 updates, without).
        return schedule(jnp.asarray(count, dtype=jnp.result_type(float)))

    return at


def lr_table(cfg: Config, updates: int | None = None) -> np.ndarray:
    """The rate of every update 0 .. updates-1 (default: steps), as float64, for reports and tests."""
    n = cfg.steps if updates is None else updates
    sched = make_schedule(cfg.optim, cfg.steps)
    return np.asarray([float(sched(u)) for u in range(n)], dtype=np.float64)


def closed_form(cfg: Config, u: int) -> float:
    """The same schedule in float64 Python, written from its definition (the reference for tests)."""
    import math

    o = cfg.optim
    if u < o.warmup_steps:
        return o.init_lr + (o.peak_lr - o.init_lr) * u / o.warmup_steps
    if o.warmup_steps == cfg.steps:
        return o.end_lr
    t = min(u - o.warmup_steps, cfg.steps - o.warmup_steps) / (cfg.steps - o.warmup_steps)
    return o.end_lr + (o.peak_lr - o.end_lr) * 0.5 * (1.0 + math.cos(math.pi * t))
