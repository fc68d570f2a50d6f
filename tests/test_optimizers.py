"""jaxloop.update.transforms worked by hand on scalar and tiny parameters (as optax tests its own): each convention
where torch and optax's aliases differ (jaxloop.update.transforms' module doc), the decay mask, the loop's
wrapping, and plateau's injected rate. Every number is exact in float32 unless stated."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxloop.config.optimizers import AdagradConfig, SGDConfig
from jaxloop.config.run import OPTIMIZERS, OptimConfig
from jaxloop.config.schedules import PlateauConfig, WarmupCosineConfig
from jaxloop.model.precision import get_policy
from jaxloop.update.optimizer import SkipWindowsState, find_state, make_optimizer, optimizer_metrics, set_learning_rate
from jaxloop.update.transforms import (
    DampenedTraceState,
    adagrad,
    adam,
    adamw,
    dampened_trace,
    lion,
    rmsprop,
    scale_by_torch_adagrad,
    sgd,
)


def _steps(tx, grads, p=1.0):
    """The updates tx emits for a scalar parameter p (held fixed) and each gradient."""
    params = jnp.asarray(p, jnp.float32)
    state, out = tx.init(params), []
    for g in grads:
        u, state = tx.update(jnp.asarray(g, jnp.float32), state, params)
        out.append(float(u))
    return out


def test_sgd_dampening_applies_from_the_second_update_on():
    # torch.optim.SGD: b1 = g1 = 1; b2 = 0.5 * 1 + (1 - 0.5) * 2 = 1.5; b3 = 0.75 + 0.5 * 3 = 2.25
    assert _steps(dampened_trace(momentum=0.5, dampening=0.5), [1.0, 2.0, 3.0]) == [1.0, 1.5, 2.25]
    tx = sgd(learning_rate=1.0, momentum=0.5, dampening=0.5, nesterov=False, weight_decay=0.0)
    assert _steps(tx, [1.0, 2.0, 3.0]) == [-1.0, -1.5, -2.25]
    assert isinstance(tx.init(jnp.zeros([]))[0], DampenedTraceState)


def test_sgd_momentum_starts_from_the_first_gradient_and_nesterov_looks_ahead():
    # dampening 0 (optax.trace): b1 = 1, b2 = 2 + 0.5 = 2.5; nesterov: g + m b = 1.5, 2 + 1.25 = 3.25
    assert _steps(sgd(1.0, momentum=0.5, dampening=0.0, nesterov=False, weight_decay=0.0), [1.0, 2.0]) == [-1.0, -2.5]
    assert _steps(sgd(1.0, momentum=0.5, dampening=0.0, nesterov=True, weight_decay=0.0), [1.0, 2.0]) == [-1.5, -3.25]


def test_sgd_weight_decay_enters_the_gradient_before_the_momentum():
    # p = 2 (a matrix: decayed), wd 0.5: g' = 1 + 1 = 2; b1 = 2, b2 = 0.5 * 2 + 2 = 3
    tx = sgd(1.0, momentum=0.5, dampening=0.0, nesterov=False, weight_decay=0.5)
    params = {"w": jnp.full((1, 1), 2.0)}
    state = tx.init(params)
    got = []
    for _ in range(2):
        u, state = tx.update({"w": jnp.ones((1, 1))}, state, params)
        got.append(float(u["w"][0, 0]))
    assert got == [-2.0, -3.0]


def test_adam_decays_as_l2_in_the_gradient_and_adamw_decoupled():
    # first step, b1 = b2 = 0, eps tiny: Adam's direction is g' / |g'| = 1 whatever the decay; AdamW adds wd p
    params, grads = {"w": jnp.full((1, 1), 1.0)}, {"w": jnp.full((1, 1), 1.0)}
    step = lambda tx: float(tx.update(grads, tx.init(params), params)[0]["w"][0, 0])  # noqa: E731
    assert step(adam(1.0, b1=0.0, b2=0.0, eps=1e-30, weight_decay=0.5)) == -1.0
    assert step(adamw(1.0, b1=0.0, b2=0.0, eps=1e-30, weight_decay=0.5)) == -1.5


def test_rmsprop_adds_eps_outside_the_root_and_keeps_momentum_before_the_rate():
    # alpha 0.75, g = 2: avg = 0.25 * 4 = 1; 2 / (sqrt(1) + 1) = 1 (eps inside the root would give 2 / sqrt(2))
    assert _steps(rmsprop(1.0, alpha=0.75, eps=1.0, momentum=0.0, centered=False, weight_decay=0.0), [2.0]) == [-1.0]
    # centered, alpha 0.5, g = 2: mean = 1, avg = 2, 2 / (sqrt(2 - 1) + 1) = 1
    assert _steps(rmsprop(1.0, alpha=0.5, eps=1.0, momentum=0.0, centered=True, weight_decay=0.0), [2.0]) == [-1.0]
    # momentum 0.5 and the rate 1 then 0.5: torch's buffer holds the directions d_t = g / (sqrt(avg) + eps) and
    # the current rate scales it: -1 * d1 = -1, then -0.5 * (0.5 d1 + d2) (optax.rmsprop traces rate-scaled
    # steps instead: -(0.5 * 1 + 0.5 d2), which differs as soon as the rate changes)
    rate = lambda count: jnp.where(count == 0, 1.0, 0.5)  # noqa: E731
    tx = optax.inject_hyperparams(rmsprop, static_args=("alpha", "eps", "momentum", "centered", "weight_decay"))(
        learning_rate=rate, alpha=0.75, eps=1.0, momentum=0.5, centered=False, weight_decay=0.0
    )
    steps = _steps(tx, [2.0, 2.0])
    d2 = 2.0 / (np.sqrt(0.75 * 1.0 + 0.25 * 4.0) + 1.0)
    assert steps[0] == -1.0 and steps[1] == pytest.approx(-0.5 * (0.5 + d2), rel=1e-7)


def test_adagrad_divides_by_root_plus_eps_from_the_initial_accumulator_and_decays_its_rate():
    # s0 = 7, g = 3: s = 16, 3 / (4 + 0) = 0.75; then g = 3: s = 25, 3 / 5, divided by 1 + 1 * lr_decay = 2
    got = _steps(scale_by_torch_adagrad(lr_decay=1.0, initial_accumulator_value=7.0, eps=0.0), [3.0, 3.0])
    assert got == [0.75, float(np.float32(3) / np.float32(5) / np.float32(2))]
    assert _steps(adagrad(2.0, lr_decay=0.0, initial_accumulator_value=7.0, eps=0.0, weight_decay=0.0), [3.0]) == [-1.5]


def test_lion_steps_by_the_sign_of_the_interpolation_and_decays_decoupled():
    # c = 0.9 * 0 + 0.1 * g: sign 1; p = 2 (matrix): -lr (1 + 0.5 * 2) = -2 * lr
    params, grads = {"w": jnp.full((1, 1), 2.0), "b": jnp.full((1,), 2.0)}, {"w": jnp.ones((1, 1)), "b": jnp.ones((1,))}
    tx = lion(0.5, b1=0.9, b2=0.99, weight_decay=0.5)
    u, _ = tx.update(grads, tx.init(params), params)
    assert float(u["w"][0, 0]) == -1.0 and float(u["b"][0]) == -0.5, "no decay on a vector (decay_mask)"


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_decays_matrices_only(name):
    """Zero gradients, weight decay 0.5: a matrix moves (toward 0), a bias never does."""
    o = OptimConfig(
        optimizer=OPTIMIZERS[name](weight_decay=0.5),  # momentum 0 (sgd, rmsprop): their default
        lr_schedule=WarmupCosineConfig(warmup_steps=0),
        peak_lr=0.1,
        clip_norm=0.0,
    )
    tx = make_optimizer(o, 10, get_policy("fp32"))
    params = {"w": jnp.full((2, 2), 1.0), "b": jnp.full((2,), 1.0)}
    zeros = jax.tree.map(jnp.zeros_like, params)
    u, _ = tx.update(zeros, tx.init(params), params)
    assert float(jnp.max(jnp.abs(u["b"]))) == 0.0
    assert float(jnp.min(-u["w"])) > 0.0, "the matrix decays toward 0"


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_logs_the_rate_it_applied(name):
    o = OptimConfig(
        optimizer=OPTIMIZERS[name](),
        lr_schedule=WarmupCosineConfig(init_lr=0.0, warmup_steps=4),
        peak_lr=0.5,
        clip_norm=0.0,
    )
    tx = make_optimizer(o, 10, get_policy("fp32"))
    params = {"w": jnp.ones((2, 2))}
    state = tx.init(params)
    for _ in range(3):
        _, state = tx.update({"w": jnp.ones((2, 2))}, state, params)
    assert float(optimizer_metrics(state)["lr"]) == 0.25, "update 2 of a warmup of 4 to 0.5"


def test_plateau_keeps_a_numeric_rate_that_the_host_replaces():
    o = OptimConfig(optimizer=SGDConfig(weight_decay=0.0), lr_schedule=PlateauConfig(), peak_lr=0.5, clip_norm=0.0)
    tx = make_optimizer(o, 10, get_policy("fp32"))
    params, grads = {"w": jnp.zeros((1,))}, {"w": jnp.ones((1,))}
    state = tx.init(params)
    u, state = tx.update(grads, state, params)
    assert float(u["w"][0]) == -0.5
    state = set_learning_rate(state, 0.125)
    u, state = tx.update(grads, state, params)
    assert float(u["w"][0]) == -0.125 and float(optimizer_metrics(state)["lr"]) == 0.125
    assert state is not None and find_state(state, SkipWindowsState).skipped == 0


def test_a_scheduled_rate_cannot_be_set_by_the_host():
    tx = make_optimizer(OptimConfig(), 10, get_policy("fp32"))
    with pytest.raises(LookupError, match="numeric learning_rate"):
        set_learning_rate(tx.init({"w": jnp.zeros((2, 2))}), 0.1)


def test_an_adagrad_update_whose_state_would_overflow_is_skipped():
    """Adagrad's sum of squares grows without bound; the loop checks its result (optimizers.BOUNDED): a sum
    that would overflow float32 (3e38 + 1e38) skips the update and keeps the state finite."""
    o = OptimConfig(
        optimizer=AdagradConfig(initial_accumulator_value=3e38, weight_decay=0.0),
        lr_schedule=WarmupCosineConfig(warmup_steps=0),
        peak_lr=0.1,
        clip_norm=0.0,
    )
    tx = make_optimizer(o, 10, get_policy("fp32"))
    params = {"w": jnp.zeros((1,))}
    u, state = tx.update({"w": jnp.full((1,), 1e19)}, tx.init(params), params)
    assert float(u["w"][0]) == 0.0 and int(find_state(state, SkipWindowsState).skipped) == 1
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(state))
