"""jaxloop.update.optimizer's own transformations, worked by hand on one scalar parameter (as optax tests its own).

Inner optimizer: optax.sgd(1), so an applied update moves p by minus the (mean) gradient; every number
below is exact in float32.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxloop.config.run import OptimConfig
from jaxloop.config.schedules import WarmupCosineConfig
from jaxloop.model.precision import get_policy
from jaxloop.update.optimizer import (
    SkipWindowsState,
    dynamic_loss_scale,
    find_state,
    make_optimizer,
    optimizer_metrics,
    record_grad_norm,
    skip_nonfinite_windows,
    updates_applied,
)

NAN, INF = float("nan"), float("inf")


def _run(tx, grads, p=1.0):
    """Feed scalar gradients through tx; the param after each and the final state."""
    params = jnp.asarray(p, jnp.float32)
    state = tx.init(params)
    trail = []
    for g in grads:
        updates, state = tx.update(jnp.asarray(g, jnp.float32), state, params)
        params = optax.apply_updates(params, updates)
        trail.append(float(params))
    return trail, state


def _skip(k: int, inner=None):
    return skip_nonfinite_windows(inner or optax.sgd(1.0), k)


def test_finite_windows_apply_the_mean_gradient_once_per_window():
    # K=2: gradients 2, 4 -> mean 3 -> p = 1 - 3 = -2, applied at the second micro-batch only.
    trail, state = _run(_skip(2), [2.0, 4.0])
    assert trail == [1.0, -2.0]
    assert int(updates_applied(state)) == 1 and int(state.skipped) == 0


def test_a_nan_in_any_micro_batch_skips_its_whole_window_and_the_next_starts_clean():
    # Window 1: NaN, 4 -> skipped (p stays 1, update count stays 0, accumulator restarts);
    # window 2: 1, 3 -> mean 2 -> p = -1. Had the NaN entered the accumulator (optax.MultiSteps resets
    # it as 0 * acc = NaN), window 2 would be NaN too.
    trail, state = _run(_skip(2), [NAN, 4.0, 1.0, 3.0])
    assert trail == [1.0, 1.0, 1.0, -1.0]
    assert int(updates_applied(state)) == 1
    assert int(state.skipped) == 1 and int(state.bad_streak) == 0 and not bool(state.poisoned)


def test_a_nan_in_the_last_micro_batch_skips_too_and_streaks_count_consecutive_skips():
    trail, state = _run(_skip(2), [1.0, INF, 1.0, NAN])
    assert trail == [1.0] * 4
    assert int(state.skipped) == 2 and int(state.bad_streak) == 2 and int(updates_applied(state)) == 0
    _, state = _run(_skip(1), [NAN, NAN, 5.0])
    assert int(state.skipped) == 2 and int(state.bad_streak) == 0, "an applied update ends the streak"


def test_an_update_whose_result_is_not_finite_is_skipped():
    # Finite gradient 2^100, scaled by -2^33: the update (-2^133) overflows float32. Skipped, p stays;
    # then 2^-33 -> update -1 -> p = 0.
    trail, state = _run(_skip(1, optax.scale(-(2.0**33))), [2.0**100, 2.0**-33])
    assert trail == [1.0, 0.0]
    assert int(state.skipped) == 1 and int(updates_applied(state)) == 1


def _counting(inner: optax.GradientTransformation, calls: list) -> optax.GradientTransformation:
    def update(u, s, p=None):
        calls.append(1)
        return inner.update(u, s, p)

    return optax.GradientTransformation(inner.init, update)


@pytest.mark.parametrize("k", [1, 2])
def test_the_inner_transformation_is_traced_once_per_step(k):
    # Trace time of a big step grows with every trace of Adam's chain: the zero updates of a skipped or
    # accumulating micro-batch take the gradient's types, no jax.eval_shape of the inner update.
    # Mutant seen failing: out_shape from jax.eval_shape again (2 traces).
    calls: list = []
    tx = skip_nonfinite_windows(_counting(optax.adam(1e-3), calls), k, check_result=False)
    params = jnp.ones(3, jnp.float32)
    jax.jit(tx.update).trace(jnp.ones(3, jnp.float32), tx.init(params), params)
    assert len(calls) == 1


def test_an_inner_transformation_changing_the_update_dtype_still_accumulates_and_skips():
    # An inner update returning float16 (not the gradient's float32): the zero updates must be float16
    # too; the types then come from a second trace. K = 2, inner optax.sgd(1) then cast: gradients 2, 4
    # -> p = 1 - 3 = -2; a NaN window is skipped with float16 zeros.
    to_f16 = optax.stateless(lambda u, p=None: jnp.asarray(u, jnp.float16))
    trail, _ = _run(skip_nonfinite_windows(optax.chain(optax.sgd(1.0), to_f16), 2), [2.0, 4.0, NAN, 1.0])
    assert trail == [1.0, -2.0, -2.0, -2.0]


def test_an_inner_transformation_changing_the_update_structure_still_accumulates():
    # Updates of another pytree structure than the gradient (here wrapped in a dict): the zero updates
    # of an accumulating micro-batch take that structure (lax.cond's structure mismatch, then eval_shape).
    wrap = optax.stateless(lambda u, p=None: {"w": u})
    tx = skip_nonfinite_windows(wrap, 2)
    state = tx.init(jnp.ones([], jnp.float32))
    first, state = tx.update(jnp.asarray(2.0, jnp.float32), state)
    second, _ = tx.update(jnp.asarray(4.0, jnp.float32), state)
    assert float(first["w"]) == 0.0 and float(second["w"]) == 3.0  # mean of 2 and 4, emitted at the second


def test_the_retry_for_other_update_types_does_not_depend_on_the_wording_of_lax_conds_error(monkeypatch):
    # A jax release may reword lax.cond's TypeError: the retry is decided by comparing the inner update's
    # types with the gradient's. Mutant seen failing: the retry decided by the message's text again.
    cond = jax.lax.cond

    def reworded(*args, **kwargs):
        try:
            return cond(*args, **kwargs)
        except TypeError:
            raise TypeError("the branches of this cond disagree") from None

    monkeypatch.setattr(jax.lax, "cond", reworded)
    to_f16 = optax.stateless(lambda u, p=None: jnp.asarray(u, jnp.float16))
    trail, _ = _run(skip_nonfinite_windows(optax.chain(optax.sgd(1.0), to_f16), 2), [2.0, 4.0])
    assert trail == [1.0, -2.0]


def test_an_inner_transformations_own_type_error_is_raised_as_it_is():
    # the retry must not swallow it. Mutant seen failing: the except clause returning the updates unchanged
    def update(u, state, params=None):
        raise TypeError("inner: bad gradient")

    with pytest.raises(TypeError, match="inner: bad gradient"):
        _run(skip_nonfinite_windows(optax.GradientTransformation(lambda p: optax.EmptyState(), update), 2), [1.0])


@pytest.mark.parametrize("k", [1, 2])
def test_make_optimizer_skips_a_window_whose_mean_gradient_overflows_when_squared(k):
    # make_optimizer's windows are checked before Adam runs (check_result=False): 2^70 is finite in
    # float32, its square 2^140 is not, so Adam's nu would overflow. The window is skipped, and the
    # moments, counts and params stay. Mutant: no check there; clipping then scales the gradient by
    # 1 / inf = 0 and a zero-gradient update (decay, count) is applied: skipped 0, counts 1.
    o = OptimConfig(
        lr_schedule=WarmupCosineConfig(init_lr=1e-2, end_lr=1e-2, warmup_steps=0),
        peak_lr=1e-2,
        clip_norm=1.0,
        accum_steps=k,
    )
    tx = make_optimizer(o, 10, get_policy("fp32"))
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    for _ in range(k):
        updates, state = tx.update({"w": jnp.full(3, 2.0**70)}, state, params)
    assert int(find_state(state, SkipWindowsState).skipped) == 1 and int(updates_applied(state)) == 0
    np.testing.assert_array_equal(updates["w"], 0.0)
    adam = find_state(state, optax.ScaleByAdamState).count
    assert int(adam) == 0 and float(jnp.abs(find_state(state, optax.ScaleByAdamState).nu["w"]).max()) == 0.0
    for _ in range(k):  # the next finite window applies
        _, state = tx.update({"w": jnp.ones(3)}, state, params)
    assert int(find_state(state, SkipWindowsState).skipped) == 1 and int(updates_applied(state)) == 1


def test_a_multisteps_is_refused_naming_what_to_pass_instead():
    # Its K, skip function and accumulator are private: wrapping it would silently run a K it cannot read.
    with pytest.raises(TypeError, match="pass its inner transformation and every_k"):
        skip_nonfinite_windows(optax.MultiSteps(optax.sgd(1.0), every_k_schedule=3))


def test_k_micro_batches_make_one_update_of_their_mean():
    tx = skip_nonfinite_windows(optax.sgd(1.0), 3, accumulator_dtype=jnp.float32)
    trail, _ = _run(tx, [3.0, 6.0, 9.0])
    assert trail == [1.0, 1.0, -5.0], "one update of the mean 6 after 3 micro-batches"


class _Renamed(NamedTuple):  # the same fields as SkipWindowsState under another type
    inner_state: Any
    poisoned: Any
    bad_streak: Any
    skipped: Any


def test_states_are_found_by_type_not_by_name():
    state = _skip(1).init({"w": jnp.zeros(2)})
    lookalike = _Renamed(*state)
    assert find_state(state, SkipWindowsState) is state
    assert find_state(lookalike, SkipWindowsState, required=False) is None, "a look-alike type is not the state"
    with pytest.raises(LookupError, match="exactly one SkipWindowsState"):
        find_state(lookalike, SkipWindowsState)
    with pytest.raises(LookupError, match="found 2"):
        find_state((state, state), SkipWindowsState)


def test_skipped_windows_keep_the_inner_state_and_schedule():
    # Adam's count is the schedule's clock: a skipped window leaves it at 1.
    tx = _skip(1, optax.adam(optax.linear_schedule(1.0, 0.0, 10)))
    _, state = _run(tx, [1.0, NAN])
    adam = next(s for s in optax.tree_utils.tree_get_all_with_path(state, "count"))[1]
    assert int(adam) == 1


def test_loss_scale_unscales_grows_after_interval_and_halves_on_a_skip():
    # init scale 8, growth every 2 applied updates. Scaled gradients 16, 8 -> true 2, 1 -> p = 1-2-1 = -2;
    # after the 2nd good update the scale doubles to 16; then an Inf: skipped, scale halves to 8.
    tx = dynamic_loss_scale(_skip(1), init_scale=8.0, growth_interval=2)
    trail, state = _run(tx, [16.0, 8.0])
    assert trail == [-1.0, -2.0]
    assert float(state.scale) == 16.0 and int(state.good_steps) == 0
    trail, state = _run(tx, [16.0, 8.0, INF])
    assert trail == [-1.0, -2.0, -2.0]
    assert float(state.scale) == 8.0 and int(state.good_steps) == 0


def test_loss_scale_counts_updates_not_micro_batches():
    # K=2: four micro-batches are two updates: growth interval 2 is reached once.
    tx = dynamic_loss_scale(_skip(2), init_scale=4.0, growth_interval=2)
    _, state = _run(tx, [4.0, 4.0, 4.0, 4.0])
    assert float(state.scale) == 8.0


def test_each_micro_batch_loss_is_scaled_by_scale_over_k_as_torch_scales_loss_over_k():
    # scale 8, K=2: factor 4. Gradients of 4 x loss: 8, 16 -> true 2, 4 -> mean 3 -> p = 1 - 3 = -2.
    tx = dynamic_loss_scale(_skip(2), init_scale=8.0, accum_steps=2)
    trail, state = _run(tx, [8.0, 16.0])
    assert trail == [1.0, -2.0]
    assert float(state.scale) == 8.0 and float(state.factor) == 4.0


def test_record_grad_norm_keeps_the_norm_and_passes_updates_through():
    tx = record_grad_norm()
    state = tx.init({"a": jnp.zeros(2)})
    updates, state = tx.update({"a": jnp.asarray([3.0, 4.0])}, state)
    assert float(state.grad_norm) == 5.0
    np.testing.assert_array_equal(updates["a"], [3.0, 4.0])


@pytest.mark.parametrize("k", [1, 3])
def test_logged_lr_is_the_rate_the_optimizer_applied(k):
    # With sgd-like unit gradients the rate is read back from inject_hyperparams' state: it must be the
    # schedule's value at each applied update u (warmup 0 -> 1e-2 over 4 updates), never per micro-batch.
    o = OptimConfig(
        lr_schedule=WarmupCosineConfig(init_lr=0.0, end_lr=1e-3, warmup_steps=4),
        peak_lr=1e-2,
        clip_norm=0.0,
        accum_steps=k,
    )
    tx = make_optimizer(o, 10, get_policy("fp32"))
    params = {"w": jnp.ones((2, 2))}
    state = tx.init(params)
    rates = []
    for _ in range(6 * k):
        _, state = tx.update({"w": jnp.ones((2, 2))}, state, params)
        rates.append(float(optimizer_metrics(state)["lr"]))
    per_update = rates[k - 1 :: k]
    np.testing.assert_allclose(per_update[:5], [0.0, 2.5e-3, 5e-3, 7.5e-3, 1e-2], rtol=1e-6)
    assert int(find_state(state, optax.MultiStepsState).gradient_step) == 6
