"""The jitted train step: schedule, accumulation, clipping, precision policies and the non-finite policy."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.tree_utils import tree_set

from jaxloop.config.optimizers import AdamWConfig
from jaxloop.config.run import Config, DataConfig, ModelConfig, OptimConfig
from jaxloop.config.schedules import WarmupCosineConfig
from jaxloop.loop.task import create_train_state
from jaxloop.model.builtin import make_model
from jaxloop.update import step as update_step
from jaxloop.update.optimizer import LossScaleState, find_state, loss_scale, replace_state
from jaxloop.update.schedules import make_schedule
from jaxloop.update.step import cross_entropy_loss, make_train_step
from parity_tests.oracle import lr_oracle as closed_form

train_step = jax.jit(update_step.train_step, donate_argnums=0)  # as the loop builds it

F32_EPS = 2.0**-23
FEATURES, CLASSES = 16, 5


def _cfg(warmup_steps: int = 4, weight_decay: float = 1e-2, **shared) -> Config:
    """AdamW under warmup_cosine (1e-4 -> 1e-2 -> 1e-5), clipping at 1; `shared`: OptimConfig's own fields."""
    o = OptimConfig(
        optimizer=AdamWConfig(weight_decay=weight_decay),
        lr_schedule=WarmupCosineConfig(init_lr=1e-4, end_lr=1e-5, warmup_steps=warmup_steps),
        **{"peak_lr": 1e-2, "clip_norm": 1.0, **shared},
    )
    return Config(steps=12, batch_size=8, optim=o, model=ModelConfig(hidden=(32,)))


def _batch(seed: int, n: int = 8) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(n, FEATURES)).astype(np.float32),
        "y": rng.integers(0, CLASSES, size=n).astype(np.int32),
    }


def _state(cfg: Config):
    return create_train_state(cfg, make_model(cfg.model, CLASSES, cfg.precision), np.zeros((1, FEATURES), np.float32))


def _host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def _inner_adam(opt_state):
    """The ScaleByAdamState inside the optimizer (MultiSteps(chain(clip, adamw)) and its wrappers)."""
    leaves = jax.tree.leaves(opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
    return next(s for s in leaves if isinstance(s, optax.ScaleByAdamState))


@pytest.mark.parametrize("accum", [1, 2])
def test_applied_lr_per_update_equals_float64_closed_form(accum):
    # optax evaluates the schedule in float32 from values <= peak_lr: allow 8 float32 ulps of peak_lr.
    # (accum 2: the step the other accumulating tests of this module compile, one program for the session)
    cfg = _cfg(accum_steps=accum)
    state = _state(cfg)
    tol = 8 * F32_EPS * cfg.optim.peak_lr
    worst = 0.0
    for u in range(cfg.steps):
        for k in range(accum):
            state, m = train_step(state, _batch(100 * u + k))
            assert bool(m["updated"]) == (k == accum - 1), "an update is applied once per K micro-batches"
        # lr: the rate the optimizer applied in update u, read from its state
        worst = max(worst, abs(float(m["lr"]) - closed_form(cfg, u)))
        assert int(state.step) == u + 1
        assert int(_inner_adam(state.opt_state).count) == u + 1, "adamw's schedule count advances once per update"
    assert worst <= tol, f"max |lr - closed form| = {worst:.3g} > {tol:.3g}"


def test_schedule_holds_end_lr_past_steps_and_hits_its_anchors():
    # float32: optax's warmup computes (init - peak) * frac + peak, so errors are ulps of peak_lr.
    cfg = _cfg(warmup_steps=4)
    s, tol = make_schedule(cfg.optim, cfg.steps), 8 * F32_EPS * cfg.optim.peak_lr
    assert abs(float(s(0)) - cfg.optim.lr_schedule.init_lr) <= tol
    assert abs(float(s(4)) - cfg.optim.peak_lr) <= tol
    for u in (cfg.steps, cfg.steps + 1, 10 * cfg.steps):
        assert abs(float(s(u)) - cfg.optim.lr_schedule.end_lr) <= tol


def test_schedule_with_warmup_equal_to_steps_is_all_warmup():
    cfg = _cfg(warmup_steps=12)
    s, tol = make_schedule(cfg.optim, cfg.steps), 8 * F32_EPS * cfg.optim.peak_lr
    for u in range(14):
        assert abs(float(s(u)) - closed_form(cfg, u)) <= tol


def test_k_micro_batches_equal_one_batch_of_k_times_b():
    # Mean of K micro-batch means (optax's running mean) vs the mean over K*B records: same gradient up
    # to float32 summation order; after 3 Adam updates params agree to 1e-6 absolute (Adam's normalised
    # steps are lr-sized, 1e-2, so this is ~1e-4 of one step).
    k, b = 4, 8
    cfg_k, cfg_1 = _cfg(accum_steps=k), _cfg(accum_steps=1)
    s_k, s_1 = _state(cfg_k), _state(cfg_1)
    for u in range(3):
        big = _batch(u, k * b)
        for i in range(k):
            s_k, m_k = train_step(s_k, {key: v[i * b : (i + 1) * b] for key, v in big.items()})
        s_1, m_1 = train_step(s_1, big)
        assert float(m_k["grad_norm"]) == pytest.approx(float(m_1["grad_norm"]), rel=1e-5)
    diff = max(
        float(np.max(np.abs(a - c)))
        for a, c in zip(jax.tree.leaves(_host(s_k.params)), jax.tree.leaves(_host(s_1.params)))
    )
    assert diff <= 1e-6, f"max |params_K - params_KB| = {diff:.3g}"


def _reference_grads(state, batch: dict) -> dict:
    """The mean cross-entropy's gradient at state.params, on the host: one jitted program of its own (the
    train step's is another), the same for every test that calls it, so the session compiles it once."""
    loss = lambda p, b: optax.softmax_cross_entropy_with_integer_labels(  # noqa: E731
        state.model.module.apply({"params": p}, b["x"]), b["y"]
    ).mean()
    return _host(jax.jit(jax.grad(loss))(state.params, batch))


def test_clip_factor_is_max_norm_over_norm_when_norm_exceeds_it():
    # Adam's first moment after one update is (1 - b1) * clipped gradient; compare it with the raw
    # gradient scaled by clip_norm / norm. The reference gradient comes from a separately compiled
    # program, so elements agree to float32 rounding: 1e-5 of each leaf's largest element.
    cfg = _cfg(clip_norm=0.01)
    state = _state(cfg)
    batch = _batch(0)
    grads = _reference_grads(state, batch)
    norm = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in jax.tree.leaves(grads)))
    assert norm > cfg.optim.clip_norm
    state, m = train_step(state, batch)
    assert float(m["grad_norm"]) == pytest.approx(norm, rel=1e-5), "grad_norm is the pre-clip norm"
    mu = _host(_inner_adam(state.opt_state).mu)
    factor = cfg.optim.clip_norm / norm
    for g, m1 in zip(jax.tree.leaves(grads), jax.tree.leaves(mu)):
        want = (1 - cfg.optim.optimizer.b1) * g * factor
        np.testing.assert_allclose(m1, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_no_clipping_below_max_norm():
    cfg = _cfg(clip_norm=1e6)
    state = _state(cfg)
    batch = _batch(0)
    grads = _reference_grads(state, batch)
    state, _ = train_step(state, batch)
    for g, m1 in zip(jax.tree.leaves(grads), jax.tree.leaves(_host(_inner_adam(state.opt_state).mu))):
        want = (1 - cfg.optim.optimizer.b1) * g
        np.testing.assert_allclose(m1, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_no_weight_decay_on_biases():
    # With zero gradients (zero learning signal is impossible with data, so use lr on decay only):
    # compare two runs differing only in weight_decay; biases move identically, kernels do not. The
    # biases start at 0.1, not flax's 0, where any decay is 0 (mutant seen failing: decay_mask true for
    # every leaf). The first config is the module's default (weight_decay 1e-2: its step is compiled once
    # for the session), the second decays 50 times as hard.
    def biases_at(state, value: float):
        params = {
            layer: {**p, "bias": np.full(p["bias"].shape, value, np.float32)} for layer, p in state.params.items()
        }
        return state.replace(params=params)

    a, b = (biases_at(_state(cfg), 0.1) for cfg in (_cfg(), _cfg(weight_decay=0.5)))
    batch = _batch(1)
    a, _ = train_step(a, batch)
    b, _ = train_step(b, batch)
    pa, pb = _host(a.params), _host(b.params)
    for layer in pa:
        np.testing.assert_array_equal(pa[layer]["bias"], pb[layer]["bias"])
        assert np.max(np.abs(pa[layer]["kernel"] - pb[layer]["kernel"])) > 0


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_policies_keep_params_optimizer_state_and_loss_fp32(precision):
    cfg = Config(steps=12, batch_size=8, precision=precision, model=ModelConfig(hidden=(32,)))
    state = _state(cfg)
    compute = jnp.bfloat16 if precision == "bf16" else jnp.float16
    jaxpr = str(jax.make_jaxpr(lambda s, b: train_step(s, b))(state, _batch(0)))
    assert f"{jnp.dtype(compute).name}" in jaxpr, "the forward/backward runs in the compute dtype"
    state, m = train_step(state, _batch(0))
    assert m["loss"].dtype == jnp.float32
    for leaf in jax.tree.leaves((state.params, _inner_adam(state.opt_state))):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert leaf.dtype == jnp.float32


def _nan_batch(seed: int) -> dict:
    b = _batch(seed)
    b["x"][0, 0] = np.nan
    return b


def test_nan_batch_leaves_params_and_moments_unchanged_and_is_counted():
    cfg = _cfg()
    state, _ = train_step(_state(cfg), _batch(0))
    before = _host((state.params, _inner_adam(state.opt_state)))
    state, m = train_step(state, _nan_batch(1))
    after = _host((state.params, _inner_adam(state.opt_state)))
    jax.tree.map(np.testing.assert_array_equal, before, after)
    assert int(m["skipped"]) == 1 and int(m["bad_streak"]) == 1 and not bool(m["updated"])
    assert int(state.step) == 1, "a skipped update does not advance the update count (nor the schedule)"
    state, m = train_step(state, _batch(2))
    assert bool(m["updated"]) and int(m["bad_streak"]) == 0 and int(state.step) == 2


def test_nan_at_a_non_emitting_micro_step_skips_the_whole_update():
    # optax.MultiSteps multiplies 0 x update at non-emitting micro-steps: unguarded, a NaN would reach
    # the params at once. The window with the NaN micro-batch is discarded at its boundary.
    cfg = _cfg(accum_steps=2)
    state = _state(cfg)
    before = _host((state.params, _inner_adam(state.opt_state)))
    state, m0 = train_step(state, _nan_batch(0))
    assert not bool(m0["updated"])
    jax.tree.map(np.testing.assert_array_equal, before, _host((state.params, _inner_adam(state.opt_state))))
    state, m1 = train_step(state, _batch(1))
    after = _host((state.params, _inner_adam(state.opt_state)))
    jax.tree.map(np.testing.assert_array_equal, before, after)
    assert int(m1["skipped"]) == 1 and int(state.step) == 0
    assert int(find_state(state.opt_state, optax.MultiStepsState).mini_step) == 0
    accumulated = _host(find_state(state.opt_state, optax.MultiStepsState).acc_grads)
    assert all(float(np.abs(a).max()) == 0 for a in jax.tree.leaves(accumulated))
    for k in range(2):
        state, m = train_step(state, _batch(10 + k))
    assert bool(m["updated"]) and int(state.step) == 1
    assert all(np.isfinite(a).all() for a in jax.tree.leaves(_host(state.params)))


def test_fp16_loss_scale_halves_on_overflow_and_doubles_after_2000_good_updates():
    cfg = Config(steps=12, batch_size=8, precision="fp16", model=ModelConfig(hidden=(32,)))
    state = _state(cfg)
    assert float(loss_scale(state.opt_state)) == 2.0**16
    state, m = train_step(state, _nan_batch(0))
    assert float(loss_scale(state.opt_state)) == 2.0**15 and int(m["skipped"]) == 1
    state = state.replace(opt_state=tree_set(state.opt_state, good_steps=jnp.asarray(1999, jnp.int32)))
    state, m = train_step(state, _batch(1))
    assert (
        float(loss_scale(state.opt_state)) == 2.0**16
        and int(find_state(state.opt_state, LossScaleState).good_steps) == 0
    )


def test_fp16_overflow_from_a_huge_scale_is_skipped_not_applied():
    # With an absurd scale the scaled fp16 backward overflows: the update is skipped and the scale halves,
    # exactly as GradScaler would; params stay finite.
    cfg = Config(steps=12, batch_size=8, precision="fp16", model=ModelConfig(hidden=(32,)))
    state = _state(cfg)
    big = lambda: jnp.asarray(2.0**40, jnp.float32)  # noqa: E731  (two buffers: the state is donated)
    state = state.replace(opt_state=replace_state(state.opt_state, LossScaleState, scale=big(), factor=big()))
    state, m = train_step(state, _batch(0))
    assert int(m["skipped"]) == 1 and float(loss_scale(state.opt_state)) == 2.0**39
    assert all(np.isfinite(a).all() for a in jax.tree.leaves(_host(state.params)))


def test_train_step_compiles_once():
    cfg = _cfg(accum_steps=2)
    state = _state(cfg)
    step = jax.jit(make_train_step(cross_entropy_loss), donate_argnums=0)
    for i in range(6):
        state, _ = step(state, _batch(i))
    assert step._cache_size() == 1


def test_train_step_donates_the_state():
    # The input state's buffers are given to the output (no second copy of params and optimizer state):
    # after the call every leaf of the old state is deleted.
    cfg = _cfg(accum_steps=2)
    state = _state(cfg)
    step = jax.jit(make_train_step(cross_entropy_loss), donate_argnums=0)
    state, _ = step(state, _batch(0))  # buffers produced by the step, as in the loop
    new_state, _ = step(state, _batch(1))
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(state))
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(new_state))


def test_train_step_needs_no_host_transfer():
    # With state and batch on the device, a compiled step moves nothing between host and device (no
    # callbacks, no implicit fetch): it runs under a guard that disallows every transfer.
    cfg = _cfg(accum_steps=2)
    step = jax.jit(make_train_step(cross_entropy_loss), donate_argnums=0)
    state = step(_state(cfg), _batch(0))[0]  # compiled outside the guard
    batch = jax.device_put(_batch(1))
    with jax.transfer_guard("disallow"):
        for _ in range(4):
            state, metrics = step(state, batch)
    assert np.isfinite(float(metrics["loss"]))


def test_per_step_randomness_differs_between_micro_steps_and_updates():
    # Dropout masks come from fold_in(rng, micro_steps): two identical batches in the same window, or
    # in consecutive updates, see different masks, hence different losses.
    cfg = Config(
        preset="shakespeare",
        steps=10,
        batch_size=4,
        optim=OptimConfig(lr_schedule=WarmupCosineConfig(warmup_steps=1), accum_steps=2),
        model=ModelConfig(kind="gpt", context=8, d_model=16, n_layers=1, n_heads=2, dropout=0.5),
        data=DataConfig(source="text", path="unused.txt"),
    )
    model = make_model(cfg.model, 11, cfg.precision)
    state = create_train_state(cfg, model, np.zeros((1, 8), np.int32))
    tokens = np.random.default_rng(0).integers(0, 11, size=(4, 9)).astype(np.int32)
    batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
    losses = []
    for _ in range(4):
        state, m = train_step(state, batch)
        losses.append(float(m["loss"]))
    assert losses[0] != losses[1]


def test_an_update_that_would_make_the_state_non_finite_is_skipped():
    # A finite gradient of 1e20 per parameter (loss = 1e20 * sum(params)) squares past float32's max:
    # Adam's second moment would be inf. The update is skipped and the state stays finite, so every
    # state out of train_step can be saved.
    def linear_loss(model, batch, train):
        return 1e20 * sum(jnp.sum(p) for p in jax.tree.leaves(model.params)), {}

    cfg = _cfg(clip_norm=0.0)
    state = _state(cfg)
    before = _host((state.params, _inner_adam(state.opt_state)))
    state, m = jax.jit(make_train_step(linear_loss))(state, _batch(0))
    assert float(m["loss"]) != 0 and np.isfinite(float(m["loss"])), "loss and gradient (1e20) are finite"
    assert int(m["skipped"]) == 1 and int(state.step) == 0
    jax.tree.map(np.testing.assert_array_equal, before, _host((state.params, _inner_adam(state.opt_state))))


def _gpt(**model) -> tuple:
    m = dict(kind="gpt", context=8, d_model=16, n_layers=2, n_heads=2)
    m.update(model)
    cfg = Config(
        preset="shakespeare",
        steps=10,
        batch_size=4,
        optim=OptimConfig(lr_schedule=WarmupCosineConfig(warmup_steps=1)),
        model=ModelConfig(**m),
        data=DataConfig(source="text", path="unused.txt"),
    )
    tokens = np.random.default_rng(0).integers(0, 11, size=(4, 9)).astype(np.int32)
    return cfg, {"x": tokens[:, :-1], "y": tokens[:, 1:]}


def test_gpt_with_rematerialised_blocks_computes_the_same_update():
    # remat recomputes the blocks' activations in the backward pass: the same math, possibly fused
    # differently, so float32 losses and updated params agree to 1e-6.
    results = []
    for remat in (False, True):
        cfg, batch = _gpt()
        state = create_train_state(cfg, make_model(cfg.model, 11, cfg.precision).clone(remat=remat), batch["x"][:1])
        state, m = train_step(state, batch)
        results.append((float(m["loss"]), _host(state.params)))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6), results[0][1], results[1][1])


def test_gpt_head_is_tied_to_the_token_embedding_or_separate():
    # the state's shapes (jax.eval_shape): what create_train_state builds, without compiling the init
    for tie, expect_head in ((True, False), (False, True)):
        cfg, batch = _gpt(tie_embeddings=tie)
        model = make_model(cfg.model, 11, cfg.precision)
        params = jax.eval_shape(lambda: create_train_state(cfg, model, batch["x"][:1])).params  # noqa: B023
        assert ("head" in params) == expect_head
        assert params["tok_embed"]["embedding"].shape == (11, 16)


def test_gpt_is_causal_a_later_token_never_changes_earlier_logits():
    cfg, batch = _gpt()
    state = create_train_state(cfg, make_model(cfg.model, 11, cfg.precision), batch["x"][:1])
    apply = jax.jit(state.model.module.apply)  # one program for both inputs (eagerly: one per op)
    x = batch["x"].copy()
    a = np.asarray(apply({"params": state.params}, x))
    x[:, -1] = (x[:, -1] + 1) % 11
    b = np.asarray(apply({"params": state.params}, x))
    np.testing.assert_array_equal(a[:, :-1], b[:, :-1])
    assert not np.array_equal(a[:, -1], b[:, -1])
