"""The two command lines end to end: `python -m jaxloop.train` and `python -m torch_ref.train`, started
from the same initial weights through `--init_from`, write metrics.jsonl files that agree to the float32
bound of test_trajectory.

The initial weights are neither loop's own: jaxloop's init for another seed (12345), saved as a jaxloop
checkpoint (J0) and converted by `parity_tests.convert --from jax` into a torch_ref checkpoint (T0).
jaxloop starts from J0 (jaxloop.checkpoint.init_from, Orbax), torch_ref from T0 (its own loader of a converted
checkpoint). Both runs: the digits preset (MLP 64-128-128-10), float32, seed 0, 40 updates, evaluation
at 20 and 40, torch_ref with optax's clip arithmetic.

Mutant caught (run, seen to fail, reverted): jaxloop ignoring --init_from (the `# --init_from` line of
jaxloop.train.run removed): its first loss is then that of its own seed-0 init, not J0's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import jax
import pytest

from jaxloop.config.run import preset, to_dict
from jaxloop.data.sources import MicroBatchGather, load_splits
from parity_tests.harness import QUIET, ROOT, curve_rel_diff, host, jax_mode, jax_state, records

UPDATES = 40
FLAGS = [
    "--preset",
    "digits",
    "--steps",
    str(UPDATES),
    "--optim.warmup_steps",
    "10",
    "--eval_every",
    "20",
    "--log_every",
    "1",
    "--log.progress",
    "off",
    "--log.no-report",
    "--log.no-tensorboard",
]


def _initial_checkpoint(run_dir):
    """J0: a jaxloop checkpoint at update 0 of the digits preset's state drawn with seed 12345."""
    import json

    from jaxloop.checkpoint.manager import Checkpointer
    from jaxloop.data.pipeline import TrainLoader

    cfg = replace(preset("digits"), run_dir=str(run_dir), seed=12345, log=QUIET)
    splits = load_splits(cfg)
    with jax_mode("fp32"):
        state = jax_state(cfg, splits)
        loader = TrainLoader(splits, seed=cfg.seed, batch_size=cfg.batch_size)
        data = {"loader": loader.state(), "best": {"best": None, "best_step": None, "since_best": 0}}
        loader.close()
        ckpt = Checkpointer(cfg.checkpoint, run_dir, config=to_dict(cfg))
        try:
            ckpt.save(0, state, data)
        finally:
            ckpt.close()
        params = host(state.params)
    (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2) + "\n")
    return params


def _cli(module, run_dir, *extra):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-m", module, *FLAGS, "--run_dir", str(run_dir), *extra],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{module} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    from parity_tests.convert import main as convert

    base = tmp_path_factory.mktemp("cli")
    init = _initial_checkpoint(base / "J0")
    assert convert(["--from", "jax", str(base / "J0"), str(base / "T0")]) == 0
    _cli("jaxloop.train", base / "jax", "--init_from", str(base / "J0"))
    _cli("torch_ref.train", base / "torch", "--clip", "optax", "--init_from", str(base / "T0"))
    return base, init


def test_both_command_lines_start_from_the_init_from_weights(cli_runs, parity):
    """The first logged loss of each run is the loss of J0's weights on micro-batch 0 (computed here)."""
    from jaxloop.update.step import cross_entropy_loss

    base, init = cli_runs
    cfg = preset("digits")
    splits = load_splits(cfg)

    @jax.jit  # one program, not one compile per operation
    def loss(state, batch):
        model, _ = state.model.bind(state.params, state.model_state, False, None, state.policy)
        return cross_entropy_loss(model, batch, False)[0]

    with jax_mode("fp32"):
        state = jax_state(cfg, splits, init)
        expected = float(loss(state, MicroBatchGather(splits.train, cfg.seed, cfg.batch_size)(0)))
    first = [records(base / name)[0]["loss"] for name in ("jax", "torch")]
    parity.check(
        "CLI --init_from: first logged loss of each loop vs the loss of the init_from weights, relative",
        max(abs(f - expected) / expected for f in first),
        1e-6,
        "the same float32 weights and batch: forward-pass rounding only",
    )


def test_metrics_jsonl_of_both_command_lines_agree(cli_runs, parity):
    base, _ = cli_runs
    jt, tt = records(base / "jax"), records(base / "torch")
    assert [r["step"] for r in jt] == [r["step"] for r in tt] == list(range(1, UPDATES + 1))
    je, te = records(base / "jax", "eval"), records(base / "torch", "eval")
    assert [r["step"] for r in je] == [r["step"] for r in te] == [20, 40]
    worst = max(curve_rel_diff([r[k] for r in jt], [r[k] for r in tt]) for k in ("loss", "grad_norm"))
    worst_eval = max(curve_rel_diff([r[k] for r in je], [r[k] for r in te]) for k in ("val_loss", "val_acc"))
    parity.check(
        f"CLI end to end fp32 ({UPDATES} updates): metrics.jsonl loss and grad_norm of every update, relative",
        worst,
        1e-5,
        "test_trajectory's float32 bound: rounding accumulated over the updates",
    )
    parity.check("CLI end to end fp32: val_loss and val_acc at both evaluations, relative", worst_eval, 1e-5, "same")
    parity.check(
        "CLI end to end fp32: lr of every update, relative",
        curve_rel_diff([r["lr"] for r in jt], [r["lr"] for r in tt]),
        2.0**-24,
        "jaxloop's float32 rate is torch_ref's float64 rate rounded once",
    )


def test_init_from_is_validated(tmp_path):
    """init_from: empty or a directory holding a checkpoint of either loop (refused before anything is written
    when it holds none); refused when the run would resume a checkpoint of its own."""
    from jaxloop.config.run import ConfigError, validate
    from jaxloop.rundir.rules import RunDir

    cfg = replace(preset("digits"), run_dir=str(tmp_path / "run"), log=QUIET)
    validate(cfg)
    with pytest.raises(ConfigError, match="init_from"):
        validate(replace(cfg, init_from=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match="holds neither"):
        validate(replace(cfg, init_from=str(tmp_path)))  # an existing folder with no checkpoint in it
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step_00000040.pt").write_bytes(b"")  # torch_ref's checkpoint file name
    validate(replace(cfg, init_from=str(tmp_path)))
    with pytest.raises(ConfigError, match="init_from"):
        RunDir(replace(cfg, init_from=str(tmp_path))).check(has_checkpoint=True)
    RunDir(replace(cfg, init_from=str(tmp_path), resume="never")).check(has_checkpoint=False)
