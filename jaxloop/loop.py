"""The training run: `run(cfg, task)` trains a Task (default: the preset's built-in one).

The host loop dispatches compiled calls of several updates each (jaxloop.cadence) and waits for the
device once per call: it then writes the log records due in the call from its per-micro-batch metrics,
and evaluates, saves or ends where the call's last update is due to.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxloop.cadence import Cadence
from jaxloop.checkpoint import Checkpointer, quiet_orbax
from jaxloop.compilation import enable_compilation_cache
from jaxloop.host_memory import retain_freed_memory
from jaxloop.init_from import init_params_from
from jaxloop.data import DevicePrefetcher, TrainLoader, val_batches
from jaxloop.distributed import (abstract_sharded, barrier, check_divisible, create_sharded, initialize, is_primary,
                                 make_mesh, pin_shardings, shard_batch, to_host, whole_params)
from jaxloop.logger import RunLogger
from jaxloop.optim import optimizer_metrics
from jaxloop.runinfo import Profiler, Timings, run_metadata
from jaxloop.state import TrainState, state_digest
from jaxloop.step import make_eval_step, make_train_step, scan_steps
from jaxloop.task import Task, builtin_task, init_state
from loopcore.cli import EXIT_SIGNAL, Interrupted, NonFiniteError
from loopcore.config import Config, ConfigError, validate
from loopcore.records import BestTracker
from loopcore.run_dir import RunDir
from loopcore.sources import Splits, write_vocab


@dataclass
class Throughput:
    """Rates over the interval since the previous log line."""

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
        """Exclude time spent outside training (evaluation, saving) from the current interval."""
        self.time += seconds


class Evaluator:
    """The validation split through one compiled eval step: loss and aux metrics, weighted by records."""

    def __init__(self, cfg: Config, task: Task, splits: Splits, mesh: Mesh):
        self.cfg, self.splits, self.mesh = cfg, splits, mesh
        eval_step = make_eval_step(task.eval_loss())
        self.step = jax.jit(lambda state, batch: eval_step(whole_params(state, mesh), batch))

    def __call__(self, state: TrainState) -> dict[str, float]:
        out: dict[str, float] = {}
        variants = [("val_", state)] + ([("ema_val_", state.replace(params=state.ema_params))]
                                       if state.ema_params is not None else [])
        for prefix, s in variants:
            batches = list(val_batches(self.cfg, self.splits))
            sums = [self.step(s, shard_batch(b, self.mesh)) for b in batches]
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
    if cfg.precision == "fp64":
        jax.config.update("jax_enable_x64", True)
    validate(cfg, check_paths=task is None)
    if cfg.compile_cache:
        enable_compilation_cache(cfg.compile_cache)  # before the first compile of the run
    if cfg.retain_host_memory:
        retain_freed_memory()  # before the first call's buffers are allocated
    task = task if task is not None else builtin_task(cfg)  # bad data is a ConfigError before anything is written
    splits = task.splits()
    initialize(cfg)  # join the other processes, if any, before any device is used
    check_divisible(cfg)
    rd = RunDir(cfg, writes=is_primary())
    rd.check(has_checkpoint=Checkpointer.has_checkpoint(rd.checkpoints))
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
    try:
        # a resume reads every shard straight into place: no fresh state is built only to be replaced
        restored = ckpt.restore_latest(abstract_sharded(init, mesh)) if cfg.resume != "never" else None
        rd.must_have_resumed(restored)
        state = restored.state if restored is not None else create_sharded(init, mesh)
        if restored is None and cfg.init_from:  # a fresh run from another run's params (--init_from)
            params = init_params_from(cfg.init_from, state.params)
            state = state.replace(params=params, ema_params=None if state.ema_params is None else params)
        if restored is not None:
            rd.record_resume(restored.step)
        timings.add("setup", time.perf_counter() - t_start)
        loop = Loop(cfg, task, splits, ckpt, timings, mesh, rd)
        summary = loop.run(state, restored)
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
                 rd: RunDir):
        self.cfg, self.splits, self.ckpt, self.timings, self.mesh, self.rd = cfg, splits, ckpt, timings, mesh, rd
        self.cadence = Cadence.of(cfg)
        self.evaluate = Evaluator(cfg, task, splits, mesh)
        self.steps = scan_steps(make_train_step(task.loss))  # K x n micro-batches (n updates) per call
        self.compiled: dict[int, Any] = {}
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
            summary = self._train(state, step, batches)
            summary["peak_mem_bytes"] = self.logger.peak_mem_bytes
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
        self.signal = signum  # finish the current call, save, then exit

    def _train(self, state: TrainState, step: int, batches: DevicePrefetcher) -> dict[str, Any]:
        cfg, cadence, profiler = self.cfg, self.cadence, Profiler(self.cfg, self.rd.path, self.timings)
        self.rate, self.saved_step, self.last_eval = Throughput(step, time.perf_counter()), step or None, {}
        while step < cfg.steps:
            n = cadence.updates_next(step)
            profiler.before_call(step, n)
            chunk = batches.take(cfg.optim.accum_steps * n)
            state, metrics = self._step_fn(n, state, chunk)(state, chunk)  # dispatched; returns at once
            # host waits here for the call: the applied update count and every micro-batch's metrics
            start, step, metrics = step, int(state.step), jax.device_get(metrics)
            if self._after_call(state, start, step, metrics, batches):
                break
        profiler.close()
        self.timings.add("data_wait", batches.total_wait_s)
        return self._summary(state)

    def _step_fn(self, n: int, state: TrainState, chunk: Any) -> Any:
        """The call running n updates, compiled on first use (its own compile time is timed)."""
        if n not in self.compiled:
            with self.timings("compile"):
                # jit with the state donated and returned in its own shardings (jaxloop.distributed)
                self.compiled[n] = pin_shardings(self.steps, state, donate=True).lower(state, chunk).compile()
            self.rate = Throughput(self.rate.step, time.perf_counter(), self.rate.data_wait)
        return self.compiled[n]

    def _after_call(self, state: TrainState, start: int, step: int, metrics: dict, batches: DevicePrefetcher) -> bool:
        """Check the skip streak, log the updates due, then evaluate and save as due at `step`; True
        when the run ends here. `start`: the applied update count before the call."""
        cfg, cadence = self.cfg, self.cadence
        applied = start + np.cumsum(metrics["updated"])  # the state's update count after each micro-batch
        streak = np.flatnonzero(metrics["bad_streak"] >= cfg.max_bad_steps)
        if streak.size:
            i = streak[0]
            raise NonFiniteError(
                f"{int(metrics['bad_streak'][i])} consecutive updates were skipped for a non-finite loss or gradient "
                f"(update {int(applied[i]) + 1}; max_bad_steps={cfg.max_bad_steps}); the last saved checkpoint is finite")
        logged = [i for i in np.flatnonzero(metrics["updated"]) if cadence.log(int(applied[i]))]
        if logged:
            with self.timings("log"):
                now, wait = time.perf_counter(), batches.total_wait_s
                for i in logged:
                    self.logger.train(self._record(int(applied[i]), metrics, i, step, now, wait))
        t_pause, evaluated = time.perf_counter(), None
        if cadence.eval(step):
            with self.timings("eval"):
                evaluated = self.last_eval = self.evaluate(state)
            self.logger.eval({"step": step, **evaluated})
            if self.tracker.update(step, self._metric(evaluated)):
                self.stop_reason = "early_stopping"
                self.logger.message(f"early stopping at update {step}: no better "
                                    f"{cfg.checkpoint.best_metric} in {cfg.patience} evaluations")
        if jax.process_count() > 1:
            self._agree_on_signal()
        end = step >= cfg.steps or self.stop_reason != "completed" or self.signal is not None
        if (cadence.save(step) or end) and self.saved_step != step:
            with self.timings("checkpoint"):
                # batches.state(): the position after the micro-batches trained on, not those prefetched
                self.ckpt.save(step, state, {"loader": batches.state(), "best": self.tracker.as_dict()},
                               metrics=evaluated, check_finite=False)  # the optimizer keeps the state finite
            self.saved_step = step
        if self.signal is not None:
            self.stop_reason = f"signal {signal.Signals(self.signal).name}"
        self.rate.pause(time.perf_counter() - t_pause)  # evaluation and saving are not training time
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

    def _agree_on_signal(self) -> None:
        """A signal that reached any process stops them all, here, at the same update."""
        from jax.experimental import multihost_utils

        received = np.ravel(multihost_utils.process_allgather(np.int32(self.signal or 0)))
        if self.signal is None and received.any():
            self.signal = int(received[received > 0][0])

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
