"""Sharded state (FSDP, issue 14) across checkpoints: a checkpoint saved at fsdp=4 restores in any
layout and on another device count, and training continues.

Subprocesses as in tests/test_fsdp.py (forced host devices, XLA CPU optimization level 0).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_fsdp import MLP, ROOT
from test_fsdp import _env as env
from test_fsdp import _main_runs as main_runs
from test_fsdp import _summary as summary
from test_fsdp import _worst_rel as worst_rel

from jaxloop.rundir.records import read_records

FP32_REL_TOL = 1e-5  # as tests/test_fsdp.py

RESTORE = r"""
import json, sys
from jaxloop.config.cli import parse_config
from jaxloop.config.run import to_dict
from jaxloop.data.sources import load_splits
from jaxloop.checkpoint.manager import Checkpointer
from jaxloop.update.distributed import create_sharded, make_mesh, to_host
from jaxloop.model.builtin import make_model
from jaxloop.update.state import state_digest
from jaxloop.loop.task import create_train_state
import jax
from jaxloop.train import main
for argv in json.loads(sys.argv[2]):  # runs trained first in this process: a run and its restore in one start
    if main(argv):
        sys.exit(1)
for argv in json.loads(sys.argv[1]):
    cfg = parse_config(argv, check_paths=False)
    splits = load_splits(cfg)
    model = make_model(cfg.model, splits.num_classes, cfg.precision)
    target = create_sharded(lambda: create_train_state(cfg, model, splits.example_x), make_mesh(cfg.distributed))
    ckpt = Checkpointer(cfg.checkpoint, cfg.run_dir, config=to_dict(cfg))
    restored = ckpt.restore_latest(target)
    ckpt.close()
    print(json.dumps({"step": restored.step, "digest": state_digest(to_host(restored.state)),
                      "in_target_layout": all(a.sharding == b.sharding for a, b in
                                              zip(jax.tree.leaves(restored.state), jax.tree.leaves(target)))}))
"""

# K = 2 (the accumulator is part of the saved state, as are the EMA and Adam's moments).
RUN = (
    *MLP,
    "--optim.accum_steps",
    "2",
    "--steps",
    "8",
    "--log_every",
    "1",
    "--eval_every",
    "4",
    "--checkpoint.every",
    "4",
    "--checkpoint.keep_last",
    "3",
)


def _restore(devices: int, argvs: list[list[str]], trained_first: tuple[list[str], ...] = ()) -> list[dict]:
    """Each argv's run_dir restored into its layout on `devices` devices, after the runs of `trained_first`."""
    out = subprocess.run(
        [sys.executable, "-c", RESTORE, json.dumps(argvs), json.dumps(list(trained_first))],
        cwd=ROOT,
        env=env(devices),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return [json.loads(line) for line in out.stdout.strip().splitlines()[-len(argvs) :]]


@pytest.fixture(scope="module")
def saved_at_fsdp4(tmp_path_factory):
    """An 8-update run at fsdp=4 on 4 devices, checkpoints at updates 4 and 8; and a copy that stops at 4."""
    base = tmp_path_factory.mktemp("fsdp4")
    main_runs(4, [*RUN, "--distributed.fsdp", "4", "--run_dir", str(base / "full")])
    at4 = base / "at4"
    shutil.copytree(base / "full", at4)
    shutil.rmtree(at4 / "checkpoints" / "8")
    (at4 / "summary.json").unlink()
    return base / "full", at4


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_a_checkpoint_saved_at_fsdp4_restores_the_same_bits_in_every_layout(saved_at_fsdp4, tmp_path):
    _, at4 = saved_at_fsdp4
    run = _copy(at4, tmp_path / "run")
    argv = lambda fsdp: [*RUN, "--distributed.fsdp", str(fsdp), "--run_dir", str(run)]
    four = _restore(4, [argv(4), argv(1), argv(2)])  # data 1 x fsdp 4, data 4 x fsdp 1, data 2 x fsdp 2
    two = _restore(2, [argv(2), argv(1)])  # another device count: fsdp 2, and replicated
    assert all(r["step"] == 4 and r["in_target_layout"] for r in four + two)
    assert len({r["digest"] for r in four + two}) == 1, "the restored state is bit-identical in every layout"


def test_resumed_in_any_layout_training_continues(saved_at_fsdp4, tmp_path):
    full, at4 = saved_at_fsdp4
    runs = {name: _copy(at4, tmp_path / name) for name in ("fsdp4", "fsdp1", "fsdp2xdata2", "two_devices")}
    main_runs(
        4,
        *[
            [*RUN, "--distributed.fsdp", fsdp, "--run_dir", str(runs[name])]
            for name, fsdp in (("fsdp4", "4"), ("fsdp1", "1"), ("fsdp2xdata2", "2"))
        ],
    )
    main_runs(2, [*RUN, "--distributed.fsdp", "2", "--run_dir", str(runs["two_devices"])])
    ref = summary(full)
    losses = lambda d: [r["loss"] for r in read_records(d) if r["kind"] == "train"]
    for name, run in runs.items():
        resumes = [json.loads(line) for line in (run / "resumes.jsonl").read_text().splitlines()]
        assert [r["step"] for r in resumes] == [4], name
        assert summary(run)["final_step"] == 8
        if name == "fsdp4":  # the same layout: bit-identical to the uninterrupted run
            assert summary(run)["state_digest"] == ref["state_digest"]
            assert losses(run) == losses(full)
        else:  # another layout: another order of the gradient's partial sums, fp32 rounding
            assert worst_rel(losses(run), losses(full)) <= FP32_REL_TOL, name


def test_a_checkpoint_saved_on_one_device_restores_the_same_bits_on_two(tmp_path):
    # A one-device run hands Orbax NumPy views (jaxloop.checkpoint.manager._for_orbax): its checkpoints must
    # restore into sharded targets too, bit for bit (fsdp 2, and replicated over data 2).
    run = tmp_path / "one_device"
    argv = lambda fsdp: [*RUN, "--distributed.fsdp", str(fsdp), "--run_dir", str(run)]
    # the one-device run and its one-device restore share a process (one start fewer)
    restored = _restore(1, [argv(1)], trained_first=([*RUN, "--run_dir", str(run)],)) + _restore(2, [argv(2), argv(1)])
    assert all(r["step"] == 8 and r["in_target_layout"] for r in restored)
    assert {r["digest"] for r in restored} == {summary(run)["state_digest"]}
