"""The optimizer: MultiSteps(K) over clip_by_global_norm -> adamw(schedule, decay mask).

Clipping sits inside MultiSteps, so it acts on the mean of the K micro-batch gradients, and adamw's
schedule count advances only when MultiSteps emits an update.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from jaxloop.config import Config
from jaxloop.precision import get_policy
from jaxloop.schedule import make_schedule


def decay_mask(params: Any) -> Any:
    """True for leaves that get weight decay: matrices and embeddings (ndim >= 2), not biases or scales.

    The same rule as nanoGPT's and torch_ref's param groups (`p.dim() >= 2`).
    """
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg: Config) -> optax.MultiSteps:
    """MultiSteps(chain(clip_by_global_norm, adamw), every_k_schedule=accum_steps) from the config.

    Weight decay is always passed explicitly: optax's adamw default (1e-4) and torch's AdamW default
    (1e-2) differ. clip_norm = 0 means no clipping.
    """
    o = cfg.optim
    parts = [optax.clip_by_global_norm(o.clip_norm)] if o.clip_norm > 0 else []
    parts.append(
        optax.adamw(
            learning_rate=make_schedule(cfg), b1=o.b1, b2=o.b2, eps=o.eps, eps_root=0.0,
            weight_decay=o.weight_decay, mask=decay_mask,
        )
    )
    # The accumulator holds gradients in the params' dtype (MultiSteps' default is float32).
    param_dtype = get_policy(cfg.precision).param_dtype
    return optax.MultiSteps(optax.chain(*parts), every_k_schedule=o.accum_steps, accumulator_dtype=param_dtype)
