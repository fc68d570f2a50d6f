"""The learning-rate schedules PyTorch users run, tabulated by update index for the device (the command
`python -m jaxloop.schedule`, jaxloop/schedule.py, prints or plots one without training).

The formulas are the schedule config classes' (jaxloop.config.schedules, `build(peak_lr, steps)`: one class
per schedule, its fields, its checks and its rate function); this module tabulates them for the device.
`make_schedule(cfg.optim, cfg.steps)(u)` is the rate of the 0-based optimizer update u: an optax.Schedule
(count -> rate) that the optimizer's inject_hyperparams calls with its own count. It advances once per
update, never per micro-batch: the optimizer runs (and counts) once per window of K micro-batches.

Every schedule but plateau is a function of u alone. The rates of updates 0 .. steps are evaluated once, in
float64 on the host (`rates`), and looked up by count (clamped at steps: the rate is held past steps) in the
default float type: in float32 each applied rate is the float64 value correctly rounded (within half an ulp
of the value); the same formulas evaluated in float32 on the device are off by several ulps, and optax's
warmup_cosine_decay_schedule by ~45 ulps late in the cosine (its 0.5 * (1 + cos) cancels). The table
costs 4 bytes per update in float32.

Notation: P = peak_lr (torch's `lr`), I = init_lr, E = end_lr, W = warmup_steps, S = steps; after the warmup
the schedule's own count is v = u - W over D = S - W updates, as the second scheduler of torch's
SequentialLR([LinearLR, main], milestones=[W]) counts (`step_size`, `milestones`, `t_0` count from there).

    warmup        u < W:  I + (P - I) * u / W           LinearLR(I/P, 1, W) (LambdaLR(u / W) when I = 0)
    warmup_cosine E + (P - E) * sin^2(pi/2 * (S - u') / D), u' = min(u, S)   (E from S on when W = S)
    constant      P                                                            ConstantLR(factor 1)
    linear        E + (P - E) * (D - v') / D, v' = min(v, D)                   LinearLR(1, E/P, D)
    polynomial    P * ((D - v') / D) ** power                                  PolynomialLR(D, power)
    step          P * gamma ** (v // step_size)                                StepLR
    multistep     P * gamma ** (number of milestones <= v)                     MultiStepLR
    exponential   P * gamma ** v                                               ExponentialLR
    cosine_restarts  E + (P - E) * sin^2(pi/2 * (T_i - T_cur) / T_i): cycles of T_0, T_0 T_mult, ...
                                                                               CosineAnnealingWarmRestarts
    one_cycle     torch's OneCycleLR over S updates (no warmup of ours): phases ending at pct_start S - 1
                  ((2 pct_start S - 2), S - 1) from P/div_factor up to P (down to P/div_factor), down to
                  P/div_factor/final_div_factor; within a phase from a to b at fraction f of it:
                  cos: b + (a - b) * sin^2(pi/2 * (1 - f)); linear: b + (a - b) * (1 - f)   (held past S - 1)
    wsd           P until v = D - decay_steps, then at fraction f = (v - (D - decay_steps)) / decay_steps to E
                  (reached at u = S, as Hugging Face's: the last trained update is one short of it):
                  E + (P - E) * (1 - f | sin^2(pi/2 (1 - f)) | (1 - f) / (1 + sqrt(f)))   Hugging Face's
                  get_wsd_schedule (linear | cosine | 1-sqrt), min_lr_ratio = E / P
    inverse_sqrt  P / sqrt((v + timescale) / timescale)      Hugging Face's get_inverse_sqrt_schedule
    plateau       P, multiplied by plateau.factor by the host at evaluations (jaxloop.loop.plateau): the
                  optimizer keeps the rate as a number the loop replaces, not as a schedule

Each formula is torch's (or Hugging Face's) closed form, written without cancellation where the textbook
form has one: 0.5 * (1 + cos(pi t)) = sin^2(pi/2 (1 - t)) with 1 - t a ratio of exact integers, so a rate
near the end of a cosine keeps its relative precision. torch's own classes step a chained form (each rate
from the previous one); parity_tests measure how far that drifts from these.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np

from jaxloop.config.run import OptimConfig
from jaxloop.config.schedules import OneCycleConfig, WarmupScheduleConfig, WSDConfig


def rates(optim: OptimConfig, steps: int) -> np.ndarray:
    """float64 rates of updates 0 .. steps (see the module doc); the last is held past steps. The formulas
    are the schedule classes' (jaxloop.config.schedules: optim.lr_schedule.build)."""
    rate = optim.lr_schedule.build(optim.peak_lr, steps)
    # filled in place: 8 bytes per update (a list first would hold a Python float and its pointer, 32)
    return np.fromiter(map(rate, range(steps + 1)), np.float64, count=steps + 1)


def make_schedule(optim: OptimConfig, steps: int) -> Any:
    """count -> the rate of update `count` (held past steps), in the default float type (an optax.Schedule).

    For plateau this is its starting rate, peak_lr, at every count: its reductions are host decisions
    (jaxloop.loop.plateau) applied to the optimizer's state."""
    import jax.numpy as jnp
    from jax.core import Tracer

    table = rates(optim, steps)

    def at(count: Any) -> Any:
        dtype = jnp.result_type(float)  # float32, or float64 under x64
        if not isinstance(count, Tracer):
            # a count outside jit (the optimizer's init builds its state eagerly): the rate is read on the host and
            # rounded once, as the device's copy of the table is; looked up on the device, each table length
            # compiled a conversion and a slice of its own
            return jnp.asarray(table[np.clip(np.asarray(count, np.int64), 0, steps)], dtype)
        values = jnp.asarray(table, dtype=dtype)
        index = jnp.clip(jnp.asarray(count).astype(jnp.int32), 0, steps)
        return values[index]

    return at


# ----------------------------------------------------------------------------- the schedule explorer


def shown_updates(optim: OptimConfig, steps: int, count: int = 12) -> list[int]:
    """The updates a table shows by default: evenly spaced ones, plus each phase's first and last update."""
    marks = {0, steps - 1}
    marks.update(round(i * (steps - 1) / (count - 1)) for i in range(count))
    sched = optim.lr_schedule
    if isinstance(sched, WarmupScheduleConfig) and 0 < sched.warmup_steps < steps:  # all but one_cycle and plateau
        marks.update((sched.warmup_steps - 1, sched.warmup_steps))
    if isinstance(sched, OneCycleConfig):
        marks.update(int(e) + d for e in (sched.pct_start * steps - 1,) for d in (0, 1))
    if isinstance(sched, WSDConfig):
        start = steps - sched.decay_steps  # its last rate at peak_lr; the decay shows from the next
        marks.update((start, start + 1))
    return sorted(m for m in marks if 0 <= m < steps)


def describe(optim: OptimConfig, steps: int) -> str:
    """One line naming the schedule and what it reads (for the explorer and the run report)."""
    shown = [f"peak_lr={optim.peak_lr}"]
    if not optim.lr_schedule.prefix:  # plateau's settings are printed apart (main)
        shown += [f"{f.name}={getattr(optim.lr_schedule, f.name)}" for f in fields(optim.lr_schedule)]
    return f"{optim.schedule} over {steps} updates ({', '.join(shown)})"


def title_lines(text: str, width: int = 95) -> str:
    """A plot title wrapped to lines of at most `width` characters (8-point text in a 7-inch figure)."""
    import textwrap

    return "\n".join(textwrap.wrap(text, width))


def steps_change_line(optim: OptimConfig, old_steps: int, new_steps: int, step: int) -> str | None:
    """A warning for a resume that changes `steps` (--allow_steps_change): the rate of update `step` under
    the saved steps and under the new ones, when they differ (None otherwise, and for plateau)."""
    if old_steps == new_steps or optim.schedule == "plateau":
        return None
    before, after = rates(optim, old_steps)[min(step, old_steps)], rates(optim, new_steps)[min(step, new_steps)]
    if before == after:
        return None
    return (
        f"warning: steps {old_steps} -> {new_steps} moves the learning rate at update {step}: "
        f"{before:.3g} -> {after:.3g} (the schedule is that of {new_steps} steps from here on)"
    )


def plot_schedule(optim: OptimConfig, steps: int, path: str) -> Any:
    """A PNG of the rate of every update, titled with `describe` wrapped to fit the figure; returns it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    Path(path).parent.mkdir(parents=True, exist_ok=True)  # runs/one_cycle.png in a fresh checkout
    fig = Figure(figsize=(7, 3.5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.plot(np.arange(steps), rates(optim, steps)[:steps], lw=1.5)
    ax.set_xlabel("update (0-based)")
    ax.set_ylabel("learning rate")
    ax.set_title(title_lines(describe(optim, steps)), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig
