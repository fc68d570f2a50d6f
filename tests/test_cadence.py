"""The loop's cadence: several updates per dispatched call, every event on a call boundary, and back on
the grid after a skipped update."""

from __future__ import annotations

import json
from dataclasses import replace

import flax.linen as nn
import numpy as np
import pytest

import jaxloop
from jaxloop.cadence import Cadence
from loopcore.config import CheckpointConfig, Config, LogConfig, OptimConfig
from loopcore.records import read_records


def test_updates_per_call_divide_every_cadence():
    c = Cadence(steps=2000, log_every=25, eval_every=250, save_every=250, check_every=20)
    assert c.per_call == 5
    assert Cadence(500, 10, 100, 100, 20).per_call == 10
    assert Cadence(500, 10, 0, 0, 20).per_call == 10, "0 (only at the end) constrains nothing"
    assert Cadence(7, 1, 0, 0, 20).per_call == 1


def test_off_the_grid_the_loop_dispatches_single_updates_until_back_on_it():
    c = Cadence(steps=40, log_every=10, eval_every=0, save_every=0, check_every=20)
    assert [c.updates_next(s) for s in (0, 10, 13, 19, 20, 30)] == [10, 10, 1, 1, 10, 10]
    assert c.updates_next(35) == 1, "never past steps"


def test_sync_points_are_the_due_events():
    c = Cadence(steps=30, log_every=10, eval_every=15, save_every=0, check_every=6)
    assert [s for s in range(1, 31) if c.sync(s)] == [6, 10, 12, 15, 18, 20, 24, 30]


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
    base = Config(run_dir=str(run_dir), steps=12, batch_size=16, log_every=4, eval_every=4,
                  optim=OptimConfig(peak_lr=1e-2, warmup_steps=1), checkpoint=CheckpointConfig(every=4, keep_last=10),
                  log=LogConfig(progress="off", report=False, tensorboard=False))
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
    # applied at its syncs, and steps singly back onto the grid: saves and logs stay at 4, 8, 12.
    run_dir, summary = skipping_run
    assert summary["final_step"] == 12 and summary["skipped_updates"] == 4
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [4, 8, 12]
    assert [r["step"] for r in read_records(run_dir) if r["kind"] == "train"] == [4, 8, 12]


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
