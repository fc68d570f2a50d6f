"""`jaxloop.run(cfg, task, hooks)`: one training run, composed from the layers below.

    validate the config -> process setup (jaxloop.runtime.settings) -> the task and its records -> the run_dir rules
    -> hold the run_dir (jaxloop.rundir.lock) -> a restored or fresh state -> the dispatcher and the actions
    -> the host loop -> summary and report -> RunResult (the trained state and the summary)

Each piece gets the part of the config it needs; the loop itself (jaxloop.loop.host_loop) knows none of them. The
dispatcher fits each compiled call to the device's memory (jaxloop.update.memory_plan); an out-of-memory error at run
time ends the host loop, and the run reloads its last checkpoint and trains on under a smaller plan.
"""

from __future__ import annotations

import errno
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
import numpy as np

from jaxloop.checkpoint.init_from import initial_params, shaped_by_init_from
from jaxloop.checkpoint.manager import Checkpointer, read_state
from jaxloop.checkpoint.write_errors import disk_full_line
from jaxloop.config.cadence import MAX_UPDATES_PER_CALL, Cadence
from jaxloop.config.errors import CheckpointWriteError, Interrupted, NonFiniteError, OutOfMemoryError
from jaxloop.config.run import Config, MemoryConfig, to_dict, validate
from jaxloop.data.identity import check_same_data, data_lines
from jaxloop.data.pipeline import DevicePrefetcher, run_val_batches, train_loader
from jaxloop.data.sources import Splits, write_vocab
from jaxloop.loop import actions as act
from jaxloop.loop.dispatch import CallEvents, CallPlan, Dispatcher
from jaxloop.loop.evaluate import ValidationPass
from jaxloop.loop.host_loop import Pace, train
from jaxloop.loop.model_check import check_init_from, check_same_model, this_model
from jaxloop.loop.task import Task, builtin_task, check_builtin_fields, check_own_optimizer, run_state
from jaxloop.model.flops import gpt_facts, mfu_inputs
from jaxloop.model.precision import resolve_precision
from jaxloop.observe.logger import RunLogger
from jaxloop.observe.runinfo import Profiler, Timings, memory_bytes, run_metadata
from jaxloop.observe.update_breakdown import measure_run
from jaxloop.rundir.lock import RunDirInUse, RunLock
from jaxloop.rundir.model_identity import read_model_record, write_model_record
from jaxloop.rundir.outcome import final_evaluation_due
from jaxloop.rundir.outcome import summary as run_summary
from jaxloop.rundir.records import BestTracker
from jaxloop.rundir.rules import RunDir, resume_by_name
from jaxloop.runtime.processes import barrier, is_primary
from jaxloop.runtime.settings import process_settings
from jaxloop.runtime.signals import on_abrupt_exit
from jaxloop.update.distributed import (
    abstract_sharded,
    check_divisible,
    create_sharded,
    make_mesh,
    shard_batch,
    to_host,
)
from jaxloop.update.memory_plan import (
    Fit,
    candidates,
    check_plan,
    describe_plan,
    is_out_of_memory,
    plan_dict,
    supports_blocks,
)
from jaxloop.update.optimizer import optimizer_metrics
from jaxloop.update.schedules import steps_change_line
from jaxloop.update.state import TrainState, state_digest
from jaxloop.update.step import make_train_step, scan_steps


@dataclass(frozen=True)
class RunResult(Mapping[str, Any]):
    """What run() returns: the trained state, and the summary written to run_dir/summary.json, whose keys
    it reads as a dict does (`result["final"]["val_loss"]`). `result.state.user_model()` gives the trained
    model as its user wrote it (Linen variables, or the NNX module); jaxloop.train_step trains it on."""

    state: TrainState | None
    summary: dict[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.summary[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.summary)

    def __len__(self) -> int:
        return len(self.summary)


def run(cfg: Config, task: Task | None = None, hooks: Sequence[act.Action] = ()) -> RunResult:
    """Train `task` (default: the preset's built-in task) according to cfg, with research code's `hooks`
    (jaxloop.Hook) among the loop's periodic actions; returns the trained state and the summary written to
    run_dir/summary.json (RunResult). `Config(run_dir=DIR)` alone resumes the run saved in DIR with its own
    config (jaxloop.rundir.rules); a run that has already ended writes nothing, says so on stderr ("already
    complete: ...") and returns its summary, with `already_complete` True, and its final state read back from
    its last checkpoint (None, with a warning, where that checkpoint does not read)."""
    t_start = time.perf_counter()
    cfg = resume_by_name(cfg)
    cfg = shaped_by_init_from(cfg, own_task=task is not None)  # --init_from a Hugging Face GPT-2: its shape
    if task is not None:  # a Task of one's own: the built-in task's model and data fields at the preset's
        check_builtin_fields(cfg)
    validate(cfg, check_paths=task is None, builtin_task=task is None)  # bad input: a ConfigError, nothing written
    with process_settings(cfg):  # x64 and the compile cache as they were when the run ends
        return _run_configured(cfg, task, hooks, t_start)


def _run_configured(cfg: Config, task: Task | None, hooks: Sequence[act.Action], t_start: float) -> RunResult:
    """run() once its config is valid and the process is set up for it."""
    cfg = resolve_precision(cfg)  # precision=auto: bf16 on an accelerator, fp32 on a CPU, recorded as chosen
    builtin = task is None
    rd = RunDir(cfg, writes=is_primary())
    # a refusal here writes nothing, and comes before the data is read (seconds for a large source)
    rd.check(has_checkpoint=Checkpointer.has_checkpoint(rd.checkpoints))
    task = builtin_task(cfg) if builtin else task  # bad data is a ConfigError before anything is written
    check_own_optimizer(cfg, task)
    splits = task.splits()  # bad or empty records too (jaxloop.data.sources)
    check_divisible(cfg)
    check_plan(cfg.memory, cfg.batch_size, task.model)
    model = check_model_identity(cfg, task, splits, rd, builtin)  # another model: refused, nothing written
    ended = rd.finished()
    if ended is not None:  # a finished run started again: nothing to do, nothing written (not even the lock)
        return already_complete(cfg, task, splits, rd, ended)
    if getattr(splits, "record", None) is not None:  # other data (jaxloop.data.identity): refused, nothing written
        splits = replace(
            splits, record=check_same_data(rd.layout, splits.record, rd.saved is not None, cfg.data.allow_changed)
        )
    lock = None
    try:
        lock = hold_run_dir(cfg)  # one run per run_dir; released at any exit (the kernel's flock, and here)
        with on_abrupt_exit(lock.release if lock is not None else None):  # a Ctrl-C while compiling: no stale record
            return _run_held(cfg, task, splits, rd, builtin, hooks, t_start, model)
    except OSError as e:  # a full disk met outside a checkpoint save: one line too (exit status 3)
        if e.errno != errno.ENOSPC:
            raise
        raise CheckpointWriteError(disk_full_line(e, cfg.run_dir)) from e
    finally:
        if lock is not None:
            lock.release()


def already_complete(cfg: Config, task: Task, splits: Splits, rd: RunDir, ended: dict[str, Any]) -> RunResult:
    """A finished run started again: the line that says so (on stderr, once per job), and the run's final state
    read from the checkpoint of its last update, read-only."""
    from jaxloop.config.cli import done_line

    summary = {**ended, "already_complete": True}
    if is_primary():
        print(done_line(summary, cfg.run_dir), file=sys.stderr)
    target = abstract_sharded(lambda: run_state(cfg, task, splits), make_mesh(cfg.distributed))
    return RunResult(state=read_state(rd.path, int(ended["final_step"]), target), summary=summary)


def hold_run_dir(cfg: Config) -> RunLock | None:
    """One run per run_dir (jaxloop.rundir.lock): process 0 holds it for the job and every process learns
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


class Replan(Exception):
    """The device ran out of memory at run time: the run reloads its last checkpoint and trains on under
    `memory` (`replans`: the run's re-plans so far, this one last, for metadata.json and the summary)."""

    def __init__(self, memory: MemoryConfig, replans: list[dict[str, Any]]):
        self.memory, self.replans = memory, replans
        super().__init__(describe_plan(memory))


def _run_held(
    cfg: Config,
    task: Task,
    splits: Splits,
    rd: RunDir,
    builtin: bool,
    hooks: Sequence[act.Action],
    t_start: float,
    model: dict[str, Any],
) -> RunResult:
    """run() once run_dir is held: write it, restore or build the state, train; after an out-of-memory error
    at run time (Replan), reload the last checkpoint and train on under the smaller plan. `model`: the
    model record of the state trained (jaxloop.rundir.model_identity), written to run_dir/model.json."""
    rd.check(has_checkpoint=Checkpointer.has_checkpoint(rd.checkpoints))  # again, held: a killed holder may have saved
    check_same_model(cfg, rd.layout, model, flags=builtin)  # again, held
    barrier("jaxloop: run_dir checked")  # nothing is written before every process has read run_dir
    metadata = run_metadata(cfg, data=getattr(splits, "record", None))
    if builtin and cfg.model.kind == "gpt":  # attention chosen, FLOPs per token, peak (jaxloop.model.flops)
        metadata["language_model"] = gpt_facts(cfg, splits.num_classes)

    def start() -> None:  # a resume's files are written once its checkpoint restored: a refusal writes nothing
        rd.start(metadata)
        if rd.writes:
            write_vocab(str(rd.path), splits)
            if read_model_record(rd.layout) != model:  # a new run's, or a run from before model.json
                write_model_record(rd.layout, model)

    started = not (cfg.resume != "never" and Checkpointer.has_checkpoint(rd.checkpoints))
    if started:
        start()

    timings = Timings()
    mesh = make_mesh(cfg.distributed)  # (data, fsdp): the state is sharded over fsdp, the batch over both
    init = lambda: run_state(cfg, task, splits)  # noqa: E731
    ckpt = Checkpointer(cfg.checkpoint, rd.path, config=to_dict(cfg), metadata=metadata)
    memory, replans, fell_back = cfg.memory, [], False
    try:
        while True:
            # a resume reads every shard straight into place: no fresh state is built only to be replaced
            resume = (
                cfg.resume != "never" or bool(replans) or fell_back
            )  # after a re-plan: this run's own last checkpoint
            began = time.perf_counter()
            restoring = resume and Checkpointer.has_checkpoint(rd.checkpoints)
            say(rd, "restoring the state from the last checkpoint..." if restoring else "creating the state...")
            restored = ckpt.restore_latest(abstract_sharded(init, mesh)) if resume else None
            if not replans and not fell_back:
                rd.must_have_resumed(restored)
            if not started:
                start()
                started = True
            state = restored.state if restored is not None else create_sharded(init, mesh)
            say(rd, f"the state is ready ({time.perf_counter() - began:.1f}s)")
            if restored is None and cfg.init_from:  # a fresh run from another run's (or a GPT-2's) params
                params, line = initial_params(cfg.init_from, state.params, cfg.model, cfg.precision)
                if line and cfg.log.progress != "off" and is_primary():
                    print(line, file=sys.stderr)
                state = state.replace(params=params, ema_params=None if state.ema_params is None else params)
            if not replans:
                if restored is not None:
                    rd.record_resume(restored.step)
                if not fell_back:
                    timings.add("setup", time.perf_counter() - t_start)
            try:
                summary, state, signum = _train(
                    replace(cfg, memory=memory),
                    task,
                    splits,
                    state,
                    restored,
                    ckpt,
                    timings,
                    mesh,
                    list(hooks),
                    rd,
                    replans,
                )
                break
            except Replan as e:
                memory, replans = e.memory, e.replans
                with timings("checkpoint"):
                    ckpt.wait()  # the last save is committed before it is read back
            except NonFiniteError as e:
                ckpt.wait()
                if restored is None or not unverified_and_bad(restored, ckpt.all_steps()):
                    raise
                ckpt.set_aside(
                    restored.step,
                    "restored without a digest to check its bytes, and the updates from it "
                    f"went non-finite before the next save: {e}",
                )
                fell_back = True
    finally:
        with timings("checkpoint"):
            ckpt.close()  # awaits the last async save and surfaces its errors
    summary["timings_s"] = timings.as_dict()
    summary["wall_time_s"] = time.perf_counter() - t_start
    summary = keep_timing_of_updates(summary, rd.layout.read_json(rd.layout.summary))
    rd.write_summary(summary)  # a stopped run's too: its report says where it stopped
    if cfg.log.report and rd.writes:
        from jaxloop.observe.run_report import write_report

        began = time.perf_counter()
        say(rd, "writing the report...")
        write_report(rd.path)
        if cfg.log.trackers:
            from jaxloop.observe.trackers import report_to_trackers

            report_to_trackers(rd.path, cfg.log.trackers, cfg.log.project, cfg.log.mlflow_uri)
        say(rd, f"wrote the report ({time.perf_counter() - began:.1f}s)")
    if signum is not None:
        raise Interrupted(signum, step=summary["final_step"], run_dir=cfg.run_dir)
    return RunResult(state=state, summary=summary)


def unverified_and_bad(restored: Any, saved: list[int]) -> bool:
    """Whether a non-finite streak is taken for damage of the checkpoint resumed: it carried no digest (an
    older jaxloop's, whose bytes nothing vouches for) and the streak came before this run saved another
    (`saved`: the committed steps), so every update of the run since descends from its bytes alone. Without
    this, each rerun would resume it and stop at the same streak."""
    return restored is not None and not restored.verified and bool(saved) and saved[-1] == restored.step


def say(rd: RunDir, line: str) -> None:
    """A line on stderr before the run's logger exists or after it closed (setup, the report): what the run is
    doing through a silence of seconds. The process that writes the run's files says it."""
    if rd.writes:
        print(line, file=sys.stderr, flush=True)


class FirstCallAnnounced:
    """`fn` whose first call, the one that compiles, is announced with its time: a first evaluation that compiles
    for minutes (gpt2-small) is not a silence after the last update line."""

    def __init__(self, fn: Callable[..., Any], logger: RunLogger, what: str):
        self.fn, self.logger, self.what, self.called = fn, logger, what, False

    def __call__(self, *args: Any) -> Any:
        if self.called:
            return self.fn(*args)
        self.called = True
        began = time.perf_counter()
        self.logger.message(f"compiling {self.what}...")
        out = self.fn(*args)
        self.logger.message(f"compiled and ran {self.what} ({time.perf_counter() - began:.1f}s)")
        return out


def check_model_identity(cfg: Config, task: Task, splits: Splits, rd: RunDir, builtin: bool) -> dict[str, Any]:
    """This run's model record (jaxloop.loop.model_check), once a resume with another model and an --init_from of
    another model's shapes are refused (ConfigError, worded for the command line when `builtin`)."""
    model = this_model(cfg, task, splits)
    check_same_model(cfg, rd.layout, model, flags=builtin)
    check_init_from(cfg, model)
    return model


def keep_timing_of_updates(summary: dict[str, Any], previous: Any) -> dict[str, Any]:
    """An invocation that ran no update (resumed at its end) keeps the wall time, rate and timings of the
    summary before it, which measured the updates; any other summary is returned as is."""
    if summary["updates_this_run"] or not isinstance(previous, dict):
        return summary
    kept = {k: previous[k] for k in ("wall_time_s", "updates_per_s", "timings_s") if k in previous}
    return {**summary, **kept}


def _train(
    cfg: Config,
    task: Task,
    splits: Splits,
    state: Any,
    restored: Any,
    ckpt: Checkpointer,
    timings: Timings,
    mesh: Any,
    hooks: list[act.Action],
    rd: RunDir,
    replans: list[dict[str, Any]],
) -> tuple[dict[str, Any], Any, int | None]:
    """The host loop over this run's dispatcher and actions, from `state` (restored or fresh) to the end, under
    the memory plan cfg.memory (and those the dispatcher re-plans to); Replan on an out-of-memory error.
    Returns the summary, the trained state and the signal that stopped the run (None: not stopped by one)."""
    run_dir = rd.path
    step = restored.step if restored is not None else 0
    cadence = Cadence.of(cfg)
    logger = RunLogger(
        run_dir,
        cfg.log,
        start_step=step,
        total_steps=cfg.steps,
        log_every=cfg.log_every,
        config=to_dict(cfg),
        writes=is_primary(),
    )
    for line in data_lines(getattr(splits, "record", None)) if not replans else ():  # each split's files
        logger.message(line)
    run = act.RunContext(
        cfg.steps, cfg.optim.accum_steps, logger, timings, act.Throughput(step, time.perf_counter()), str(run_dir)
    )
    tracker = BestTracker(cfg.checkpoint.best_mode, cfg.patience)
    evaluator = FirstCallAnnounced(
        ValidationPass(task.eval_loss(), lambda: run_val_batches(cfg, splits), mesh), logger, "the evaluation"
    )
    evaluate = act.Evaluate(cadence, evaluator, tracker, cfg.checkpoint.best_metric)
    actions = run_actions(cfg, splits, ckpt, run, evaluate, hooks, restored.data if restored is not None else None)
    signals = next(a for a in actions if isinstance(a, act.SignalStop))
    # paced in one process only: processes timing their own calls could choose other sizes, and wait apart
    pace = Pace.of(
        cfg.steps,
        actions,
        cfg.updates_per_call or MAX_UPDATES_PER_CALL,
        measure=jax.process_count() == 1,
        paced=lambda pace: record_pace(pace, logger, ckpt, rd),
    )
    loader = train_loader(cfg, splits, restored.data["loader"] if restored is not None else None)
    K = cfg.optim.accum_steps
    batches = DevicePrefetcher(
        loader,
        size=cfg.data.prefetch,
        put=lambda b: shard_batch(b, mesh, stacked=True),
        chunk=K * pace.chunk,
        first_chunk=K * (-step % pace.chunk),
    )
    memory = Memory(cfg.memory, replans, logger, ckpt, rd)
    plan = CallPlan(
        lambda planned: scan_steps(make_train_step(task.loss, planned)),
        K,
        cfg.memory,
        cfg.batch_size,
        supports_blocks(state.model),
    )
    dispatcher = Dispatcher(
        plan,
        batches,
        timings,
        CallEvents(compile=signals.heard(CompileLines(logger, cfg)), compiled=run.clock.compiled, fitted=memory.fitted),
    )
    if restored is not None:
        logger.message(resume_line(restored))
        moved = (
            steps_change_line(cfg.optim, int(rd.saved.get("steps", cfg.steps)), cfg.steps, step)
            if rd.saved is not None
            else None
        )
        if moved:
            logger.message(moved)
    try:
        try:
            state, stop_reason, final = train(state, step, dispatcher, actions, run, pace)
        except jax.errors.JaxRuntimeError as e:
            if not is_out_of_memory(e):
                raise
            raise memory.replan_after(
                e, dispatcher.memory or cfg.memory, cfg.batch_size, supports_blocks(task.model)
            ) from e
        if final_evaluation_due(final, stop_reason):  # e.g. a run resumed at its end
            final = evaluator(state)
        summary = run_summary(
            final_step=int(state.step),
            updates_this_run=int(state.step) - step,
            stop_reason=stop_reason,
            final=final,
            tracker=tracker,
            metric=cfg.checkpoint.best_metric,
            checkpoint_step=ckpt.best_step(),
            updates_per_s=run.clock.updates_per_s,
            skipped=int(optimizer_metrics(state.opt_state)["skipped"]),
            digest=state_digest(to_host(state)),  # shards held by other processes too
            peak_mem_bytes=max((m for m in (logger.peak_mem_bytes, memory_bytes()) if m is not None), default=None),
        )
        summary["memory"] = memory.record(dispatcher.memory or cfg.memory)  # the plan in force (CallPlan(cfg.memory))
        if cfg.log.breakdown:  # where an update's time goes, for the report (docs/observing.md)
            with timings("breakdown"):
                summary["update_breakdown"] = measure_run(
                    cfg, task.loss, state, splits, mesh, min(pace.longest(), cfg.steps)
                )
        if "calls" in ckpt.metadata and rd.writes:  # the pace's record (record_pace)
            rd.write_json(rd.layout.metadata, ckpt.metadata)
        timings.add("data_wait", batches.total_wait_s)
    finally:
        batches.close()
        loader.close()
        logger.close()
    return summary, state, signals.signal


def run_actions(
    cfg: Config,
    splits: Splits,
    ckpt: Checkpointer,
    run: act.RunContext,
    evaluate: act.Evaluate,
    hooks: list[act.Action],
    restored: dict[str, Any] | None,
) -> list[act.Action]:
    """The run's periodic actions in order: the signal stop (first), the non-finite streak, logs, the profiler,
    the evaluation (before every action that reads its results), the plateau's rate, the research code's hooks,
    and the save last (it saves the state those before it hand on, with every keyed part's state, restored here
    from a resumed checkpoint's data item)."""
    cadence = Cadence.of(cfg)
    actions: list[act.Action] = [
        act.SignalStop(),
        act.NonFiniteStreak(cfg.max_bad_steps),
        act.LogTrain(
            cadence,
            cfg.batch_size,
            cfg.model.context if splits.source in ("text", "tokens") else 0,
            **mfu_inputs(ckpt.metadata.get("language_model")),
        ),
        act.Profile(Profiler(cfg.log.profile_start, cfg.log.profile_steps, run.logger.layout.profile, run.timings)),
        evaluate,
    ]
    if cfg.optim.schedule == "plateau":  # decides the rate of the next updates from each evaluation
        from jaxloop.loop.plateau import Plateau

        actions.append(act.PlateauRate(Plateau.of(cfg), cfg.checkpoint.best_metric, cadence.eval_every))
    actions += hooks
    keyed = list(actions)  # what a checkpoint's data item holds beside the loader's position
    for part in keyed:
        if restored is not None and part.key is not None and part.key in restored:
            part.load_state_dict(restored[part.key])
    return [*actions, act.Save(cadence, ckpt, keyed)]


def record_pace(pace: Pace, logger: RunLogger, ckpt: Checkpointer, rd: RunDir) -> None:
    """A cap chosen for the calls, kept in the checkpoints' metadata (`calls`); said and written to metadata.json
    at once when below the bound, else at the end of training (no file write between a fast run's calls)."""
    ckpt.metadata["calls"] = pace.record()
    line = pace.line()
    if line:
        logger.message(line)
        if rd.writes:
            rd.write_json(rd.layout.metadata, ckpt.metadata)


COMPILE_LINE_STARTS = (
    "compiling the training call",
    "compiled in ",
    "loaded the compiled training call",
    "creating the state...",
    "restoring the state from",
    "the state is ready (",
    "compiling the evaluation...",
    "compiled and ran the evaluation (",
    "writing the report...",
    "wrote the report (",
)


def is_compile_line(line: str) -> bool:
    """Whether a line of stderr is one of CompileLines' or another announcement of a stage of seconds (say,
    FirstCallAnnounced): informational, a reader of the errors skips them."""
    return line.startswith(COMPILE_LINE_STARTS)


class CompileLines:
    """The lines around compiling a training call (silence at the start reads as a hang): what is compiled
    and where the next run finds it, before; how long it took, or that JAX's persistent cache answered it
    (the call traced and lowered, its executable read from disk), after."""

    def __init__(self, logger: RunLogger, cfg: Config):
        self.logger, self.cfg = logger, cfg

    def __call__(self, n: int, loaded: bool | None, seconds: float) -> None:
        if loaded is None:
            cache = (
                f"the next run of this config loads it from the cache ({self.cfg.compile_cache})"
                if self.cfg.compile_cache
                else "compile_cache is off: every run compiles it"
            )
            self.logger.message(
                f"compiling the training call ({n} update(s) of batch {self.cfg.batch_size} per "
                f"device call); {cache}..."
            )
        elif loaded:
            self.logger.message(f"loaded the compiled training call from the cache in {seconds:.1f}s")
        else:
            self.logger.message(f"compiled in {seconds:.1f}s")


def resume_line(restored: Any) -> str:
    """The line a resumed run prints first: the update, its checkpoint and the data position it holds."""
    saved = restored.data["loader"]
    position, per_epoch = int(saved["position"]), max(int(saved["num_train"]) // int(saved["batch_size"]), 1)
    return (
        f"resuming from update {restored.step} (checkpoint {restored.path}), data position {position} "
        f"(epoch {position // per_epoch}, micro-batch {position % per_epoch} of {per_epoch})"
    )


class Memory:
    """The run's memory plans: each call the dispatcher fits is logged (when it did not fit as planned) and
    recorded, with every re-plan, in metadata.json and every later checkpoint's metadata; after an
    out-of-memory error at run time, the next smaller plan (Replan) or OutOfMemoryError."""

    def __init__(
        self, memory: MemoryConfig, replans: list[dict[str, Any]], logger: RunLogger, ckpt: Checkpointer, rd: RunDir
    ):
        self.replans, self.logger, self.ckpt, self.rd = list(replans), logger, ckpt, rd
        self.last: Fit | None = None
        self.plan = memory

    def fitted(self, fitted: Fit, n: int, step: int) -> None:
        message = fitted.message(f"the call of {n} update(s)")
        if message:
            self.logger.message(message)
        if fitted.replanned:
            self.replans.append(fitted.record(step))
        self.last, self.plan = fitted, fitted.memory
        self.ckpt.metadata["memory"] = self.record(fitted.memory)
        if self.rd.writes:
            self.rd.write_json(self.rd.layout.metadata, self.ckpt.metadata)

    def record(self, memory: MemoryConfig) -> dict[str, Any]:
        """The plan, the footprint of its last call fitted and the limit, and the re-plans so far."""
        last = self.last
        return {
            "plan": plan_dict(memory),
            "footprint": last.footprint.as_dict() if last is not None else None,
            "limit": {"bytes": last.limit.bytes, "source": last.limit.source} if last is not None else None,
            "replans": self.replans,
        }

    def replan_after(self, error: Exception, memory: MemoryConfig, batch_size: int, blocks: bool) -> Exception:
        """Replan with the next smaller plan than `memory` (the run reloads its last checkpoint), or
        OutOfMemoryError when there is none, re-planning is off, or several processes run."""
        first = str(error).strip().splitlines()[0][:200]
        saved = self.ckpt.all_steps()
        where = f"update {saved[-1]}" if saved else "the initial state"
        smaller = candidates(memory, batch_size, blocks)
        if not memory.auto_fit or jax.process_count() > 1 or not smaller:
            why = (
                "memory.auto_fit is off"
                if not memory.auto_fit
                else "several processes cannot re-plan alone"
                if jax.process_count() > 1
                else f"no smaller plan than {describe_plan(memory)}"
            )
            return OutOfMemoryError(
                f"out of device memory at run time ({first}); {why}; the last checkpoint is "
                f"{where}: lower batch_size or the model's size"
            )
        plan = smaller[0]
        self.logger.message(
            f"out of device memory at run time ({first}): reloading {where} and re-planning "
            f"{describe_plan(memory)} -> {describe_plan(plan)}"
        )
        return Replan(
            plan,
            [
                *self.replans,
                {
                    "at_update": saved[-1] if saved else 0,
                    "reason": "out of memory at run time",
                    "from": plan_dict(memory),
                    "to": plan_dict(plan),
                    "error": first,
                },
            ],
        )
