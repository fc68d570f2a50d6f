"""Hooks: research code's periodic actions inside jaxloop.run (jaxloop.Hook, jaxloop.loop.actions).

A small linear regression Task, 12 updates of 2 micro-batches; checkpoints every 4 updates, all kept.
"""

from __future__ import annotations

import json
from dataclasses import replace

import flax.linen as nn
import jax
import numpy as np
import orbax.checkpoint as ocp

import jaxloop
from jaxloop.config.run import CheckpointConfig, Config, LogConfig, OptimConfig
from jaxloop.config.schedules import WarmupCosineConfig
from jaxloop.loop.dispatch import Dispatcher
from jaxloop.rundir.records import read_records


class Lin(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        return nn.Dense(1)(x)[:, 0]


def _mse(model, batch, train):
    err = model(batch["x"]) - batch["y"]
    return jaxloop.weighted_mean(err**2, batch), {"mae": jaxloop.weighted_mean(abs(err), batch)}


def _task() -> jaxloop.Task:
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    records = [{"x": xi, "y": np.float32(np.sin(xi).sum())} for xi in x]
    return jaxloop.Task(Lin(), _mse, records, records[:16])


def _cfg(run_dir, **fields) -> Config:
    base = Config(
        run_dir=str(run_dir),
        steps=12,
        batch_size=16,
        log_every=1,
        eval_every=0,
        optim=OptimConfig(lr_schedule=WarmupCosineConfig(warmup_steps=1), peak_lr=1e-2, accum_steps=2),
        checkpoint=CheckpointConfig(every=4, keep_last=10),
        log=LogConfig(progress="off", report=False),
    )
    return replace(base, **fields)


def _checkpoint_params(run_dir, step: int):
    with ocp.StandardCheckpointer() as reader:
        return reader.restore((run_dir / "checkpoints" / str(step) / "state").resolve())["params"]


def test_a_hook_sees_the_state_of_exactly_its_update(tmp_path):
    # Hooks every 4 updates, where the run also saves: the params a hook is handed are the saved ones,
    # bit for bit, and the metrics are that update's train record.
    seen = {}

    def capture(info):
        seen[info.step] = (int(info.state.step), jax.device_get(info.state.params), dict(info.metrics))

    jaxloop.run(_cfg(tmp_path), _task(), hooks=[jaxloop.Hook(capture, every=4)])
    assert sorted(seen) == [4, 8, 12]
    train = {r["step"]: r for r in read_records(tmp_path) if r["kind"] == "train"}
    for step, (count, params, metrics) in seen.items():
        assert count == step, "the state's own update count"
        jax.tree.map(np.testing.assert_array_equal, params, _checkpoint_params(tmp_path, step))
        assert metrics["loss"] == train[step]["loss"] and metrics["lr"] == train[step]["lr"]


def test_a_hook_needing_the_state_ends_the_device_calls_on_its_updates(tmp_path, monkeypatch):
    calls = []
    dispatch = Dispatcher.dispatch
    monkeypatch.setattr(
        Dispatcher, "dispatch", lambda self, state, step, n: (calls.append(n), dispatch(self, state, step, n))[1]
    )
    jaxloop.run(
        _cfg(tmp_path / "a", checkpoint=CheckpointConfig(every=0)),
        _task(),
        hooks=[jaxloop.Hook(lambda info: None, every=3)],
    )
    assert calls == [3, 3, 3, 3]
    calls.clear()
    jaxloop.run(
        _cfg(tmp_path / "b", checkpoint=CheckpointConfig(every=0)),
        _task(),
        hooks=[jaxloop.Hook(lambda info: None, every=3, needs_state=False)],
    )
    assert calls == [12], "a hook reading only metrics cuts no call short (mutant: needs_state ignored -> [3]*4)"


def test_a_metrics_hook_is_called_at_each_of_its_updates_without_the_state(tmp_path):
    seen = []
    jaxloop.run(
        _cfg(tmp_path),
        _task(),
        hooks=[
            jaxloop.Hook(
                lambda info: seen.append((info.step, info.state, info.metrics["loss"])), every=5, needs_state=False
            )
        ],
    )
    train = {r["step"]: r["loss"] for r in read_records(tmp_path) if r["kind"] == "train"}
    assert seen == [(5, None, train[5]), (10, None, train[10]), (12, None, train[12])], "every 5, and at the end"


def test_resuming_neither_repeats_nor_skips_a_hook(tmp_path):
    # Session 1 is stopped by a hook at update 6 (saved there); session 2 resumes from 6 to 12. A state
    # hook every 4 and a metrics hook every 3 fire at each of their updates exactly once over both
    # sessions (and at each session's end).
    calls: list[tuple[str, int]] = []

    def hooks(stop_at: int | None):
        def stopper(info):
            if info.step == stop_at:
                info.stop("planned")

        return [
            jaxloop.Hook(lambda info: calls.append(("state", info.step)), every=4),
            jaxloop.Hook(lambda info: calls.append(("metrics", info.step)), every=3, needs_state=False),
            jaxloop.Hook(stopper, every=6),
        ]

    first = jaxloop.run(_cfg(tmp_path), _task(), hooks=hooks(stop_at=6))
    assert first["stop_reason"] == "planned" and first["final_step"] == 6
    assert 6 in [int(p.name) for p in (tmp_path / "checkpoints").iterdir()], "the stop is saved"
    second = jaxloop.run(_cfg(tmp_path), _task(), hooks=hooks(stop_at=None))
    assert second["final_step"] == 12
    state_steps = [s for kind, s in calls if kind == "state"]
    metric_steps = [s for kind, s in calls if kind == "metrics"]
    assert state_steps == [4, 6, 8, 12], "4, 8, 12 once each; 6 ended session 1"
    assert metric_steps == [3, 6, 9, 12]


def test_a_hook_logs_scalars_text_and_images_to_the_run(tmp_path):
    def report(info):
        info.log(weight_norm=float(np.linalg.norm(np.asarray(info.state.params["Dense_0"]["kernel"]))))
        info.log_text("note", f"update {info.step}")
        info.log_image("ramp", np.linspace(0, 1, 12).reshape(3, 4))

    jaxloop.run(
        _cfg(tmp_path, log=LogConfig(progress="off", report=False, tensorboard=True)),
        _task(),
        hooks=[jaxloop.Hook(report, every=6)],
    )
    hooks = [r for r in read_records(tmp_path) if r["kind"] == "hook"]
    assert [(r["step"], sorted(k for k in r if k not in ("kind", "step"))) for r in hooks] == [
        (6, ["weight_norm"]),
        (6, ["note"]),
        (6, ["ramp"]),
        (12, ["weight_norm"]),
        (12, ["note"]),
        (12, ["ramp"]),
    ]
    assert (tmp_path / hooks[2]["ramp"]).is_file() and hooks[2]["ramp"] == "hooks/ramp-6.png"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "images": 0}).Reload()
    assert [e.step for e in events.Scalars("hook/weight_norm")] == [6, 12]
    assert [e.step for e in events.Images("hook/ramp")] == [6, 12]


def test_a_hook_stops_the_run_with_a_save_and_its_reason(tmp_path):
    summary = jaxloop.run(
        _cfg(tmp_path), _task(), hooks=[jaxloop.Hook(lambda info: info.stop("loss small enough"), every=5)]
    )
    assert summary["stop_reason"] == "loss small enough" and summary["final_step"] == 5
    saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == [4, 5]
    assert json.loads((tmp_path / "summary.json").read_text())["stop_reason"] == "loss small enough"


def test_an_nnx_model_reaches_the_hook_as_the_module():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(4, 1, rngs=rngs)

        def __call__(self, x):
            return self.dense(x)[:, 0]

    def loss(model, batch, train):
        return jaxloop.weighted_mean((model(batch["x"]) - batch["y"]) ** 2, batch), {}

    task = _task()
    modules = []
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        jaxloop.run(
            _cfg(tmp, steps=4),
            jaxloop.Task(Net(nnx.Rngs(0)), loss, task.train, task.val),
            hooks=[jaxloop.Hook(lambda info: modules.append(info.model), every=4)],
        )
    assert len(modules) == 1 and isinstance(modules[0], nnx.Module)
    assert modules[0].dense.kernel.value.shape == (4, 1)


def test_a_hook_is_handed_the_evaluation_of_its_update(tmp_path):
    # Evaluation every 4 updates runs before the hooks of that update: a hook every 2 has it in
    # info.evaluation at 4, 8, 12 (the eval records' values) and None between.
    seen = {}
    jaxloop.run(
        _cfg(tmp_path, eval_every=4),
        _task(),
        hooks=[jaxloop.Hook(lambda info: seen.__setitem__(info.step, info.evaluation), every=2)],
    )
    evals = {
        r["step"]: {k: r[k] for k in ("val_loss", "val_mae")} for r in read_records(tmp_path) if r["kind"] == "eval"
    }
    assert sorted(evals) == [4, 8, 12]
    assert seen == {2: None, 4: evals[4], 6: None, 8: evals[8], 10: None, 12: evals[12]}
