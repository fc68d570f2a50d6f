"""The host loop: device calls of several updates, and the run's periodic actions between them.

It keeps the device busy while the host works: as soon as a call's metrics are in, it dispatches the
next call, unless the state reached is needed (an action that reads the state is due there, or the run
ends) or the next call is still to be compiled (compiling is not training time); then it hands the
finished call to the actions (logs, streaks, metric hooks). At a boundary it decides first how the run
stands (the last update, a signal), then calls each action due there once, in order, with the boundary's
immutable record (jaxloop.loop.actions.Boundary; the evaluation is one of them, listed before those that
read its results), before dispatching again. How many updates each call runs is the Pace's (paced to
about a second from the first calls' own time, jaxloop.config.cadence). It knows no action by name
(jaxloop.loop.actions) and reaches the device only through a Dispatcher (jaxloop.loop.dispatch).
`jaxloop.run` builds both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from jaxloop.config.cadence import TARGET_CALL_S, call_sizes, next_call_size, on_grid, paced_cap
from jaxloop.loop.actions import Action, Boundary, RunContext, metrics_of
from jaxloop.loop.dispatch import Call, Dispatcher, Finished
from jaxloop.rundir.outcome import COMPLETED
from jaxloop.update.state import TrainState

MEASURED_CALLS = 2
"""A paced run's first calls, whose device time sets the cap (the lesser: the first run of a compiled call
pays for its start)."""


@dataclass
class Pace:
    """How many updates each call runs (jaxloop.config.cadence.next_call_size): the grid, or the largest of a few
    sizes under `cap` that ends at or before the next update where an action reading the state is due
    (`periods`), or the last. Paced (`measure`), the run's first MEASURED_CALLS calls, of the normal size,
    are timed, and where the longest call would last over 2 x `target_s` (and more than one such call is
    left) the cap is lowered so that a call lasts about `target_s` (paced_cap: a divisor of the grid, or a
    power of two), at most max_per_call; `paced(pace)` is told of the first measurement and of each cap
    chosen. Unpaced, the cap is max_per_call. `chunk`: the grid where the calls are of it (the loader's
    chunks of that many updates are taken whole), else 1 (the loader's single updates are joined into
    each call)."""

    steps: int
    periods: tuple[int, ...]
    max_per_call: int
    measure: bool = False
    target_s: float = TARGET_CALL_S
    paced: Callable[[Pace], None] = field(default=lambda pace: None, repr=False)
    chunk: int = 1
    cap: int = 0
    seconds_per_update: float | None = None
    measured: int = 0

    def __post_init__(self) -> None:
        self.cap = self.cap or self.max_per_call

    @classmethod
    def of(cls, steps: int, actions: Sequence[Action], max_per_call: int, **options: Any) -> Pace:
        """The pace of a run of `steps` updates whose `actions` that read the state end calls on their updates."""
        periods = tuple(sorted({a.every for a in actions if a.needs_state and a.every > 0}))
        return cls(steps, periods, max_per_call, chunk=on_grid(steps, periods, max_per_call) or 1, **options)

    def size(self, step: int) -> int:
        """The updates of the call after update `step`."""
        return next_call_size(step, self.periods, self.steps, self.cap)

    def longest(self) -> int:
        """The longest call under the cap: the grid, or the cap."""
        return on_grid(self.steps, self.periods, self.cap) or self.cap

    def finished(self, done: Finished, accum_steps: int) -> None:
        """Told of each finished call: the first MEASURED_CALLS set the seconds per update (the least) and,
        where the longest call would last over 2 x target_s with more than one such call left, lower the cap
        (to a divisor of the grid, so that the loader's chunks stay whole, or to a power of two)."""
        dispatched = len(done.metrics["updated"]) // accum_steps
        if not self.measure or self.measured >= MEASURED_CALLS or dispatched < 1:
            return
        seconds = done.seconds / dispatched
        self.seconds_per_update = min(seconds, self.seconds_per_update or seconds)
        self.measured += 1
        longest, cap = self.longest(), self.cap
        if longest * self.seconds_per_update > 2 * self.target_s and self.steps - done.step > longest:
            g = on_grid(self.steps, self.periods, self.cap)
            cap = paced_cap(self.seconds_per_update, longest, self.target_s, divides=g)
        if cap != self.cap or self.measured == 1:
            self.cap = cap
            self.paced(self)

    def record(self) -> dict[str, Any]:
        """metadata.json's `calls`: the bound, the cap chosen, what it was chosen from, the sizes the calls take
        (the grid, or the cap's sizes; a call off the grid, after a resume or a skipped update, adds powers of two)."""
        g = on_grid(self.steps, self.periods, self.cap)
        return {
            "max_updates_per_call": self.max_per_call,
            "updates_per_call": self.cap,
            "target_s": self.target_s,
            "measured_s_per_update": self.seconds_per_update,
            "sizes": [g] if g else list(call_sizes(self.cap, (*self.periods, self.steps))),
        }

    def line(self) -> str | None:
        """The line a run prints when its cap is below the bound (None: calls of up to the bound)."""
        if self.cap >= self.max_per_call or self.seconds_per_update is None:
            return None
        return (
            f"device calls of up to {self.cap} update(s): {self.seconds_per_update:.3g}s per update measured, "
            f"so a call lasts about {self.cap * self.seconds_per_update:.1f}s and a stop or a hook waits no "
            f"longer (--updates_per_call {self.max_per_call} bounds them)"
        )


class Ended(NamedTuple):
    """How train() ended: the final state, summary.json's stop_reason, the session's last evaluation ({}: none)."""

    state: TrainState
    stop_reason: str
    evaluation: dict[str, float]


class Acted(NamedTuple):
    """The parts run at update `step` (its boundary may come again after a call whose updates were all
    skipped: what ran there does not run twice)."""

    step: int
    parts: set[int]
    record: Boundary | None


def act(run: RunContext, actions: Sequence[Action], b: Boundary, acted: set[int]) -> Boundary:
    """Call each action due at `b` and not yet run at its update, once, in order, each handed the record
    the one before it returned; where one of them ends the run, the actions before it that the end makes
    due are called then (once: a hook's call at the end)."""
    ends = b.ends
    while True:
        for i, action in enumerate(actions):
            if i not in acted and action.due(b):
                acted.add(i)
                b = action.at_boundary(run, b) or b
        if ends or not b.ends:
            return b
        ends = True  # one more pass: those before the one that ended the run, now due at its end


class Parts(NamedTuple):
    """What train() runs: the dispatcher, the actions, the run's inputs, the calls' pace."""

    dispatcher: Dispatcher
    actions: Sequence[Action]
    run: RunContext
    pace: Pace

    def dispatch(self, state: TrainState, step: int) -> Call:
        n = self.pace.size(step)
        for action in self.actions:
            action.before_dispatch(self.run, step, n)
        return self.dispatcher.dispatch(state, step, n)  # returns at once; `state` is donated

    def polled(self, hook: str, *args: Any) -> str | None:
        """Every action's stop decision (each is asked: several processes agree on a signal together)."""
        reasons = [getattr(action, hook)(self.run, *args) for action in self.actions]
        return next((r for r in reasons if r is not None), None)

    def cuts(self, done: Finished, stop: str | None) -> bool:
        """Whether the call ends here: the run ends, or something reading the state is due."""
        return done.step >= self.run.steps or stop is not None or any(a.cuts(done.step) for a in self.actions)

    def boundary(self, done: Finished, stop: str | None, acted: Acted) -> tuple[Boundary, Acted]:
        """The record of the boundary `done` reached, and the actions due there, once."""
        if acted.step != done.step:
            acted = Acted(done.step, set(), None)
        b = Boundary(
            done.step,
            done.state,
            metrics_of(done, done.step, self.run.accum_steps),
            self.dispatcher.data_state(),
            acted.record.evaluation if acted.record is not None else None,
            stop,
            final=done.step >= self.run.steps,
        )
        b = act(self.run, self.actions, b, acted.parts)
        if not b.ends:  # a signal that came during the actions stops here, not a call later
            reason = self.polled("poll")
            if reason is not None:
                b = act(self.run, self.actions, b.stopping(reason), acted.parts)
        return b, acted._replace(record=b)


def train(
    state: TrainState, step: int, dispatcher: Dispatcher, actions: Sequence[Action], run: RunContext, pace: Pace | int
) -> Ended:
    """Train from `state` (after `step` applied updates) to the end of the run, in calls of `pace` (an int:
    unpaced calls of up to that many updates), calling `actions` in order (the evaluation among them)."""
    if isinstance(pace, int):
        pace = Pace.of(run.steps, actions, pace)
    parts = Parts(dispatcher, actions, run, pace)
    for action in actions:
        action.start(run, step)
    # the update the run starts from was acted on by the session before it (or is the initial state)
    acted = Acted(step, set(range(len(actions))), None)
    last_eval: dict[str, float] = {}
    try:
        if step >= run.steps:  # a finished run started again (resumed at its end): no update to run
            return Ended(state, COMPLETED, last_eval)
        call, stop = parts.dispatch(state, step), None
        while True:
            done = dispatcher.wait(call)  # the host waits for the device here, once per call
            pace.finished(done, run.accum_steps)
            reason = parts.polled("poll")  # asked after every call (several processes agree on a signal together)
            stop = reason if stop is None else stop
            ready = dispatcher.ready(pace.size(done.step))
            ahead = parts.dispatch(done.state, done.step) if ready and not parts.cuts(done, stop) else None
            reason = parts.polled("after_call", done)  # every action has the call's metrics (logs, streaks)
            stop = reason if stop is None else stop
            if ahead is None:
                b, acted = parts.boundary(done, stop, acted)
                last_eval = dict(b.evaluation) if b.evaluation is not None else last_eval  # the latest
                if b.ends:
                    return Ended(b.state, b.stop_reason, last_eval)
                ahead = parts.dispatch(b.state, b.step)
            call = ahead
    finally:
        for action in reversed(actions):
            action.close(run)
