"""The host loop: device calls of several updates, and the run's periodic actions between them.

It keeps the device busy while the host works: as soon as a call's metrics are in, it dispatches the
next call, unless the state reached is needed (an action that reads the state is due there, or the run
ends) or the next call is still to be compiled (compiling is not training time); then it hands the
finished call to the actions (logs, streaks, metric hooks), and at a boundary lets them act on the state
(evaluate, save, hooks) before dispatching again; where one of them decides to stop, they act once more
on that state, so that those before it see the run's end (each acts at most once per update). It knows
no action by name (jaxloop.actions) and
reaches the device only through a Dispatcher (jaxloop.dispatch). `jaxloop.run` builds both.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxloop.actions import Action, RunContext
from jaxloop.dispatch import Call, Dispatcher
from jaxloop.state import TrainState
from loopcore.cadence import call_size, next_call_size


def updates_per_call(steps: int, actions: Sequence[Action], max_per_call: int) -> int:
    """The loop's call size: the largest count up to max_per_call that ends a call on every update where
    an action reading the state is due, and on the last."""
    return call_size(steps, [a.every for a in actions if a.needs_state], max_per_call)


def train(state: TrainState, step: int, dispatcher: Dispatcher, actions: Sequence[Action], run: RunContext,
          per_call: int) -> TrainState:
    """Train from `state` (after `step` applied updates) to the end of the run; returns the final state."""

    def dispatch(state: TrainState, step: int) -> Call:
        n = next_call_size(step, per_call, run.steps)
        for action in actions:
            action.before_dispatch(run, step, n)
        return dispatcher.dispatch(state, step, n)  # returns at once; `state` is donated

    for action in actions:
        action.start(run, step)
    try:
        if run.ends(step):  # a finished run started again (resumed at its end): no update to run
            return state
        call = dispatch(state, step)
        while True:
            done = run.done = dispatcher.wait(call)  # the host waits for the device here, once per call
            for action in actions:
                action.poll(run)
            boundary = run.ends(done.step) or any(a.needs_state and a.due(done.step) for a in actions)
            ready = dispatcher.ready(next_call_size(done.step, per_call, run.steps))
            ahead = dispatch(done.state, done.step) if ready and not boundary else None
            for action in actions:
                action.after_call(run, done)
            if ahead is None:
                state, ending = done.state, run.ends(done.step)
                for action in actions:
                    state = action.at_step(run, done.step, state) or state
                if not run.ends(done.step):  # a signal that came during the actions stops here, not a call later
                    for action in actions:
                        action.poll(run)
                if run.ends(done.step) and not ending:  # a stop decided here: the actions before it see the end too
                    for action in actions:
                        state = action.at_step(run, done.step, state) or state
                if run.ends(done.step):
                    return state
                ahead = dispatch(state, done.step)
            call = ahead
    finally:
        for action in reversed(actions):
            action.close(run)
