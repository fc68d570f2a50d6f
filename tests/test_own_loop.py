"""A researcher's own loop: jaxloop.init_state(model, loss, example_batch, tx) builds the state of a Linen or
NNX model, jaxloop.train_step(state, batch) trains the loss the state carries, and jaxloop.run returns the
trained state beside its summary. Tiny models, a few steps each."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxloop
from jaxloop.loop.task import create_train_state
from jaxloop.update.step import cross_entropy_loss, make_train_step


class Lin(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(x)[:, 0]


class NnxLin(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x):
        return self.dense(x)[:, 0]


def mse(model, batch, train):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2), {}


def batch(i: int, n: int = 8) -> dict:
    x = np.random.default_rng(i).normal(size=(n, 4)).astype(np.float32)
    return {"x": x, "y": np.sin(x).sum(1).astype(np.float32)}


def test_linen_params_are_modules_init_from_the_seed():
    """init_state draws a Linen module's params as module.init does, from the first half of PRNGKey(seed)."""
    state = jaxloop.init_state(Lin(), mse, batch(0), optax.sgd(0.1), seed=3)
    key = jax.random.split(jax.random.PRNGKey(3))[0]
    expected = Lin().init({"params": key, "dropout": jax.random.fold_in(key, 1)}, batch(0)["x"])["params"]
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), state.params, expected))
    assert int(state.step) == 0 and state.loss is mse


def test_train_step_is_a_plain_function_that_leaves_its_state_valid():
    """jaxloop.train_step is pure and not jitted (as the Flax examples' train_step): called twice on the same
    state it gives the same new state and metrics, bit for bit, and the state passed in is still readable
    (jit and donation are the caller's: the loop builds them, docs/your-model.md shows how). Mutant seen
    failing: train_step = jax.jit(make_train_step(), donate_argnums=0) (the second call: deleted buffers)."""
    state = jaxloop.init_state(Lin(), mse, batch(0), optax.adamw(1e-2), seed=0)
    first, m1 = jaxloop.train_step(state, batch(1))
    second, m2 = jaxloop.train_step(state, batch(1))
    assert not hasattr(jaxloop.train_step, "lower"), "not a jitted function"
    same = jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()), (first, m1), (second, m2))
    assert jax.tree.all(same)
    assert int(state.step) == 0 and int(first.step) == 1


def test_train_step_on_an_own_state_is_the_textbook_sgd_update():
    """Three updates of jaxloop.train_step with optax.sgd equal jax.grad + optax.apply_updates on the same
    batches (float32; 1e-6 relative: the same arithmetic, the matmuls pinned to full precision in both)."""
    state = jaxloop.init_state(Lin(), mse, batch(0), optax.sgd(0.1), seed=0)
    params = jax.tree.map(jnp.copy, state.params)
    step = jax.jit(jaxloop.train_step, donate_argnums=0)
    for i in range(3):
        state, metrics = step(state, batch(i))
        with jax.default_matmul_precision("highest"):
            grads = jax.grad(lambda p, i=i: mse(lambda x: Lin().apply({"params": p}, x), batch(i), True)[0])(params)
        params = optax.apply_updates(params, jax.tree.map(lambda g: -0.1 * g, grads))
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert int(state.step) == 3 and bool(metrics["updated"])


def test_nnx_state_keeps_the_modules_weights_and_leaves_the_module_usable():
    net = NnxLin(nnx.Rngs(0))
    before = np.asarray(net.dense.kernel[...])
    state = jaxloop.init_state(net, mse, batch(0), optax.adam(1e-2))
    np.testing.assert_array_equal(np.asarray(state.params["dense"]["kernel"]), before)
    step = jax.jit(jaxloop.train_step, donate_argnums=0)
    losses = []
    for i in range(20):
        state, metrics = step(state, batch(i % 2))
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    np.testing.assert_array_equal(np.asarray(net.dense.kernel[...]), before)  # the module passed in: as it was
    assert isinstance(state.user_model(), NnxLin)


def test_a_non_finite_batch_is_skipped_and_counted_for_any_optax_optimizer():
    """init_state runs the user's tx inside skip_nonfinite_windows (the documented wrap): a NaN batch leaves
    the params as they were and counts one skipped update."""
    state = jaxloop.init_state(Lin(), mse, batch(0), optax.sgd(0.1))
    before = jax.tree.map(np.asarray, state.params)
    bad = batch(1)
    bad["x"][0, 0] = np.nan
    state, metrics = jaxloop.train_step(state, bad)
    assert int(metrics["skipped"]) == 1 and int(state.step) == 0
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((np.asarray(a) == b).all()), state.params, before))


def test_train_step_on_a_builtin_state_is_the_cross_entropy_step():
    """A built-in task's state carries cross_entropy_loss: jaxloop.train_step on it computes what a step
    built for that loss explicitly computes, bit for bit."""
    cfg = jaxloop.preset("debug")
    from jaxloop.model.builtin import make_model

    def fresh():
        return create_train_state(cfg, make_model(cfg.model, 3, cfg.precision), np.zeros((1, 64), np.float32))

    b = {"x": np.random.default_rng(0).normal(size=(8, 64)).astype(np.float32), "y": np.arange(8, dtype=np.int32) % 3}
    ours, m1 = jax.jit(jaxloop.train_step)(fresh(), b)  # both compiled: eager ops may round otherwise
    explicit, m2 = jax.jit(make_train_step(cross_entropy_loss))(fresh(), b)
    assert fresh().loss is cross_entropy_loss
    assert jaxloop.state_digest(ours) == jaxloop.state_digest(explicit) and float(m1["loss"]) == float(m2["loss"])


def test_a_state_without_a_loss_is_refused_by_name():
    state = jaxloop.init_state(Lin(), mse, batch(0), optax.sgd(0.1)).replace(loss=None)
    with pytest.raises(TypeError, match="carries no loss: build it with jaxloop.init_state"):
        jaxloop.train_step(state, batch(0))


def test_trainstate_create_refuses_a_tx_the_step_cannot_count():
    """TrainState.create assembles parts already made; a plain optax tx is refused (no silent wrap), and
    the message names init_state, which takes one."""
    params = {"w": jnp.zeros(3)}
    with pytest.raises(TypeError, match="init_state"):
        jaxloop.TrainState.create(params=params, tx=optax.sgd(0.1), rng=jax.random.PRNGKey(0))


def test_run_returns_the_trained_state_which_train_step_trains_on(tmp_path):
    """jaxloop.run returns a RunResult: its state is the run's last (its digest is the summary's), the
    summary reads as a dict, and jaxloop.train_step goes on from the state."""
    records = [{k: v[j] for k, v in batch(0, 64).items()} for j in range(64)]
    cfg = jaxloop.Config(
        run_dir=str(tmp_path / "run"),
        steps=6,
        batch_size=8,
        eval_every=0,
        optim=jaxloop.OptimConfig(lr_schedule=jaxloop.WarmupCosineConfig(warmup_steps=1)),
        log=jaxloop.LogConfig(progress="off", report=False),
    )
    result = jaxloop.run(cfg, jaxloop.Task(Lin(), mse, records, records[:16]))
    assert isinstance(result, jaxloop.RunResult) and result["final_step"] == 6 == int(result.state.step)
    assert jaxloop.state_digest(result.state) == result["state_digest"] == result.summary["state_digest"]
    assert dict(result) == result.summary
    state, metrics = jax.jit(jaxloop.train_step, donate_argnums=0)(result.state, batch(1))
    assert int(state.step) == 7 and np.isfinite(float(metrics["loss"]))
