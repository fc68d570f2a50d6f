"""The host loop (jaxloop.loop.host_loop.train) over a scripted Dispatcher and recording actions: no device, no JAX.

The Dispatcher is the loop's seam: here a fake one finishes each call at once with one applied update
per micro-batch, so the order of dispatches, waits and action calls can be read off an event list.
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import pytest

from jaxloop.config.cadence import Cadence
from jaxloop.loop.actions import Action, Evaluate, RunContext, Throughput
from jaxloop.loop.dispatch import Call, Finished
from jaxloop.loop.host_loop import Pace, train
from jaxloop.observe.runinfo import Timings
from jaxloop.rundir.records import BestTracker


class FakeDispatcher:
    """Calls of n updates that finish at once; the 'state' is the update count."""

    def __init__(self, events: list):
        self.events = events

    def ready(self, n: int) -> bool:
        return True

    def dispatch(self, state: int, step: int, n: int) -> Call:
        self.events.append(("dispatch", step, n))
        return Call(state + n, {"updated": np.ones(n, bool), "loss": np.zeros(n)}, step)

    def wait(self, call: Call) -> Finished:
        self.events.append(("wait", call.start))
        step = call.start + int(call.metrics["updated"].sum())
        return Finished(call.state, call.metrics, call.start, step, time.perf_counter(), 0.0)

    def data_state(self) -> dict:
        return {"position": -1}


class Recorder(Action):
    """Records every call; ends the run with reason "recorder" at update `stop_at`."""

    def __init__(self, name: str, events: list, every: int = 0, needs_state: bool = False, stop_at: int | None = None):
        self.name, self.events, self.every, self.needs_state, self.stop_at = name, events, every, needs_state, stop_at

    def after_call(self, run, done):
        self.events.append((self.name, "after_call", done.step))

    def at_boundary(self, run, b):
        self.events.append((self.name, "at_boundary", b.step, b.state))
        self.events.append((self.name, "record", b.step, b.ends, b.evaluation))
        return b.stopping("recorder" if b.step == self.stop_at else None)

    def close(self, run):
        self.events.append((self.name, "close"))


class Sinks:
    """The logger an evaluation writes to: its records and messages, kept."""

    def __init__(self):
        self.records: list = []

    def eval(self, record):
        self.records.append(record)

    def message(self, line):
        self.records.append(line)


def _context(steps: int, start: int = 0) -> RunContext:
    return RunContext(steps, 1, logger=Sinks(), timings=Timings(), clock=Throughput(start, 0.0))


def _evaluate(steps: int, every: int, losses: dict[int, float], patience: int = 0) -> Evaluate:
    """A real Evaluate over a scripted evaluation: val_loss losses[step] (default 1.0) at each due update."""
    return Evaluate(
        Cadence(steps, 1, every, 0),
        lambda state: {"val_loss": losses.get(state, 1.0)},
        BestTracker("min", patience),
        "val_loss",
    )


def _run(steps: int, actions_of, max_per_call: int = 50, evaluate: Evaluate | None = None):
    events: list = []
    actions = [*([evaluate] if evaluate is not None else []), *actions_of(events)]
    ended = train(0, 0, FakeDispatcher(events), actions, _context(steps), max_per_call)
    return ended, events


def _boundary_calls(events: list) -> list:
    return [e for e in events if e[1:2] == ("at_boundary",)]


def test_the_next_call_goes_out_before_the_finished_one_is_handed_to_the_actions():
    # No action reads the state before the end: every call but the last is followed by the next dispatch
    # before the actions see its metrics. Mutant (after_call before the dispatch ahead): seen failing.
    ended, events = _run(20, lambda ev: [Recorder("log", ev)], max_per_call=5)
    assert ended.state == 20
    for end in (5, 10, 15):
        assert events.index(("dispatch", end, 5)) < events.index(("log", "after_call", end))
    assert events[-4:] == [
        ("log", "after_call", 20),
        ("log", "at_boundary", 20, 20),
        ("log", "record", 20, True, None),
        ("log", "close"),
    ]


def test_an_action_reading_the_state_ends_calls_on_its_updates_and_sees_that_state():
    ended, events = _run(12, lambda ev: [Recorder("eval", ev, every=4, needs_state=True)])
    assert [e for e in events if e[0] == "dispatch"] == [("dispatch", s, 4) for s in (0, 4, 8)]
    assert _boundary_calls(events) == [("eval", "at_boundary", s, s) for s in (4, 8, 12)]
    for s in (4, 8):  # at a boundary the loop acts on the state first, then dispatches
        assert events.index(("eval", "at_boundary", s, s)) < events.index(("dispatch", s, 4))


def test_an_action_that_only_reads_metrics_cuts_no_call_short():
    actions = lambda ev: [Recorder("metrics", ev, every=3), Recorder("save", ev, every=10, needs_state=True)]  # noqa: E731
    _, events = _run(20, actions)
    assert [e[2] for e in events if e[0] == "dispatch"] == [10, 10], "calls end at the saves only"


def test_a_hook_period_co_prime_to_the_others_keeps_the_calls_large():
    # issue 44: a state hook every 7 beside a save every 100 made every call one update (500 calls: the gcd
    # rule, call_size). Calls run up to the next boundary in a few sizes: 7s, and 2 + 4 + 1 around each save;
    # every boundary is still reached exactly. Mutant (the former gcd rule): 500 dispatches of 1, seen failing.
    _, events = _run(
        500,
        lambda ev: [Recorder("hook", ev, every=7, needs_state=True), Recorder("save", ev, every=100, needs_state=True)],
    )
    sizes = [e[2] for e in events if e[0] == "dispatch"]
    assert sum(sizes) == 500 and len(sizes) == 81 and sizes.count(7) == 67 and set(sizes) == {7, 4, 2, 1}
    assert [e[2] for e in _boundary_calls(events) if e[0] == "hook"] == [*range(7, 500, 7), 500]
    assert [e[2] for e in _boundary_calls(events) if e[0] == "save"] == [100, 200, 300, 400, 500]


class Timed(FakeDispatcher):
    """Calls that take `seconds` an update on the device (their Finished.seconds)."""

    def __init__(self, events: list, seconds: float):
        super().__init__(events)
        self.seconds = seconds

    def wait(self, call):
        return super().wait(call)._replace(seconds=self.seconds * len(call.metrics["updated"]))


def _paced(steps: int, seconds: float) -> tuple[list[int], list[dict]]:
    """The call sizes of a paced run (a save every 20, target 1 s a call) and the pace's records told."""
    events: list = []
    told: list = []
    actions = [Recorder("save", events, every=20, needs_state=True)]
    pace = Pace.of(steps, actions, 50, measure=True, target_s=1.0, paced=lambda p: told.append(p.record()))
    train(0, 0, Timed(events, seconds), actions, _context(steps), pace)
    return [e[2] for e in events if e[0] == "dispatch"], told


def test_a_paced_run_times_its_first_calls_and_lowers_the_cap_to_about_a_second():
    # issue 45: the first call is of the normal size (the grid, 20: no probe of another size, no call of
    # one update after it); at 0.25 s an update it lasts 5 s, over twice the target, so the cap becomes
    # the largest divisor of the grid within a second: 4 (the loader's chunks of 20 stay whole), told once.
    # Mutant (the pace not lowered: calls of 20 throughout) seen failing.
    sizes, told = _paced(100, 0.25)
    assert sizes == [20] + [4] * 20
    assert [t["updates_per_call"] for t in told] == [4]
    assert told[0]["measured_s_per_update"] == 0.25 and told[0]["max_updates_per_call"] == 50
    assert told[0]["sizes"] == [4]


def test_a_fast_run_keeps_its_calls_and_a_short_one_compiles_no_other_size():
    # 1 ms an update: a call of 20 lasts 20 ms, kept (the measurement recorded all the same). 0.25 s an update
    # with a single call of 20 left after the first: lowering it would compile a size for one call's wait.
    # Mutant (lowered whatever is left: 20, then 4 x 5) seen failing.
    sizes, told = _paced(100, 0.001)
    assert sizes == [20] * 5 and [t["updates_per_call"] for t in told] == [50]
    sizes, told = _paced(40, 0.25)
    assert sizes == [20, 20] and [t["updates_per_call"] for t in told] == [50]


def test_each_action_is_called_once_per_boundary_the_stopping_one_included():
    # Boundaries at 3 (b), 4 (a), 6 (b: it stops the run there). Every action is called at most once per
    # update; at the stopping update a (before b) and c (after it, every=0) are called once, seeing the
    # end. Mutant (the loop's second pass over every action where a stop is decided, as before): b is
    # called twice at 6 (seen failing).
    ended, events = _run(
        20,
        lambda ev: [
            Recorder("a", ev, every=4, needs_state=True),
            Recorder("b", ev, every=3, needs_state=True, stop_at=6),
            Recorder("c", ev),
        ],
    )
    assert ended.state == 6 and ended.stop_reason == "recorder"
    calls = Counter((e[0], e[2]) for e in _boundary_calls(events))
    assert max(calls.values()) == 1, f"called more than once at an update: {calls}"
    assert sorted(calls) == [("a", 4), ("a", 6), ("b", 3), ("b", 6), ("c", 6)]
    records = {(e[0], e[2]): e[3] for e in events if e[1:2] == ("record",)}
    assert records[("a", 6)] and records[("c", 6)], "the actions before and after the stopping one see the end"
    assert not records[("b", 6)], "the stopping one was handed the record before its own stop"
    assert events.index(("c", "at_boundary", 6, 6)) < events.index(("a", "at_boundary", 6, 6)), (
        "those after it first (a save sees the stop), then those before it that the end makes due"
    )


def test_a_signal_during_the_actions_ends_the_run_at_that_boundary_with_one_call_each():
    class LateSignal(Recorder):
        """A stop polled after update 4's actions ran (the signal came while they ran)."""

        polls = 0

        def poll(self, run):
            self.polls += 1
            # polled after each wait and after the actions of each boundary: 1, 2 at update 2; 3, 4 at 4
            return "signal SIGTERM" if self.polls == 4 else None

    ended, events = _run(12, lambda ev: [LateSignal("s", ev, every=2, needs_state=True), Recorder("save", ev)])
    assert ended.state == 4 and ended.stop_reason == "signal SIGTERM"
    assert [(e[0], e[2], e[3]) for e in events if e[1:2] == ("record",)] == [
        ("s", 2, False),
        ("s", 4, False),
        ("save", 4, True),
    ], "called once each; the save (due at the end) sees it"


def test_the_evaluation_is_an_action_whose_results_are_in_the_record_of_those_after_it():
    # Evaluate is listed before the recorder (as the run lists it before the plateau, the hooks and the
    # save): the recorder is handed the evaluation of its update (mutant: the evaluation listed after the
    # recorder: the recorder sees None; seen failing).
    evaluate = _evaluate(12, 4, {4: 0.5, 8: 0.25})
    ended, events = _run(12, lambda ev: [Recorder("first", ev, every=2, needs_state=True)], evaluate=evaluate)
    seen = {e[2]: e[4] for e in events if e[1:2] == ("record",)}
    assert seen == {2: None, 4: {"val_loss": 0.5}, 6: None, 8: {"val_loss": 0.25}, 10: None, 12: {"val_loss": 1.0}}
    assert ended.evaluation == {"val_loss": 1.0}, "the session's last evaluation, for the summary"


def test_early_stopping_ends_the_run_at_the_evaluated_update_and_every_action_sees_it():
    # patience 1: the evaluation at 8 (no better than 4) stops the run at 8, before the actions are called.
    evaluate = _evaluate(20, 4, {4: 0.5, 8: 0.75}, patience=1)
    ended, events = _run(
        20, lambda ev: [Recorder("a", ev), Recorder("b", ev, every=4, needs_state=True)], evaluate=evaluate
    )
    assert ended.state == 8 and ended.stop_reason == "early_stopping"
    assert [(e[0], e[2], e[3]) for e in events if e[1:2] == ("record",)] == [
        ("b", 4, False),
        ("a", 8, True),
        ("b", 8, True),
    ]


def test_a_run_started_at_its_end_dispatches_nothing():
    # A finished run started again resumes at `steps`: not one update more (seen: 21 of 20 before).
    events: list = []
    ended = train(20, 20, FakeDispatcher(events), [Recorder("a", events)], _context(20, 20), 5)
    assert ended.state == 20 and ended.stop_reason == "completed"
    assert [e for e in events if e[0] in ("dispatch", "wait")] == []


def test_actions_are_closed_when_an_action_raises():
    class Failing(Recorder):
        def after_call(self, run, done):
            raise RuntimeError("boom")

    events: list = []
    actions = [Recorder("a", events), Failing("f", events)]
    with pytest.raises(RuntimeError, match="boom"):
        train(0, 0, FakeDispatcher(events), actions, _context(10), 5)
    assert events[-2:] == [("f", "close"), ("a", "close")]


def test_an_action_written_for_the_former_protocol_is_refused_with_what_to_do():
    with pytest.raises(TypeError, match="at_boundary"):
        type("Old", (Action,), {"at_step": lambda self, run, step, state: None})
