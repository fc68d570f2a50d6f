"""The memory plan (jaxloop.update.memory_plan): split micro-batches and rematerialisation keep the update; the fit check
re-plans before the first update; an out-of-memory error at run time reloads the last checkpoint and goes on
(a real process, the error injected at update k as jaxlib raises it)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

import jaxloop
from jaxloop.checkpoint.manager import read_checkpoint
from jaxloop.config.run import Config, ConfigError, MemoryConfig, ModelConfig, OptimConfig, preset, replace
from jaxloop.config.schedules import WarmupCosineConfig
from jaxloop.data.sources import record_order
from jaxloop.loop.task import builtin_task, create_train_state, run_state
from jaxloop.model.builtin import make_model
from jaxloop.rundir.records import read_records
from jaxloop.update.distributed import create_sharded, make_mesh, pin_shardings, shard_batch
from jaxloop.update.memory_plan import Footprint, candidates, check_plan, supports_blocks
from jaxloop.update.step import cross_entropy_loss, make_train_step, scan_steps


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def _relative(a, b) -> float:
    """||a - b|| / ||b|| of one tensor (the parity suite's measure for parameters)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _mlp_batches(n: int, batch: int = 16, features: int = 12, classes: int = 5) -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(batch, features)).astype(np.float32),
            "y": rng.integers(0, classes, size=batch).astype(np.int32),
        }
        for _ in range(n)
    ]


def _mlp_state(cfg: Config, features: int = 12, classes: int = 5):
    return create_train_state(cfg, make_model(cfg.model, classes, cfg.precision), np.zeros((1, features), np.float32))


MLP_CFG = Config(
    steps=10,
    batch_size=16,
    optim=OptimConfig(lr_schedule=WarmupCosineConfig(warmup_steps=2), peak_lr=1e-2),
    model=ModelConfig(hidden=(32, 32)),
)


def _run_steps(cfg: Config, memory: MemoryConfig | None, batches: list[dict], state=None):
    step = jax.jit(make_train_step(cross_entropy_loss, memory))
    state = state if state is not None else _mlp_state(cfg)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return state, losses


@pytest.mark.parametrize("split", [2, 4, 16])
def test_a_micro_batch_split_into_sub_batches_gives_the_same_updates(split):
    # The mean of `split` sub-batch mean gradients is the batch's mean gradient: only float32 summation
    # order differs, ~1e-7 relative per element; 5 AdamW updates keep the params within 2e-6 relative
    # (mutant seen failing: the sub-batch gradients summed instead of averaged).
    batches = _mlp_batches(5)
    whole, whole_losses = _run_steps(MLP_CFG, None, batches)
    parts, part_losses = _run_steps(MLP_CFG, MemoryConfig(split=split), batches)
    np.testing.assert_allclose(part_losses, whole_losses, rtol=1e-6)
    worst = max(
        _relative(a, b) for a, b in zip(jax.tree.leaves(_host(parts.params)), jax.tree.leaves(_host(whole.params)))
    )
    assert worst < 2e-6, worst
    assert int(parts.step) == int(whole.step) == 5


def test_split_keeps_the_plain_step_when_it_is_1():
    # split 1 (the default plan) is the plain step, bit for bit: no scan, no averaging
    batches = _mlp_batches(3)
    a, _ = _run_steps(MLP_CFG, None, batches)
    b, _ = _run_steps(MLP_CFG, MemoryConfig(split=1), batches)
    jax.tree.map(np.testing.assert_array_equal, _host(a.params), _host(b.params))


class NnxMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.a, self.b = nnx.Linear(12, 32, rngs=rngs), nnx.Linear(32, 5, rngs=rngs)

    def __call__(self, x, train: bool = False):
        return self.b(jax.nn.gelu(self.a(x)))


def _task_state(model):
    records = [{"x": np.zeros(12, np.float32), "y": np.int32(0)}]
    task = jaxloop.Task(model=model, loss=cross_entropy_loss, train=records, val=records)
    return task, run_state(MLP_CFG, task)


@pytest.mark.parametrize("remat", ["dots_saveable", "full"])
@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_a_checkpoint_policy_around_the_loss_keeps_the_update_of_any_task(remat, kind):
    # jax.checkpoint recomputes the same forward pass in the backward one: the same float32 update up
    # to XLA's fusion choices (2e-6 relative after 3 updates)
    model = NnxMLP(nnx.Rngs(0)) if kind == "nnx" else make_model(ModelConfig(hidden=(32,)), 5)
    batches = _mlp_batches(3)
    _, plain = _task_state(model)
    plain, _ = _run_steps(MLP_CFG, None, batches, plain)
    _, state = _task_state(NnxMLP(nnx.Rngs(0)) if kind == "nnx" else model)
    state, _ = _run_steps(MLP_CFG, MemoryConfig(remat=remat), batches, state)
    worst = max(
        _relative(a, b) for a, b in zip(jax.tree.leaves(_host(state.params)), jax.tree.leaves(_host(plain.params)))
    )
    assert worst < 2e-6, worst


def _gpt_cfg(**memory) -> Config:
    base = preset("shakespeare")
    return replace(
        base,
        batch_size=8,
        steps=10,
        model=replace(base.model, context=16, d_model=16, n_layers=2, n_heads=2),
        optim=replace(base.optim, lr_schedule=replace(base.optim.lr_schedule, warmup_steps=2)),
        memory=MemoryConfig(**memory),
    )


def _gpt_updates(cfg: Config) -> tuple[float, float, dict]:
    """Loss and gradient norm of the last update, and the params after it, of the loop's first call (4 updates
    in one scan, as _footprint compiles it: the plain plan's program is the fit test's) under cfg.memory."""
    call, state, chunk = _loop_call(cfg)
    state, m = call(state, chunk)
    return float(m["loss"][-1]), float(m["grad_norm"][-1]), _host(state.params)


@pytest.fixture(scope="module")
def gpt_plain(tmp_path_factory, text_file):
    return _gpt_updates(_gpt_run_cfg(tmp_path_factory.mktemp("plain"), text_file))


@pytest.mark.parametrize(
    "memory", [dict(remat="blocks"), dict(remat="dots_saveable"), dict(split=2), dict(split=2, remat="blocks")]
)
def test_the_gpt_under_another_plan_computes_the_same_update(gpt_plain, tmp_path, text_file, memory):
    # Loss and gradient norm to 1e-6; params but the attention's qkv bias to 1e-5: the key bias is a null
    # direction (its exact gradient is 0, see PARITY.md), where Adam turns rounding noise into a step.
    loss_a, norm_a, params_a = gpt_plain
    loss_b, norm_b, params_b = _gpt_updates(_gpt_run_cfg(tmp_path, text_file, **memory))
    assert loss_b == pytest.approx(loss_a, rel=1e-6) and norm_b == pytest.approx(norm_a, rel=1e-6)
    flat_a = jax.tree_util.tree_flatten_with_path(params_a)[0]
    for (path, a), b in zip(flat_a, jax.tree.leaves(params_b)):
        if "qkv" in jax.tree_util.keystr(path) and "bias" in jax.tree_util.keystr(path):
            continue
        assert _relative(b, a) < 1e-5, jax.tree_util.keystr(path)


def test_remat_blocks_needs_a_model_that_can_rematerialise_its_blocks(tmp_path):
    assert supports_blocks(make_model(_gpt_cfg().model, 11))
    assert not supports_blocks(make_model(ModelConfig(hidden=(8,)), 3)), "the MLP has no blocks"
    assert not supports_blocks(NnxMLP(nnx.Rngs(0)))
    with pytest.raises(ConfigError, match=r"memory.remat='blocks' is not allowed: .*remat: bool"):
        check_plan(MemoryConfig(remat="blocks"), 16, NnxMLP(nnx.Rngs(0)))
    # through run(): refused before anything is written
    records = [{"x": np.zeros(12, np.float32), "y": np.int32(i % 5)} for i in range(32)]
    cfg = replace(preset("debug"), run_dir=str(tmp_path / "run"), batch_size=16, memory=MemoryConfig(remat="blocks"))
    with pytest.raises(ConfigError, match="memory.remat"):
        jaxloop.run(cfg, jaxloop.Task(NnxMLP(nnx.Rngs(0)), cross_entropy_loss, records, records))
    assert not (tmp_path / "run").exists()


def test_re_planning_tries_splits_then_each_later_remat():
    plans = [(p.split, p.remat) for p in candidates(MemoryConfig(), batch_size=8, blocks=True)]
    assert plans == [
        (2, "none"),
        (4, "none"),
        (8, "none"),
        (1, "blocks"),
        (2, "blocks"),
        (4, "blocks"),
        (8, "blocks"),
        (1, "dots_saveable"),
        (2, "dots_saveable"),
        (4, "dots_saveable"),
        (8, "dots_saveable"),
        (1, "full"),
        (2, "full"),
        (4, "full"),
        (8, "full"),
    ]
    assert [(p.split, p.remat) for p in candidates(MemoryConfig(split=4, remat="dots_saveable"), 8, blocks=False)] == [
        (8, "dots_saveable"),
        (4, "full"),
        (8, "full"),
    ]
    assert candidates(MemoryConfig(split=8, remat="full"), 8, blocks=True) == []
    with pytest.raises(ConfigError, match=r"memory.split=3 is not allowed: a divisor of the 8 rows"):
        check_plan(MemoryConfig(split=3), 8, None)


def test_a_plan_is_resume_safe():
    # the same math computed another way, so a resume may change it
    from jaxloop.config.run import resume_conflicts, to_dict

    cfg = preset("debug")
    for memory in (MemoryConfig(split=2), MemoryConfig(remat="full"), MemoryConfig(budget=1 << 30, auto_fit=False)):
        assert resume_conflicts(to_dict(cfg), replace(cfg, memory=memory)) == []


# ----------------------------------------------------------------------------- the fit check in a run


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    words = "to be or not that is the question whether tis nobler in mind suffer slings arrows".split()
    path = tmp_path_factory.mktemp("text") / "tiny.txt"
    path.write_text("\n".join(" ".join(rng.choice(words, size=8)) for _ in range(300)) + "\n")
    return path


def _gpt_run_cfg(run_dir: Path, text: Path, **memory) -> Config:
    cfg = _gpt_cfg(**memory)
    return replace(
        cfg,
        run_dir=str(run_dir),
        steps=8,
        eval_every=4,
        log_every=1,
        updates_per_call=4,
        compile_cache="",
        data=replace(cfg.data, path=str(text), eval_batch_size=64),
        checkpoint=replace(cfg.checkpoint, every=4),
        log=replace(cfg.log, progress="off", report=False),
    )


def _loop_call(cfg: Config) -> tuple:
    """The loop's call (cfg.updates_per_call updates of K micro-batches) under cfg.memory, jitted, with its fresh
    state and first chunk: the program the run compiles (its state and chunk placed on the run's mesh, the state
    pinned and donated, as jaxloop.loop.dispatch does), so a run of the same plan loads it from the session's
    compilation cache."""
    task = builtin_task(cfg)
    splits = task.splits()
    mesh = make_mesh(cfg.distributed)
    state = create_sharded(lambda: run_state(cfg, task, splits), mesh)
    n = cfg.updates_per_call * cfg.optim.accum_steps
    batch = splits.train.get(record_order(cfg, splits.num_train, 0, n).reshape(-1))
    chunk = shard_batch({k: v.reshape((n, cfg.batch_size) + v.shape[1:]) for k, v in batch.items()}, mesh, stacked=True)
    return pin_shardings(scan_steps(make_train_step(task.loss, cfg.memory)), state, donate=True), state, chunk


def _footprint(cfg: Config) -> Footprint:
    """The footprint of the loop's call under cfg.memory (_loop_call)."""
    call, state, chunk = _loop_call(cfg)
    return Footprint.of(call.lower(state, chunk).compile())


def test_an_update_over_the_budget_is_re_planned_before_the_first_update(tmp_path, text_file, capsys):
    one, two = (_footprint(_gpt_run_cfg(tmp_path, text_file, split=s)) for s in (1, 2))
    assert two.total < one.total, "splitting in two halves the activations alive at once"
    budget = (one.total + two.total) // 2
    summary = jaxloop.run(_gpt_run_cfg(tmp_path / "fit", text_file, budget=budget))
    err = capsys.readouterr().err
    assert "re-planned to split 2, remat none" in err and "of memory.budget (plan: split 1, remat none)" in err
    assert summary["memory"]["plan"] == {"split": 2, "remat": "none"}
    assert summary["memory"]["footprint"]["total"] <= budget
    (replan,) = summary["memory"]["replans"]
    assert replan["reason"] == "fit" and replan["at_update"] == 0 and replan["bytes_after"] <= budget
    metadata = json.loads((tmp_path / "fit" / "metadata.json").read_text())
    assert metadata["memory"]["plan"] == {"split": 2, "remat": "none"}
    assert json.loads((tmp_path / "fit" / "config.json").read_text())["memory"]["split"] == 1, "the config as given"
    # the same training: every update's loss as the plain run's, to the fp32 trajectory tolerance
    plain = jaxloop.run(_gpt_run_cfg(tmp_path / "plain", text_file))
    assert plain["memory"]["plan"] == {"split": 1, "remat": "none"} and plain["memory"]["replans"] == []
    losses = [[r["loss"] for r in read_records(tmp_path / d) if r["kind"] == "train"] for d in ("fit", "plain")]
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)


def test_auto_fit_off_says_the_update_does_not_fit_and_goes_on(tmp_path, text_file, capsys):
    summary = jaxloop.run(_gpt_run_cfg(tmp_path, text_file, budget=1024, auto_fit=False))
    assert "memory.auto_fit is off: going on with this plan" in capsys.readouterr().err
    assert summary["memory"]["plan"] == {"split": 1, "remat": "none"} and summary["final_step"] == 8


def test_an_update_no_plan_fits_stops_with_the_numbers_and_exit_status_4(tmp_path, capsys):
    from jaxloop.train import main

    argv = [
        "--preset",
        "debug",
        "--run_dir",
        str(tmp_path),
        "--steps",
        "4",
        "--batch_size",
        "4",
        "--optim.warmup_steps",
        "1",
        "--log.progress",
        "off",
        "--compile_cache",
        "",
        "--memory.budget",
        "4096",
    ]
    assert main(argv) == 4
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(
        r"jaxloop\.train: error: memory: the call of \d+ update\(s\) needs [\d.]+ KiB \([\d.]+ KiB "
        r"arguments, .* new outputs, .* temporaries\), more than the 4\.0 KiB of memory\.budget \(plan: "
        r"split 1, remat none\); no plan fits: the smallest of the \d+ tried needs [\d.]+ KiB \(split "
        r"\d+, remat \w+\): lower batch_size or the model's size, or raise memory\.budget",
        line,
    ), line


# ----------------------------------------------------------------------------- out of memory at run time


INJECT = textwrap.dedent("""
    # Runs jaxloop.train, with the device call that would apply update K failing, once, with what jaxlib
    # raises when an accelerator runs out of memory: at its dispatch (the donated state is deleted, as a
    # failed donating call leaves it), or when its results are read (the error of an asynchronous call).
    import sys
    import jax
    import jaxloop.loop.dispatch as dispatch
    from jaxloop.train import main

    k, accum, when, argv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
    compile_call, device_get, fired = dispatch.Dispatcher._compile, jax.device_get, []
    ERROR = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17179869184 bytes."

    class OutOfMemoryAtK:
        def __init__(self, compiled):
            self.compiled = compiled

        def __call__(self, state, chunk):
            start = int(device_get(state.step))
            if fired or not start < k <= start + chunk["x"].shape[0] // accum:
                return self.compiled(state, chunk)
            fired.append(start)
            if when == "dispatch":
                for leaf in jax.tree.leaves(state):
                    leaf.delete()
                raise jax.errors.JaxRuntimeError(ERROR)
            new_state, metrics = self.compiled(state, chunk)
            return new_state, {**metrics, "out_of_memory": metrics["loss"]}

        def __getattr__(self, name):
            return getattr(self.compiled, name)

    def injecting(self, *args):
        return OutOfMemoryAtK(compile_call(self, *args))

    def reading(tree):
        if isinstance(tree, dict) and "out_of_memory" in tree:
            raise jax.errors.JaxRuntimeError(ERROR)
        return device_get(tree)

    dispatch.Dispatcher._compile, jax.device_get = injecting, reading
    sys.exit(main(argv))
""")


OOM_ARGS = [
    "--preset",
    "debug",
    "--steps",
    "30",
    "--updates_per_call",
    "5",
    "--optim.accum_steps",
    "2",
    "--checkpoint.every",
    "10",
    "--eval_every",
    "10",
    "--log_every",
    "1",
    "--log.progress",
    "off",
    "--log.no-tensorboard",
]
"""The out-of-memory test's runs: 30 updates of 2 micro-batches, 5 per call, a checkpoint every 10."""


@pytest.fixture(scope="module")
def oom_reference(tmp_path_factory) -> Path:
    """The run without an error that both out-of-memory runs are compared with: one child process for both."""
    path = tmp_path_factory.mktemp("oom") / "ref"
    ref = subprocess.run(
        [sys.executable, "-m", "jaxloop.train", "--run_dir", str(path), *OOM_ARGS],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ref.returncode == 0, ref.stderr
    return path


@pytest.mark.parametrize("when", ["dispatch", "fetch"])
def test_an_out_of_memory_error_at_run_time_reloads_the_last_checkpoint_and_goes_on_smaller(
    tmp_path, oom_reference, when
):
    # 30 updates of 2 micro-batches, 5 per call, a checkpoint every 10; the call that would apply update 17
    # fails: at its dispatch (before the loop logged 11-15: it dispatches ahead), or when its metrics are
    # read (11-15 logged already). The run reloads update 10, re-plans to split 2 and trains 11..30 again:
    # every update applied once. Tolerance: the fp32 trajectory tolerance of the parity suite (1e-5 relative per tensor, PARITY.md
    # section 5): from update 11 on the gradients are means of two sub-batch means, float32 summation in
    # another order. Mutants seen failing: no reload (the run restarted from its initial state), and the
    # metrics not truncated to the checkpoint (updates 11-15 logged twice).
    out = subprocess.run(
        [sys.executable, "-c", INJECT, "17", "2", when, "--run_dir", str(tmp_path / "oom"), *OOM_ARGS],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert (
        "out of device memory at run time (RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
        "17179869184 bytes.): reloading update 10 and re-planning split 1, remat none -> split 2, remat none"
    ) in out.stderr
    steps = [r["step"] for r in read_records(tmp_path / "oom") if r["kind"] == "train"]
    assert steps == list(range(1, 31)), "every update applied (and logged) once"
    runs = {"oom": tmp_path / "oom", "ref": oom_reference}
    losses = [[r["loss"] for r in read_records(runs[d]) if r["kind"] == "train"] for d in ("oom", "ref")]
    assert losses[0][:10] == losses[1][:10], "updates 1-10 (up to the checkpoint reloaded) were not redone"
    assert losses[0][10:] != losses[1][10:], "11-30 ran under the new plan (another summation order)"
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    _, _, oom = read_checkpoint(tmp_path / "oom", "latest")
    _, _, reference = read_checkpoint(oom_reference, "latest")
    assert int(np.asarray(jax.tree.leaves(oom["opt_state"])[0])) >= 0
    paths = jax.tree_util.tree_flatten_with_path(reference)[0]
    for (path, a), b in zip(paths, jax.tree.leaves(oom)):
        if np.issubdtype(np.asarray(a).dtype, np.floating):
            assert _relative(b, a) <= 1e-5, jax.tree_util.keystr(path)
        else:
            np.testing.assert_array_equal(b, a, err_msg=jax.tree_util.keystr(path))  # counters: same updates
    positions = [
        json.loads((runs[d] / "checkpoints" / "30" / "data" / "metadata").read_text())["loader"] for d in ("oom", "ref")
    ]
    assert positions[0] == positions[1] and positions[0]["position"] == 60, "the same records, each once"
    summary = json.loads((tmp_path / "oom" / "summary.json").read_text())
    assert summary["memory"]["plan"] == {"split": 2, "remat": "none"}
    (replan,) = summary["memory"]["replans"]
    assert replan["reason"] == "out of memory at run time" and replan["at_update"] == 10
    assert json.loads((tmp_path / "oom" / "metadata.json").read_text())["memory"]["replans"] == [replan]
