"""The periodic actions of a run: what the host loop (jaxloop.loop.host_loop) does between device calls.

An Action has a period `every` (in applied updates; 0 = only at the end) and says whether it reads the
state (`needs_state`): the loop ends its device calls on the updates of every such action (`cuts`), so
that it sees the state of exactly its update, and leaves the others to read the call's per-update metrics
(they never cut a call short). A boundary is an update where a call ends and something reading the
state is due, or the run ends there. The loop calls, for every action, in list order:

    start(run, step)                  once, before the first call (step: the update the run starts from)
    poll(run) -> reason | None        after each call's wait: a stop decided outside (a signal)
    before_dispatch(run, step, n)     before each call of n updates after update `step` (the profiler)
    after_call(run, done) -> reason | None   with each finished call's metrics (the next call may already
                                      run); a reason ends the run (at this boundary, or the next one)
    at_boundary(run, b) -> b | None   once per boundary where `due(b)`, with its immutable record `b`
                                      (Boundary: the update, the state, its metrics, the data position,
                                      the evaluation of that update, whether and why the run ends there);
                                      returns a new record (another state, a stop) for the actions after it
    close(run)                        at the end, however the run ends (in reverse order)

Every stop known before a boundary (the last update, a signal, a non-finite streak) is in the record the
actions get, and one an action decides (the evaluation's early stopping: Evaluate comes before the actions
that read its results) in the record of those after it, so each is called once per boundary and none
keeps an "already done at this update" guard. A stop an action decides
at the boundary (a hook's `info.stop`, a signal that came during the actions) is in the record of the
actions after it; the loop then calls, once, those before it that the end makes due (a hook's last call).
`run` (RunContext) holds the run's immutable inputs: its length and its sinks.

Built in: SignalStop, NonFiniteStreak, LogTrain, Profile, Evaluate (with early stopping), PlateauRate (the
plateau schedule's decision after each evaluation), Save; and Hook, a research code's own action
(`jaxloop.run(cfg, task, hooks=[Hook(fn, every=200)])`). An action with a `key` keeps a JSON state in every
checkpoint's data item (state_dict / load_state_dict).
"""

from __future__ import annotations

import contextlib
import dataclasses
import shlex
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import jax
import numpy as np

from jaxloop.config.cadence import Cadence, due
from jaxloop.config.errors import EXIT_SIGNAL, NonFiniteError
from jaxloop.config.run import ConfigError
from jaxloop.loop.dispatch import Finished
from jaxloop.model.flops import Peak, device_memory
from jaxloop.observe.logger import RunLogger
from jaxloop.observe.runinfo import Profiler, Timings, memory_bytes
from jaxloop.rundir.outcome import COMPLETED, EARLY_STOPPING, early_stopping_message, signal_stop
from jaxloop.rundir.records import BestTracker
from jaxloop.runtime.signals import CLI_SESSION, Session, watch_signals
from jaxloop.update.optimizer import set_learning_rate
from jaxloop.update.state import TrainState

# ----------------------------------------------------------------------------- what actions share


@dataclass
class Throughput:
    """Rates over the interval since the previous log record: the loop's wall time, the time checkpoint
    saves block it included; evaluation and compiling excluded (reported apart)."""

    step: int
    time: float
    data_wait: float = 0.0
    updates: int = 0
    seconds: float = 0.0
    compiles: int = 0

    def interval(self, step: int, now: float, data_wait: float) -> dict[str, float]:
        updates = max(step - self.step, 1)
        seconds = max(now - self.time, 1e-9)
        rates = {
            "updates_per_s": updates / seconds,
            "step_ms": 1e3 * seconds / updates,
            "data_wait_ms": 1e3 * (data_wait - self.data_wait) / updates,
        }
        self.step, self.time, self.data_wait = step, now, data_wait
        self.updates, self.seconds = self.updates + updates, self.seconds + seconds
        return rates

    def pause(self, seconds: float) -> None:
        """Exclude time spent outside training (evaluation) from the current interval."""
        self.time += seconds

    def compiled(self, seconds: float) -> None:
        """Leave a compile of `seconds` out of the current interval (compiling is not training time): the
        first starts it now (the setup before it is not either), a later one (a call of another size) is
        paused out of it."""
        if self.compiles:
            self.pause(seconds)
        else:
            self.time = time.perf_counter()
        self.compiles += 1

    @property
    def updates_per_s(self) -> float:
        """The mean rate over every interval logged so far."""
        return self.updates / self.seconds if self.seconds else 0.0


@dataclass(frozen=True)
class RunContext:
    """The run's immutable inputs every action may read: its length, sinks and timings (the clock is the
    throughput sink that logging, evaluation and compiling share)."""

    steps: int
    accum_steps: int
    logger: RunLogger
    timings: Timings
    clock: Throughput
    run_dir: str = ""


@dataclass(frozen=True)
class Boundary:
    """The record of one boundary, as each action is handed it: the update `step`, the state after it,
    that update's train metrics ({} where no update was applied), the loader's position there (`data`,
    what a checkpoint holds), the evaluation of that update (None: none there), and why the run ends
    there (`stop`: a signal, early stopping, a hook's reason; None with `final`: all updates done).
    An action returns `b.replace(...)` to hand the actions after it another state or a stop."""

    step: int
    state: Any
    metrics: Mapping[str, float] = field(default_factory=dict)
    data: Mapping[str, Any] = field(default_factory=dict)
    evaluation: Mapping[str, float] | None = None
    stop: str | None = None
    final: bool = False

    @property
    def ends(self) -> bool:
        """Whether the run ends at this update (all updates done, or a stop decided)."""
        return self.final or self.stop is not None

    @property
    def stop_reason(self) -> str:
        """summary.json's stop_reason were the run to end here: the first stop decided, else completed."""
        return self.stop if self.stop is not None else COMPLETED

    def replace(self, **changes: Any) -> Boundary:
        return dataclasses.replace(self, **changes)

    def stopping(self, reason: str | None) -> Boundary:
        """This record with the run ending for `reason` (the first reason decided is the one kept)."""
        return self if reason is None or self.stop is not None else self.replace(stop=reason)


def metrics_of(done: Finished, step: int, accum_steps: int) -> dict[str, float]:
    """The metrics of update `step` from the finished call that applied it (empty if it did not)."""
    applied = done.applied()
    hits = np.flatnonzero((applied == step) & done.metrics["updated"].astype(bool))
    return update_metrics(done.metrics, int(hits[0]), accum_steps) if hits.size else {}


def update_metrics(metrics: dict[str, np.ndarray], i: int, accum_steps: int) -> dict[str, float]:
    """The metrics of the update that micro-batch i of a call closed: its loss (the mean of its K
    micro-batch losses), the rate it applied, its pre-clip gradient norm, skips so far, the loss scale,
    and the loss's aux metrics (of micro-batch i)."""
    out: dict[str, Any] = {"loss": float(np.mean(metrics["loss"][max(i + 1 - accum_steps, 0) : i + 1]))}
    for key, cast in (("lr", float), ("grad_norm", float), ("skipped", int), ("loss_scale", float)):
        if key in metrics:
            out[key] = cast(metrics[key][i])
    for key, value in metrics.items():
        if key not in out and key not in ("updated", "bad_streak") and np.ndim(value[i]) == 0:
            out[key] = float(value[i])
    return out


class Action:
    """A periodic part of the host loop (see the module doc); every hook is a no-op by default."""

    every: int = 0
    needs_state: bool = False
    key: str | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "at_step" in vars(cls):  # the protocol before one call per boundary: it would never be called
            raise TypeError(
                f"{cls.__name__}.at_step: the loop calls at_boundary(run, b) once per boundary, with its "
                "record b (b.step, b.state, b.evaluation, b.ends); rename it (docs/hooks.md)"
            )

    def cuts(self, step: int) -> bool:
        """Whether the loop's device calls must end at `step` for this action (it reads the state there)."""
        return self.needs_state and due(self.every, step)

    def due(self, b: Boundary) -> bool:
        """Whether the loop calls at_boundary at `b`: at the action's updates and where the run ends."""
        return due(self.every, b.step) or b.ends

    def start(self, run: RunContext, step: int) -> None: ...

    def poll(self, run: RunContext) -> str | None: ...

    def before_dispatch(self, run: RunContext, step: int, n: int) -> None: ...

    def after_call(self, run: RunContext, done: Finished) -> str | None: ...

    def at_boundary(self, run: RunContext, b: Boundary) -> Boundary | None: ...

    def close(self, run: RunContext) -> None: ...

    def state_dict(self) -> dict[str, Any] | None:
        return None

    def load_state_dict(self, saved: dict[str, Any]) -> None: ...


# ----------------------------------------------------------------------------- the built-in actions


class SignalStop(Action):
    """SIGINT / SIGTERM end the run after the calls already dispatched, with a save (exit 130 / 143). With
    several processes they agree once per call, so that all dispatch and stop alike.

    The signal is acknowledged at once (jaxloop.runtime.signals's watcher thread: the main thread may be waiting
    on the device or compiling), naming the updates the run finishes (the calls on the device: paced calls
    last about a second, jaxloop.loop.host_loop.Pace) and the update it stops and saves after. Under the CLI
    (jaxloop.runtime.signals.CLI_SESSION), in one process, a signal before the first compile ended (setup,
    the first compile: nothing trained in this run yet) ends the process at once, and so does a second
    SIGINT; one during the first call waits for it and saves what it trained."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self.received = 0
        self.trained = False  # the first call is compiled: what it trains is worth finishing and saving
        self.finished = 0  # the update the call on the device started from
        self.stops_after: int | None = None  # the last update dispatched: the run stops and saves there
        self._scope: contextlib.ExitStack | None = None
        self._run: RunContext | None = None
        self.session: Session | None = None

    def start(self, run: RunContext, step: int) -> None:
        self._run, self.stops_after, self.finished = run, step, step
        # read here: the watcher thread runs in a context of its own. Several processes stop together only
        # through poll's agreement: none of them ends alone (the others would wait in a collective)
        self.session = CLI_SESSION.get() if jax.process_count() == 1 else None
        self._scope = contextlib.ExitStack()
        self._scope.enter_context(watch_signals(self._acknowledge, handler=self._on_signal))

    def heard(
        self, compile_event: Callable[[int, bool | None, float], None]
    ) -> Callable[[int, bool | None, float], None]:
        """The dispatcher's compile event (jaxloop.loop.dispatch.CallEvents.compile), heard here too: once a
        compile ended, a signal lets the call run and saves what it trained."""

        def event(n: int, loaded: bool | None, seconds: float) -> None:
            # heard before the line is printed: a Ctrl-C typed on seeing "compiled in" finds the call kept
            self.trained = self.trained or loaded is not None
            compile_event(n, loaded, seconds)

        return event

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.signal = self.signal or signum  # finish the calls dispatched, save, then exit

    def _acknowledge(self, signum: int) -> None:
        """On the watcher thread, the moment a signal arrives: say what happens next (or end at once)."""
        self.received += 1
        self.signal = self.signal or signum
        run, session = self._run, self.session
        assert run is not None, "the watcher that calls this is started by start(), after _run is set"
        name, cli = signal.Signals(signum).name, session is not None
        resume = f"resume with: python -m jaxloop.train --run_dir {shlex.quote(run.run_dir)}"
        if session is not None and not self.trained:
            session.exit(
                EXIT_SIGNAL[signum],
                f"{name} received while compiling (nothing trained in this run yet): stopped at once; {resume}",
            )
        if session is not None and self.received > 1 and signum == signal.SIGINT:
            session.exit(
                EXIT_SIGNAL[signum],
                f"second {name}: stopped at once without saving (the run resumes from its last checkpoint); {resume}",
            )
        if self.received == 1:
            again = "; Ctrl-C again to stop at once without saving" if cli and signum == signal.SIGINT else ""
            run.logger.message(f"{name} received: {stop_line(self.finished, self.stops_after)}{again}")

    def before_dispatch(self, run: RunContext, step: int, n: int) -> None:
        self.finished, self.stops_after = step, step + n  # the call before it has finished

    def poll(self, run: RunContext) -> str | None:
        self.trained = True
        seen = self.signal  # read once: the handler may set it at any moment
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            received = np.ravel(multihost_utils.process_allgather(np.int32(seen or 0)))
            seen = int(received[received > 0][0]) if received.any() else None
            if self.signal is None:
                self.signal = seen
        return signal_stop(seen) if seen is not None else None

    def close(self, run: RunContext) -> None:
        if self._scope is not None:
            self._scope.close()
            self._scope = None


def stop_line(finished: int, stops_after: int | None) -> str:
    """What a stop does next: finish the updates on the device (after update `finished`), then save."""
    if stops_after is None or stops_after <= finished:
        return f"stopping after update {finished}: saving..."
    updates = f"update {stops_after}" if stops_after == finished + 1 else f"updates {finished + 1}-{stops_after}"
    return f"finishing {updates}, then stopping after update {stops_after}: saving..."


class NonFiniteStreak(Action):
    """Stop with NonFiniteError (exit 1) after max_bad_steps consecutive skipped updates, found in the
    per-update metrics of the call that reached the streak."""

    def __init__(self, max_bad_steps: int):
        self.max_bad_steps = max_bad_steps

    def after_call(self, run: RunContext, done: Finished) -> None:
        m = done.metrics
        streak = np.flatnonzero(m["bad_streak"] >= self.max_bad_steps)
        if streak.size:
            i = streak[0]
            update = int(done.applied()[i]) + 1
            raise NonFiniteError(
                f"{int(m['bad_streak'][i])} consecutive updates were skipped for a non-finite loss or gradient "
                f"(update {update}; max_bad_steps={self.max_bad_steps}); the last saved checkpoint is finite"
            )


class LogTrain(Action):
    """The train records due in each finished call (cadence.logs): metrics.jsonl, TensorBoard, progress.
    Rates are over the interval since the previous record; a call's time is shared evenly by its updates;
    one memory reading per call (its records end at the same moment). With flops_per_token and a peak
    (jaxloop.model.flops), each record has its MFU; where the device reports its memory limit, mem_util
    (peak bytes in use / limit)."""

    def __init__(
        self,
        cadence: Cadence,
        batch_size: int,
        tokens_per_sample: int = 0,
        flops_per_token: float = 0.0,
        peak: Peak | None = None,
    ):
        self.cadence, self.batch_size, self.tokens_per_sample = cadence, batch_size, tokens_per_sample
        self.flops_per_token, self.peak = flops_per_token, peak

    def after_call(self, run: RunContext, done: Finished) -> None:
        m = done.metrics
        applied = done.applied()
        logged = [int(i) for i in np.flatnonzero(m["updated"]) if self.cadence.logs(int(applied[i]))]
        if not logged:
            return
        with run.timings("log"):
            mem, device = memory_bytes(), device_memory()
            extra: dict[str, float] = {"mem_bytes": mem} if mem is not None else {}
            if device and device["bytes_limit"] and "peak_bytes_in_use" in device:
                extra["mem_util"] = device["peak_bytes_in_use"] / device["bytes_limit"]
            for i in logged:
                run.logger.train({**self._record(run, int(applied[i]), done, i), **extra})
            run.logger.flush()

    def _record(self, run: RunContext, step: int, done: Finished, i: int) -> dict[str, Any]:
        clock, K = run.clock, run.accum_steps
        record = {
            "step": step,
            **update_metrics(
                {
                    k: done.metrics[k]
                    for k in ("loss", "lr", "grad_norm", "skipped", "loss_scale", "updated")
                    if k in done.metrics
                },
                i,
                K,
            ),
        }
        share = (step - clock.step) / max(done.step - clock.step, 1)
        record.update(
            clock.interval(
                step,
                clock.time + share * (done.synced - clock.time),
                clock.data_wait + share * (done.data_wait - clock.data_wait),
            )
        )
        record["samples_per_s"] = record["updates_per_s"] * K * self.batch_size
        if self.tokens_per_sample:
            record["tokens_per_s"] = record["samples_per_s"] * self.tokens_per_sample
            if self.flops_per_token and self.peak is not None:
                record["mfu"] = self.peak.mfu(record["tokens_per_s"], self.flops_per_token)
        return record


class Profile(Action):
    """A jax.profiler trace of the calls that run updates [log.profile_start, + log.profile_steps)."""

    def __init__(self, profiler: Profiler):
        self.profiler = profiler

    def before_dispatch(self, run: RunContext, step: int, n: int) -> None:
        self.profiler.before_call(step, n)

    def close(self, run: RunContext) -> None:
        self.profiler.close()


class Evaluate(Action):
    """The validation split every `every` updates and at the end (cadence.evaluates): an eval record, the best
    metric tracked, early stopping after `patience` evaluations without a better one. The run lists it before
    every action that reads `b.evaluation` (the plateau's rate, the hooks, the save): they get its results,
    and its early stopping, in their record."""

    needs_state = True
    key = "best"

    def __init__(
        self, cadence: Cadence, evaluate: Callable[[TrainState], dict[str, float]], tracker: BestTracker, metric: str
    ):
        self.every, self.cadence, self.evaluate = cadence.eval_every, cadence, evaluate
        self.tracker, self.metric = tracker, metric

    def due(self, b: Boundary) -> bool:
        return self.cadence.evaluates(b.step)

    def at_boundary(self, run: RunContext, b: Boundary) -> Boundary:
        evaluation, early = self(run, b.step, b.state)
        return b.replace(evaluation=evaluation).stopping(early)

    def __call__(self, run: RunContext, step: int, state: TrainState) -> tuple[dict[str, float], str | None]:
        """The evaluation of update `step`, and EARLY_STOPPING where it ends the run (else None)."""
        t0 = time.perf_counter()
        with run.timings("eval"):
            evaluated = self.evaluate(state)
        run.logger.eval({"step": step, **evaluated})
        run.clock.pause(time.perf_counter() - t0)  # evaluation is reported apart, not as training time
        if self.metric not in evaluated:
            raise ConfigError(
                "checkpoint.best_metric", self.metric, f"a metric the evaluation reports ({', '.join(evaluated)})"
            )
        if not self.tracker.update(step, evaluated[self.metric]):
            return evaluated, None
        run.logger.message(early_stopping_message(step, self.metric, self.tracker.patience))
        return evaluated, EARLY_STOPPING

    def state_dict(self) -> dict[str, Any]:
        return self.tracker.as_dict()

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.tracker.load(saved)


class PlateauRate(Action):
    """The plateau schedule (torch's ReduceLROnPlateau): after each evaluation `plateau` (jaxloop.loop.plateau,
    host-side) decides on `metric`, and a reduced rate is written into the optimizer's state for the
    updates that follow; its decision state goes into every checkpoint."""

    needs_state = True
    key = "plateau"

    def __init__(self, plateau: Any, metric: str, every: int):
        self.plateau, self.metric, self.every = plateau, metric, every

    def due(self, b: Boundary) -> bool:
        return b.evaluation is not None

    def at_boundary(self, run: RunContext, b: Boundary) -> Boundary | None:
        assert b.evaluation is not None, "called only where due(), at an evaluation"
        if not self.plateau.step(b.evaluation[self.metric]):
            return None
        run.logger.message(f"plateau at update {b.step}: learning rate reduced to {self.plateau.rate:.6g}")
        return b.replace(state=b.state.replace(opt_state=set_learning_rate(b.state.opt_state, self.plateau.rate)))

    def state_dict(self) -> dict[str, Any]:
        return self.plateau.as_dict()

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.plateau.load(saved)


class Keyed(Protocol):
    """What keeps a JSON state in every checkpoint's data item: a `key`, state_dict and load_state_dict."""

    key: str | None

    def state_dict(self) -> dict[str, Any] | None: ...

    def load_state_dict(self, saved: dict[str, Any]) -> None: ...


class Save(Action):
    """A checkpoint every `every` updates and wherever the run ends (cadence.saves), with the data
    position and the state of every `keyed` part of the run (the evaluation's best, the plateau's
    decision, a hook's), and the evaluation's metrics when one ran at that update."""

    needs_state = True

    def __init__(self, cadence: Cadence, checkpointer: Any, keyed: Sequence[Keyed]):
        self.every, self.cadence, self.checkpointer = cadence.save_every, cadence, checkpointer
        self.keyed = [k for k in keyed if k.key is not None]

    def due(self, b: Boundary) -> bool:
        return self.cadence.saves(b.step, b.ends)

    def at_boundary(self, run: RunContext, b: Boundary) -> None:
        data = {"loader": dict(b.data), **{k.key: k.state_dict() for k in self.keyed}}
        with run.timings("checkpoint"):
            # check_finite=False: the optimizer skips non-finite updates, so the state is finite
            self.checkpointer.save(b.step, b.state, data, metrics=b.evaluation, check_finite=False)


# ----------------------------------------------------------------------------- hooks: research code's actions


@dataclass
class StepInfo:
    """What a hook is given: the update, the state after it (None for a hook that does not need it; valid
    during the call: the next device call reuses its buffers, so copy what you keep, e.g. jax.device_get),
    that update's metrics, the evaluation of that update (None: none there), whether the run ends there,
    and the run's sinks."""

    step: int
    state: TrainState | None
    metrics: Mapping[str, float]
    run: RunContext
    evaluation: Mapping[str, float] | None = None
    ends: bool = False
    stop_reason: str | None = None  # set by stop(): the loop ends the run at this update

    @property
    def model(self) -> Any:
        """The trained model as you wrote it: an NNX module (in eval mode), or a Linen module's variables."""
        if self.state is None:
            raise ValueError("this hook does not read the state (needs_state=False): no model")
        return self.state.user_model()

    @property
    def module(self) -> Any:
        """The module being trained: a Linen module (apply it to info.state.params), or the NNX module."""
        if self.state is None:
            raise ValueError("this hook does not read the state (needs_state=False): no module")
        module = getattr(self.state.model, "module", None)
        return module if module is not None else self.model

    @property
    def run_dir(self) -> str:
        return self.run.run_dir

    def log(self, **scalars: float) -> None:
        """Scalars into metrics.jsonl (a `hook` record of this update) and TensorBoard (hook/<name>)."""
        self.run.logger.hook(self.step, {k: float(v) for k, v in scalars.items()})

    def log_text(self, name: str, text: str) -> None:
        self.run.logger.text(self.step, name, text)

    def log_image(self, name: str, image: Any) -> Any:
        """An [H, W] or [H, W, 3|4] array in [0, 1]: run_dir/hooks/<name>-<step>.png and TensorBoard."""
        return self.run.logger.image(self.step, name, image)

    def stop(self, reason: str = "hook") -> None:
        """End the run here: the state is evaluated and saved as at any end; summary's stop_reason = reason."""
        self.stop_reason = self.stop_reason or reason


class Hook(Action):
    """Research code's periodic action: `fn(info: StepInfo)` every `every` updates and once at the end.

    needs_state=True (default): called at its updates with the state of exactly that update (the loop's
    device calls end there). needs_state=False: called from the finished call's per-update metrics
    (info.state is None), which cuts no call short. A resumed run calls it at the updates after the
    checkpoint it resumes from, so none is repeated or skipped.
    """

    def __init__(self, fn: Callable[[StepInfo], Any], every: int, needs_state: bool = True):
        if not isinstance(every, int) or every < 0:
            raise ValueError(f"Hook every={every!r}: an integer >= 0 (0 = only at the end)")
        self.fn, self.every, self.needs_state = fn, every, needs_state

    def _call(self, info: StepInfo) -> str | None:
        self.fn(info)
        return info.stop_reason

    def after_call(self, run: RunContext, done: Finished) -> str | None:
        if self.needs_state:
            return None
        applied, reason = done.applied(), None
        for i in np.flatnonzero(done.metrics["updated"]):
            step = int(applied[i])
            if due(self.every, step):
                reason = reason or self._call(StepInfo(step, None, metrics_of(done, step, run.accum_steps), run))
        return reason

    def due(self, b: Boundary) -> bool:
        """A state hook: at its updates and at the end; a metrics hook: at the end, unless after_call had
        that update (its own)."""
        return (due(self.every, b.step) or b.ends) if self.needs_state else (b.ends and not due(self.every, b.step))

    def at_boundary(self, run: RunContext, b: Boundary) -> Boundary | None:
        info = StepInfo(b.step, b.state if self.needs_state else None, b.metrics, run, b.evaluation, b.ends)
        return b.stopping(self._call(info))


def every(n: int, needs_state: bool = True) -> Callable[[Callable[[StepInfo], Any]], Hook]:
    """Decorator form: `@jaxloop.every(200)` over `def sample(info): ...` makes it a Hook."""
    return lambda fn: Hook(fn, n, needs_state)
