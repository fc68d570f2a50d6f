"""When a run logs, evaluates, saves and ends, and how many updates one device call runs: the rule
both loops follow (torch_ref one update at a time, jaxloop in calls of several).

Evaluation and checkpoints come every `eval_every` / `save_every` updates (0: only at the end) and at
the end; a save is also made wherever the run ends early (early stopping, a signal, a hook's stop).
The step counted here is the state's count of applied updates; skipped (non-finite) updates do not
advance it.

jaxloop dispatches calls of several updates (K x n micro-batches, one lax.scan) of a few compiled sizes,
each ending at or before the next update where an action that reads the state (evaluation, saving, a hook
of the user's) is due or the run ends (`next_call_size`). Where the grid (the largest count up to the cap
dividing the run's length and every such period) is at least 1/GRID_SHARE of the cap, every call is of
the grid: one compiled size, the loader's chunks taken whole (the default run: 50s). Else, where a period
is co-prime to the others, calls are the largest of the cap, those periods and the powers of two below
it that fits, so the calls never collapse to one update (a hook every 7 updates beside saves every 100:
calls of 7, and 2 + 4 + 1 around each save). A call off the grid (a resume, a skipped update) reaches it
in powers of two. The cap is paced: the loop times its first calls and, where one would last over
2 x TARGET_CALL_S, lowers the cap so that a call lasts about TARGET_CALL_S on the machine at hand
(`paced_cap`): a signal or a hook is served within seconds.
Logs and hooks that only read metrics take them from the call's per-update metrics and bound nothing.
A scan of k updates computes what k single updates do, bit for bit: the sizes chosen change no result.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from jaxloop.config.run import Config

MAX_UPDATES_PER_CALL = 50
"""Default bound of updates dispatched in one call (bounds the micro-batches stacked on the device)."""


@dataclass(frozen=True)
class Cadence:
    """The log / evaluate / save / end rule of a run of `steps` updates."""

    steps: int
    log_every: int
    eval_every: int  # 0: only at the end
    save_every: int  # 0: only at the end

    @classmethod
    def of(cls, cfg: Config) -> Cadence:
        return cls(cfg.steps, cfg.log_every, cfg.eval_every, cfg.checkpoint.every)

    def logs(self, step: int) -> bool:
        return step % self.log_every == 0 or step >= self.steps

    def evaluates(self, step: int) -> bool:
        return due(self.eval_every, step) or step >= self.steps

    def saves(self, step: int, ending: bool = False) -> bool:
        """Whether the state at `step` is saved; `ending`: the run stops there (any reason)."""
        return due(self.save_every, step) or self.ends(step, ending)

    def ends(self, step: int, stopped: bool = False) -> bool:
        """Whether the run ends at `step`: all updates done, or a stop was decided (early stopping, a
        signal, a hook)."""
        return step >= self.steps or stopped


def due(every: int, step: int) -> bool:
    """Whether a periodic action of period `every` (0: none) falls on `step`."""
    return every > 0 and step % every == 0


TARGET_CALL_S = 1.0
"""How long a paced device call is meant to last (seconds): a signal or a hook waits about this long."""

GRID_SHARE = 4
"""Calls are all of the grid where it is at least 1/GRID_SHARE of the cap (one compiled size; a call costs the
host a few milliseconds, so calls a quarter of the cap's size cost little), else the cap's few sizes."""


def call_sizes(cap: int, periods: Iterable[int] = ()) -> tuple[int, ...]:
    """The sizes of call the loop runs under `cap`, largest first: the cap, the `periods` below it (0 = only at
    the end: none) and the powers of two below it (1 among them, so any distance can be covered)."""
    below = {p for p in periods if 0 < p < cap} | {1 << i for i in range(cap.bit_length()) if 1 << i < cap}
    return (cap, *sorted(below, reverse=True))


def grid(steps: int, periods: Iterable[int], max_per_call: int) -> int:
    """The largest count up to max_per_call dividing `steps` and every period (0: none): every boundary is on
    its multiples (the loader gathers the micro-batches of calls of this many updates whole)."""
    g = math.gcd(steps, *periods)
    return max(d for d in range(1, min(g, max_per_call) + 1) if g % d == 0)


def on_grid(steps: int, periods: Iterable[int], cap: int) -> int:
    """The grid where the calls are all of it (at least 1/GRID_SHARE of `cap`), else 0."""
    g = grid(steps, periods, cap)
    return g if g * GRID_SHARE >= cap else 0


def next_boundary(step: int, periods: Iterable[int], steps: int) -> int:
    """The first update after `step` where an action of one of `periods` (0: none) is due, or the last update."""
    return min([steps, *((step // p + 1) * p for p in periods if p > 0)])


def next_call_size(step: int, periods: Sequence[int], steps: int, cap: int) -> int:
    """How many updates the call after `step` runs: on the grid (on_grid), the grid, or the powers of two below
    it that reach it; else the largest of call_sizes(cap, periods and steps) that ends at or before the next
    boundary (an update where an action reading the state is due, or the last)."""
    g = on_grid(steps, periods, cap)
    if g:
        cap, periods = g, (g,)
    distance = max(next_boundary(step, periods, steps) - step, 1)
    return next(n for n in call_sizes(cap, (*periods, steps)) if n <= distance)


def call_plan(start: int, steps: int, periods: Sequence[int], cap: int) -> list[int]:
    """The sizes of the calls from update `start` to `steps` when every update is applied (none skipped)."""
    sizes, step = [], start
    while step < steps:
        sizes.append(next_call_size(step, periods, steps, cap))
        step += sizes[-1]
    return sizes


def paced_cap(seconds_per_update: float, max_per_call: int, target_s: float = TARGET_CALL_S, divides: int = 0) -> int:
    """The cap for calls of about `target_s` seconds at `seconds_per_update`: max_per_call where that many fit,
    else the largest divisor of `divides` (a grid: its chunks stay whole) or power of two (few sizes are
    compiled) that fits, at least 1."""
    fits = int(target_s / seconds_per_update) if seconds_per_update > 0 else max_per_call
    if fits >= max_per_call:
        return max_per_call
    fits = max(fits, 1)
    if divides:
        return max(d for d in range(1, fits + 1) if divides % d == 0)
    return 1 << (fits.bit_length() - 1)
