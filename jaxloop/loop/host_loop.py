"""The host loop: device calls of several updates, and the run's periodic actions between them.

It keeps the device busy while the host works: as soon as a call's metrics are in, it dispatches the
next call, unless the state reached is needed (an action that reads the state is due there, or the run
ends) or the next call is still to be compiled (compiling is not training time); then it hands the
finished call to the actions (logs, streaks, metric hooks). At a boundary it decides first how the run
stands (the last update, a signal, the evaluation and its early stopping), then calls each action due
there once, with the boundary's immutable record (jaxloop.loop.actions.Boundary), before dispatching again.
It knows no action by name (jaxloop.loop.actions) and reaches the device only through a Dispatcher
(jaxloop.loop.dispatch). `jaxloop.run` builds both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from jaxloop.core.cadence import call_size, next_call_size
from jaxloop.core.outcome import COMPLETED
from jaxloop.loop.actions import Action, Boundary, Evaluate, RunContext, metrics_of
from jaxloop.loop.dispatch import Call, Dispatcher, Finished
from jaxloop.update.state import TrainState

EVALUATION = -1
"""The evaluation's place in a boundary's set of parts already run (the actions': their index)."""


def updates_per_call(steps: int, actions: Sequence[Action | Evaluate], max_per_call: int) -> int:
    """The loop's call size: the largest count up to max_per_call that ends a call on every update where
    an action reading the state is due, and on the last."""
    return call_size(steps, [a.every for a in actions if a.needs_state], max_per_call)


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
    for i, action in enumerate(actions):
        if i not in acted and action.due(b):
            acted.add(i)
            b = action.at_boundary(run, b) or b
    return act(run, actions, b, acted) if b.ends and not ends else b


class Parts(NamedTuple):
    """What train() runs: the dispatcher, the actions, the run's inputs, the call size, the evaluation."""

    dispatcher: Dispatcher
    actions: Sequence[Action]
    run: RunContext
    per_call: int
    evaluate: Evaluate | None

    def dispatch(self, state: TrainState, step: int) -> Call:
        n = next_call_size(step, self.per_call, self.run.steps)
        for action in self.actions:
            action.before_dispatch(self.run, step, n)
        return self.dispatcher.dispatch(state, step, n)  # returns at once; `state` is donated

    def polled(self, hook: str, *args: Any) -> str | None:
        """Every action's stop decision (each is asked: several processes agree on a signal together)."""
        reasons = [getattr(action, hook)(self.run, *args) for action in self.actions]
        return next((r for r in reasons if r is not None), None)

    def cuts(self, done: Finished, stop: str | None) -> bool:
        """Whether the call ends here: the run ends, or something reading the state is due."""
        return (
            done.step >= self.run.steps
            or stop is not None
            or any(a.cuts(done.step) for a in self.actions)
            or (self.evaluate is not None and self.evaluate.cuts(done.step))
        )

    def boundary(self, done: Finished, stop: str | None, acted: Acted) -> tuple[Boundary, Acted]:
        """The record of the boundary `done` reached, evaluated there first when due; the actions, once."""
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
        if self.evaluate is not None and EVALUATION not in acted.parts and self.evaluate.due(b.step):
            acted.parts.add(EVALUATION)
            evaluation, early = self.evaluate(self.run, b.step, b.state)
            b = b.replace(evaluation=evaluation).stopping(early)
        b = act(self.run, self.actions, b, acted.parts)
        if not b.ends:  # a signal that came during the actions stops here, not a call later
            reason = self.polled("poll")
            if reason is not None:
                b = act(self.run, self.actions, b.stopping(reason), acted.parts)
        return b, acted._replace(record=b)


def train(
    state: TrainState,
    step: int,
    dispatcher: Dispatcher,
    actions: Sequence[Action],
    run: RunContext,
    per_call: int,
    evaluate: Evaluate | None = None,
) -> Ended:
    """Train from `state` (after `step` applied updates) to the end of the run; `evaluate` runs at each
    boundary where it is due, before the actions (its results and early stopping are in their record)."""
    parts = Parts(dispatcher, actions, run, per_call, evaluate)
    for action in actions:
        action.start(run, step)
    # the update the run starts from was acted on by the session before it (or is the initial state)
    acted = Acted(step, {EVALUATION, *range(len(actions))}, None)
    last_eval: dict[str, float] = {}
    try:
        if step >= run.steps:  # a finished run started again (resumed at its end): no update to run
            return Ended(state, COMPLETED, last_eval)
        call, stop = parts.dispatch(state, step), None
        while True:
            done = dispatcher.wait(call)  # the host waits for the device here, once per call
            reason = parts.polled("poll")  # asked after every call (several processes agree on a signal together)
            stop = reason if stop is None else stop
            ready = dispatcher.ready(next_call_size(done.step, per_call, run.steps))
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
