"""`jaxloop.run(cfg, task, hooks)`: one training run, composed from the layers below.

    validate the config -> process setup (jaxloop.setup) -> the task and its records -> the run_dir rules
    -> a restored or fresh state -> the dispatcher and the actions -> the host loop -> summary and report

Each piece gets the part of the config it needs; the loop itself (jaxloop.loop) knows none of them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from jaxloop import actions as act
from jaxloop.checkpoint import Checkpointer
from jaxloop.data import DevicePrefetcher, eval_batch_size, train_loader, val_batches
from jaxloop.dispatch import Compiler, Dispatcher
from jaxloop.distributed import (abstract_sharded, barrier, check_divisible, create_sharded, is_primary, make_mesh,
                                 shard_batch, to_host)
from jaxloop.evaluate import Evaluator
from jaxloop.init_from import init_params_from
from jaxloop.logger import RunLogger
from jaxloop.loop import train, updates_per_call
from jaxloop.optim import optimizer_metrics
from jaxloop.runinfo import Profiler, Timings, run_metadata
from jaxloop.setup import configure_process
from jaxloop.state import state_digest
from jaxloop.step import make_train_step, scan_steps
from jaxloop.task import Task, builtin_task, check_own_optimizer, init_state
from loopcore.cadence import MAX_UPDATES_PER_CALL, Cadence
from loopcore.cli import Interrupted
from loopcore.config import NOT_COMPILED, Config, compiled_fields, to_dict, validate
from loopcore.outcome import final_evaluation_due, summary as run_summary
from loopcore.records import BestTracker
from loopcore.run_dir import RunDir
from loopcore.sources import Splits, write_vocab


def executables_dir(cfg: Config, builtin: bool) -> str | None:
    """Where the loop keeps compiled calls by config and source (jaxloop.executables): beside JAX's cache,
    for a built-in task in one process; None otherwise (a user's task is code jaxloop cannot key)."""
    if not (builtin and cfg.compile_cache and jax.process_count() == 1):
        return None
    return str(Path(cfg.compile_cache).expanduser() / "jaxloop-executables")


def compiled_context(cfg: Config, name: str) -> dict[str, Any]:
    """The store key's context of the compiled call `name` of a run of cfg: the call, and the config's fields
    but loopcore.config.NOT_COMPILED (the compiled-call rule, apart from the resume rule)."""
    return Compiler(None, compiled_fields(cfg, NOT_COMPILED)).context(name)


def run(cfg: Config, task: Task | None = None, hooks: Sequence[act.Action] = ()) -> dict[str, Any]:
    """Train `task` (default: the preset's built-in task) according to cfg, with research code's `hooks`
    (jaxloop.Hook) among the loop's periodic actions; returns the summary written to run_dir/summary.json."""
    t_start = time.perf_counter()
    validate(cfg, check_paths=task is None)  # bad input: a ConfigError before anything is set or written
    configure_process(cfg)
    builtin = task is None
    task = builtin_task(cfg) if builtin else task  # bad data is a ConfigError before anything is written
    check_own_optimizer(cfg, task)
    splits = task.splits()
    check_divisible(cfg)
    rd = RunDir(cfg, writes=is_primary())
    rd.check(has_checkpoint=Checkpointer.has_checkpoint(rd.checkpoints))
    barrier("jaxloop: run_dir checked")  # nothing is written before every process has read run_dir
    metadata = run_metadata(cfg)
    rd.start(metadata)
    if rd.writes:
        write_vocab(str(rd.path), splits)

    timings = Timings()
    mesh = make_mesh(cfg.distributed)  # (data, fsdp): the state is sharded over fsdp, the batch over both
    init = lambda: init_state(cfg, task, splits)  # noqa: E731
    ckpt = Checkpointer(cfg.checkpoint, rd.path, config=to_dict(cfg), metadata=metadata)
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
        compiler = Compiler(executables_dir(cfg, builtin), compiled_fields(cfg, NOT_COMPILED))
        summary = _train(cfg, task, splits, state, restored, ckpt, timings, mesh, compiler, list(hooks), rd.path)
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


def _train(cfg: Config, task: Task, splits: Splits, state: Any, restored: Any, ckpt: Checkpointer, timings: Timings,
           mesh: Any, compiler: Compiler, hooks: list[act.Action], run_dir: Path) -> dict[str, Any]:
    """The host loop over this run's dispatcher and actions, from `state` (restored or fresh) to the end."""
    step = restored.step if restored is not None else 0
    cadence = Cadence.of(cfg)
    logger = RunLogger(run_dir, cfg.log, start_step=step, total_steps=cfg.steps, log_every=cfg.log_every,
                       config=to_dict(cfg), writes=is_primary())
    run = act.RunContext(cfg.steps, cfg.optim.accum_steps, logger, timings, act.Throughput(step, time.perf_counter()),
                         str(run_dir))
    tracker = BestTracker(cfg.checkpoint.best_mode, cfg.patience)
    evaluator = Evaluator(task.eval_loss(), lambda: val_batches(splits, eval_batch_size(cfg)), mesh, compiler)
    evaluate = act.Evaluate(cadence, evaluator, tracker, cfg.checkpoint.best_metric)
    signals = act.SignalStop()
    actions: list[act.Action] = [
        signals, act.NonFiniteStreak(cfg.max_bad_steps),
        act.LogTrain(cadence, cfg.batch_size, cfg.model.context if splits.source == "text" else 0),
        act.Profile(Profiler(cfg.log.profile_start, cfg.log.profile_steps, logger.layout.profile, timings)),
        evaluate]
    if cfg.optim.schedule == "plateau":  # decides the rate of the next updates from each evaluation
        from jaxloop.plateau import Plateau

        actions.append(act.PlateauRate(Plateau.of(cfg), cfg.checkpoint.best_metric, cadence.eval_every))
    actions += hooks
    # the data position a checkpoint holds is the dispatcher's (built below, once the call size is known)
    actions.append(act.Save(cadence, ckpt, lambda: dispatcher.data_state(), list(actions), saved_step=step or None))
    per_call = updates_per_call(cfg.steps, actions, cfg.updates_per_call or MAX_UPDATES_PER_CALL)
    loader = train_loader(cfg, splits, restored.data["loader"] if restored is not None else None)
    K = cfg.optim.accum_steps
    batches = DevicePrefetcher(loader, size=cfg.data.prefetch, put=lambda b: shard_batch(b, mesh, stacked=True),
                               chunk=K * per_call, first_chunk=K * (-step % per_call))
    dispatcher = Dispatcher(scan_steps(make_train_step(task.loss)), batches, K, compiler, timings,
                            on_compiled=run.clock.restart)
    if restored is not None:
        for action in actions:
            if action.key is not None and action.key in restored.data:
                action.load_state_dict(restored.data[action.key])
        logger.message(resume_line(restored))
    try:
        state = train(state, step, dispatcher, actions, run, per_call)
        if final_evaluation_due(run.last_eval, run.stop_reason):  # e.g. a run resumed at its end
            run.last_eval = evaluator(state)
        summary = run_summary(
            final_step=int(state.step), stop_reason=run.stop_reason, final=run.last_eval, tracker=tracker,
            metric=cfg.checkpoint.best_metric, checkpoint_step=ckpt.best_step(), updates_per_s=run.clock.updates_per_s,
            skipped=int(optimizer_metrics(state.opt_state)["skipped"]),
            digest=state_digest(to_host(state)),  # shards held by other processes too
            peak_mem_bytes=logger.peak_mem_bytes)
        timings.add("data_wait", batches.total_wait_s)
    finally:
        batches.close()
        loader.close()
        logger.close()
    if signals.signal is not None:
        raise Interrupted(signals.signal)
    return summary


def resume_line(restored: Any) -> str:
    """The line a resumed run prints first: the update, its checkpoint and the data position it holds."""
    saved = restored.data["loader"]
    position, per_epoch = int(saved["position"]), max(int(saved["num_train"]) // int(saved["batch_size"]), 1)
    return (f"resuming from update {restored.step} (checkpoint {restored.path}), data position {position} "
            f"(epoch {position // per_epoch}, micro-batch {position % per_epoch} of {per_epoch})")
