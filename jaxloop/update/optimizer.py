"""The optimizer, as optax transformations:

    [dynamic_loss_scale(] skip_nonfinite_windows(chain(
        record_grad_norm(), clip_by_global_norm, inject_hyperparams(optimizer)(schedule)), K) [)]

`optimizer` is optim.name's (jaxloop.update.transforms: adamw by default; adam, sgd, rmsprop, adagrad, lion with
torch.optim's semantics) or a Task's own optax transformation. skip_nonfinite_windows averages K
micro-batch gradients as optax.MultiSteps does (and keeps its state, MultiStepsState), so clipping acts on
the mean and the optimizer (and its schedule count) steps once per update; it drops a whole accumulation
window that saw a non-finite gradient (or whose mean gradient's sum of squares overflows): params,
moments, update count and schedule stay, the accumulator restarts. `dynamic_loss_scale` (fp16) unscales
the gradients and follows torch.amp.GradScaler's rule. The step reads what it logs from the state by type
(`find_state`, by isinstance): the applied rate (inject_hyperparams' `learning_rate`), GradNormState,
SkipWindowsState, LossScaleState.
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import optax

from jaxloop.config.run import OptimConfig
from jaxloop.model import precision
from jaxloop.model.precision import BACKOFF_FACTOR, GROWTH_FACTOR, GROWTH_INTERVAL, Policy
from jaxloop.update import transforms as torch_optimizers
from jaxloop.update.schedules import make_schedule
from jaxloop.update.transforms import adamw, decay_mask, scale_by_adam  # noqa: F401  (jaxloop.update.optimizer's names before the menu)

OwnOptimizer = Any
"""A Task's own optimizer: an optax.GradientTransformation, or a factory schedule -> GradientTransformation
(called with jaxloop's schedule, count -> rate)."""


def all_finite(tree: Any) -> jax.Array:
    """True when every floating leaf of tree is free of NaN and Inf: sum(x * 0) is 0 for finite x and NaN
    otherwise. One scalar sum, not a reduction-and-stack per leaf: XLA:CPU compiles this several
    times faster on a state of a few hundred leaves."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    return jnp.isfinite(sum(jnp.sum(x * 0, dtype=jnp.float32) for x in leaves)) if leaves else jnp.asarray(True)


def same_types(a: Any, b: Any) -> bool:
    """Whether two pytrees have one structure and each leaf one shape and dtype (what lax.cond's branches
    must agree on; weak types aside)."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(
        jnp.shape(x) == jnp.shape(y) and jnp.result_type(x) == jnp.result_type(y)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def _where(cond: jax.Array, a: Any, b: Any) -> Any:
    return jax.tree.map(lambda x, y: jnp.where(cond, x, y), a, b)


# ----------------------------------------------------------------------------- the gradient norm


class GradNormState(NamedTuple):
    grad_norm: jax.Array  # global L2 norm of the last gradient seen (inside MultiSteps: of the last update)


def record_grad_norm() -> optax.GradientTransformation:
    """Identity on the updates; keeps their global norm in the state (before clipping, for the logs)."""

    def init_fn(params: Any) -> GradNormState:
        return GradNormState(jnp.zeros([], optax.tree.dtype(params, "highest")))

    def update_fn(updates: Any, state: GradNormState, params: Any = None) -> tuple[Any, GradNormState]:
        del params
        return updates, GradNormState(optax.global_norm(updates).astype(state.grad_norm.dtype))

    return optax.GradientTransformation(init_fn, cast(optax.TransformUpdateFn, update_fn))  # its own state type


# ----------------------------------------------------------------------------- skipping non-finite windows


class SkipWindowsState(NamedTuple):
    inner_state: optax.MultiStepsState  # the accumulation window: counts, running mean, the inner tx's state
    poisoned: jax.Array  # the current accumulation window has seen a non-finite gradient
    bad_streak: jax.Array  # consecutive skipped updates
    skipped: jax.Array  # skipped updates in the whole run


def sum_of_squares_finite(tree: Any) -> jax.Array:
    """True when the sum of squares of tree's leaves is finite: every element finite and the global norm
    free of overflow."""
    return jnp.isfinite(optax.tree.norm(tree, squared=True))


def skip_nonfinite_windows(
    inner: optax.GradientTransformation, every_k: int = 1, *, accumulator_dtype: Any = None, check_result: bool = True
) -> optax.GradientTransformation:
    """Average `every_k` micro-batch gradients and apply `inner` to their mean once per window, as
    optax.MultiSteps does and with its state (optax.MultiStepsState, built by MultiSteps' public init),
    skipping every window that saw a non-finite gradient or whose result is not finite. An optax.MultiSteps
    as `inner` is refused: its K and accumulator are private; pass its inner transformation and K here.

    A non-finite micro-batch gradient enters the accumulator as zeros (so it never poisons the running
    mean) and marks the window; the update that closes a marked window, or one whose result would not be
    finite, is dropped as a whole: zero updates, the inner optimizer state (moments, counts, schedule)
    and the update count as before the window, the accumulator restarted. This is
    torch.amp.GradScaler's semantics (an overflow in any micro-batch makes the accumulated .grad
    non-finite and the step is skipped), and a state out of it is always finite, safe to checkpoint.

    `check_result`: True (any `inner`) inspects the updates and inner state it returns. False decides
    before running `inner`, from the mean gradient: a window is applied when the sum of its squares is
    finite. That suffices for make_optimizer's chain (clip scales by a factor <= 1; Adam's moments and
    update are finite when every g^2 is, given eps > 0 in float32, which the config enforces) and costs
    one reduction instead of one over the whole state.

    Unlike optax.MultiSteps, which runs the inner optimizer at every micro-batch and selects its result
    leaf by leaf, the inner transformation runs once per window (one lax.cond between accumulating and
    closing; none at K = 1): K = 4 runs Adam a quarter as often, and XLA:CPU compiles the step faster.
    """
    if isinstance(inner, optax.MultiSteps):
        raise TypeError(
            "skip_nonfinite_windows: an optax.MultiSteps is not accepted (its K and accumulator are "
            "private); pass its inner transformation and every_k instead (in a run: optim.accum_steps)"
        )
    if not isinstance(every_k, int) or every_k < 1:
        raise ValueError(f"skip_nonfinite_windows: every_k={every_k!r}; allowed: an int >= 1")
    k = every_k
    acc_dtype = jax.dtypes.canonicalize_dtype(accumulator_dtype or jnp.float32)
    window = optax.MultiSteps(inner, every_k_schedule=k, accumulator_dtype=acc_dtype)  # its public init only

    def init_fn(params: Any) -> SkipWindowsState:
        return SkipWindowsState(
            window.init(params), jnp.zeros([], bool), jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32)
        )

    def update_fn(updates: Any, state: SkipWindowsState, params: Any = None) -> tuple[Any, SkipWindowsState]:
        # The zero updates of a skipped or accumulating micro-batch take the inner transformation's output
        # types. Nearly every optax transformation returns its input's: assume so, and inner.update is
        # traced once (in its branch); only where lax.cond then finds the branches disagree is it traced
        # again, by jax.eval_shape for its types and in the retry (three traces where eval_shape always
        # made two; the 4-block GPT step's trace: 0.65 -> 0.55 s, best of 6 runs each).
        try:
            return windowed(updates, state, params, updates)
        except TypeError:  # lax.cond's, when its branches' outputs differ: retried only if inner's do
            shapes = jax.eval_shape(inner.update, updates, state.inner_state.inner_opt_state, params)[0]
            if same_types(shapes, updates):
                raise
        return windowed(updates, state, params, shapes)

    def windowed(updates: Any, state: SkipWindowsState, params: Any, out_shape: Any) -> tuple[Any, SkipWindowsState]:
        ms = state.inner_state
        zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)  # noqa: E731
        no_updates = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)  # noqa: E731
        if k == 1 and not check_result:  # the sum-of-squares check below covers the micro-batch's finiteness
            finite = jnp.asarray(True)
        else:
            finite = all_finite(updates)
        if k > 1:  # lax.cond over the whole tree, not a select per leaf (XLA:CPU compiles those slowly)
            updates = jax.lax.cond(finite, lambda u: u, zeros, updates)
        poisoned = state.poisoned | ~finite
        # optax.MultiSteps' running mean (Welford), in the same arithmetic; at K = 1 the gradient itself,
        # and the accumulator is never touched (it stays zeros)
        mean = updates if k == 1 else jax.tree.map(lambda g, a: a + (g - a) / (ms.mini_step + 1), updates, ms.acc_grads)

        def accumulate(_: Any) -> tuple[Any, optax.MultiStepsState, jax.Array]:
            acc = jax.tree.map(lambda a: a.astype(acc_dtype), mean)
            return no_updates(), ms._replace(mini_step=ms.mini_step + 1, acc_grads=acc), jnp.asarray(False)

        def close(_: Any) -> tuple[Any, optax.MultiStepsState, jax.Array]:
            g = optax.tree.cast_like(mean, updates)
            run = lambda _: inner.update(g, ms.inner_opt_state, params)  # noqa: E731
            keep = lambda _: (no_updates(), ms.inner_opt_state)  # noqa: E731
            # lax.cond over whole trees, not a select per leaf: XLA:CPU compiles the GPT step's selects
            # several times slower (measured: 10.9 s against 3.6 s; 67 s against 8 s with the predicate
            # reduced from the whole state)
            if check_result:
                new_updates, new_inner = run(None)
                skip = poisoned | ~all_finite((new_updates, new_inner))
                new_updates, new_inner = jax.lax.cond(skip, keep, lambda _: (new_updates, new_inner), None)
            else:
                skip = poisoned | ~sum_of_squares_finite(g)
                new_updates, new_inner = jax.lax.cond(skip, keep, run, None)
            closed = ms._replace(
                mini_step=jnp.zeros_like(ms.mini_step),
                acc_grads=ms.acc_grads if k == 1 else zeros(ms.acc_grads),
                gradient_step=ms.gradient_step + (~skip).astype(jnp.asarray(ms.gradient_step).dtype),
                inner_opt_state=new_inner,
            )
            return new_updates, closed, skip

        if k == 1:
            new_updates, new_ms, skip = close(None)
            emitted = jnp.asarray(True)
        else:
            emitted = ms.mini_step == k - 1
            new_updates, new_ms, skip = jax.lax.cond(emitted, close, accumulate, None)
        applied = emitted & ~skip
        return new_updates, SkipWindowsState(
            inner_state=new_ms,
            poisoned=poisoned & ~emitted,
            bad_streak=jnp.where(skip, state.bad_streak + 1, jnp.where(applied, 0, state.bad_streak)),
            skipped=state.skipped + skip.astype(jnp.int32),
        )

    return optax.GradientTransformation(init_fn, cast(optax.TransformUpdateFn, update_fn))  # its own state type


# ----------------------------------------------------------------------------- dynamic loss scale


class LossScaleState(NamedTuple):
    scale: jax.Array  # GradScaler's scale S
    factor: jax.Array  # what each micro-batch's loss is multiplied by: S / K (torch_ref scales loss / K)
    good_steps: jax.Array  # applied updates since the scale last changed
    inner_state: Any


def dynamic_loss_scale(
    inner: optax.GradientTransformation,
    init_scale: float = 2.0**16,
    growth_interval: int = GROWTH_INTERVAL,
    accum_steps: int = 1,
) -> optax.GradientTransformation:
    """Unscale gradients of a loss multiplied by `factor` = scale / accum_steps; halve the scale on a
    skipped update and double it after `growth_interval` applied ones (torch.amp.GradScaler's rule and
    defaults). The factor divides by K as torch's `scaler.scale(loss / K).backward()` does, so each
    micro-batch's scaled backward pass has the magnitude torch's has and overflows where torch's does.

    `inner` must keep `skipped` and `gradient_step` in its state (skip_nonfinite_windows over MultiSteps):
    they tell a skipped update from an applied one.
    """

    def init_fn(params: Any) -> LossScaleState:
        scale = jnp.asarray(init_scale, jnp.float32)
        return LossScaleState(scale, scale / accum_steps, jnp.zeros([], jnp.int32), inner.init(params))

    def update_fn(updates: Any, state: LossScaleState, params: Any = None) -> tuple[Any, LossScaleState]:
        updates = jax.tree.map(lambda g: (g / state.factor.astype(g.dtype)).astype(g.dtype), updates)
        new_updates, new_inner = inner.update(updates, state.inner_state, params)
        skipped = (
            find_state(new_inner, SkipWindowsState).skipped > find_state(state.inner_state, SkipWindowsState).skipped
        )
        applied = updates_applied(new_inner) > updates_applied(state.inner_state)
        good = state.good_steps + applied.astype(jnp.int32)
        grow = good >= growth_interval
        scale = jnp.where(
            skipped, state.scale * BACKOFF_FACTOR, jnp.where(grow, state.scale * GROWTH_FACTOR, state.scale)
        )
        good = jnp.where(skipped | grow, 0, good)
        return new_updates, LossScaleState(scale, scale / accum_steps, good, new_inner)

    return optax.GradientTransformation(init_fn, cast(optax.TransformUpdateFn, update_fn))  # its own state type


# ----------------------------------------------------------------------------- the whole optimizer


def make_optimizer(
    optim: OptimConfig, steps: int, policy: Policy, optimizer: OwnOptimizer = None
) -> optax.GradientTransformation:
    """The run's optimizer (module doc) from its sub-config, the update count and the precision policy;
    `optimizer`: a Task's own (a GradientTransformation, or a factory given the schedule), in place of
    optim.name's.

    Every hyperparameter is passed explicitly (optax's and torch's defaults differ: AdamW's weight decay
    is 1e-4 in optax, 1e-2 in torch). clip_norm = 0 means no clipping. The plateau schedule's rate is a
    number in the state, which the loop replaces at evaluations (jaxloop.loop.plateau).
    """
    o = optim
    parts = [record_grad_norm()]
    if o.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(o.clip_norm))
    schedule = make_schedule(o, steps)
    rate = lambda count: schedule(count).astype(policy.param_dtype)  # noqa: E731  (kept in the params' dtype)
    if optimizer is None:
        parts.append(torch_optimizers.build(o.optimizer, float(o.peak_lr) if o.schedule == "plateau" else rate))
        # For the optimizers whose state stays finite with a finite gradient the window is judged from the
        # mean gradient before running them; others are checked after (OptimizerConfig.bounded)
        check_result = not o.optimizer.bounded
    else:
        parts.append(optimizer if isinstance(optimizer, optax.GradientTransformation) else optimizer(rate))
        check_result = True
    # The accumulator holds gradients in the params' dtype (MultiSteps' default is float32)
    tx = skip_nonfinite_windows(
        optax.chain(*parts), o.accum_steps, accumulator_dtype=policy.param_dtype, check_result=check_result
    )
    if not policy.dynamic_scale:
        return tx
    return dynamic_loss_scale(tx, init_scale=precision.INIT_SCALE, accum_steps=o.accum_steps)


def set_learning_rate(opt_state: Any, rate: float) -> Any:
    """opt_state with the rate of the next updates replaced: the optimizer's one injected numeric
    `learning_rate` (plateau's; a scheduled one is recomputed from its count, so it cannot be set). The new
    value keeps the old one's dtype and placement."""
    injected = [
        s
        for s in _of_type(opt_state, INJECTED)
        if "learning_rate" in s.hyperparams and "learning_rate" not in s.hyperparams_states
    ]
    if len(injected) != 1:
        raise LookupError(
            f"expected exactly one injected numeric learning_rate in the optimizer state, found {len(injected)}"
        )
    old = injected[0].hyperparams["learning_rate"]
    new = jnp.asarray(rate, old.dtype)
    new = jax.device_put(new, old.sharding) if isinstance(old, jax.Array) and hasattr(old, "sharding") else new
    return replace_state(opt_state, type(injected[0]), hyperparams={**injected[0].hyperparams, "learning_rate": new})


def _of_type(opt_state: Any, cls: type | tuple[type, ...]) -> list[Any]:
    """Every node of opt_state that is a `cls` (by isinstance; the search stops at each one found)."""
    is_it = lambda node: isinstance(node, cls)  # noqa: E731
    return [node for node in jax.tree.leaves(opt_state, is_leaf=is_it) if is_it(node)]


def find_state(opt_state: Any, cls: type | tuple[type, ...], *, required: bool = True) -> Any:
    """The one `cls` state inside opt_state (e.g. optax.MultiStepsState): found by type, never by name, so a
    param named like a field (LayerNorm's `scale`) or a renamed class cannot be taken for it. Several are
    an error; none is an error when `required`, else None."""
    found = _of_type(opt_state, cls)
    name = cls.__name__ if isinstance(cls, type) else " or ".join(c.__name__ for c in cls)
    if len(found) > 1 or (required and not found):
        raise LookupError(
            f"expected {'exactly' if required else 'at most'} one {name} in the optimizer state, found {len(found)}"
        )
    return found[0] if found else None


def replace_state(opt_state: Any, cls: type, **values: Any) -> Any:
    """opt_state with the named fields of every `cls` state replaced (e.g. to build a state converted from
    another framework's)."""
    is_it = lambda node: isinstance(node, cls)  # noqa: E731
    return jax.tree.map(lambda node: node._replace(**values) if is_it(node) else node, opt_state, is_leaf=is_it)


def updates_applied(opt_state: Any) -> jax.Array:
    """Optimizer updates applied so far (skipped ones not counted)."""
    return find_state(opt_state, optax.MultiStepsState).gradient_step


def loss_scale(opt_state: Any) -> jax.Array:
    """The factor a micro-batch's loss is multiplied by before differentiation (1 without dynamic scaling)."""
    scaling = find_state(opt_state, LossScaleState, required=False)
    return jnp.ones([], jnp.float32) if scaling is None else scaling.factor


def optimizer_metrics(opt_state: Any) -> dict[str, jax.Array]:
    """What the loop logs from the optimizer state: the rate of the last applied update, its pre-clip
    gradient norm (both where the optimizer keeps them, as make_optimizer's does), skipped updates so
    far, the current streak of them, and the loss scale."""
    injected = _of_type(opt_state, INJECTED)
    rates = [s.hyperparams["learning_rate"] for s in injected if "learning_rate" in s.hyperparams]
    norm = find_state(opt_state, GradNormState, required=False)
    skips = find_state(opt_state, SkipWindowsState, required=False)
    scaling = find_state(opt_state, LossScaleState, required=False)
    metrics = {
        "lr": rates[0] if len(rates) == 1 else None,  # several injected rates: none is "the" rate
        "grad_norm": None if norm is None else norm.grad_norm,
        "skipped": None if skips is None else skips.skipped,
        "bad_streak": None if skips is None else skips.bad_streak,
        "loss_scale": jnp.ones([], jnp.float32) if scaling is None else scaling.scale,
    }
    return {k: v for k, v in metrics.items() if v is not None}


INJECTED = (optax.InjectStatefulHyperparamsState, optax.InjectHyperparamsState)
"""The states of optax.inject_hyperparams, where an optimizer keeps the rate it applied."""


def for_the_loop(tx: Any, params: Any) -> optax.GradientTransformation:
    """tx as the step needs it: an optimizer from make_optimizer as it is; any other optax
    transformation inside skip_nonfinite_windows(tx) (K = 1). An optax.MultiSteps is refused (see
    skip_nonfinite_windows)."""
    if find_state(jax.eval_shape(tx.init, params), SkipWindowsState, required=False) is not None:
        return tx
    return skip_nonfinite_windows(tx)  # K = 1: the loop's accumulation is optim.accum_steps
