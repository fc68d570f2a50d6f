"""A researcher's own model through the whole loop: jaxloop.run(cfg, Task(...)) with a Flax Linen or NNX
model, checkpoints, a SIGKILL of a real process and a bit-identical resume, and the model loaded back.

The two snippets of docs/your-model.md ("Your own Linen model", "Your own NNX model") are the programs under test.
"""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from docs_blocks import env, in_section

import jaxloop
from jaxloop.config.run import CheckpointConfig, Config, LogConfig, OptimConfig
from jaxloop.config.schedules import WarmupCosineConfig
from jaxloop.rundir.records import read_records

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "your-model.md"
SNIPPETS = {"linen": "Your own Linen model", "nnx": "Your own NNX model"}


def snippet(kind: str) -> str:
    return in_section(PAGE, SNIPPETS[kind]).body


def run_snippet(kind: str, cwd: Path) -> subprocess.Popen:
    """The snippet as its own program, in the environment of the docs' blocks (tests/docs_blocks.py), as a
    process this test may kill."""
    (cwd / f"{kind}.py").write_text(snippet(kind))
    return subprocess.Popen(
        [sys.executable, f"{kind}.py"], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env()
    )


@pytest.fixture(scope="module", params=["linen", "nnx"])
def uninterrupted(request, tmp_path_factory):
    """The snippet run to the end: (kind, its run_dir, its printed line). In this process (the reference needs no
    process of its own: the killed and the resumed runs below are real processes, compared with it bit for bit)."""
    kind, cwd = request.param, tmp_path_factory.mktemp(request.param)
    (cwd / f"{kind}.py").write_text(snippet(kind))
    out = io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        runpy.run_path(f"{kind}.py", run_name="__main__")
    return kind, cwd / "runs" / kind, out.getvalue().split()


def test_snippet_is_at_most_25_lines_and_learns_the_regression(uninterrupted):
    kind, _, printed = uninterrupted
    assert len(snippet(kind).strip().splitlines()) <= 25
    # y = sum(sin(x_i)) over 4 N(0,1) inputs has variance ~1.7, the MSE of predicting 0 at init.
    assert int(printed[0]) == 300 and float(printed[1]) < 0.05, printed


def test_snippet_run_writes_checkpoints_and_metrics(uninterrupted):
    _, run_dir, _ = uninterrupted
    kept = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert kept[-1] == 300 and len(kept) >= 2
    evals = [r for r in read_records(run_dir) if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [100, 200, 300]


def test_sigkilled_snippet_resumes_bit_identically(uninterrupted, tmp_path):
    kind, ref_dir, printed = uninterrupted
    proc = run_snippet(kind, tmp_path)
    run_dir = tmp_path / "runs" / kind
    deadline = time.monotonic() + 300
    # kill at the first committed checkpoint (update 50): 250 updates before the run could end by itself
    while not any(p.name.isdigit() and int(p.name) >= 50 for p in _entries(run_dir / "checkpoints")):
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run_dir / "summary.json").exists(), "killed before the end"
    resumed = run_snippet(kind, tmp_path)
    out, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    resumes = [json.loads(line) for line in (run_dir / "resumes.jsonl").read_text().splitlines()]
    assert resumes and resumes[0]["step"] >= 50, "the second process resumed from a checkpoint"
    digest = lambda d: json.loads((d / "summary.json").read_text())["state_digest"]
    assert digest(run_dir) == digest(ref_dir)
    assert out.split() == printed, "same final validation loss, to the last digit"


def _entries(path: Path) -> list[Path]:
    return list(path.iterdir()) if path.is_dir() else []


# ----------------------------------------------------------------------------- in-process behaviours


def _records(n: int = 256, seed: int = 0) -> list[dict]:
    x = np.random.default_rng(seed).normal(size=(n, 4)).astype(np.float32)
    return [{"x": xi, "y": np.float32(np.sin(xi).sum())} for xi in x]


def _cfg(run_dir: Path, **fields) -> Config:
    base = Config(
        run_dir=str(run_dir),
        steps=6,
        batch_size=16,
        eval_every=3,
        log_every=3,
        optim=OptimConfig(lr_schedule=WarmupCosineConfig(warmup_steps=1), peak_lr=1e-2),
        checkpoint=CheckpointConfig(every=3),
        log=LogConfig(progress="off", report=False, tensorboard=False),
    )
    return replace(base, **fields)


class NormNet(nn.Module):
    """A Linen model with a mutable collection (batch_stats)."""

    @nn.compact
    def __call__(self, x, train=False):
        return nn.Dense(1)(nn.BatchNorm(use_running_average=not train)(x))[:, 0]


def _mse(model, batch, train):
    return jaxloop.weighted_mean((model(batch["x"], train=train) - batch["y"]) ** 2, batch), {}


def test_linen_batch_stats_are_trained_checkpointed_and_loaded_back(tmp_path):
    records = _records()
    summary = jaxloop.run(_cfg(tmp_path), jaxloop.Task(NormNet(), _mse, train=records[:192], val=records[192:]))
    assert summary["final_step"] == 6
    variables = jaxloop.load_model(tmp_path, NormNet(), which="latest")
    mean = np.asarray(variables["batch_stats"]["BatchNorm_0"]["mean"])
    assert np.abs(mean).max() > 0, "the running mean moved from its zero init while training"
    assert set(variables) == {"params", "batch_stats"}


def test_a_users_task_fills_the_compile_cache_too(tmp_path):
    # --compile_cache is JAX's persistent cache, keyed by the traced code: a user's model and loss are cached
    # as the built-in ones are, so their next run loads its compiled calls.
    records = _records()
    jaxloop.run(
        _cfg(tmp_path / "run", compile_cache=str(tmp_path / "cache")),
        jaxloop.Task(NormNet(), _mse, train=records[:192], val=records[192:]),
    )
    assert any(p.is_file() for p in (tmp_path / "cache").iterdir())


def test_eval_metrics_are_logged_as_val_metrics(tmp_path):
    records = _records()
    metrics = lambda model, batch: {"mae": jaxloop.weighted_mean(jnp.abs(model(batch["x"]) - batch["y"]), batch)}

    class Lin(nn.Module):
        @nn.compact
        def __call__(self, x, train=False):
            return nn.Dense(1)(x)[:, 0]

    def loss(model, batch, train):
        return jaxloop.weighted_mean((model(batch["x"]) - batch["y"]) ** 2, batch), {}

    summary = jaxloop.run(_cfg(tmp_path), jaxloop.Task(Lin(), loss, records[:192], records[192:], eval_metrics=metrics))
    assert set(summary["final"]) == {"val_loss", "val_mae"}
    assert summary["final"]["val_mae"] ** 2 <= summary["final"]["val_loss"] + 1e-6, "Jensen: mean|e|^2 <= mean e^2"


def test_a_best_metric_the_task_does_not_report_is_a_config_error(tmp_path):
    records = _records()
    cfg = _cfg(tmp_path, checkpoint=CheckpointConfig(every=3, best_metric="val_acc", best_mode="max"))

    class Lin(nn.Module):
        @nn.compact
        def __call__(self, x, train=False):
            return nn.Dense(1)(x)[:, 0]

    with pytest.raises(jaxloop.ConfigError, match="checkpoint.best_metric='val_acc'.*val_loss"):
        jaxloop.run(cfg, jaxloop.Task(Lin(), _mse, records[:192], records[192:]))


@pytest.mark.parametrize(
    "section, changes, named",
    [
        ("model", dict(d_model=256), r"model.d_model=256 is not allowed: the digits preset's 128: only the built-in"),
        ("model", dict(kind="gpt"), r"model.kind='gpt' is not allowed: the digits preset's 'mlp'"),
        ("data", dict(val_fraction=0.3), r"data.val_fraction=0.3 is not allowed: the digits preset's 0.2"),
    ],
)
def test_a_users_task_run_refuses_a_builtin_task_field_it_would_ignore(tmp_path, section, changes, named):
    """model.* and data.source/path/val_fraction are the built-in task's: the Task's model and records replace
    them, so a run of a Task of one's own refuses them set away from the preset's, naming the field, before
    anything is written. Mutant (jaxloop.run without check_builtin_fields): each case trains instead, seen."""
    records = _records()
    cfg = _cfg(tmp_path / "run")
    cfg = replace(cfg, **{section: replace(getattr(cfg, section), **changes)})
    with pytest.raises(jaxloop.ConfigError, match=named + r".*a Task of its own"):
        jaxloop.run(cfg, jaxloop.Task(NormNet(), _mse, train=records[:192], val=records[192:]))
    assert not (tmp_path / "run").exists()


def test_a_users_task_run_of_a_text_preset_needs_no_data_path(tmp_path):
    """The shakespeare preset's optimizer for one's own Task: its data.source is text, yet the run reads no
    file, so data.path stays empty. Mutant (validate(builtin_task=True) for every run): refused, seen."""
    records = _records()
    text = jaxloop.preset("shakespeare")
    cfg = replace(_cfg(tmp_path), preset="shakespeare", model=text.model, data=text.data)
    assert cfg.data.source == "text" and cfg.data.path == ""
    summary = jaxloop.run(cfg, jaxloop.Task(NormNet(), _mse, train=records[:192], val=records[192:]))
    assert summary["final_step"] == 6


def test_validation_is_exact_over_a_padded_last_batch(tmp_path):
    # 64 validation records in batches of 48: the second batch holds 16 records and 32 of padding
    # (weight 0). The loop's val_loss equals the plain mean over the 64 records (float32 sums: 1e-6).
    records = _records()
    cfg = _cfg(tmp_path, data=replace(Config().data, eval_batch_size=48))

    class Lin(nn.Module):
        @nn.compact
        def __call__(self, x, train=False):
            return nn.Dense(1)(x)[:, 0]

    summary = jaxloop.run(cfg, jaxloop.Task(Lin(), _mse, records[:192], records[192:]))
    variables = jaxloop.load_model(tmp_path, Lin(), which="latest")
    x = np.stack([r["x"] for r in records[192:]])
    y = np.stack([r["y"] for r in records[192:]])
    # one program (op by op it compiled six)
    direct = float(jax.jit(lambda v, x, y: jnp.mean((Lin().apply(v, x) - y) ** 2))(variables, x, y))
    assert summary["final"]["val_loss"] == pytest.approx(direct, rel=1e-6)


def test_nnx_model_loads_back_as_a_module_equal_to_the_trained_state(tmp_path):
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 1, rngs=rngs)

        def __call__(self, x):
            return self.lin(x)[:, 0]

    def loss(model, batch, train):
        return jaxloop.weighted_mean((model(batch["x"]) - batch["y"]) ** 2, batch), {}

    records = _records()
    trained = Net(nnx.Rngs(0))
    before = np.asarray(trained.lin.kernel.value).copy()
    jaxloop.run(_cfg(tmp_path), jaxloop.Task(trained, loss, records[:192], records[192:]))
    np.testing.assert_array_equal(np.asarray(trained.lin.kernel.value), before)  # run() does not mutate it
    loaded = jaxloop.load_model(tmp_path, Net(nnx.Rngs(7)), which="latest")
    assert not np.array_equal(np.asarray(loaded.lin.kernel.value), before), "trained weights, not the init"
    x = np.stack([r["x"] for r in records[192:]])
    y = np.stack([r["y"] for r in records[192:]])
    val = json.loads((tmp_path / "summary.json").read_text())["final"]["val_loss"]
    mse = nnx.jit(lambda model, x, y: jnp.mean((model(x) - y) ** 2))  # one program (op by op it compiled six)
    assert float(mse(loaded, x, y)) == pytest.approx(val, rel=1e-6)
