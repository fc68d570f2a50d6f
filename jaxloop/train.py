"""The training loop and its CLI: `python -m jaxloop.train [--preset NAME] [--config FILE] [--field value ...]`.

Exit status: 0 done (also after early stopping); 1 too many consecutive non-finite updates; 2 bad
input (one line on stderr, nothing written); 130 / 143 interrupted by SIGINT / SIGTERM after the
current update was finished and saved.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxloop.checkpoint import Checkpointer, quiet_orbax
from loopcore.cli import EXIT_BAD_INPUT, EXIT_NONFINITE, EXIT_SIGNAL, Interrupted, NonFiniteError, parse_or_exit
from loopcore.config import Config, ConfigError
from loopcore.run_dir import RunDir
from jaxloop.data import DevicePrefetcher, TrainLoader, val_batches
from jaxloop.init_from import init_params_from
from jaxloop.distributed import barrier, check_divisible, initialize, is_primary, make_mesh, replicate, shard_batch
from jaxloop.logger import RunLogger
from jaxloop.runinfo import Profiler, Timings, run_metadata
from loopcore.records import BestTracker
from jaxloop.models import make_model
from loopcore.sources import load_splits, write_vocab
from jaxloop.state import TrainState, create_train_state, state_digest
from jaxloop.step import eval_step, train_step

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


def evaluate(state: TrainState, cfg: Config, splits: Any, mesh: Mesh) -> dict[str, float]:
    """Loss and accuracy over the whole validation split (and of the EMA params, when kept)."""
    out: dict[str, float] = {}
    variants = [("val_", state)]
    if state.ema_params is not None:
        variants.append(("ema_val_", state.replace(params=state.ema_params)))
    for prefix, s in variants:
        sums = [eval_step(s, shard_batch(batch, mesh)) for batch in val_batches(cfg, splits)]
        sums = jax.device_get(sums)
        weight = sum(float(m["weight"]) for m in sums)
        out[prefix + "loss"] = sum(float(m["loss"]) * float(m["weight"]) for m in sums) / weight
        out[prefix + "acc"] = sum(float(m["acc"]) * float(m["weight"]) for m in sums) / weight
    return out


def run(cfg: Config) -> dict[str, Any]:
    """Train according to cfg; returns the summary written to run_dir/summary.json."""
    t_start = time.perf_counter()
    if cfg.precision == "fp64":
        jax.config.update("jax_enable_x64", True)
    splits = load_splits(cfg)  # bad data is a ConfigError before anything is written
    initialize(cfg)  # join the other processes, if any, before any device is used
    check_divisible(cfg)
    primary = is_primary()
    rd = RunDir(cfg, writes=primary)
    rd.check(has_checkpoint=Checkpointer.has_checkpoint(rd.checkpoints))
    barrier("jaxloop: run_dir checked")  # nothing is written before every process has read run_dir
    run_dir = rd.path
    metadata = run_metadata(cfg)
    rd.start(metadata)
    if primary:
        write_vocab(run_dir, splits)
    quiet_orbax()

    timings = Timings()
    mesh = make_mesh()
    state = replicate(create_train_state(cfg, make_model(cfg, splits.num_classes), splits.example_x), mesh)
    state = state.replace(params=(p := init_params_from(cfg.init_from, state.params)), ema_params=jax.tree.map(jnp.copy, p) if state.ema_params is not None else None) if cfg.init_from else state  # --init_from
    ckpt = Checkpointer(cfg, run_dir, metadata)
    try:
        restored = ckpt.restore_latest(state) if cfg.resume != "never" else None
        rd.must_have_resumed(restored)
        if restored is not None:
            rd.record_resume(restored.step)
        timings.add("setup", time.perf_counter() - t_start)
        summary = Loop(cfg, run_dir, splits, ckpt, timings, mesh).run(state, restored)
    finally:
        with timings("checkpoint"):
            ckpt.close()  # awaits the last async save and surfaces its errors
    summary["timings_s"] = timings.as_dict()
    summary["wall_time_s"] = time.perf_counter() - t_start
    if not primary:
        return summary
    rd.write_summary(summary)
    if cfg.log.report:
        from jaxloop.report import write_report

        write_report(run_dir)
    return summary


class Loop:
    """One training run from a fresh or restored state to `steps` updates (or an early stop)."""

    def __init__(self, cfg: Config, run_dir: Path, splits: Any, ckpt: Checkpointer, timings: Timings, mesh: Mesh):
        self.cfg, self.run_dir, self.splits, self.ckpt, self.timings = cfg, run_dir, splits, ckpt, timings
        self.mesh = mesh
        self.signal: int | None = None

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.signal = signum  # finish the current update, save, then exit

    def run(self, state: TrainState, restored: Any) -> dict[str, Any]:
        cfg = self.cfg
        step = 0
        tracker = BestTracker(cfg.checkpoint.best_mode, cfg.patience)
        if restored is not None:
            state, step = restored.state, restored.step
            loader = TrainLoader.from_state(cfg, self.splits, restored.data["loader"])
            tracker.load(restored.data["best"])
        else:
            loader = TrainLoader(cfg, self.splits)
        logger = RunLogger(cfg, self.run_dir, start_step=step, total_steps=cfg.steps, writes=is_primary())
        batches = DevicePrefetcher(loader, size=cfg.data.prefetch, put=partial(shard_batch, mesh=self.mesh))
        previous = {s: signal.signal(s, self._on_signal) for s in EXIT_SIGNAL}
        try:
            summary = self._train(state, step, batches, logger, tracker)
            summary["peak_mem_bytes"] = logger.peak_mem_bytes
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            batches.close()
            loader.close()
            logger.close()
        if self.signal is not None:
            raise Interrupted(self.signal)
        return summary

    def _agree_on_signal(self) -> None:
        """A signal that reached any process stops them all, here, at the same update."""
        from jax.experimental import multihost_utils

        received = np.ravel(multihost_utils.process_allgather(np.int32(self.signal or 0)))
        if self.signal is None and received.any():
            self.signal = int(received[received > 0][0])

    def _train(self, state, step, batches, logger, tracker) -> dict[str, Any]:
        cfg, K, timings = self.cfg, self.cfg.optim.accum_steps, self.timings
        every = cfg.checkpoint.every
        sync_every = min(cfg.log_every, cfg.max_bad_steps)
        step_fn = None
        host_step, synced_step = step, step
        rate = Throughput(step, time.perf_counter())
        data_wait = 0.0
        last_eval: dict[str, float] = {}
        saved_step = step if step else None
        stop_reason = "completed"
        window: list[dict] = []
        profiler = Profiler(cfg, self.run_dir, timings)
        multi = jax.process_count() > 1  # then every process must stop at the same sync point
        while host_step < cfg.steps:
            profiler.before_update(host_step)
            window = []
            for _ in range(K):
                batch = next(batches)
                data_wait += batches.last_wait_s
                if step_fn is None:
                    with timings("compile"):
                        step_fn = train_step.lower(state, batch).compile()
                    rate = Throughput(host_step, time.perf_counter(), data_wait)
                state, metrics = step_fn(state, batch)
                window.append(metrics)
            host_step += 1
            due = lambda n: n > 0 and host_step % n == 0
            if not (due(cfg.log_every) or due(cfg.eval_every) or due(every) or host_step >= cfg.steps
                    or host_step - synced_step >= sync_every or (self.signal is not None and not multi)):
                continue

            jax.block_until_ready(window)  # waiting for the updates' compute is not log time
            with timings("log"):
                fetched = jax.device_get(window)
                host_step = synced_step = int(state.step)
                last = fetched[-1]
                if int(last["bad_streak"]) >= cfg.max_bad_steps:
                    first = host_step + 1
                    raise NonFiniteError(
                        f"{int(last['bad_streak'])} consecutive updates were skipped for a non-finite loss or "
                        f"gradient (update {first} tried {int(last['bad_streak'])} times; max_bad_steps="
                        f"{cfg.max_bad_steps}); the last saved checkpoint is finite")
                if due(cfg.log_every) or host_step >= cfg.steps:
                    record = {
                        "step": host_step,
                        "loss": float(np.mean([float(m["loss"]) for m in fetched])),
                        "lr": float(last["lr"]),
                        "grad_norm": float(last["grad_norm"]),
                        "skipped": int(last["skipped"]),
                        "loss_scale": float(last["loss_scale"]),
                        **rate.interval(host_step, time.perf_counter(), data_wait),
                    }
                    record["samples_per_s"] = record["updates_per_s"] * K * cfg.batch_size
                    if cfg.model.kind == "gpt":
                        record["tokens_per_s"] = record["samples_per_s"] * cfg.model.context
                    logger.train(record)

            evaluated = None
            t_pause = time.perf_counter()
            if due(cfg.eval_every) or host_step >= cfg.steps:
                with timings("eval"):
                    evaluated = last_eval = evaluate(state, cfg, self.splits, self.mesh)
                logger.eval({"step": host_step, **evaluated})
                if tracker.update(host_step, evaluated[cfg.checkpoint.best_metric]):
                    stop_reason = "early_stopping"
                    logger.message(f"early stopping at update {host_step}: no better "
                                   f"{cfg.checkpoint.best_metric} in {cfg.patience} evaluations")
            if multi:
                self._agree_on_signal()
            end = host_step >= cfg.steps or stop_reason != "completed" or self.signal is not None
            if (due(every) or end) and saved_step != host_step:
                with timings("checkpoint"):
                    # batches.state(): the position after the micro-batches consumed, not those prefetched
                    self.ckpt.save(host_step, state, {"loader": batches.state(), "best": tracker.as_dict()},
                                   metrics=evaluated, check_finite=False)  # train_step keeps it finite
                saved_step = host_step
            if end:
                if self.signal is not None:
                    stop_reason = f"signal {signal.Signals(self.signal).name}"
                break
            rate.pause(time.perf_counter() - t_pause)  # evaluation and saving are not training time

        profiler.close()
        timings.add("data_wait", data_wait)
        if not last_eval:
            last_eval = evaluate(state, cfg, self.splits, self.mesh)
        return {
            "final_step": int(state.step),
            "stop_reason": stop_reason,
            "final": last_eval,
            "best": {"metric": cfg.checkpoint.best_metric, "value": tracker.best, "step": tracker.best_step,
                     "checkpoint_step": self.ckpt.best_step()},
            "updates_per_s": rate.updates / rate.seconds if rate.seconds else 0.0,
            "skipped_updates": int(state.skipped),
            "state_digest": state_digest(state),
        }


def main(argv: list[str] | None = None) -> int:
    """Parse, build, run; returns the exit status."""
    cfg = parse_or_exit(sys.argv[1:] if argv is None else argv, "jaxloop.train")
    try:
        summary = run(cfg)
    except ConfigError as e:
        print(f"jaxloop.train: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except NonFiniteError as e:
        print(f"jaxloop.train: error: {e}", file=sys.stderr)
        return EXIT_NONFINITE
    except Interrupted as e:
        print(f"jaxloop.train: {e} received: saved and stopped", file=sys.stderr)
        return EXIT_SIGNAL[e.signum]
    if not is_primary():
        return 0  # process 0 reports
    final = ", ".join(f"{k} {v:.4f}" for k, v in summary["final"].items())
    print(f"done: {summary['final_step']} updates in {summary['wall_time_s']:.1f}s; {final}; "
          f"outputs in {cfg.run_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
