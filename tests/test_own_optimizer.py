"""A Task's own optimizer: `jaxloop.Task(..., optimizer=tx)` with any optax GradientTransformation (here
optax.adafactor) or a factory given jaxloop's schedule trains through `jaxloop.run` under the loop's
clipping, accumulation and non-finite skip, checkpoints and resumes bit for bit, and logs its rate where
optax.inject_hyperparams keeps one; config fields it does not read are refused."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import flax.linen as nn
import numpy as np
import optax
import pytest

import jaxloop
from jaxloop.config.optimizers import AdamWConfig, SGDConfig
from jaxloop.config.run import CheckpointConfig, Config, ConfigError, LogConfig, OptimConfig
from jaxloop.config.schedules import PlateauConfig, StepConfig, WarmupCosineConfig
from jaxloop.rundir.records import read_records
from jaxloop.update.schedules import rates


class Linear(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        return nn.Dense(1)(nn.gelu(nn.Dense(16)(x)))[:, 0]


def _mse(model, batch, train):
    return jaxloop.weighted_mean((model(batch["x"], train=train) - batch["y"]) ** 2, batch), {}


def _task(optimizer) -> jaxloop.Task:
    x = np.random.default_rng(0).normal(size=(256, 4)).astype(np.float32)
    records = [{"x": xi, "y": np.float32(np.sin(xi).sum())} for xi in x]
    return jaxloop.Task(Linear(), _mse, train=records[:192], val=records[192:], optimizer=optimizer)


def _cfg(run_dir: Path, **optim) -> Config:
    return Config(
        run_dir=str(run_dir),
        steps=24,
        batch_size=16,
        eval_every=6,
        log_every=1,
        optim=replace(
            OptimConfig(lr_schedule=WarmupCosineConfig(warmup_steps=4), clip_norm=0.5, accum_steps=2), **optim
        ),
        checkpoint=CheckpointConfig(every=6, keep_last=10, keep_best=0),
        log=LogConfig(progress="off", report=False, tensorboard=False),
    )


def _factory(lr):
    """adafactor with jaxloop's schedule, its rate kept in the state (min_dim_size_to_factor is a shape rule,
    not a number to inject)."""
    return optax.inject_hyperparams(optax.adafactor, static_args="min_dim_size_to_factor")(learning_rate=lr)


def _resumed_digest(cfg: Config, optimizer, tmp_path: Path, at: int) -> str:
    """Resume a copy of the finished run's directory as a SIGKILL right after the checkpoint at `at` left it."""
    to = tmp_path / "resumed"
    shutil.copytree(cfg.run_dir, to)
    for ckpt in (to / "checkpoints").iterdir():
        if ckpt.name.isdigit() and int(ckpt.name) > at:
            shutil.rmtree(ckpt)
    return jaxloop.run(replace(cfg, run_dir=str(to), resume="must"), _task(optimizer))["state_digest"]


@pytest.mark.parametrize("kind", ["transformation", "factory"])
def test_an_own_optimizer_trains_under_the_loops_wrapping_and_resumes_exactly(kind, tmp_path):
    optimizer = optax.adafactor(1e-2) if kind == "transformation" else _factory
    # a factory reads the schedule's fields; a transformation has its own rate (the warmup fields, checked
    # against steps for every run, are free)
    cfg = _cfg(tmp_path / "run", **({} if kind == "transformation" else dict(peak_lr=1e-2)))
    summary = jaxloop.run(cfg, _task(optimizer))
    train = [r for r in read_records(cfg.run_dir) if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 25)), "one update per accum_steps = 2 micro-batches"
    loss = [r["loss"] for r in train]
    assert np.mean(loss[-6:]) < 0.8 * np.mean(loss[:6]), "it learns"
    assert all(r["grad_norm"] > 0 for r in train), "the loop's record_grad_norm and clipping wrap it"
    assert _resumed_digest(cfg, optimizer, tmp_path, 12) == summary["state_digest"]
    if kind == "factory":  # inject_hyperparams keeps the rate: the logged lr is jaxloop's schedule, in float32
        want = [float(np.float32(r)) for r in rates(cfg.optim, cfg.steps)[:24]]
        assert [r["lr"] for r in train] == want
    else:
        assert all("lr" not in r for r in train), "no rate is kept by plain adafactor: none is logged"


def test_an_own_optimizer_update_that_is_not_finite_is_skipped(tmp_path):
    cfg = replace(_cfg(tmp_path / "run"), steps=6, eval_every=3, checkpoint=CheckpointConfig(every=3, keep_best=0))
    blow_up = optax.chain(optax.adafactor(1e-2), optax.scale(np.float32(np.inf)))
    with pytest.raises(Exception, match="consecutive updates were skipped"):
        jaxloop.run(replace(cfg, max_bad_steps=3), _task(blow_up))


@pytest.mark.parametrize(
    "optimizer,changes,field",
    [
        (optax.adafactor(1e-2), dict(optimizer=SGDConfig()), "optim.name"),
        (_factory, dict(optimizer=AdamWConfig(b1=0.8)), "optim.b1"),
        (optax.adafactor(1e-2), dict(lr_schedule=StepConfig(warmup_steps=4, step_size=10)), "optim.schedule"),
        (optax.adafactor(1e-2), dict(peak_lr=1e-2), "optim.peak_lr"),
        (_factory, dict(lr_schedule=PlateauConfig()), "optim.schedule"),  # (PlateauConfig holds no warmup fields)
    ],
)
def test_config_fields_an_own_optimizer_does_not_read_are_refused(optimizer, changes, field, tmp_path):
    cfg = _cfg(tmp_path / "run")
    cfg = replace(cfg, optim=replace(cfg.optim, **changes))
    with pytest.raises(ConfigError) as e:
        jaxloop.run(cfg, _task(optimizer))
    assert e.value.field_path == field
    assert not (tmp_path / "run").exists(), "refused before anything is written"


def test_a_factory_reads_the_schedule_fields(tmp_path):
    cfg = replace(_cfg(tmp_path / "run"), steps=4, eval_every=2, checkpoint=CheckpointConfig(every=2, keep_best=0))
    cfg = replace(cfg, optim=replace(cfg.optim, lr_schedule=StepConfig(warmup_steps=0, step_size=1, gamma=0.5)))
    jaxloop.run(cfg, _task(_factory))
    lrs = [r["lr"] for r in read_records(cfg.run_dir) if r["kind"] == "train"]
    assert lrs == [float(np.float32(3e-3 * 0.5**i)) for i in range(4)]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["optim"]["lr_schedule"]["name"] == "step"
