"""The optimizers PyTorch users run, each an optax transformation with torch.optim's semantics.

Each config class of jaxloop.config.optimizers is built by its factory here (BUILDERS: `build(SGDConfig(), rate)`
is `sgd(rate, **its fields)`), under optax.inject_hyperparams so that the rate it applies is kept in its state
(the loop logs it; plateau replaces it). Each is optax's own
transformation where optax computes what torch computes, and a small one here where it does not:

| name    | torch class                | here                                                                 |
|---------|----------------------------|----------------------------------------------------------------------|
| adamw   | AdamW                      | scale_by_adam (exact bias corrections) -> decoupled decay -> rate    |
| adam    | Adam(weight_decay=wd)      | L2 decay into the gradient -> scale_by_adam -> rate                  |
| sgd     | SGD(momentum, dampening,   | L2 -> optax.trace (dampening 0) or dampened_trace -> rate            |
|         |   nesterov, weight_decay)  |                                                                      |
| rmsprop | RMSprop(alpha, eps,        | L2 -> optax.scale_by_rms / scale_by_stddev (eps_in_sqrt=False) ->    |
|         |   momentum, centered)      |   optax.trace(momentum) -> rate                                      |
| adagrad | Adagrad(lr_decay, eps,     | L2 -> scale_by_torch_adagrad -> rate                                 |
|         |   initial_accumulator_...) |                                                                      |
| lion    | (none in torch: the paper) | optax.lion                                                           |

Where torch and optax's aliases differ, and which one these follow (torch's, in every case):
- Adam's weight_decay is L2 added to the gradient before the moments (torch.optim.Adam); AdamW decouples it
  (p -= lr * wd * p). optax.adam has no weight decay; optax.adamw is the decoupled one.
- Adam's bias corrections 1 - b^t: optax computes them from b rounded to the moments' float type (in float32,
  0.999 is 1.3e-8 off, so 1 - 0.999^t is 1.3e-5 off for small t: every float32 step ~6e-6 short of
  torch's, which uses float64). Here 1 - b^t = -expm1(t log b), log b in Python float64: a few ulps.
- SGD: torch adds weight decay to the gradient before the momentum, its buffer starts as the first
  (decayed) gradient, and `dampening` scales the gradient into the buffer from the second update on:
  b_1 = g_1, b_t = momentum b_{t-1} + (1 - dampening) g_t. optax.trace (zero start, b_t = g_t + momentum
  b_{t-1}) equals it exactly when dampening = 0 (the same two roundings) and is used then;
  `dampened_trace` otherwise. Nesterov: g_t + momentum b_t in both.
- RMSprop: torch adds eps outside the square root (optax.rmsprop's default is inside: eps_in_sqrt=True),
  starts the average at 0, and keeps the momentum buffer before the rate (b = momentum b + g / avg;
  p -= lr b): optax.rmsprop applies its trace after the rate, which differs as soon as the rate changes.
- Adagrad: torch divides by sqrt(sum) + eps (optax.adagrad: rsqrt(sum + eps), eps inside), starts the sum at
  initial_accumulator_value (torch 0, optax 0.1) and divides update t's rate by 1 + (t - 1) lr_decay.
- Lion: optax.lion is the paper's Algorithm (c = b1 m + (1 - b1) g; p -= lr (sign(c) + wd p);
  m = b2 m + (1 - b2) g); torch_ref implements the same from the paper (torch has no Lion).

Weight decay acts on matrices and embeddings only (`decay_mask`: leaf.ndim >= 2), never on biases or norm
scales, for every optimizer (torch_ref: two param groups, p.dim() >= 2).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import optax

from jaxloop.config.optimizers import (
    AdagradConfig,
    AdamConfig,
    AdamWConfig,
    LionConfig,
    OptimizerConfig,
    RMSpropConfig,
    SGDConfig,
)


def decay_mask(params: Any) -> Any:
    """True for leaves that get weight decay: matrices and embeddings (ndim >= 2), not biases or scales.

    The same rule as nanoGPT's and torch_ref's param groups (`p.dim() >= 2`).
    """
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def _l2(weight_decay: float) -> list[optax.GradientTransformation]:
    """torch's weight_decay for Adam, SGD, RMSprop, Adagrad: g + wd * p, before everything else."""
    return [optax.add_decayed_weights(weight_decay, decay_mask)] if weight_decay else []


# ----------------------------------------------------------------------------- Adam, AdamW


def _one_minus_pow(b: float, count: jax.Array) -> jax.Array:
    """1 - b**count in the default float type, a few ulps from exact: -expm1(count * log(b)), log(b) in float64."""
    if b == 0.0:
        return jnp.ones([], jnp.result_type(float))  # 0**t = 0 for the counts used (t >= 1)
    return -jnp.expm1(count.astype(jnp.result_type(float)) * math.log(b))


def scale_by_adam(b1: float, b2: float, eps: float) -> optax.GradientTransformation:
    """optax.scale_by_adam(b1, b2, eps, eps_root=0) with exact bias corrections (see the module doc).

    State optax.ScaleByAdamState(count, mu, nu), updated as optax does; the update is
    (mu / (1 - b1^t)) / (sqrt(nu / (1 - b2^t)) + eps).
    """
    base = optax.scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=0.0)

    def update_fn(updates: Any, state: optax.ScaleByAdamState, params: Any = None) -> tuple[Any, Any]:
        del params
        mu = optax.tree.update_moment(updates, state.mu, b1, 1)
        nu = optax.tree.update_moment_per_elem_norm(updates, state.nu, b2, 2)
        count = jnp.asarray(optax.safe_increment(state.count))
        c1, c2 = _one_minus_pow(b1, count), _one_minus_pow(b2, count)
        updates = jax.tree.map(lambda m, v: (m / c1.astype(m.dtype)) / (jnp.sqrt(v / c2.astype(v.dtype)) + eps), mu, nu)
        return updates, optax.ScaleByAdamState(count=count, mu=mu, nu=optax.tree.cast_like(nu, state.nu))

    return optax.GradientTransformation(base.init, cast(optax.TransformUpdateFn, update_fn))  # its own state type


def adamw(learning_rate: Any, b1: float, b2: float, eps: float, weight_decay: float) -> optax.GradientTransformation:
    """optax.adamw(learning_rate, b1, b2, eps, eps_root=0, weight_decay, mask=decay_mask), exact bias corrections."""
    return optax.chain(
        scale_by_adam(b1=b1, b2=b2, eps=eps),
        optax.add_decayed_weights(weight_decay, decay_mask),
        optax.scale_by_learning_rate(learning_rate),
    )


def adam(learning_rate: Any, b1: float, b2: float, eps: float, weight_decay: float) -> optax.GradientTransformation:
    """torch.optim.Adam: weight decay as L2 in the gradient, before the moments; exact bias corrections."""
    return optax.chain(
        *_l2(weight_decay), scale_by_adam(b1=b1, b2=b2, eps=eps), optax.scale_by_learning_rate(learning_rate)
    )


# ----------------------------------------------------------------------------- SGD


class DampenedTraceState(NamedTuple):
    # count: updates seen: the first one starts the buffer
    count: jax.Array  # pyright: ignore[reportIncompatibleMethodOverride]  # optax's own state classes name it count
    trace: Any  # torch's momentum_buffer


def dampened_trace(momentum: float, dampening: float) -> optax.GradientTransformation:
    """torch.optim.SGD's momentum buffer with dampening (no optax counterpart; optax.trace has no dampening
    and starts from zeros): b_1 = g_1, then b_t = momentum * b_{t-1} + (1 - dampening) * g_t; the update is b_t."""

    def init_fn(params: Any) -> DampenedTraceState:
        return DampenedTraceState(jnp.zeros([], jnp.int32), optax.tree.zeros_like(params))

    def update_fn(updates: Any, state: DampenedTraceState, params: Any = None) -> tuple[Any, DampenedTraceState]:
        del params
        first = state.count == 0
        trace = jax.tree.map(lambda g, b: jnp.where(first, g, b * momentum + g * (1 - dampening)), updates, state.trace)
        return trace, DampenedTraceState(jnp.asarray(optax.safe_increment(state.count)), trace)

    return optax.GradientTransformation(init_fn, cast(optax.TransformUpdateFn, update_fn))  # its own state type


def sgd(
    learning_rate: Any, momentum: float, dampening: float, nesterov: bool, weight_decay: float
) -> optax.GradientTransformation:
    """torch.optim.SGD: L2 decay, then the momentum buffer (module doc), then the rate."""
    parts = _l2(weight_decay)
    if momentum:
        parts.append(
            optax.trace(decay=momentum, nesterov=nesterov) if dampening == 0 else dampened_trace(momentum, dampening)
        )
    return optax.chain(*parts, optax.scale_by_learning_rate(learning_rate))


# ----------------------------------------------------------------------------- RMSprop


def rmsprop(
    learning_rate: Any, alpha: float, eps: float, momentum: float, centered: bool, weight_decay: float
) -> optax.GradientTransformation:
    """torch.optim.RMSprop: L2 decay; g / (sqrt(avg) + eps) with eps outside the root (centered: the root
    of avg - mean^2); a momentum buffer of those before the rate."""
    scale = (optax.scale_by_stddev if centered else optax.scale_by_rms)(
        decay=alpha, eps=eps, initial_scale=0.0, eps_in_sqrt=False, bias_correction=False
    )
    parts = [*_l2(weight_decay), scale]
    if momentum:
        parts.append(optax.trace(decay=momentum))
    return optax.chain(*parts, optax.scale_by_learning_rate(learning_rate))


# ----------------------------------------------------------------------------- Adagrad


class TorchAdagradState(NamedTuple):
    # count: updates seen (torch's `step`)
    count: jax.Array  # pyright: ignore[reportIncompatibleMethodOverride]  # optax's own state classes name it count
    sum_of_squares: Any  # torch's state_sum


def scale_by_torch_adagrad(
    lr_decay: float, initial_accumulator_value: float, eps: float
) -> optax.GradientTransformation:
    """torch.optim.Adagrad's direction (optax.scale_by_rss puts eps inside the root and starts the sum at
    0.1): s_t = s_{t-1} + g^2 from s_0 = initial_accumulator_value; g / (sqrt(s_t) + eps), divided by
    1 + (t - 1) * lr_decay (torch's clr = lr / (1 + (t - 1) lr_decay))."""

    def init_fn(params: Any) -> TorchAdagradState:
        return TorchAdagradState(jnp.zeros([], jnp.int32), optax.tree.full_like(params, initial_accumulator_value))

    def update_fn(updates: Any, state: TorchAdagradState, params: Any = None) -> tuple[Any, TorchAdagradState]:
        del params
        count = jnp.asarray(optax.safe_increment(state.count))
        sums = jax.tree.map(lambda s, g: s + g * g, state.sum_of_squares, updates)
        out = jax.tree.map(lambda g, s: g / (jnp.sqrt(s) + eps), updates, sums)
        if lr_decay:
            decay = 1 + (count - 1).astype(jnp.result_type(float)) * lr_decay
            out = jax.tree.map(lambda u: u / decay.astype(u.dtype), out)
        return out, TorchAdagradState(count, sums)

    return optax.GradientTransformation(init_fn, cast(optax.TransformUpdateFn, update_fn))  # its own state type


def adagrad(
    learning_rate: Any, lr_decay: float, initial_accumulator_value: float, eps: float, weight_decay: float
) -> optax.GradientTransformation:
    """torch.optim.Adagrad: L2 decay, scale_by_torch_adagrad, the rate."""
    return optax.chain(
        *_l2(weight_decay),
        scale_by_torch_adagrad(lr_decay, initial_accumulator_value, eps),
        optax.scale_by_learning_rate(learning_rate),
    )


# ----------------------------------------------------------------------------- Lion


def lion(learning_rate: Any, b1: float, b2: float, weight_decay: float) -> optax.GradientTransformation:
    """optax.lion (the paper's Lion, decoupled decay scaled by the rate) with decay_mask."""
    return optax.lion(learning_rate, b1=b1, b2=b2, weight_decay=weight_decay, mask=decay_mask)


BUILDERS: dict[type[OptimizerConfig], Any] = {
    AdamWConfig: adamw,
    AdamConfig: adam,
    SGDConfig: sgd,
    RMSpropConfig: rmsprop,
    AdagradConfig: adagrad,
    LionConfig: lion,
}
"""Each optimizer config class -> its factory here (torch_ref.optim.TORCH_OPTIMIZERS is torch's table)."""


def build(config: OptimizerConfig, learning_rate: Any) -> optax.GradientTransformation:
    """The config's optimizer under optax.inject_hyperparams: `learning_rate` a schedule (count -> rate) or a
    number (which the host may replace in the state's hyperparams: plateau); the fields static Python numbers
    (the bias corrections need them in float64)."""
    factory = BUILDERS.get(type(config))
    if factory is None:
        raise ValueError(f"optim.name={config.name!r}: no optax transformation for {type(config).__name__}")
    hyper = dataclasses.asdict(config)
    return optax.inject_hyperparams(factory, static_args=tuple(hyper))(learning_rate=learning_rate, **hyper)
