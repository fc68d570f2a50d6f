"""The torch_ref training loop and CLI: `python -m torch_ref.train [--preset NAME] [--config FILE] [--field value ...]`.

The same flags, config validation, run_dir outputs and exit statuses as `python -m jaxloop.train`, plus
one flag of its own, `--clip torch|optax` (how gradients are clipped, see torch_ref/optim.py; default
torch). Exit status: 0 done (also after early stopping); 1 too many consecutive non-finite updates;
2 bad input (one line on stderr, nothing written); 130 / 143 interrupted by SIGINT / SIGTERM after the
current update was finished and saved.

run_dir outputs: config.json (jaxloop.config.run.to_dict), metrics.jsonl (one JSON record per line: train
records every log_every updates, eval records every eval_every updates and at the end), checkpoints/,
summary.json, resumes.jsonl (one line per resume), vocab.json (text sources).

Library use (what the parity tests call):

    result = run(cfg, init_params=jax_params, clip="optax")   # -> RunResult(records, summary, state)
    state = create_torch_state(cfg, splits, init_params)       # torch_ref.state
    metrics = train_update(state, micro_batches, clip="optax") # torch_ref.step: one update
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jaxloop.config.argv import take_option
from jaxloop.config.cadence import Cadence
from jaxloop.config.cli import (
    EXIT_BAD_INPUT,
    EXIT_SIGNAL,
    Interrupted,
    NonFiniteError,
    UsageError,
    finish,
    parse_or_exit,
)
from jaxloop.config.run import Config, ConfigError
from jaxloop.data.sources import Splits, load_splits, write_vocab
from jaxloop.rundir.layout import RunLayout
from jaxloop.rundir.lock import RunLock
from jaxloop.rundir.outcome import COMPLETED, EARLY_STOPPING, early_stopping_message, final_evaluation_due, signal_stop
from jaxloop.rundir.outcome import summary as run_summary
from jaxloop.rundir.records import BestTracker, read_records, rewrite_for_resume
from jaxloop.rundir.rules import RunDir
from torch_ref.checkpoint import CheckpointManager
from torch_ref.data import make_train_loader, make_val_loader
from torch_ref.optim import ClipMode
from torch_ref.schedule import after_evaluation
from torch_ref.state import TrainState, create_torch_state, state_digest
from torch_ref.step import evaluate, train_update

PROG = "torch_ref.train"
CLIP_MODES = ("torch", "optax")


def init_model_from(state: TrainState, path: str | Path) -> None:
    """--init_from: the model weights of the newest torch_ref checkpoint under `path` (a run_dir, e.g. one
    written by parity_tests.convert from a jaxloop run, or its checkpoints/ directory); the optimizer,
    schedule, step and data position stay fresh. The EMA, if kept, restarts from the loaded weights."""
    import torch

    restored = CheckpointManager(state.cfg, RunLayout.of(path).root).restore_latest()
    if restored is None:
        raise ConfigError("init_from", str(path), "a run_dir holding a torch_ref checkpoint")
    state.model.load_state_dict(restored[1]["model"])
    if state.ema is not None:
        with torch.no_grad():
            for e, p in zip(state.ema, state.model.parameters()):
                e.copy_(p.detach())


@dataclass
class RunResult:
    records: list[dict[str, Any]]
    """Every record of run_dir/metrics.jsonl after the run (a resumed run's earlier ones included)."""
    summary: dict[str, Any]
    """What run_dir/summary.json holds."""
    state: TrainState
    """The final state (export_jax_params(result.state.model) gives the weights as a flax tree)."""


# ----------------------------------------------------------------------------- metrics.jsonl


class MetricsWriter:
    """Appends records to metrics.jsonl; on resume first keeps only the records up to the restored update."""

    def __init__(self, cfg: Config, run_dir: Path, start_step: int):
        self.cfg = cfg
        self.path = RunLayout(run_dir).metrics
        rewrite_for_resume(run_dir, start_step)  # jaxloop.rundir.records: the records a resume keeps, atomically
        self._file = open(self.path, "a", buffering=1)
        self._print = cfg.log.progress != "off"

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        if self._print:
            shown = " ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                for k, v in record.items()
                if k not in ("kind", "step")
            )
            print(f"{record['kind']} {record['step']}/{self.cfg.steps}: {shown}", file=sys.stderr, flush=True)

    def message(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        self._file.close()


# ----------------------------------------------------------------------------- run


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run(
    cfg: Config,
    init_params: Any = None,
    clip: ClipMode = "torch",
    stop_after: int | None = None,
    save_on_stop: bool = True,
    device: str | None = None,
    splits: Splits | None = None,
) -> RunResult:
    """Train according to cfg into cfg.run_dir (resuming per cfg.resume); the records and summary.

    init_params: a flax params tree (e.g. jaxloop's initial params) to start from instead of torch's own
    initialisation; ignored when resuming from a checkpoint. clip: "torch" (clip_grad_norm_) or
    "optax" (optax.clip_by_global_norm's arithmetic). stop_after: end the run after this many applied
    updates as a SIGTERM would (evaluate if due, save a checkpoint unless save_on_stop is False, which
    stands for a kill), without the final evaluation; summary["stop_reason"] is then "stop_after".
    """
    t_start = time.perf_counter()
    if clip not in CLIP_MODES:
        raise ConfigError("--clip", clip, f"one of {', '.join(CLIP_MODES)}")
    if cfg.distributed.num_processes != 1:
        raise ConfigError(
            "distributed.num_processes", cfg.distributed.num_processes, "1 (torch_ref runs in one process)"
        )
    splits = splits if splits is not None else load_splits(cfg)  # bad data: ConfigError, nothing written
    rd = RunDir(cfg)
    rd.check(has_checkpoint=CheckpointManager.has_checkpoint(rd.checkpoints))
    with RunLock(rd.path):  # one run per run_dir, as jaxloop's (jaxloop.rundir.lock); a refusal writes nothing
        rd.check(
            has_checkpoint=CheckpointManager.has_checkpoint(rd.checkpoints)
        )  # held: a killed holder may have saved
        rd.start()
        run_dir = rd.path
        write_vocab(str(run_dir), splits)

        state = create_torch_state(cfg, splits, init_params, device or default_device())
        ckpt = CheckpointManager(cfg, run_dir)
        restored = ckpt.restore_latest() if cfg.resume != "never" else None
        rd.must_have_resumed(restored)
        if restored is not None:
            state.load_state_dict(restored[1])
            rd.record_resume(state.step)
        elif cfg.init_from:
            init_model_from(state, cfg.init_from)
        loop = Loop(cfg, run_dir, splits, ckpt, clip, stop_after, save_on_stop)
        summary = loop.run(state)
        summary["wall_time_s"] = time.perf_counter() - t_start
        rd.write_summary(summary)
    return RunResult(records=read_records(run_dir), summary=summary, state=state)


class Loop:
    """One training run from a fresh or restored state to `steps` updates (or an early stop)."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        splits: Splits,
        ckpt: CheckpointManager,
        clip: ClipMode,
        stop_after: int | None = None,
        save_on_stop: bool = True,
    ):
        self.cfg, self.run_dir, self.splits, self.ckpt, self.clip = cfg, run_dir, splits, ckpt, clip
        self.stop_after, self.save_on_stop = stop_after, save_on_stop
        self.signal: int | None = None
        self.timings: dict[str, float] = {"train": 0.0, "eval": 0.0, "checkpoint": 0.0}

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.signal = signum  # finish the current update, save, then exit

    def run(self, state: TrainState) -> dict[str, Any]:
        in_main_thread = threading.current_thread() is threading.main_thread()
        previous = {s: signal.signal(s, self._on_signal) for s in EXIT_SIGNAL} if in_main_thread else {}
        logger = MetricsWriter(self.cfg, self.run_dir, start_step=state.step)
        try:
            summary = self._train(state, logger)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            logger.close()
        if self.signal is not None:
            raise Interrupted(self.signal)
        return summary

    def _evaluate(self, state: TrainState, val_loader: Any) -> dict[str, float]:
        t0 = time.perf_counter()
        out = evaluate(state, val_loader)
        self.timings["eval"] += time.perf_counter() - t0
        return out

    def _train(self, state: TrainState, logger: MetricsWriter) -> dict[str, Any]:
        cfg, K = self.cfg, self.cfg.optim.accum_steps
        cadence = Cadence.of(cfg)  # the log / evaluate / save / end rule jaxloop follows too
        tracker = BestTracker(cfg.checkpoint.best_mode, cfg.patience)
        if "best" in state.extra:
            tracker.load(state.extra["best"])
        train_loader = make_train_loader(cfg, self.splits, position=state.position, device=state.device)
        val_loader = make_val_loader(cfg, self.splits, device=state.device)
        batches = iter(train_loader)
        saved_step = state.step if state.step else None
        last_eval: dict[str, float] = {}
        stop_reason = COMPLETED
        updates_done, interval_start, interval_updates = 0, time.perf_counter(), 0

        while state.step < cfg.steps:
            attempted = state.step + 1
            t0 = time.perf_counter()
            metrics = train_update(state, [next(batches) for _ in range(K)], self.clip)
            self.timings["train"] += time.perf_counter() - t0
            u = state.step
            if metrics["updated"]:
                updates_done += 1
                interval_updates += 1
            elif state.bad_streak >= cfg.max_bad_steps:
                raise NonFiniteError(
                    f"{state.bad_streak} consecutive updates were skipped for a non-finite loss or gradient "
                    f"(update {attempted} tried {state.bad_streak} times; max_bad_steps={cfg.max_bad_steps}); "
                    "the last saved checkpoint is finite"
                )

            if cadence.logs(attempted) or (metrics["updated"] and u >= cfg.steps):
                now = time.perf_counter()
                rate = interval_updates / max(now - interval_start, 1e-9)
                interval_start, interval_updates = now, 0
                logger.write(
                    {
                        "kind": "train",
                        "step": u,
                        "lr": metrics["lr"],
                        "loss": metrics["loss"],
                        "grad_norm": metrics["grad_norm"],
                        "skipped": metrics["skipped"],
                        "updated": metrics["updated"],
                        "loss_scale": metrics["loss_scale"],
                        "updates_per_s": rate,
                    }
                )

            stopping = self.signal is not None or (self.stop_after is not None and u >= self.stop_after)
            if not metrics["updated"]:
                if stopping and saved_step != u and u > 0 and self.save_on_stop:
                    self._save(state, tracker, None)
                    saved_step = u
                if stopping:
                    stop_reason = self._stop_reason()
                    break
                continue

            if stopping:  # decided before the evaluation, as jaxloop's signal action does: the first reason stands
                stop_reason = self._stop_reason()
            evaluated = None
            if cadence.evaluates(u):
                evaluated = last_eval = self._evaluate(state, val_loader)
                logger.write({"kind": "eval", "step": u, **evaluated})
                after_evaluation(state.scheduler, evaluated[cfg.checkpoint.best_metric])  # plateau's decision
                if tracker.update(u, evaluated[cfg.checkpoint.best_metric]):
                    stop_reason = EARLY_STOPPING if stop_reason == COMPLETED else stop_reason
                    logger.message(early_stopping_message(u, cfg.checkpoint.best_metric, cfg.patience))
            end = cadence.ends(u, stop_reason != COMPLETED)
            may_save = not stopping or self.save_on_stop or u >= cfg.steps
            if cadence.saves(u, end) and saved_step != u and may_save:
                self._save(state, tracker, evaluated)
                saved_step = u
            if end:
                break

        if final_evaluation_due(last_eval, stop_reason):
            last_eval = self._evaluate(state, val_loader)
        del batches, train_loader, val_loader  # stops loader worker processes
        train_time = self.timings["train"]
        return run_summary(
            final_step=state.step,
            stop_reason=stop_reason,
            final=last_eval,
            tracker=tracker,
            metric=cfg.checkpoint.best_metric,
            checkpoint_step=self.ckpt.best_step(),
            updates_per_s=updates_done / train_time if train_time > 0 else 0.0,
            skipped=state.skipped,
            digest=state_digest(state),
            timings_s=dict(self.timings),
            framework="torch",
            clip=self.clip,
            device=str(state.device),
        )

    def _stop_reason(self) -> str:
        if self.signal is not None:
            return signal_stop(self.signal)
        return "stop_after"

    def _save(self, state: TrainState, tracker: BestTracker, metrics: dict[str, float] | None) -> None:
        state.extra["best"] = tracker.as_dict()
        self.timings["checkpoint"] += self.ckpt.save(state.step, state.state_dict(), metrics)


# ----------------------------------------------------------------------------- CLI


def _take_clip(argv: list[str]) -> str:
    """Remove `--clip MODE` / `--clip=MODE` from argv; the mode (default torch)."""
    mode = take_option(argv, "--clip", allowed=" or ".join(CLIP_MODES))
    if mode is None:
        return "torch"
    if mode not in CLIP_MODES:
        raise ConfigError("--clip", mode, f"one of {', '.join(CLIP_MODES)}")
    return mode


def main(argv: list[str] | None = None) -> int:
    """Parse, build, run; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        clip = _take_clip(argv)
    except (ConfigError, UsageError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    cfg = parse_or_exit(argv, PROG)
    return finish(PROG, cfg, lambda: run(cfg, clip=clip).summary)


if __name__ == "__main__":
    sys.exit(main())
