"""The one closed-form oracle of the learning-rate schedule (jax-free, torch-free), for every test.

Written from the documented definition (docs/training.md), not from either loop's code: linear warmup from init_lr to peak_lr
over warmup_steps updates, then the textbook cosine end + (peak - end) * 0.5 * (1 + cos(pi t)) with
t = (min(u, steps) - warmup) / (steps - warmup); with warmup == steps the rate is end_lr from u = steps.
Evaluated in numpy's long double (80-bit extended precision on x86-64, 64-bit mantissa), so that the
cancellation of 1 + cos(pi t) near t = 1 costs nothing at float64 resolution (relative error ~1e-16
at the end of the cosine of a 60-update schedule, where float64 would give ~1e-13).
"""

from __future__ import annotations

import numpy as np

from jaxloop.config.run import Config

LD = np.longdouble
PI = LD("3.141592653589793238462643383279502884")
"""pi in long double (np.pi is its float64 rounding, 1.2e-16 off)."""


def lr_oracle(cfg: Config, u: int) -> float:
    """The rate of the 0-based optimizer update u, rounded to float64 from extended precision."""
    o, steps = cfg.optim.lr_schedule, cfg.steps
    init, peak, end = LD(o.init_lr), LD(cfg.optim.peak_lr), LD(o.end_lr)
    if u < o.warmup_steps:
        return float(init + (peak - init) * LD(u) / LD(o.warmup_steps))
    if u >= steps:  # lr(steps) = end_lr by definition (1 + cos(pi) is a rounding above 0 in long double)
        return float(end)
    t = LD(u - o.warmup_steps) / LD(steps - o.warmup_steps)
    return float(end + (peak - end) * LD(0.5) * (LD(1) + np.cos(PI * t, dtype=LD)))


def lr_oracle_table(cfg: Config, updates: int) -> np.ndarray:
    """float64 rates of updates 0 .. updates - 1."""
    return np.array([lr_oracle(cfg, u) for u in range(updates)], np.float64)


# ----------------------------------------------------------------------------- every schedule of the menu


def _cos_anneal(a: LD, b: LD, t: LD) -> LD:
    """From a (t = 0) to b (t = 1) along half a cosine: the textbook b + (a - b) (1 + cos(pi t)) / 2."""
    return b + (a - b) * LD(0.5) * (LD(1) + np.cos(PI * t, dtype=LD))


def menu_lr_oracle(cfg: Config, u: int) -> float:
    """The rate of update u < steps for any optim.schedule but plateau, from the definitions in the torch and
    Hugging Face documentation (textbook forms, long double), rounded to float64."""
    o, S = cfg.optim.lr_schedule, cfg.steps
    # a schedule's config holds only what it reads (one_cycle no warmup, constant no end_lr): 0 for the rest
    P, I, E, W = (  # noqa: E741 (the formulas' names)
        LD(cfg.optim.peak_lr),
        LD(getattr(o, "init_lr", 0.0)),
        LD(getattr(o, "end_lr", 0.0)),
        getattr(o, "warmup_steps", 0),
    )
    if o.name == "warmup_cosine":
        return lr_oracle(cfg, u)
    if o.name == "one_cycle":  # OneCycleLR's documented phases (its float phase ends included)
        low0 = P / LD(o.div_factor)
        low1 = low0 / LD(o.final_div_factor)
        up = LD(float(o.pct_start * S)) - 1
        if o.three_phase:
            phases = [(up, low0, P), (LD(float(2 * o.pct_start * S)) - 2, P, low0), (LD(S - 1), low0, low1)]
        else:
            phases = [(up, low0, P), (LD(S - 1), P, low1)]
        start = LD(0)
        for i, (end, a, b) in enumerate(phases):
            if u <= end or i == len(phases) - 1:
                t = (LD(u) - start) / (end - start)
                return float(_cos_anneal(a, b, t) if o.anneal_strategy == "cos" else a + (b - a) * t)
            start = end
    if u < W:
        return float(I + (P - I) * LD(u) / LD(W))
    v, D = u - W, S - W
    s = o.name
    if s == "constant":
        r = P
    elif s == "linear":
        r = P + (E - P) * LD(min(v, D)) / LD(D)
    elif s == "polynomial":
        r = P * (LD(1) - LD(min(v, D)) / LD(D)) ** LD(o.power)
    elif s == "step":
        r = P * LD(o.gamma) ** (v // o.step_size)
    elif s == "multistep":
        r = P * LD(o.gamma) ** sum(1 for m in o.milestones if m <= v)
    elif s == "exponential":
        r = P * LD(o.gamma) ** v
    elif s == "cosine_restarts":
        t_cur, t_i = v, o.t_0
        while t_cur >= t_i:
            t_cur, t_i = t_cur - t_i, t_i * o.t_mult
        r = _cos_anneal(P, E, LD(t_cur) / LD(t_i))
    elif s == "wsd":
        k = v - (D - o.decay_steps)
        if k <= 0:
            r = P
        else:
            f = LD(min(k, o.decay_steps)) / LD(o.decay_steps)
            shape = {
                "linear": LD(1) - f,
                "cosine": LD(0.5) * (LD(1) + np.cos(PI * f, dtype=LD)),
                "1-sqrt": LD(1) - np.sqrt(f, dtype=LD),
            }[o.decay_type]
            r = E + (P - E) * shape
    elif s == "inverse_sqrt":
        ts = LD(o.timescale or W or 10_000)
        r = P / np.sqrt((LD(v) + ts) / ts, dtype=LD)
    else:
        raise ValueError(f"no oracle for optim.schedule={s!r}")
    return float(r)


def menu_oracle_table(cfg: Config, updates: int) -> np.ndarray:
    """float64 rates of updates 0 .. updates - 1 (< steps)."""
    return np.array([menu_lr_oracle(cfg, u) for u in range(updates)], np.float64)
