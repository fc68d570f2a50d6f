"""Sharded state (FSDP, issue 14): the (data, fsdp) mesh on forced host devices, in subprocesses.

Each case runs in a subprocess because the device count is fixed when jax starts. Several runs share
one subprocess where they can (`_main_runs` calls jaxloop.train.main once per argv), and every
subprocess compiles with XLA's CPU backend at optimization level 0: compiling the step is most of a
tiny run's time, and every run compared with another is compiled the same way.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxloop.rundir.records import read_records

ROOT = Path(__file__).resolve().parents[1]
TEXT = str(ROOT / "tests" / "data" / "tinyshakespeare_60k.txt")  # Tiny Shakespeare's first 60k characters

# A GPT small enough to compile in seconds whose matrices are still sharded (>= MIN_SHARD_SIZE elements).
# One update per call: a scanned call of several compiles slower here and the layouts' sums are the same.
GPT = (
    "--preset",
    "shakespeare",
    "--data.path",
    TEXT,
    "--steps",
    "4",
    "--batch_size",
    "8",
    "--updates_per_call",
    "1",
    "--model.context",
    "8",
    "--model.d_model",
    "64",
    "--model.n_layers",
    "1",
    "--model.n_heads",
    "2",
    "--log_every",
    "1",
    "--eval_every",
    "0",
    "--data.val_fraction",
    "0.01",
    "--data.eval_batch_size",
    "64",
    "--optim.warmup_steps",
    "1",
    "--optim.ema_decay",
    "0.9",
    "--log.progress",
    "off",
    "--log.no-report",
    "--log.no-tensorboard",
)
# The digits MLP, with matrices big enough to shard; compiles in a second or two.
MLP = (
    "--preset",
    "debug",
    "--updates_per_call",
    "1",
    "--model.hidden",
    "128",
    "128",
    "--optim.ema_decay",
    "0.9",
    "--log.progress",
    "off",
)
LAYOUTS = {
    "fsdp4": ("--distributed.fsdp", "4"),
    "fsdp2xdata2": ("--distributed.fsdp", "2"),
    "fsdp1": ("--distributed.fsdp", "1"),
}

FP32_REL_TOL = 1e-5
"""Logged fp32 losses of every layout agree with fsdp=1's to this relative difference (measured at most
1.2e-7, on the shipped 60k-character text and on the whole Tiny Shakespeare); only the order in which XLA
adds partial sums differs."""
FP64_REL_TOL = 4 * 2.0**-52
"""float64: four ulps (relative), where the order of XLA's partial sums still shows in the last bit: on the
60k-character text the tests ship, fsdp 4 and fsdp 2 x data 2 at K = 4 logged losses up to 2.3e-16 (one
ulp) from fsdp 1's; on the whole Tiny Shakespeare all were bit-identical (K = 1 and K = 4). The suite runs
K = 4 in float64, each GPT compile costing ~10 s here."""

MAIN_RUNS = r"""
import json, sys
from jaxloop.train import main
for argv in json.loads(sys.argv[1]):
    status = main(argv)
    if status:
        sys.exit(status)
"""


def _env(devices: int) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0",
    }


def _main_runs(devices: int, *argvs: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """jaxloop.train.main(argv) for each argv in turn, in one process with `devices` host devices."""
    out = subprocess.run(
        [sys.executable, "-c", MAIN_RUNS, json.dumps([list(a) for a in argvs])],
        cwd=ROOT,
        env=_env(devices),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_records(run_dir) if r["kind"] == "train"]


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _worst_rel(got: list[float], ref: list[float]) -> float:
    assert len(got) == len(ref) > 0
    return max(abs(a - b) / abs(b) for a, b in zip(got, ref))


# ----------------------------------------------------------------------------- the rule, on abstract shapes


def test_partition_rule_shards_the_largest_divisible_dimension_and_replicates_small_leaves():
    from jax.sharding import PartitionSpec as P

    from jaxloop.update.distributed import MIN_SHARD_SIZE, partition_spec

    assert partition_spec((65, 128), 4) == P(None, "fsdp")  # 65 does not divide: the next largest
    assert partition_spec((512, 128), 4) == P("fsdp")
    assert partition_spec((128, 128), 2) == P("fsdp")  # a tie: the first
    assert partition_spec((128, 384), 1) == P()  # fsdp = 1: replicated
    assert partition_spec((512,), 4, min_size=MIN_SHARD_SIZE) == P()  # a bias: small
    assert partition_spec((), 4) == P()
    assert partition_spec((4099, 3), 2) == P()  # nothing divisible


# ----------------------------------------------------------------------------- the step keeps the layout

PROBE = r"""
import json
import jax, numpy as np
from jaxloop.config.cli import parse_config
from jaxloop.update.distributed import create_sharded, make_mesh, pin_shardings, shard_batch, state_shardings
from jaxloop.model.builtin import make_model
from jaxloop.data.sources import load_splits, record_order
from jaxloop.loop.task import create_train_state
from jaxloop.update.step import train_step
cfg = parse_config(json.loads(__import__("sys").argv[1]), check_paths=False)
splits = load_splits(cfg)
mesh = make_mesh(cfg.distributed)
model = make_model(cfg.model, splits.num_classes, cfg.precision)
state = create_sharded(lambda: create_train_state(cfg, model, splits.example_x), mesh)
plain = create_train_state(cfg, model, splits.example_x)
wanted = jax.tree.leaves(state_shardings(state, mesh))
step = pin_shardings(train_step, state)
batch = shard_batch(splits.train.get(record_order(cfg, splits.num_train, 0, 1)[0]), mesh)
before = jax.tree.leaves(state)
facts = {
    "mesh": dict(mesh.shape),
    "same_values_as_unsharded_init": all(np.array_equal(np.asarray(a), np.asarray(b))
                                         for a, b in zip(before, jax.tree.leaves(plain))),
    "built_in_rule_layout": all(a.sharding == s for a, s in zip(before, wanted)),
    "sharded_leaves": sum(not a.sharding.is_fully_replicated for a in before),
    "batch_shards": sorted(s.data.shape[0] for s in batch["x"].addressable_shards),
}
for _ in range(2):
    new, metrics = step(state, batch)
    facts.setdefault("layout_kept", True)
    facts["layout_kept"] &= all(a.sharding == s for a, s in zip(jax.tree.leaves(new), wanted))
    facts.setdefault("donated", True)
    facts["donated"] &= all(a.is_deleted() for a in jax.tree.leaves(state))
    state = new
print(json.dumps(facts))
"""


def test_state_is_built_sharded_and_the_step_keeps_its_layout_and_donates():
    # Without pin_shardings, GSPMD's propagation returned some GPT leaves in another layout (measured):
    # the state would drift and not be donated into.
    argv = [*MLP, "--distributed.fsdp", "2", "--optim.accum_steps", "2", "--run_dir", "/nonexistent"]
    out = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(argv)],
        cwd=ROOT,
        env=_env(4),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    assert probe["mesh"] == {"data": 2, "fsdp": 2}
    assert probe["same_values_as_unsharded_init"]
    assert probe["built_in_rule_layout"]
    # 2 matrices (64 x 128, 128 x 128; not the 128 x 10 head) x (params, mu, nu, acc_grads, ema) = 10 sharded
    assert probe["sharded_leaves"] == 10
    assert probe["layout_kept"] and probe["donated"]
    assert probe["batch_shards"] == [8, 8, 8, 8]


# ----------------------------------------------------------------------------- same numbers


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    """GPT runs of every layout on 4 devices, K = 1 and 4 in fp32, K = 4 in fp64, all in one process:
    {precision: {(layout, K): run_dir}}."""
    base = tmp_path_factory.mktemp("layouts")
    dirs, argvs = {}, []
    for precision, ks in (("fp32", (1, 4)), ("fp64", (4,))):
        dirs[precision] = {}
        for k in ks:
            for name, flags in LAYOUTS.items():
                dirs[precision][name, k] = base / f"{precision}_{name}_k{k}"
                argvs.append(
                    [
                        *GPT,
                        "--precision",
                        precision,
                        "--optim.accum_steps",
                        str(k),
                        "--run_dir",
                        str(dirs[precision][name, k]),
                        *flags,
                    ]
                )
    _main_runs(4, *argvs, timeout=600)
    return dirs


@pytest.mark.slow  # 9 GPT runs, ~10 s of compiling each on 2 idle cores
@pytest.mark.parametrize("precision", ["fp32", "fp64"])
def test_every_layout_logs_the_same_losses(layout_runs, precision):
    # Same global batches, same init: the layouts differ only in how XLA splits the reductions (the
    # gradient's sum over the batch: an all-reduce for fsdp=1, a reduce-scatter for fsdp=4).
    dirs = layout_runs[precision]
    tol = FP32_REL_TOL if precision == "fp32" else FP64_REL_TOL
    report = {}
    for k in sorted({k for _, k in dirs}):
        ref = _losses(dirs["fsdp1", k])
        assert len(ref) == 4
        for name in ("fsdp4", "fsdp2xdata2"):
            report[f"{name} K={k}"] = worst = _worst_rel(_losses(dirs[name, k]), ref)
            assert worst <= tol, f"{precision} {name} K={k}: max relative loss difference {worst:.3g}"
            val = _summary(dirs[name, k])["final"]["val_loss"]
            assert abs(val - _summary(dirs["fsdp1", k])["final"]["val_loss"]) <= tol * abs(val)
    print(
        f"\n{precision} max relative loss difference vs fsdp=1:", ", ".join(f"{k} {v:.2g}" for k, v in report.items())
    )


# ----------------------------------------------------------------------------- memory


def test_per_device_state_bytes_shrink_with_fsdp():
    # The shakespeare preset's GPT with 2 of its 4 layers (docs/sharded-state.md's table has all 4); 4 devices.
    # the shipped slice of the text (the benchmark's default, the whole text, is not in a clone)
    text = ROOT / "tests" / "data" / "tinyshakespeare_60k.txt"
    out = subprocess.run(
        [sys.executable, "benchmarks/bench_memory.py", "--json", "--n_layers", "2", "--data.path", str(text)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": "--xla_backend_optimization_level=0"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rows = {r["fsdp"]: r for r in json.loads(out.stdout.strip().splitlines()[-1])}
    replicated = rows[1]["per_device_bytes"]
    assert rows[1]["total_bytes"] == replicated
    for n in (2, 4):
        row = rows[n]
        assert row["per_device_bytes"] <= replicated / n + row["replicated_bytes"], row
        assert row["per_device_bytes"] < replicated / n * 1.1  # small leaves are a few percent at most


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "flags, line",
    [
        (
            ("--distributed.fsdp", "3"),
            "distributed.fsdp=3 is not allowed: a divisor of the device count (4): one of 1, 2, 4",
        ),
        (
            ("--distributed.fsdp", "2", "--batch_size", "6"),
            "batch_size=6 is not allowed: a multiple of the device count (4)",
        ),
        (("--distributed.fsdp", "0"), "distributed.fsdp=0 is not allowed: an integer >= 1"),
    ],
)
def test_bad_layout_is_one_line_and_exit_2_and_nothing_written(tmp_path, flags, line):
    out = subprocess.run(
        [sys.executable, "-m", "jaxloop.train", "--preset", "debug", "--run_dir", str(tmp_path / "r"), *flags],
        cwd=ROOT,
        env=_env(4),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"jaxloop.train: error: {line}"]
    assert not (tmp_path / "r").exists()
