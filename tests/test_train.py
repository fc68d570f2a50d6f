"""The loop and its CLI end to end: outputs, the metrics conventions, the default run's accuracy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxloop.config.run import from_dict
from jaxloop.rundir.records import read_records
from parity_tests.oracle import lr_oracle as closed_form


def _cli(run_dir: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """The CLI as a user starts it; without the test process's XLA_FLAGS, which the determinism tests read."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run(
        [sys.executable, "-m", "jaxloop.train", "--run_dir", str(run_dir), "--log.progress", "off", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.fixture(scope="module")
def debug_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("debug")
    out = _cli(run_dir, "--preset", "debug", "--optim.accum_steps", "2")
    assert out.returncode == 0, out.stderr
    return run_dir


def test_the_cli_asks_xla_for_deterministic_gpu_kernels_and_records_the_flags(debug_run):
    # jaxloop.runtime.determinism: set before jax starts its backend, so the CLI's XLA reads it
    flags = json.loads((debug_run / "metadata.json").read_text())["xla_flags"]
    assert "--xla_gpu_deterministic_ops=true" in flags.split()


def test_no_deterministic_leaves_xla_flags_alone(tmp_path):
    out = _cli(
        tmp_path, "--preset", "debug", "--steps", "4", "--eval_every", "4", "--no_deterministic", "--compile_cache", ""
    )
    assert out.returncode == 0, out.stderr
    assert "xla_gpu_deterministic_ops" not in json.loads((tmp_path / "metadata.json").read_text())["xla_flags"]


def test_debug_preset_runs_end_to_end_and_writes_its_outputs(debug_run):
    for name in ("config.json", "metadata.json", "metrics.jsonl", "summary.json"):
        assert (debug_run / name).is_file(), name
    summary = json.loads((debug_run / "summary.json").read_text())
    assert summary["final_step"] == 20 and summary["stop_reason"] == "completed"
    assert set(summary["final"]) == {"val_loss", "val_acc"}
    assert len(summary["state_digest"]) == 64
    assert sorted(int(p.name) for p in (debug_run / "checkpoints").iterdir()) == [10, 20]


def test_metrics_records_follow_the_step_and_lr_conventions(debug_run):
    # step = updates completed (1-based); lr = the rate that update used = schedule(step - 1), in float32
    # (8 ulps of peak_lr); floats are written at full precision, so they read back exactly.
    cfg = from_dict(json.loads((debug_run / "config.json").read_text()))
    train = [r for r in read_records(debug_run) if r["kind"] == "train"]
    evals = [r for r in read_records(debug_run) if r["kind"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, 21))
    for r in train:
        assert abs(r["lr"] - closed_form(cfg, r["step"] - 1)) <= 8 * 2**-23 * cfg.optim.peak_lr
        assert np.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["skipped"] == 0
    assert [r["step"] for r in evals] == [10, 20]
    assert all(0 <= r["val_acc"] <= 1 and r["val_loss"] > 0 for r in evals)
    line = (debug_run / "metrics.jsonl").read_text().splitlines()[0]
    assert json.loads(line)["loss"] == float(repr(json.loads(line)["loss"]))


def test_the_same_command_twice_gives_bit_identical_runs(debug_run, tmp_path):
    out = _cli(tmp_path, "--preset", "debug", "--optim.accum_steps", "2")
    assert out.returncode == 0, out.stderr
    a, b = (json.loads((d / "summary.json").read_text()) for d in (debug_run, tmp_path))
    assert a["state_digest"] == b["state_digest"]
    assert [r["loss"] for r in read_records(debug_run) if r["kind"] == "train"] == [
        r["loss"] for r in read_records(tmp_path) if r["kind"] == "train"
    ]


def test_a_second_run_loads_its_compiled_calls_and_gives_the_same_bits(debug_run, tmp_path):
    # --compile_cache is JAX's persistent compilation cache (jaxloop.runtime.compilation): the first run writes its
    # compiled calls (training and evaluation) there; the same command again finds every one (a miss would
    # write a new entry), says that it loaded the training call, and trains the same bits.
    cache = tmp_path / "cache"
    first = _cli(tmp_path / "a", "--preset", "debug", "--optim.accum_steps", "2", "--compile_cache", str(cache))
    assert first.returncode == 0, first.stderr
    assert "compiled in " in first.stderr and "loaded the compiled training call" not in first.stderr
    entries = sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file())
    assert len(entries) >= 2  # at least one training call and the evaluation
    second = _cli(tmp_path / "b", "--preset", "debug", "--optim.accum_steps", "2", "--compile_cache", str(cache))
    assert second.returncode == 0, second.stderr
    assert sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file()) == entries
    assert "loaded the compiled training call from the cache in " in second.stderr
    digests = [
        json.loads((d / "summary.json").read_text())["state_digest"]
        for d in (debug_run, tmp_path / "a", tmp_path / "b")
    ]
    assert digests[0] == digests[1] == digests[2]


def test_non_finite_data_stops_the_run_after_max_bad_steps(tmp_path):
    rng = np.random.default_rng(0)
    # Finite inputs at float32's edge (the loader refuses NaN): every forward pass overflows to inf/NaN.
    x = np.full((200, 8), 3e38, np.float32)
    np.savez(tmp_path / "nan.npz", x=x, y=rng.integers(0, 3, 200))
    out = _cli(
        tmp_path / "run",
        "--data.source",
        "npz",
        "--data.path",
        str(tmp_path / "nan.npz"),
        "--batch_size",
        "16",
        "--max_bad_steps",
        "5",
        "--log_every",
        "50",
    )
    assert out.returncode == 1, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert "5 consecutive updates were skipped" in last and "update 1" in last, last
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


@pytest.mark.slow
def test_default_run_reaches_95_percent_validation_accuracy(tmp_path):
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "jaxloop.train", "--log.progress", "off"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    wall = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr
    summary = json.loads((tmp_path / "runs" / "digits" / "summary.json").read_text())
    print(f"default run: val_acc {summary['final']['val_acc']:.4f} in {wall:.1f}s wall")
    assert summary["final"]["val_acc"] >= 0.95
