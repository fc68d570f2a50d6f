"""Data parallelism on several host devices (XLA_FLAGS=--xla_force_host_platform_device_count=N).

Each case runs in a subprocess because the device count is fixed when jax starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxloop.metrics import read_records

PROBE = r"""
import json, sys
import jax, numpy as np
from jaxloop.config import preset
from jaxloop.distributed import make_mesh, replicate, shard_batch
from jaxloop.models import make_model
from jaxloop.sources import load_splits, record_order
from jaxloop.state import create_train_state
from jaxloop.step import train_step
cfg = preset("debug")
splits = load_splits(cfg)
mesh = make_mesh()
state = replicate(create_train_state(cfg, make_model(cfg, splits.num_classes), splits.example_x), mesh)
batch = shard_batch(splits.train.get(record_order(cfg, splits.num_train, 0, 1)[0]), mesh)
state, metrics = train_step(state, batch)
print(json.dumps({
    "devices": jax.device_count(),
    "batch_shards": sorted(s.data.shape[0] for s in batch["x"].addressable_shards),
    "params_replicated": all(l.sharding.is_fully_replicated for l in jax.tree.leaves(state.params)),
    "loss": float(metrics["loss"]),
}))
"""


def _env(devices: int) -> dict[str, str]:
    return {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}


def _train(run_dir: Path, devices: int, *extra: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "jaxloop.train", "--preset", "debug", "--run_dir", str(run_dir),
                          "--log.progress", "off", *extra], env=_env(devices), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.parametrize("devices", [2, 4])
def test_batch_is_split_over_devices_and_state_stays_replicated(devices):
    out = subprocess.run([sys.executable, "-c", PROBE], env=_env(devices), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    assert probe["devices"] == devices
    assert probe["batch_shards"] == [32 // devices] * devices
    assert probe["params_replicated"]


@pytest.fixture(scope="module")
def single_device_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("one_device")
    return _train(run_dir, 1), run_dir


@pytest.mark.parametrize("devices", [2, 4])
def test_multi_device_run_matches_single_device(single_device_run, tmp_path, devices):
    # Same data, same init; only the gradient all-reduce adds partial sums in another order: float32
    # losses agree to 1e-5 relative over the 20 updates (2.4e-7 absolute measured on 2 devices).
    ref_summary, ref_dir = single_device_run
    summary = _train(tmp_path, devices)
    ref = [r["loss"] for r in read_records(ref_dir) if r["kind"] == "train"]
    got = [r["loss"] for r in read_records(tmp_path) if r["kind"] == "train"]
    assert len(got) == len(ref) == 20
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    assert worst <= 1e-5, f"max relative loss difference {worst:.3g}"
    assert summary["final"]["val_acc"] == pytest.approx(ref_summary["final"]["val_acc"], abs=1 / 360)


def test_checkpoint_from_one_device_resumes_on_two(single_device_run, tmp_path):
    import shutil

    _, ref_dir = single_device_run
    shutil.copytree(ref_dir, tmp_path / "run")
    summary = _train(tmp_path / "run", 2, "--steps", "26", "--allow_steps_change")
    assert summary["final_step"] == 26
    steps = [r["step"] for r in read_records(tmp_path / "run") if r["kind"] == "train"]
    assert steps == list(range(1, 27)), "the run continued from update 20 on 2 devices"


def test_batch_size_not_divisible_by_devices_is_refused(tmp_path):
    out = subprocess.run([sys.executable, "-m", "jaxloop.train", "--preset", "debug", "--run_dir", str(tmp_path / "r"),
                          "--batch_size", "30"], env=_env(4), capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "jaxloop.train: error: batch_size=30 is not allowed: a multiple of the device count (4)"]
    assert not (tmp_path / "r").exists()
