"""A component's process-wide effects last as long as it does: a Checkpointer quiets Orbax (absl's level and
filters, sys.unraisablehook) until it is closed, load_model reads an fp64 run in jax's x64 mode and absl
quieted only while it reads, and a run's x64 and compile-cache settings end with the run."""

from __future__ import annotations

import logging
import sys

import jax
import numpy as np
import pytest

import jaxloop
from jaxloop.checkpoint.manager import Checkpointer
from jaxloop.config.run import CheckpointConfig, Config, LogConfig, OptimConfig, replace
from jaxloop.config.schedules import WarmupCosineConfig


def _process_wide() -> dict:
    absl = logging.getLogger("absl")
    return {
        "unraisablehook": sys.unraisablehook,
        "absl level": absl.level,
        "absl filters": list(absl.filters),
        "jax_enable_x64": bool(jax.config.jax_enable_x64),
    }


def test_a_checkpointer_quiets_orbax_while_open_and_puts_everything_back_when_closed(tmp_path):
    # mutants seen failing: orbax_quiet.abandoned_writes_dropped without its restore; quiet_absl without its
    # setLevel(before)
    before = _process_wide()
    ckpt = Checkpointer(Config().checkpoint, tmp_path)
    try:
        during = _process_wide()
        assert during["unraisablehook"] is not before["unraisablehook"], "abandoned writes are dropped"
        assert during["absl level"] >= logging.WARNING and len(during["absl filters"]) > len(before["absl filters"])
    finally:
        ckpt.close()
    assert _process_wide() == before


def test_a_hook_installed_over_a_checkpointers_is_kept_and_passed_everything_after_close(tmp_path):
    # mutant seen failing: DropAbandonedWrites dropping after its scope ended (`self.active and` removed)
    seen = []
    previous = sys.unraisablehook
    ckpt = Checkpointer(Config().checkpoint, tmp_path)
    wrapped = sys.unraisablehook

    def theirs(unraisable):  # someone else's hook, installed over the Checkpointer's while it is open
        wrapped(unraisable)

    sys.unraisablehook = theirs
    try:
        ckpt.close()
        assert sys.unraisablehook is theirs, "another's hook is not removed by the Checkpointer"
        wrapped.previous = seen.append
        closed = type("Unraisable", (), {"exc_value": RuntimeError("Event loop is closed")})()
        theirs(closed)
        assert seen == [closed], "once closed, the Checkpointer's hook drops nothing"
    finally:
        sys.unraisablehook = previous


@pytest.fixture(scope="module")
def fp64_run(tmp_path_factory):
    """A tiny fp64 run (3 updates) with a compile cache of its own: (run_dir, the model class, jax's settings
    before and after the run, its RunResult)."""
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train=False):
            return nn.Dense(1)(x)[:, 0]

    def mse(model, batch, train):
        return jaxloop.weighted_mean((model(batch["x"], train=train) - batch["y"]) ** 2, batch), {}

    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    records = [{"x": xi, "y": np.float32(xi.sum())} for xi in x]
    run_dir = tmp_path_factory.mktemp("fp64")
    cfg = replace(
        Config(
            run_dir=str(run_dir),
            steps=3,
            batch_size=16,
            eval_every=3,
            log_every=3,
            optim=OptimConfig(lr_schedule=WarmupCosineConfig(warmup_steps=1), peak_lr=1e-2),
            checkpoint=CheckpointConfig(every=3),
            log=LogConfig(progress="off", report=False, tensorboard=False),
        ),
        precision="fp64",
    )
    cfg = replace(cfg, compile_cache=str(tmp_path_factory.mktemp("jax-cache")))
    before = _jax_settings()
    try:
        result = jaxloop.run(cfg, jaxloop.Task(Net(), mse, train=records[:48], val=records[48:]))
        after = _jax_settings()
    finally:  # whatever the run left, the other tests of this process start from jax's settings as they were
        for key, value in before.items():
            jax.config.update(key, value)
    return run_dir, Net, before, after, result


def _jax_settings() -> dict:
    return {
        k: getattr(jax.config, k)
        for k in ("jax_enable_x64", "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    }


def test_a_run_puts_x64_and_the_compile_cache_back_as_they_were_when_it_ends(fp64_run):
    # jaxloop.run (precision fp64, compile_cache DIR) switches both on for the run (jaxloop.runtime.settings) and
    # back when it ends; the trained state stays float64. Mutants seen failing: process_settings without its
    # scope.callback for x64; enable_compilation_cache called in place of the compilation_cache scope
    _, _, before, after, result = fp64_run
    assert not before["jax_enable_x64"], "the test starts with x64 off"
    assert after == before
    assert {leaf.dtype for leaf in jax.tree.leaves(result.state.params)} == {np.dtype("float64")}


def test_load_model_of_an_fp64_run_gives_float64_weights_and_leaves_x64_and_absl_as_they_were(fp64_run):
    # mutant seen failing: read_checkpoint's jax.enable_x64(True) scope replaced by
    # jax.config.update("jax_enable_x64", True) (the switch it made before)
    run_dir, Net = fp64_run[:2]
    before = _process_wide()
    assert not before["jax_enable_x64"], "the test starts with x64 off"
    variables = jaxloop.load_model(run_dir, Net(), which="latest")
    assert _process_wide() == before
    assert {leaf.dtype for leaf in jax.tree.leaves(variables["params"])} == {np.dtype("float64")}
