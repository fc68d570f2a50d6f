"""Sharded state (FSDP, issue 14) across checkpoints and processes: a checkpoint saved at fsdp=4
restores in any layout and on another device count; two processes sharding one state match one process.

Subprocesses as in tests/test_fsdp.py (forced host devices, XLA CPU optimization level 0).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loopcore.records import read_records
from test_fsdp import GPT, MLP, ROOT
from test_fsdp import _env as env, _main_runs as main_runs, _summary as summary, _worst_rel as worst_rel

FP32_REL_TOL = 1e-5  # as tests/test_fsdp.py

RESTORE = r"""
import json, sys
from loopcore.cli import parse_config
from loopcore.sources import load_splits
from jaxloop.checkpoint import Checkpointer
from jaxloop.distributed import create_sharded, make_mesh, to_host
from jaxloop.models import make_model
from jaxloop.state import create_train_state, state_digest
import jax
for argv in json.loads(sys.argv[1]):
    cfg = parse_config(argv, check_paths=False)
    splits = load_splits(cfg)
    model = make_model(cfg, splits.num_classes)
    target = create_sharded(lambda: create_train_state(cfg, model, splits.example_x), make_mesh(cfg.distributed))
    ckpt = Checkpointer(cfg, cfg.run_dir)
    restored = ckpt.restore_latest(target)
    ckpt.close()
    print(json.dumps({"step": restored.step, "digest": state_digest(to_host(restored.state)),
                      "in_target_layout": all(a.sharding == b.sharding for a, b in
                                              zip(jax.tree.leaves(restored.state), jax.tree.leaves(target)))}))
"""

# K = 2 (the accumulator is part of the saved state, as are the EMA and Adam's moments).
RUN = (*MLP, "--optim.accum_steps", "2", "--steps", "8", "--log_every", "1", "--eval_every", "4",
       "--checkpoint.every", "4", "--checkpoint.keep_last", "3")


def _restore(devices: int, argvs: list[list[str]]) -> list[dict]:
    out = subprocess.run([sys.executable, "-c", RESTORE, json.dumps(argvs)], cwd=ROOT, env=env(devices),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return [json.loads(line) for line in out.stdout.strip().splitlines()[-len(argvs):]]


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
    main_runs(4, *[[*RUN, "--distributed.fsdp", fsdp, "--run_dir", str(runs[name])]
                   for name, fsdp in (("fsdp4", "4"), ("fsdp1", "1"), ("fsdp2xdata2", "2"))])
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


# ----------------------------------------------------------------------------- several processes


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(run_dir: Path, processes: int, *args: str) -> list[subprocess.Popen]:
    """The same command in `processes` processes of one device each, joined by jax.distributed."""
    coordinator = f"127.0.0.1:{_free_port()}"
    return [subprocess.Popen([sys.executable, "-m", "jaxloop.train", *args, "--run_dir", str(run_dir),
                              "--distributed.num_processes", str(processes), "--distributed.process_id", str(p),
                              "--distributed.coordinator", coordinator],
                             cwd=ROOT, env=env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for p in range(processes)]


def _wait(procs: list[subprocess.Popen], timeout: int = 300) -> list[tuple[int, str]]:
    done = []
    for p in procs:
        _, err = p.communicate(timeout=timeout)
        done.append((p.returncode, err))
    return done


def test_two_processes_sharding_one_state_match_one_process_with_two_devices(tmp_path):
    # fsdp=2 over two processes of one device each: every sharded leaf has one half in each process,
    # gloo carries the all-gathers and reduce-scatters; the same global computation as one process
    # with two devices, bit for bit.
    args = (*GPT, "--optim.accum_steps", "2", "--distributed.fsdp", "2")
    main_runs(2, [*args, "--run_dir", str(tmp_path / "one")])
    for status, err in _wait(_launch(tmp_path / "two", 2, *args)):
        assert status == 0, err[-3000:]
    assert summary(tmp_path / "two")["state_digest"] == summary(tmp_path / "one")["state_digest"]
    keys = ("kind", "step", "lr", "loss", "grad_norm", "val_loss", "val_acc", "ema_val_loss")
    strip = lambda d: [{k: r[k] for k in keys if k in r} for r in read_records(d)]
    assert strip(tmp_path / "two") == strip(tmp_path / "one")


def test_sigterm_to_one_process_saves_and_stops_both_and_the_run_resumes_exactly(tmp_path):
    flags = (*MLP, "--distributed.fsdp", "2", "--steps", "300", "--log_every", "1", "--checkpoint.every", "50")
    main_runs(2, [*flags, "--run_dir", str(tmp_path / "ref")])
    procs = _launch(tmp_path / "run", 2, *flags)
    deadline = time.monotonic() + 240
    while len([r for r in read_records(tmp_path / "run") if r["kind"] == "train"]) < 30:
        assert time.monotonic() < deadline and procs[0].poll() is None, "the run did not get to update 30"
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)
    done = _wait(procs)
    assert [status for status, _ in done] == [143, 143], [err[-2000:] for _, err in done]
    stopped = [r["step"] for r in read_records(tmp_path / "run") if r["kind"] == "train"][-1]
    assert stopped < 300
    assert (tmp_path / "run" / "checkpoints" / str(stopped)).is_dir(), "the update it stopped at was saved"

    for status, err in _wait(_launch(tmp_path / "run", 2, *flags)):
        assert status == 0, err[-3000:]
    assert summary(tmp_path / "run")["state_digest"] == summary(tmp_path / "ref")["state_digest"]
