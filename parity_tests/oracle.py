"""The one closed-form oracle of the learning-rate schedule (jax-free, torch-free), for every test.

Written from DESIGN.md's definition, not from either loop's code: linear warmup from init_lr to peak_lr
over warmup_steps updates, then the textbook cosine end + (peak - end) * 0.5 * (1 + cos(pi t)) with
t = (min(u, steps) - warmup) / (steps - warmup); with warmup == steps the rate is end_lr from u = steps.
Evaluated in numpy's long double (80-bit extended precision on x86-64, 64-bit mantissa), so that the
cancellation of 1 + cos(pi t) near t = 1 costs nothing at float64 resolution (relative error ~1e-16
at the end of the cosine of a 60-update schedule, where float64 would give ~1e-13).
"""

from __future__ import annotations

import numpy as np

from loopcore.config import Config

LD = np.longdouble
PI = LD("3.141592653589793238462643383279502884")
"""pi in long double (np.pi is its float64 rounding, 1.2e-16 off)."""


def lr_oracle(cfg: Config, u: int) -> float:
    """The rate of the 0-based optimizer update u, rounded to float64 from extended precision."""
    o, steps = cfg.optim, cfg.steps
    init, peak, end = LD(o.init_lr), LD(o.peak_lr), LD(o.end_lr)
    if u < o.warmup_steps:
        return float(init + (peak - init) * LD(u) / LD(o.warmup_steps))
    if u >= steps:  # lr(steps) = end_lr by definition (1 + cos(pi) is a rounding above 0 in long double)
        return float(end)
    t = LD(u - o.warmup_steps) / LD(steps - o.warmup_steps)
    return float(end + (peak - end) * LD(0.5) * (LD(1) + np.cos(PI * t, dtype=LD)))


def lr_oracle_table(cfg: Config, updates: int) -> np.ndarray:
    """float64 rates of updates 0 .. updates - 1."""
    return np.array([lr_oracle(cfg, u) for u in range(updates)], np.float64)
