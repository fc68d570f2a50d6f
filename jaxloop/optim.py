"""The optimizer: MultiSteps(K) over clip_by_global_norm -> adamw(schedule, decay mask).

Clipping sits inside MultiSteps, so it acts on the mean of the K micro-batch gradients, and adamw's
schedule count advances only when MultiSteps emits an update.

adamw is optax's chain scale_by_adam -> add_decayed_weights(mask) -> scale_by_learning_rate, with one
change inside scale_by_adam: the bias corrections 1 - b^t. optax computes them from b rounded to the
moments' float type; in float32, float32(0.999) is 1.3e-8 off, which puts 1 - 0.999^t 1.3e-5
(relative) off for small t and made every float32 step ~6e-6 (relative) shorter than AdamW's (torch's,
which takes them in float64); the parity suite measured it. Here they come from log(b) in Python
float64: 1 - b^t = -expm1(t log b), a few ulps from exact in any float type. Same state, same moments.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

from loopcore.config import Config
from jaxloop.precision import get_policy
from jaxloop.schedule import make_schedule


def decay_mask(params: Any) -> Any:
    """True for leaves that get weight decay: matrices and embeddings (ndim >= 2), not biases or scales.

    The same rule as nanoGPT's and torch_ref's param groups (`p.dim() >= 2`).
    """
    return jax.tree.map(lambda p: p.ndim >= 2, params)


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
        count = optax.safe_increment(state.count)
        c1, c2 = _one_minus_pow(b1, count), _one_minus_pow(b2, count)
        updates = jax.tree.map(lambda m, v: (m / c1.astype(m.dtype)) / (jnp.sqrt(v / c2.astype(v.dtype)) + eps), mu, nu)
        return updates, optax.ScaleByAdamState(count=count, mu=mu, nu=optax.tree.cast_like(nu, state.nu))

    return optax.GradientTransformation(base.init, update_fn)


def make_optimizer(cfg: Config) -> optax.MultiSteps:
    """MultiSteps(chain(clip_by_global_norm, adamw), every_k_schedule=accum_steps) from the config.

    Weight decay is always passed explicitly: optax's adamw default (1e-4) and torch's AdamW default
    (1e-2) differ. clip_norm = 0 means no clipping.
    """
    o = cfg.optim
    parts = [optax.clip_by_global_norm(o.clip_norm)] if o.clip_norm > 0 else []
    parts.append(
        optax.chain(  # optax.adamw(schedule, b1, b2, eps, eps_root=0, weight_decay, mask), exact bias corrections
            scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps),
            optax.add_decayed_weights(o.weight_decay, decay_mask),
            optax.scale_by_learning_rate(make_schedule(cfg)),
        )
    )
    # The accumulator holds gradients in the params' dtype (MultiSteps' default is float32).
    param_dtype = get_policy(cfg.precision).param_dtype
    return optax.MultiSteps(optax.chain(*parts), every_k_schedule=o.accum_steps, accumulator_dtype=param_dtype)
