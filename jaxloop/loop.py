"""The training run: `run(cfg, task)` trains a Task (default: the preset's built-in one).

The host loop dispatches compiled calls of several updates each (jaxloop.cadence) and waits for the
device once per call. It keeps the device busy while it works: as soon as a call's metrics are in, it
dispatches the next call (unless the state reached is to be evaluated, saved or returned), then writes
the finished call's log records from its per-micro-batch metrics; where the state is due to be
evaluated or saved, or the run ends, it does that before dispatching again.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh

from jaxloop.cadence import Cadence
from jaxloop.checkpoint import Checkpointer, quiet_orbax
from jaxloop.compilation import enable_compilation_cache
from jaxloop.determinism import request_deterministic_ops
from jaxloop.host_memory import retain_freed_memory
from jaxloop.init_from import init_params_from
from jaxloop.data import DevicePrefetcher, TrainLoader, val_batches
from jaxloop.executables import compile_cached
from jaxloop.distributed import (abstract_sharded, barrier, check_divisible, create_sharded, initialize, is_primary,
                                 make_mesh, pin_shardings, shard_batch, to_host, whole_params)
from jaxloop.logger import RunLogger
from jaxloop.memory import Fit, candidates, check_plan, describe_plan, fit, is_out_of_memory, plan_dict, supports_blocks
from jaxloop.optim import optimizer_metrics
from jaxloop.runinfo import Profiler, Timings, memory_bytes, run_metadata
from jaxloop.state import TrainState, state_digest
from jaxloop.step import make_eval_step, make_train_step, scan_steps
from jaxloop.task import Task, builtin_task, init_state
from loopcore.cli import EXIT_SIGNAL, Interrupted, NonFiniteError, OutOfMemoryError
from loopcore.config import RESUME_SAFE, Config, ConfigError, MemoryConfig, compiled_fields, validate
from loopcore.lock import RunDirInUse, RunLock
from loopcore.records import BestTracker
from loopcore.run_dir import METADATA_FILE, RunDir
from loopcore.sources import Splits, write_vocab


@dataclass
class Throughput:
    """Rates over the interval since the previous log line: the loop's wall time, the time checkpoint
    saves block it included, evaluation excluded (it is reported apart)."""

    step: int
    time: float
    data_wait: float = 0.0
    updates: int = 0
    seconds: float = 0.0

    def interval(self, step: int, now: float, data_wait: float) -> dict[str, float]:
        updates = max(step - self.step, 1)
        seconds = max(now - self.time, 1e-9)
        rates = {"updates_per_s": updates / seconds, "step_ms": 1e3 * seconds / updates,
                 "data_wait_ms": 1e3 * (data_wait - self.data_wait) / updates}
        self.step, self.time, self.data_wait = step, now, data_wait
        self.updates, self.seconds = self.updates + updates, self.seconds + seconds
        return rates

    def pause(self, seconds: float) -> None:
        """Exclude time spent outside training (evaluation) from the current interval."""
        self.time += seconds


class Call(NamedTuple):
    """A dispatched call: its output state and stacked metrics (device arrays, maybe not computed yet)
    and the applied update count it started from."""

    state: TrainState
    metrics: dict[str, jax.Array]
    start: int


# Config fields the compiled calls do not depend on: those a resume may change (RESUME_SAFE: host-side,
# or seen in the arguments' shapes and shardings: eval batch size, mesh) but the memory plan (the same
# math, other code: a resume may change it, the key must not ignore it), and the seed (initial values
# and data order, not code). Any other field changed is a miss.
NOT_COMPILED = (*(f for f in RESUME_SAFE if f != "memory."), "seed")


def executables_dir(cfg: Config, builtin_task: bool) -> str | None:
    """Where the loop keeps compiled calls by config and source (jaxloop.executables): beside JAX's cache,
    for a built-in task in one process; None otherwise (a user's task is code jaxloop cannot key)."""
    if not (builtin_task and cfg.compile_cache and jax.process_count() == 1):
        return None
    return str(Path(cfg.compile_cache).expanduser() / "jaxloop-executables")


def compiled_context(cfg: Config, name: str) -> dict[str, Any]:
    """What, beside jaxloop's sources and the arguments, a compiled call depends on: which call it is, and
    the config's fields but NOT_COMPILED (dotted names)."""
    return {"call": name, "config": compiled_fields(cfg, NOT_COMPILED)}


def _types(tree: Any) -> tuple:
    """The type (shape, dtype, weak type) and sharding of each leaf: what a compiled call is specific to."""
    return tuple((jax.typeof(x), getattr(x, "sharding", None)) for x in jax.tree.leaves(tree))


class Replan(Exception):
    """The device ran out of memory at run time: the loop reloads its last checkpoint and goes on under `memory`."""

    def __init__(self, memory: MemoryConfig, record: dict[str, Any]):
        self.memory, self.record = memory, record
        super().__init__(describe_plan(memory))


def hold_run_dir(cfg: Config) -> RunLock | None:
    """One run per run_dir (loopcore.lock): process 0 holds it for the job and every process learns
    whether it may go on; RunDirInUse (a ConfigError) names the holder before anything is written."""
    lock, refused = None, None
    if is_primary():
        try:
            lock = RunLock(cfg.run_dir).acquire()
        except RunDirInUse as e:
            refused = e
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        held = bool(multihost_utils.broadcast_one_to_all(np.int32(refused is None)))
        if not held and refused is None:  # another process of this job: process 0 was refused
            refused = RunDirInUse(cfg.run_dir, None, who="another run (process 0 of this job was refused)")
    if refused is not None:
        raise refused
    return lock


class Evaluator:
    """The validation split through one compiled eval step: loss and aux metrics, weighted by records."""

    def __init__(self, cfg: Config, task: Task, splits: Splits, mesh: Mesh, executables: str | None = None):
        self.cfg, self.splits, self.mesh, self.executables = cfg, splits, mesh, executables
        eval_step = make_eval_step(task.eval_loss())
        self.jitted = jax.jit(lambda state, batch: eval_step(whole_params(state, mesh), batch))
        self.compiled: dict[Any, Any] = {}

    def step(self, state: TrainState, batch: Any, state_types: tuple) -> dict[str, jax.Array]:
        """eval_step on one batch, compiled (or loaded: jaxloop.executables) once per type and sharding of
        its arguments, as jax.jit would; state_types: _types(state), taken once per pass."""
        types = (state_types, _types(batch))
        if types not in self.compiled:
            self.compiled[types] = compile_cached(self.jitted, (state, batch), self.executables,
                                                  compiled_context(self.cfg, "eval"))
        return self.compiled[types](state, batch)

    def __call__(self, state: TrainState) -> dict[str, float]:
        out: dict[str, float] = {}
        variants = [("val_", state)] + ([("ema_val_", state.replace(params=state.ema_params))]
                                       if state.ema_params is not None else [])
        for prefix, s in variants:
            batches = list(val_batches(self.cfg, self.splits))
            state_types = _types(s)
            sums = [self.step(s, shard_batch(b, self.mesh), state_types) for b in batches]
            # host waits for every validation batch's metrics
            sums = jax.device_get(sums)
            weights = [float(m.get("weight", b["weight"].sum())) for m, b in zip(sums, batches)]
            for key in ["loss"] + sorted(k for k in sums[0] if k not in ("loss", "weight")):
                out[prefix + key] = sum(float(m[key]) * w for m, w in zip(sums, weights)) / sum(weights)
        return out


def run(cfg: Config, task: Task | None = None) -> dict[str, Any]:
    """Train `task` (default: the preset's built-in task) according to cfg; returns the summary
    written to run_dir/summary.json."""
    t_start = time.perf_counter()
    if cfg.deterministic:
        request_deterministic_ops()  # before jax starts a backend: XLA reads XLA_FLAGS once
    if cfg.precision == "fp64":
        jax.config.update("jax_enable_x64", True)
    validate(cfg, check_paths=task is None)
    if cfg.compile_cache:
        enable_compilation_cache(cfg.compile_cache)  # before the first compile of the run
    if cfg.retain_host_memory:
        retain_freed_memory()  # before the first call's buffers are allocated
    user_task = task
    task = task if task is not None else builtin_task(cfg)  # bad data is a ConfigError before anything is written
    splits = task.splits()  # bad or empty records too (loopcore.sources)
    initialize(cfg)  # join the other processes, if any, before any device is used
    check_divisible(cfg)
    check_plan(cfg.memory, cfg.batch_size, task.model)
    rd = RunDir(cfg, writes=is_primary())
    rd.check(has_checkpoint=Checkpointer.has_checkpoint(rd.checkpoints))  # a refusal here writes nothing
    lock = hold_run_dir(cfg)  # one run per run_dir; released at any exit (the kernel's flock, and here)
    try:
        return _run_held(cfg, task, splits, rd, t_start, executables_dir(cfg, builtin_task=user_task is None))
    finally:
        if lock is not None:
            lock.release()


def _run_held(cfg: Config, task: Task, splits: Splits, rd: RunDir, t_start: float,
              executables: str | None) -> dict[str, Any]:
    """run() once run_dir is held: write it, restore or build the state, train; after an out-of-memory error
    at run time, reload the last checkpoint and train on under the smaller plan (Replan)."""
    rd.check(has_checkpoint=Checkpointer.has_checkpoint(rd.checkpoints))  # again, held: a killed holder may have saved
    barrier("jaxloop: run_dir checked")  # nothing is written before every process has read run_dir
    metadata = run_metadata(cfg)
    rd.start(metadata)
    if rd.writes:
        write_vocab(rd.path, splits)
    quiet_orbax()

    timings = Timings()
    mesh = make_mesh(cfg.distributed)  # (data, fsdp): the state is sharded over fsdp, the batch over both
    init = lambda: init_state(cfg, task, splits)  # noqa: E731
    ckpt = Checkpointer(cfg, rd.path, metadata)
    memory, replans = cfg.memory, []
    try:
        while True:
            # a resume reads every shard straight into place: no fresh state is built only to be replaced
            resume = cfg.resume != "never" or replans  # after a re-plan, this run's own checkpoints
            restored = ckpt.restore_latest(abstract_sharded(init, mesh)) if resume else None
            if not replans:
                rd.must_have_resumed(restored)
            state = restored.state if restored is not None else create_sharded(init, mesh)
            if restored is None and cfg.init_from:  # a fresh run from another run's params (--init_from)
                params = init_params_from(cfg.init_from, state.params)
                state = state.replace(params=params, ema_params=None if state.ema_params is None else params)
            if restored is not None and not replans:
                rd.record_resume(restored.step)
            if not replans:
                timings.add("setup", time.perf_counter() - t_start)
            loop = Loop(replace(cfg, memory=memory), task, splits, ckpt, timings, mesh, rd, executables, replans)
            try:
                summary = loop.run(state, restored)
                break
            except Replan as e:
                memory = e.memory
                replans.append(e.record)
                with timings("checkpoint"):
                    ckpt.wait()  # the last save is committed before it is read back
    finally:
        with timings("checkpoint"):
            ckpt.close()  # awaits the last async save and surfaces its errors
    summary["timings_s"] = timings.as_dict()
    summary["wall_time_s"] = time.perf_counter() - t_start
    rd.write_summary(summary)
    if cfg.log.report and rd.writes:
        from jaxloop.report import write_report

        write_report(rd.path)
    return summary


class Loop:
    """One training run from a fresh or restored state to `steps` updates (or an early stop)."""

    def __init__(self, cfg: Config, task: Task, splits: Splits, ckpt: Checkpointer, timings: Timings, mesh: Mesh,
                 rd: RunDir, executables: str | None = None, replans: list[dict[str, Any]] | None = None):
        self.cfg, self.splits, self.ckpt, self.timings, self.mesh, self.rd = cfg, splits, ckpt, timings, mesh, rd
        self.task, self.executables, self.replans = task, executables, list(replans or [])
        self.cadence = Cadence.of(cfg)
        self.evaluate = Evaluator(cfg, task, splits, mesh, executables)
        self.steps = scan_steps(make_train_step(task.loss, cfg.memory))  # K x n micro-batches (n updates) per call
        self.compiled: dict[int, Any] = {}
        self.fitted: Fit | None = None  # the memory plan's outcome for the last call compiled
        self.signal: int | None = None
        self.tracker = BestTracker(cfg.checkpoint.best_mode, cfg.patience)
        self.stop_reason = "completed"

    def run(self, state: TrainState, restored: Any) -> dict[str, Any]:
        cfg, step = self.cfg, 0
        if restored is not None:
            state, step = restored.state, restored.step
            self.tracker.load(restored.data["best"])
            loader = TrainLoader.from_state(cfg, self.splits, restored.data["loader"])
        else:
            loader = TrainLoader(cfg, self.splits)
        self.logger = RunLogger(cfg, self.rd.path, start_step=step, total_steps=cfg.steps, writes=is_primary())
        K, n = cfg.optim.accum_steps, self.cadence.per_call
        batches = DevicePrefetcher(loader, size=cfg.data.prefetch, put=partial(shard_batch, mesh=self.mesh, stacked=True),
                                   chunk=K * n, first_chunk=K * (-step % n))
        previous = {s: signal.signal(s, self._on_signal) for s in EXIT_SIGNAL}
        try:
            try:
                summary = self._train(state, step, batches)
            except jax.errors.JaxRuntimeError as e:
                if not is_out_of_memory(e):
                    raise
                raise self._replan_after(e) from e
            summary["peak_mem_bytes"] = self.logger.peak_mem_bytes
            summary["memory"] = self._memory_record()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            batches.close()
            loader.close()
            self.logger.close()
        if self.signal is not None:
            raise Interrupted(self.signal)
        return summary

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.signal = signum  # finish the calls dispatched, save, then exit

    def _train(self, state: TrainState, step: int, batches: DevicePrefetcher) -> dict[str, Any]:
        cfg, profiler = self.cfg, Profiler(self.cfg, self.rd.path, self.timings)
        self.rate, self.saved_step, self.last_eval = Throughput(step, time.perf_counter()), step or None, {}
        call = self._dispatch(state, step, batches, profiler)
        while True:
            # host waits here for the call: every micro-batch's metrics (the applied update count with them)
            metrics = jax.device_get(call.metrics)
            synced, waited = time.perf_counter(), batches.total_wait_s
            start, step = call.start, call.start + int(np.sum(metrics["updated"]))
            stopping = self._stop_requested()
            # the device gets the next call before the host logs this one, unless the state reached is
            # needed or the next call is still to be compiled (compiling is not training time)
            ready = self.cadence.updates_next(step) in self.compiled
            ahead = self._dispatch(call.state, step, batches, profiler) if ready and not (stopping or self._due(step)) else None
            self._check_streak(start, metrics)
            self._log(start, step, metrics, synced, waited)
            if ahead is None:
                if self._at_boundary(call.state, step, stopping, batches):
                    break
                ahead = self._dispatch(call.state, step, batches, profiler)
            call = ahead
        profiler.close()
        self.timings.add("data_wait", batches.total_wait_s)
        return self._summary(call.state)

    def _dispatch(self, state: TrainState, step: int, batches: DevicePrefetcher, profiler: Profiler) -> "Call":
        """Dispatch the call after update `step` (state is donated to it); returns at once."""
        n = self.cadence.updates_next(step)
        profiler.before_call(step, n)
        chunk = batches.take(self.cfg.optim.accum_steps * n)
        new_state, metrics = self._step_fn(n, state, chunk)(state, chunk)
        return Call(new_state, metrics, step)

    def _step_fn(self, n: int, state: TrainState, chunk: Any) -> Any:
        """The call running n updates, compiled on first use (its own compile time is timed) and fitted to the
        device's memory before it first runs (jaxloop.memory: re-planned if it does not fit)."""
        if n not in self.compiled:
            with self.timings("compile"):
                fitted = fit(lambda memory: self._compile(n, state, chunk, memory), self.cfg.memory,
                             self.cfg.batch_size, supports_blocks(state.model), f"the call of {n} update(s)")
            message = fitted.message(f"the call of {n} update(s)")
            if message:
                self.logger.message(message)
            if fitted.replanned:
                self._use(fitted.memory)
                self.replans.append(fitted.record(int(jax.device_get(state.step))))
            self.fitted = fitted
            self._record_memory()
            self.compiled[n] = fitted.compiled
            self.rate = Throughput(self.rate.step, time.perf_counter(), self.rate.data_wait)
        return self.compiled[n]

    def _compile(self, n: int, state: TrainState, chunk: Any, memory: MemoryConfig) -> Any:
        """The call of n updates under a memory plan, jitted with the state donated and returned in its own
        shardings (jaxloop.distributed), compiled or loaded (jaxloop.executables)."""
        steps = self.steps if memory == self.cfg.memory else scan_steps(make_train_step(self.task.loss, memory))
        return compile_cached(pin_shardings(steps, state, donate=True), (state, chunk), self.executables,
                              compiled_context(replace(self.cfg, memory=memory), f"train x{n}"))

    def _use(self, memory: MemoryConfig) -> None:
        """Train under another memory plan from now on (calls compiled under the former one are dropped)."""
        self.cfg = replace(self.cfg, memory=memory)
        self.steps = scan_steps(make_train_step(self.task.loss, memory))
        self.compiled.clear()

    def _memory_record(self) -> dict[str, Any]:
        fitted = self.fitted
        return {"plan": plan_dict(self.cfg.memory),
                "footprint": fitted.footprint.as_dict() if fitted is not None else None,
                "limit": {"bytes": fitted.limit.bytes, "source": fitted.limit.source} if fitted is not None else None,
                "replans": self.replans}

    def _record_memory(self) -> None:
        """The plan, the call's footprint and the re-plans, in metadata.json and every later checkpoint."""
        self.ckpt.metadata["memory"] = self._memory_record()
        if self.rd.writes:
            self.rd.write_json(METADATA_FILE, self.ckpt.metadata)

    def _replan_after(self, error: Exception) -> Exception:
        """An out-of-memory error at run time: Replan with the next smaller plan (the run reloads its last
        checkpoint), or OutOfMemoryError when there is none or re-planning is off."""
        first = str(error).strip().splitlines()[0][:200]
        saved = self.ckpt.all_steps()
        where = f"update {saved[-1]}" if saved else "the initial state"
        smaller = candidates(self.cfg.memory, self.cfg.batch_size, supports_blocks(self.task.model))
        if not self.cfg.memory.auto_fit or jax.process_count() > 1 or not smaller:
            why = ("memory.auto_fit is off" if not self.cfg.memory.auto_fit else "several processes cannot re-plan "
                   "alone" if jax.process_count() > 1 else f"no smaller plan than {describe_plan(self.cfg.memory)}")
            return OutOfMemoryError(f"out of device memory at run time ({first}); {why}; the last checkpoint is "
                                    f"{where}: lower batch_size or the model's size")
        plan = smaller[0]
        self.logger.message(f"out of device memory at run time ({first}): reloading {where} and re-planning "
                            f"{describe_plan(self.cfg.memory)} -> {describe_plan(plan)}")
        return Replan(plan, {"at_update": saved[-1] if saved else 0, "reason": "out of memory at run time",
                             "from": plan_dict(self.cfg.memory), "to": plan_dict(plan), "error": first})

    def _due(self, step: int) -> bool:
        """Whether the state at `step` is to be evaluated, saved or returned (the next call must wait)."""
        return step >= self.cfg.steps or self.cadence.eval(step) or self.cadence.save(step)

    def _stop_requested(self) -> bool:
        """Whether a signal has reached this process (or, with several, any of them: they agree here,
        once per call, so that they all dispatch and stop alike)."""
        seen = self.signal  # read once: the handler may set it at any moment
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            received = np.ravel(multihost_utils.process_allgather(np.int32(seen or 0)))
            seen = int(received[received > 0][0]) if received.any() else None
            if self.signal is None:
                self.signal = seen
        return seen is not None

    def _check_streak(self, start: int, metrics: dict) -> None:
        """Stop on max_bad_steps consecutive skipped updates. `start`: the applied update count before the call."""
        streak = np.flatnonzero(metrics["bad_streak"] >= self.cfg.max_bad_steps)
        if streak.size:
            i = streak[0]
            update = start + int(np.sum(metrics["updated"][:i + 1])) + 1
            raise NonFiniteError(
                f"{int(metrics['bad_streak'][i])} consecutive updates were skipped for a non-finite loss or gradient "
                f"(update {update}; max_bad_steps={self.cfg.max_bad_steps}); the last saved checkpoint is finite")

    def _log(self, start: int, step: int, metrics: dict, now: float, data_wait: float) -> None:
        """Write the log records due in the call that took the state from update `start` to `step`
        (finished at time `now`, with `data_wait` seconds of data waits so far)."""
        applied = start + np.cumsum(metrics["updated"])  # the state's update count after each micro-batch
        logged = [i for i in np.flatnonzero(metrics["updated"]) if self.cadence.log(int(applied[i]))]
        if logged:
            with self.timings("log"):
                mem = memory_bytes()  # one reading for the call's records: they end at the same moment
                extra = {"mem_bytes": mem} if mem is not None else {}
                for i in logged:
                    self.logger.train({**self._record(int(applied[i]), metrics, i, step, now, data_wait), **extra})
                self.logger.flush()

    def _at_boundary(self, state: TrainState, step: int, stopping: bool, batches: DevicePrefetcher) -> bool:
        """Evaluate and save as due at `step`; True when the run ends here."""
        cfg, cadence = self.cfg, self.cadence
        evaluated = None
        if cadence.eval(step):
            t_eval = time.perf_counter()
            with self.timings("eval"):
                evaluated = self.last_eval = self.evaluate(state)
            self.logger.eval({"step": step, **evaluated})
            self.rate.pause(time.perf_counter() - t_eval)  # evaluation is reported apart, not as training time
            if self.tracker.update(step, self._metric(evaluated)):
                self.stop_reason = "early_stopping"
                self.logger.message(f"early stopping at update {step}: no better "
                                    f"{cfg.checkpoint.best_metric} in {cfg.patience} evaluations")
        end = step >= cfg.steps or self.stop_reason != "completed" or stopping
        if (cadence.save(step) or end) and self.saved_step != step:
            with self.timings("checkpoint"):
                # batches.state(): the position after the micro-batches trained on, not those prefetched
                self.ckpt.save(step, state, {"loader": batches.state(), "best": self.tracker.as_dict()},
                               metrics=evaluated, check_finite=False)  # the optimizer keeps the state finite
            self.saved_step = step
        if stopping:
            self.stop_reason = f"signal {signal.Signals(self.signal).name}"
        return end

    def _record(self, step: int, metrics: dict, i: int, call_end: int, now: float, data_wait: float) -> dict[str, Any]:
        """The log record of the update that micro-batch i of the call applied (reaching `step`). Rates are
        over the interval since the previous record; the call's time is shared evenly by its updates."""
        K = self.cfg.optim.accum_steps
        record = {"step": step, "loss": float(np.mean(metrics["loss"][max(i + 1 - K, 0):i + 1]))}
        record.update(lr=float(metrics["lr"][i]), grad_norm=float(metrics["grad_norm"][i]),
                      skipped=int(metrics["skipped"][i]), loss_scale=float(metrics["loss_scale"][i]))
        share = (step - self.rate.step) / max(call_end - self.rate.step, 1)
        record.update(self.rate.interval(step, self.rate.time + share * (now - self.rate.time),
                                         self.rate.data_wait + share * (data_wait - self.rate.data_wait)))
        record["samples_per_s"] = record["updates_per_s"] * K * self.cfg.batch_size
        if self.splits.source == "text":
            record["tokens_per_s"] = record["samples_per_s"] * self.cfg.model.context
        return record

    def _metric(self, evaluated: dict[str, float]) -> float:
        name = self.cfg.checkpoint.best_metric
        if name not in evaluated:
            raise ConfigError("checkpoint.best_metric", name, f"a metric the evaluation reports ({', '.join(evaluated)})")
        return evaluated[name]

    def _summary(self, state: TrainState) -> dict[str, Any]:
        cfg = self.cfg
        last_eval = self.last_eval or self.evaluate(state)
        return {
            "final_step": int(state.step),
            "stop_reason": self.stop_reason,
            "final": last_eval,
            "best": {"metric": cfg.checkpoint.best_metric, "value": self.tracker.best, "step": self.tracker.best_step,
                     "checkpoint_step": self.ckpt.best_step()},
            "updates_per_s": self.rate.updates / self.rate.seconds if self.rate.seconds else 0.0,
            "skipped_updates": int(optimizer_metrics(state.opt_state)["skipped"]),
            "state_digest": state_digest(to_host(state)),  # shards held by other processes too
        }
