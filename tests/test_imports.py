"""Importing jaxloop leaves the user's JAX as it was and imports nothing heavy; jaxloop's own steps still
run their float32 matmuls at full precision."""

from __future__ import annotations

import json
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


def _in_a_fresh_process(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_jaxloop_changes_no_jax_setting_and_imports_no_checkpointing_or_loader():
    got = _in_a_fresh_process(
        "import json, sys, jax\n"
        "before = {k: str(getattr(jax.config, k)) for k in ('jax_default_matmul_precision', 'jax_enable_x64',"
        " 'jax_compilation_cache_dir')}\n"
        "import jaxloop\n"
        "heavy = [m for m in ('orbax.checkpoint', 'grain', 'torch', 'optax', 'flax', 'tensorboardX') if m in sys.modules]\n"
        "import jaxloop.loop.runner, jaxloop.train, jaxloop.sample, jaxloop.observe.run_report  # every module of the loop\n"
        "after = {k: str(getattr(jax.config, k)) for k in before}\n"
        "print(json.dumps({'before': before, 'after': after, 'heavy': heavy}))\n"
    )
    assert got["after"] == got["before"], "importing jaxloop's modules changed jax's configuration"
    assert got["heavy"] == [], f"import jaxloop imported {got['heavy']}"


def test_each_public_name_is_imported_on_first_use():
    got = _in_a_fresh_process(
        "import json, sys, jaxloop\n"
        "jaxloop.train_step\n"
        "step_only = 'orbax.checkpoint' in sys.modules or 'grain' in sys.modules\n"
        "jaxloop.run\n"
        "print(json.dumps({'step_only': step_only, 'run': 'orbax.checkpoint' in sys.modules, 'names': sorted(dir(jaxloop))}))\n"
    )
    assert not got["step_only"], "the train step alone needs neither Orbax nor grain"
    assert got["run"], "run imports the loop's checkpointing"
    assert {"run", "Task", "Hook", "TrainState", "train_step", "make_optimizer", "Config"} <= set(got["names"])


def test_a_run_of_a_linen_model_never_imports_flax_nnx(tmp_path):
    """flax.nnx costs 0.2 s of a run's start-up; only an NNX model needs it (and whoever built one imported it).
    mutant seen failing: is_nnx importing flax.nnx for its isinstance check"""
    got = _in_a_fresh_process(
        "import json, sys, contextlib, io, jaxloop\n"
        f"cfg = jaxloop.from_dict({{'run_dir': {str(tmp_path / 'run')!r}, 'steps': 4, 'eval_every': 4,"
        " 'log': {'progress': 'off'}}, jaxloop.preset('debug'))\n"
        "with contextlib.redirect_stderr(io.StringIO()):\n"
        "    jaxloop.run(cfg)\n"
        "print(json.dumps('flax.nnx' in sys.modules))\n"
    )
    assert got is False, "a run of the built-in (Linen) MLP imported flax.nnx"


def test_config_and_errors_import_no_jax_tyro_or_torch():
    """What a command line or a config file needs (jaxloop.Config, preset, from_dict, jaxloop.errors) stays
    light: jax, tyro and torch are imported by none of it."""
    got = _in_a_fresh_process(
        "import json, sys, jaxloop, jaxloop.errors\n"
        "jaxloop.Config, jaxloop.OptimConfig, jaxloop.preset, jaxloop.from_dict, jaxloop.read_vocab, jaxloop.ConfigError\n"
        "jaxloop.errors.ConfigError, jaxloop.errors.NonFiniteError, jaxloop.errors.RecordError\n"
        "jaxloop.OptimConfig(optimizer=jaxloop.SGDConfig(momentum=0.9), lr_schedule=jaxloop.StepConfig(step_size=5))\n"
        "jaxloop.OptimConfig(optimizer=jaxloop.LionConfig(), lr_schedule=jaxloop.PlateauConfig())\n"
        "jaxloop.PlateauConfig().validate(1e-3, 10)\n"
        "print(json.dumps([m for m in ('jax', 'tyro', 'torch', 'flax', 'optax') if m in sys.modules]))\n"
    )
    assert got == [], f"jaxloop.Config and jaxloop.errors imported {got}"


def test_every_public_name_resolves():
    import jaxloop

    missing = [n for n in jaxloop.__all__ if getattr(jaxloop, n, None) is None]
    assert missing == [] and "errors" in jaxloop.__all__ and "init_state" in jaxloop.__all__


def test_the_exceptions_are_one_class_each_wherever_they_are_imported_from():
    """jaxloop.errors is their public home; their older import paths (jaxloop.config.run, jaxloop.config.cli) name
    the same classes, so an `except` written against either catches what the loop raises."""
    import jaxloop
    import jaxloop.config.cli
    import jaxloop.config.run
    import jaxloop.errors

    assert (
        jaxloop.errors.ConfigError
        is jaxloop.ConfigError
        is jaxloop.config.run.ConfigError
        is jaxloop.config.cli.ConfigError
    )
    for n in ("NonFiniteError", "CheckpointWriteError", "OutOfMemoryError", "Interrupted", "UsageError", "EXIT_SIGNAL"):
        assert getattr(jaxloop.errors, n) is getattr(jaxloop.config.cli, n), n
    assert issubclass(jaxloop.errors.RecordError, jaxloop.errors.ConfigError)
    assert issubclass(jaxloop.errors.RunDirInUse, jaxloop.errors.ConfigError)


class Proj(nn.Module):  # a user's model: its matmul names no precision
    @nn.compact
    def __call__(self, x, train=False):
        return nn.Dense(3, use_bias=False)(x)


def _loss(model, batch, train):
    import optax

    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}


def test_jaxloops_step_pins_float32_matmuls_to_highest_and_the_users_own_code_keeps_the_default():
    import jaxloop

    assert jax.config.jax_default_matmul_precision is None  # this process's default, untouched by jaxloop
    batch = {"x": np.ones((4, 5), np.float32), "y": np.zeros(4, np.int32)}
    state = jaxloop.init_state(
        Proj(), _loss, batch, jaxloop.make_optimizer(jaxloop.Config().optim, 2, jaxloop.get_policy("fp32"))
    )
    hlo = jax.jit(jaxloop.train_step).lower(state, batch).as_text()
    dots = [line for line in hlo.splitlines() if "dot_general" in line]
    assert dots and all("precision = [HIGHEST, HIGHEST]" in line for line in dots), dots
    own = jax.jit(lambda a, b: a @ b).lower(jnp.ones((4, 5)), jnp.ones((5, 3))).as_text()
    assert "HIGHEST" not in own, "jaxloop set no process-wide precision"
