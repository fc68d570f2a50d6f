"""`python -m jaxloop.export RUN_DIR` (docs/language-models.md#hand-the-weights-to-pytorch): a built-in GPT run
out as a Hugging Face GPT-2 directory that transformers loads with jaxloop's logits; any run's params (and
EMA params) as one safetensors file named by pytree paths; bad input in one line, exit status 2.

The GPT runs are fine-tunes of tiny random GPT-2s (tests/test_hf_gpt2.py builds them; nothing downloaded) of
two shapes, a few updates each, so the exported weights are trained ones.
"""

from __future__ import annotations

import contextlib
import io
import shutil

import flax.linen as nn
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from test_hf_gpt2 import SHAPES, finetune_args, shards, tiny_gpt2, train  # noqa: F401 (shards: a fixture)
from transformers import GPT2LMHeadModel

import jaxloop
from jaxloop.checkpoint import hf_gpt2
from jaxloop.checkpoint.manager import read_checkpoint
from jaxloop.config.run import CheckpointConfig, Config, LogConfig, OptimConfig
from jaxloop.config.schedules import WarmupCosineConfig
from jaxloop.export import PARAMS_FILE, main
from jaxloop.rundir.rules import read_config

pytestmark = pytest.mark.torch


def export(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as e:  # argparse's own errors: one line, exit 2
            code = e.code
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module", params=sorted(SHAPES))
def gpt_run(request, tmp_path_factory, shards):  # noqa: F811 (the fixture imported above)
    """A GPT-2 of each shape fine-tuned for 3 updates at lr 1e-3 (the weights move)."""
    base = tmp_path_factory.mktemp(f"export_{request.param}")
    tiny_gpt2(base / "gpt2", **SHAPES[request.param])
    code, err = train(finetune_args(base / "gpt2", shards, base / "run", "--steps", "3"))
    assert code == 0, err
    return base / "run"


@pytest.mark.parametrize("precision,tolerance", [("fp64", 1e-10), ("fp32", 1e-5)])
def test_transformers_loads_the_export_with_jaxlooops_logits(gpt_run, tmp_path, precision, tolerance):
    # HF -> jaxloop (3 updates) -> HF: GPT2LMHeadModel.from_pretrained on the export against the built-in GPT on
    # the same checkpoint's params, max |a - b| / max |b| (fp64: summation order only; fp32: its rounding).
    # mutants seen failing: hf_config writing layer_norm_epsilon 1e-5 always (the untied shape's is 1e-3);
    # from_params leaving out the untied head (transformers then initialises lm_head at random)
    code, out, err = export(str(gpt_run), "--checkpoint", "last", "--out", str(tmp_path / "hf"))
    assert code == 0, err
    assert out.strip() == str(tmp_path / "hf")
    m = read_config(gpt_run).model
    _, _, state = read_checkpoint(gpt_run, "latest")
    tokens = hf_gpt2.check_batch(m, seed=2)
    dtype = torch.float64 if precision == "fp64" else torch.float32
    tm = GPT2LMHeadModel.from_pretrained(tmp_path / "hf", dtype=dtype).eval()
    with torch.no_grad():
        want = tm(input_ids=torch.as_tensor(tokens)).logits.numpy()
    assert hf_gpt2.rel_diff(hf_gpt2.gpt_logits(state["params"], m, tokens, precision), want) <= tolerance


def test_the_export_is_config_json_and_model_safetensors_of_the_checkpoint_asked_for(gpt_run, tmp_path):
    # mutant seen failing: --checkpoint STEP read as the latest (read_checkpoint ignoring the number)
    assert export(str(gpt_run), "--checkpoint", "3", "--out", str(tmp_path / "a"))[0] == 0
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["config.json", "model.safetensors"]
    assert export(str(gpt_run), "--checkpoint", "0", "--out", str(tmp_path / "b"))[2] == (
        f"jaxloop.export: error: {gpt_run} holds no checkpoint of update 0 (it holds 3)\n"
    )


def test_ema_of_a_run_without_one_is_one_line_exit_2(gpt_run, tmp_path):
    # mutant seen failing: the EMA check removed (a traceback mapping None)
    code, out, err = export(str(gpt_run), "--ema", "--out", str(tmp_path / "x"))
    assert (code, out) == (2, "")
    assert err == f"jaxloop.export: error: --ema: {gpt_run} keeps no EMA of its params (optim.ema_decay was 0)\n"
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------- any run: params.safetensors


class Lin(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        return nn.Dense(1)(nn.Dense(3, name="hidden")(x))[:, 0]


def _mse(model, batch, train):
    return jaxloop.weighted_mean((model(batch["x"], train=train) - batch["y"]) ** 2, batch), {}


@pytest.fixture(scope="module")
def task_run(tmp_path_factory):
    """A Task of one's own (two Dense layers), 4 updates, keeping an EMA of its params."""
    run_dir = tmp_path_factory.mktemp("task_run")
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    records = [{"x": xi, "y": np.float32(xi.sum())} for xi in x]
    cfg = Config(
        run_dir=str(run_dir),
        steps=4,
        batch_size=16,
        eval_every=2,
        log_every=2,
        optim=OptimConfig(lr_schedule=WarmupCosineConfig(warmup_steps=1), peak_lr=1e-2, ema_decay=0.5),
        checkpoint=CheckpointConfig(every=2),
        log=LogConfig(progress="off", report=False, tensorboard=False),
    )
    jaxloop.run(cfg, jaxloop.Task(Lin(), _mse, records[:48], records[48:]))
    return run_dir


def test_a_task_runs_params_and_ema_params_by_pytree_path(task_run, tmp_path):
    # mutant seen failing: the EMA params left out of the file
    code, _, err = export(str(task_run), "--checkpoint", "last", "--out", str(tmp_path))
    assert code == 0, err
    saved = load_file(tmp_path / PARAMS_FILE)
    _, _, state = read_checkpoint(task_run, "latest")
    want = {
        f"{tree}/{layer}/{leaf}": np.asarray(state[tree][layer][leaf])
        for tree in ("params", "ema_params")
        for layer in ("hidden", "Dense_0")
        for leaf in ("kernel", "bias")
    }
    assert sorted(saved) == sorted(want)
    assert all(np.array_equal(saved[k], want[k]) for k in want)
    assert not np.array_equal(saved["params/hidden/kernel"], saved["ema_params/hidden/kernel"])


def test_a_task_run_asked_for_hf_format_is_one_line_exit_2(task_run, tmp_path):
    # mutant seen failing: the built-in GPT check left out (a traceback from the mapping)
    code, out, err = export(str(task_run), "--format", "hf", "--out", str(tmp_path / "x"))
    assert (code, out) == (2, "")
    assert err == (
        f"jaxloop.export: error: --format hf exports the built-in GPT; {task_run} trained another model "
        f"(--format params writes its params as {PARAMS_FILE})\n"
    )
    assert not (tmp_path / "x").exists()


def test_a_run_that_does_not_exist_is_one_line_exit_2(tmp_path):
    code, out, err = export(str(tmp_path / "nope"))
    assert (code, out, err) == (
        2,
        "",
        f"jaxloop.export: error: {tmp_path / 'nope'} does not exist (a jaxloop run directory)\n",
    )


def test_a_run_without_checkpoints_is_one_line_exit_2(task_run, tmp_path):
    # mutant seen failing: read_checkpoint's FileNotFoundError not caught (a traceback)
    shutil.copy(task_run / "config.json", tmp_path / "config.json")
    code, out, err = export(str(tmp_path))
    assert (code, out) == (2, "")
    assert err.startswith("jaxloop.export: error: ") and "holds no checkpoint" in err and err.count("\n") == 1
