"""The loop's cadence: several updates per dispatched call, evaluations and saves on call boundaries, logs
from inside calls, and back on the grid after a skipped update (jaxloop.config.cadence, jaxloop.loop.host_loop)."""

from __future__ import annotations

import json
from dataclasses import replace

import flax.linen as nn
import numpy as np
import pytest

import jaxloop
from jaxloop.config.cadence import call_plan, call_sizes, next_call_size, paced_cap
from jaxloop.config.run import CheckpointConfig, Config, LogConfig, OptimConfig
from jaxloop.config.schedules import WarmupCosineConfig
from jaxloop.rundir.records import read_records


def test_calls_end_on_the_evaluation_checkpoint_and_end_cadences():
    assert call_plan(0, 2000, [250], 50) == [50] * 40
    assert call_plan(0, 500, [100], 50) == [50] * 10
    assert call_plan(0, 500, [], 50) == [50] * 10, "no period (0: only at the end) constrains nothing"
    assert call_plan(0, 60, [100], 50) == [20] * 3, "the grid (20 divides 60 and 100): one size, chunks whole"
    assert call_plan(0, 300, [45], 50) == [15] * 20, "a grid of at least a quarter of the cap is kept"
    assert call_plan(0, 7, [], 50) == [7], "so is the run's length"
    assert call_plan(0, 7, [2], 50) == [2, 2, 2, 1]


def test_a_period_co_prime_to_the_others_never_shrinks_the_calls_to_one_update():
    # issue 44: a hook every 7 updates beside evaluations every 100 made the gcd rule (call_size) dispatch
    # 500 calls of one update. Off a usable grid, calls run up to the next boundary in a few sizes: 7s, and
    # 2 + 4 + 1 around each evaluation. Mutant (the grid alone, GRID_SHARE = 10**9): 500 calls of 1.
    plan = call_plan(0, 500, [7, 100], 50)
    assert sum(plan) == 500 and set(plan) == {7, 4, 2, 1}
    assert plan[:17] == [7] * 14 + [2, 4, 1], "7 ... 98, then 100 (an evaluation), then 105"
    assert len(plan) == 81
    assert call_plan(0, 1003, [100], 50) == [50] * 20 + [2, 1], "a length co-prime to the period: the end in two"


def test_a_set_maximum_bounds_a_call():
    assert call_plan(0, 500, [100], 1) == [1] * 500
    assert call_plan(0, 500, [100], 30) == [25] * 20, "the largest divisor within the maximum"
    assert call_plan(0, 97, [], 30) == [30, 30, 30, 4, 2, 1], "no usable grid: the cap, then powers of two"
    assert call_sizes(50, [100, 7]) == (50, 32, 16, 8, 7, 4, 2, 1)


def test_off_the_grid_the_calls_reach_it_in_powers_of_two():
    # after a resume off the grid or a skipped update: at most log2(grid) sizes, each compiled once
    assert call_plan(13, 40, [20], 20) == [4, 2, 1, 20], "7 = 4 + 2 + 1"
    assert next_call_size(2, [50], 500, 50) == 32
    assert next_call_size(30, [15], 45, 15) == 15 and next_call_size(30, [10], 35, 10) == 5, "never past steps"


def test_the_pace_fits_a_call_into_the_target_seconds():
    # paced_cap(seconds per update measured, the longest call, target seconds a call, a grid to divide)
    assert paced_cap(0.001, 50, 1.0) == 50, "1000 updates fit in a second: the maximum"
    assert paced_cap(0.02, 50, 1.0) == 50, "exactly the maximum fits"
    assert paced_cap(0.03, 50, 1.0) == 32, "33 fit: the power of two below"
    assert paced_cap(0.03, 50, 1.0, divides=50) == 25, "33 fit: the largest divisor of the grid"
    assert paced_cap(0.3, 50, 1.0) == 2 and paced_cap(0.15, 50, 1.0, divides=50) == 5
    assert paced_cap(1.0, 50, 1.0) == 1 and paced_cap(50.0, 50, 1.0, divides=50) == 1, "never below one update"
    assert paced_cap(0.1, 4, 2.0) == 4, "bounded by the maximum"
    assert paced_cap(0.0, 50, 1.0) == 50, "a call too fast to measure"


@pytest.fixture(scope="module")
def runs_of_two_call_sizes(tmp_path_factory):
    """The debug preset, every update logged, with 2-micro-batch updates, run one update per call and
    in calls of 10 (the default's choice for it): (summary, train records) of each."""
    from jaxloop.config.run import preset
    from jaxloop.loop.runner import run

    out = {}
    for per_call in (1, 0):
        base = preset("debug")
        cfg = replace(
            base,
            run_dir=str(tmp_path_factory.mktemp(f"calls{per_call}")),
            steps=30,
            log_every=1,
            updates_per_call=per_call,
            optim=replace(base.optim, accum_steps=2),
            log=replace(base.log, progress="off", tensorboard=False),
        )
        summary = run(cfg)
        out[per_call] = summary, [r for r in read_records(cfg.run_dir) if r["kind"] == "train"]
    return out


def test_every_due_log_record_is_written_from_inside_a_call(runs_of_two_call_sizes):
    summary, records = runs_of_two_call_sizes[0]
    assert summary["final_step"] == 30
    assert [r["step"] for r in records] == list(range(1, 31)), "a record per update, 10 per call"


def test_the_call_size_changes_no_state_bit_and_no_logged_value(runs_of_two_call_sizes):
    """Scanned calls of 10 updates compute what 30 single-update calls do, bit for bit; the logged loss,
    lr, grad_norm and skip count of every update agree exactly (their rates of course differ)."""
    (one, one_records), (auto, auto_records) = runs_of_two_call_sizes[1], runs_of_two_call_sizes[0]
    assert auto["state_digest"] == one["state_digest"]
    fields = ("step", "loss", "lr", "grad_norm", "skipped", "loss_scale")
    assert [[r[f] for f in fields] for r in auto_records] == [[r[f] for f in fields] for r in one_records]


def test_a_calls_time_is_shared_by_its_updates_records(runs_of_two_call_sizes):
    _, records = runs_of_two_call_sizes[0]
    for call in (records[10:20], records[20:30]):  # after the first call (its compile resets the clock)
        # one rate for the updates of one call (to rounding: each is its share of the call's time)
        assert [r["step_ms"] for r in call] == pytest.approx([call[0]["step_ms"]] * 10, rel=1e-6)
        assert all(r["step_ms"] > 0 for r in call)


def test_the_next_call_is_dispatched_before_the_host_logs_the_finished_one(tmp_path, monkeypatch):
    """The device is not left idle while the host writes a call's records: the loop dispatches the next
    call first, unless the state reached is to be evaluated or saved (then it waits for both). Mutant:
    logging before dispatching fails the first check."""
    from jaxloop.config.run import preset
    from jaxloop.loop.dispatch import Dispatcher
    from jaxloop.loop.runner import run
    from jaxloop.observe.logger import RunLogger

    events: list[tuple[str, int]] = []
    dispatch, train = Dispatcher.dispatch, RunLogger.train
    monkeypatch.setattr(
        Dispatcher,
        "dispatch",
        lambda self, state, step, n: (events.append(("dispatch", step)), dispatch(self, state, step, n))[1],
    )
    monkeypatch.setattr(
        RunLogger, "train", lambda self, record: (events.append(("log", record["step"])), train(self, record))[1]
    )
    base = preset("debug")
    cfg = replace(  # the fixture's run (its init and evaluation compiled once), in calls of 5
        base,
        run_dir=str(tmp_path),
        steps=30,
        log_every=1,
        eval_every=20,
        updates_per_call=5,
        optim=replace(base.optim, accum_steps=2),
        checkpoint=CheckpointConfig(every=20),
        log=replace(base.log, progress="off", tensorboard=False),
    )
    run(cfg)
    calls = [step for kind, step in events if kind == "dispatch"]
    assert calls == list(range(0, 30, 5)), "calls of the grid from the first (no probe of another size)"
    for end in range(5, 30, 5):  # the call that reached `end`: its records, and the next call's dispatch
        first_record, next_call = events.index(("log", end - 4)), events.index(("dispatch", end))
        if end % 20:
            assert next_call < first_record, f"update {end}: the next call goes out before the logs"
        else:
            assert next_call > events.index(("log", end)), f"update {end} is evaluated and saved first"


class Lin(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        return nn.Dense(1)(x)[:, 0]


def _mse(model, batch, train):
    return jaxloop.weighted_mean((model(batch["x"]) - batch["y"]) ** 2, batch), {}


def _records_with_one_nan() -> list[dict]:
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    records = [{"x": xi, "y": np.float32(xi.sum())} for xi in x]
    records[5]["x"] = np.full(4, np.nan, np.float32)  # one micro-batch of every epoch is skipped
    return records


def _cfg(run_dir, **fields) -> Config:
    base = Config(
        run_dir=str(run_dir),
        steps=12,
        batch_size=16,
        log_every=4,
        eval_every=4,
        optim=OptimConfig(lr_schedule=WarmupCosineConfig(warmup_steps=1), peak_lr=1e-2),
        checkpoint=CheckpointConfig(every=4, keep_last=10),
        log=LogConfig(progress="off", report=False, tensorboard=False),
    )
    return replace(base, **fields)


@pytest.fixture(scope="module")
def skipping_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("skips")
    records = _records_with_one_nan()
    summary = jaxloop.run(_cfg(run_dir), jaxloop.Task(Lin(), _mse, records, records[:16]))
    return run_dir, summary


def test_skipped_updates_do_not_move_saves_or_logs_off_their_updates(skipping_run):
    # 64 records in micro-batches of 16: 4 windows an epoch, one of them holding the NaN record. 12
    # applied updates take 16 windows (4 skipped); the loop dispatches 4 updates a call, finds fewer
    # applied after it, and steps back onto the grid in powers of two: saves and logs stay at 4, 8, 12.
    run_dir, summary = skipping_run
    assert summary["final_step"] == 12 and summary["skipped_updates"] == 4
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [4, 8, 12]
    assert [r["step"] for r in read_records(run_dir) if r["kind"] == "train"] == [4, 8, 12]


def test_every_record_has_its_time_when_skips_move_the_loop_off_the_grid(tmp_path):
    # After a skip the loop compiles calls of other sizes; a compile is not training time, so it waits
    # for the logs of the call before it (else the clock restarts after them: step_ms 0). Mutant
    # dispatching ahead regardless of compiling: records with step_ms ~1e-7, seen failing.
    records = _records_with_one_nan()
    jaxloop.run(
        _cfg(tmp_path, log_every=1, eval_every=0, checkpoint=CheckpointConfig(every=0)),
        jaxloop.Task(Lin(), _mse, records, records[:16]),
    )
    train = [r for r in read_records(tmp_path) if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 13))
    # no update of this model takes under a microsecond; a clock restarted after `now` gives ~1e-7 ms
    assert all(r["step_ms"] > 1e-3 for r in train), [r["step_ms"] for r in train]


def test_a_run_resumed_after_skips_ends_bit_identical(skipping_run, tmp_path):
    # Resume from update 8's checkpoint: its data position counts the skipped windows too.
    run_dir, summary = skipping_run
    import shutil

    shutil.copytree(run_dir, tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "12")
    (tmp_path / "run" / "summary.json").unlink()
    records = _records_with_one_nan()
    resumed = jaxloop.run(_cfg(tmp_path / "run"), jaxloop.Task(Lin(), _mse, records, records[:16]))
    assert json.loads((tmp_path / "run" / "resumes.jsonl").read_text().splitlines()[0])["step"] == 8
    assert resumed["state_digest"] == summary["state_digest"]


def test_step_ms_counts_the_time_a_save_blocks_and_not_the_evaluation(tmp_path, monkeypatch):
    # A save's blocking is the loop's time (the loop efficiency counts async checkpoints);
    # evaluation is reported apart. Every save is made 0.2 s slower and every evaluation 1.0 s: over
    # the 4 updates a record covers, 50 and 250 ms. Saves at 4, 8, 12; evaluations at 8 and 12 (the
    # end). The record at 8 covers the save at 4 alone, the one at 12 the save and evaluation at 8:
    # both must hold the save (>= 50 ms) and not the evaluation (< 200 ms; the 4 updates of this model
    # take ~1 ms, Orbax's background writes some tens of ms more).
    # Mutants seen failing: the save paused out of the interval (~1 ms); the evaluation kept in (~300 ms).
    import time

    from jaxloop.checkpoint.manager import Checkpointer
    from jaxloop.loop.evaluate import ValidationPass

    save, evaluate = Checkpointer.save, ValidationPass.__call__
    monkeypatch.setattr(Checkpointer, "save", lambda self, *a, **k: (time.sleep(0.2), save(self, *a, **k))[1])
    monkeypatch.setattr(ValidationPass, "__call__", lambda self, state: (time.sleep(1.0), evaluate(self, state))[1])
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    records = [{"x": xi, "y": np.float32(xi.sum())} for xi in x]
    jaxloop.run(_cfg(tmp_path, steps=12, eval_every=8), jaxloop.Task(Lin(), _mse, records, records[:16]))
    step_ms = {r["step"]: r["step_ms"] for r in read_records(tmp_path) if r["kind"] == "train"}
    assert 50 <= step_ms[8] < 200 and 50 <= step_ms[12] < 200, step_ms


def test_a_short_default_run_compiles_one_training_call(tmp_path):
    # issue 44/45: the paced loop compiled a call of one update for its probes, and others to get back onto
    # the boundaries (1, 50, 8, 2 ...: each a whole compile). The default run (digits) of 40 updates (evaluations and
    # saves every 100: the grid is 20) compiles one call, announced once, and runs it twice; the one call
    # left after the first is not worth lowering the cap for, whatever the machine's speed. Counted from the
    # run's announcements. Mutants seen failing: w5-stop's pace (probes of one update: 1, then 50, 2 compiles);
    # GRID_SHARE = 1 (the cap's sizes: one call of 40, the run's length, not the grid's 20).
    import contextlib
    import io

    from jaxloop.train import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(
            ["--steps", "40", "--optim.warmup_steps", "0", "--log.no_tensorboard", "--log.progress", "off"]
            + ["--run_dir", str(tmp_path)]
        )
    assert status == 0, err.getvalue()
    compiles = [line for line in err.getvalue().splitlines() if line.startswith("compiling the training call")]
    assert len(compiles) == 1 and compiles[0].startswith("compiling the training call (20 update(s)"), compiles
    calls = json.loads((tmp_path / "metadata.json").read_text())["calls"]
    assert calls["sizes"] == [20] and calls["updates_per_call"] == 50 and calls["measured_s_per_update"] > 0
