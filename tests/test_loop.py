"""The host loop (jaxloop.loop.train) over a scripted Dispatcher and recording actions: no device, no JAX.

The Dispatcher is the loop's seam: here a fake one finishes each call at once with one applied update
per micro-batch, so the order of dispatches, waits and action calls can be read off an event list.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from jaxloop.actions import Action, RunContext, Throughput
from jaxloop.dispatch import Call, Finished
from jaxloop.loop import train, updates_per_call
from jaxloop.runinfo import Timings


class FakeDispatcher:
    """Calls of n updates that finish at once; the 'state' is the update count."""

    def __init__(self, events: list):
        self.events = events

    def ready(self, n: int) -> bool:
        return True

    def dispatch(self, state: int, step: int, n: int) -> Call:
        self.events.append(("dispatch", step, n))
        return Call(state + n, {"updated": np.ones(n, bool)}, step)

    def wait(self, call: Call) -> Finished:
        self.events.append(("wait", call.start))
        step = call.start + int(call.metrics["updated"].sum())
        return Finished(call.state, call.metrics, call.start, step, time.perf_counter(), 0.0)


class Recorder(Action):
    def __init__(self, name: str, events: list, every: int = 0, needs_state: bool = False, stop_at: int | None = None):
        self.name, self.events, self.every, self.needs_state, self.stop_at = name, events, every, needs_state, stop_at

    def after_call(self, run, done):
        self.events.append((self.name, "after_call", done.step))

    def at_step(self, run, step, state):
        self.events.append((self.name, "at_step", step, state))
        if step == self.stop_at:
            run.stop("recorder")

    def close(self, run):
        self.events.append((self.name, "close"))


def _run(steps: int, actions_of, per_call: int | None = None, max_per_call: int = 50):
    events: list = []
    actions = actions_of(events)
    run = RunContext(steps, 1, logger=None, timings=Timings(), clock=Throughput(0, 0.0))
    n = per_call or updates_per_call(steps, actions, max_per_call)
    final = train(0, 0, FakeDispatcher(events), actions, run, n)
    return final, events, run


def test_the_next_call_goes_out_before_the_finished_one_is_handed_to_the_actions():
    # No action reads the state before the end: every call but the last is followed by the next dispatch
    # before the actions see its metrics. Mutant (after_call before the dispatch ahead): seen failing.
    final, events, _ = _run(20, lambda ev: [Recorder("log", ev)], max_per_call=5)
    assert final == 20
    for end in (5, 10, 15):
        assert events.index(("dispatch", end, 5)) < events.index(("log", "after_call", end))
    assert events[-3:] == [("log", "after_call", 20), ("log", "at_step", 20, 20), ("log", "close")]


def test_an_action_reading_the_state_ends_calls_on_its_updates_and_sees_that_state():
    final, events, _ = _run(12, lambda ev: [Recorder("eval", ev, every=4, needs_state=True)])
    assert [e for e in events if e[0] == "dispatch"] == [("dispatch", s, 4) for s in (0, 4, 8)]
    assert [e for e in events if e[1:2] == ("at_step",)] == [("eval", "at_step", s, s) for s in (4, 8, 12)]
    for s in (4, 8):  # at a boundary the loop acts on the state first, then dispatches
        assert events.index(("eval", "at_step", s, s)) < events.index(("dispatch", s, 4))


def test_an_action_that_only_reads_metrics_cuts_no_call_short():
    actions = lambda ev: [Recorder("metrics", ev, every=3), Recorder("save", ev, every=10, needs_state=True)]  # noqa: E731
    _, events, _ = _run(20, actions)
    assert [e[2] for e in events if e[0] == "dispatch"] == [10, 10], "calls end at the saves only"


def test_a_stop_decided_at_a_boundary_ends_the_run_there_and_every_action_is_closed():
    final, events, run = _run(20, lambda ev: [Recorder("a", ev, every=4, needs_state=True, stop_at=8),
                                             Recorder("b", ev)])
    assert final == 8 and run.stop_reason == "recorder"
    assert ("b", "at_step", 8, 8) in events, "the actions after the stopping one still act at that update"
    assert events[-2:] == [("b", "close"), ("a", "close")], "closed in reverse order"


def test_actions_are_closed_when_an_action_raises():
    class Failing(Recorder):
        def after_call(self, run, done):
            raise RuntimeError("boom")

    events: list = []
    actions = [Recorder("a", events), Failing("f", events)]
    run = RunContext(10, 1, logger=None, timings=Timings(), clock=Throughput(0, 0.0))
    with pytest.raises(RuntimeError, match="boom"):
        train(0, 0, FakeDispatcher(events), actions, run, 5)
    assert events[-2:] == [("f", "close"), ("a", "close")]
