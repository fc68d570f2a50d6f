"""The learning-rate schedule of record: linear warmup then cosine decay, by update index.

`make_schedule(cfg.optim, cfg.steps)(u)` is the rate used by the 0-based optimizer update u: an optax.Schedule
(count -> rate) that adamw's scale_by_learning_rate calls with its own count. The schedule advances once
per update, never per micro-batch: optax.MultiSteps only steps the inner adamw (and so its count) when
it emits an update.

    lr(u) = init + (peak - init) * u / warmup                                  u < warmup
    lr(u) = end + (peak - end) * sin^2(pi/2 * (steps - u') / (steps - warmup))  u' = min(u, steps) >= warmup

The cosine part is the usual end + (peak - end) * 0.5 * (1 + cos(pi t)), t = (u' - warmup) / (steps -
warmup), written without its cancellation: 0.5 * (1 + cos(pi t)) = cos^2(pi t / 2) = sin^2(pi/2 (1 - t)),
and 1 - t = (steps - u') / (steps - warmup) is a ratio of exact integers, so the rate near the end of the
cosine (a small difference of nearly equal numbers in the textbook form) keeps its relative precision.
With warmup == steps the cosine part is empty and the rate is end_lr from u = steps on; past steps it
is held at end_lr.

Precision. The rates of updates 0 .. steps are evaluated once, in float64 on the host, and the schedule
looks them up by count (clamped at steps) in the default float type: in float32 each applied rate is
the float64 value correctly rounded (within half an ulp of the value). The same formula evaluated in
float32 on the device is off by up to 4 ulps of the value (measured over the parity suite's 60
schedules: the argument's roundings are doubled by the square), and optax's
warmup_cosine_decay_schedule, which jaxloop used before, by ~45 ulps late in the cosine (its
0.5 * (1 + cos) cancels). The table costs 4 bytes per update in float32 (4 MB per million updates).
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax

from loopcore.config import OptimConfig


def _rates(o: OptimConfig, steps: int) -> np.ndarray:
    """float64 rates of updates 0 .. steps (see the module doc)."""
    out = np.empty(steps + 1, np.float64)
    for u in range(steps + 1):
        if u < o.warmup_steps:
            out[u] = o.init_lr + (o.peak_lr - o.init_lr) * (u / o.warmup_steps)
        elif o.warmup_steps == steps:
            out[u] = o.end_lr
        else:
            s = math.sin(0.5 * math.pi * ((steps - u) / (steps - o.warmup_steps)))
            out[u] = o.end_lr + (o.peak_lr - o.end_lr) * (s * s)
    return out


def make_schedule(optim: OptimConfig, steps: int) -> optax.Schedule:
    """count -> the rate of update `count` (held at end_lr past steps), in the default float type."""
    rates = _rates(optim, steps)

    def at(count: Any) -> Any:
        table = jnp.asarray(rates, dtype=jnp.result_type(float))  # float32, or float64 under x64
        index = jnp.clip(jnp.asarray(count).astype(jnp.int32), 0, steps)
        return table[index]

    return at
