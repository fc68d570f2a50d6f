"""TrainState: everything a run needs to continue, as one pytree.

Leaves: params, opt_state (optax.MultiStepsState: the update count, the inner clip+adamw state and the
micro-batch accumulator), rng, the loss scale, the optional EMA of params, and the non-finite counters.
Static (not saved): the model's apply function, the optimizer, the schedule and the precision policy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from loopcore.config import Config
from jaxloop.models import init_params
from jaxloop.optim import make_optimizer
from jaxloop.precision import LossScale, Policy, get_policy
from jaxloop.schedule import make_schedule


class TrainState(struct.PyTreeNode):
    params: Any
    opt_state: optax.MultiStepsState
    rng: jax.Array
    loss_scale: LossScale
    ema_params: Any
    poisoned: jax.Array  # the current accumulation window has seen a non-finite micro-batch
    bad_streak: jax.Array  # consecutive skipped updates
    skipped: jax.Array  # skipped updates in the whole run
    apply_fn: Callable[..., Any] = struct.field(pytree_node=False)
    tx: optax.MultiSteps = struct.field(pytree_node=False)
    policy: Policy = struct.field(pytree_node=False)
    schedule: Callable[[Any], Any] | None = struct.field(pytree_node=False, default=None)
    ema_decay: float = struct.field(pytree_node=False, default=0.0)

    @property
    def step(self) -> jax.Array:
        """Optimizer updates applied so far (MultiSteps' gradient_step)."""
        return self.opt_state.gradient_step

    @classmethod
    def create(
        cls,
        *,
        apply_fn: Callable[..., Any],
        params: Any,
        tx: optax.GradientTransformation | optax.MultiSteps,
        rng: jax.Array,
        policy: Policy | None = None,
        schedule: Callable[[Any], Any] | None = None,
        ema_decay: float = 0.0,
    ) -> "TrainState":
        """A fresh state. A plain optax transformation is wrapped in MultiSteps(every_k_schedule=1)."""
        policy = policy or get_policy("fp32")
        if not isinstance(tx, optax.MultiSteps):
            tx = optax.MultiSteps(tx, every_k_schedule=1)
        params = policy.cast_to_param(params)
        return cls(
            params=params,
            opt_state=tx.init(params),
            rng=rng,
            loss_scale=LossScale.create(policy.dynamic_scale),
            ema_params=jax.tree.map(jnp.copy, params) if ema_decay > 0 else None,
            poisoned=jnp.zeros([], bool),
            bad_streak=jnp.zeros([], jnp.int32),
            skipped=jnp.zeros([], jnp.int32),
            apply_fn=apply_fn,
            tx=tx,
            policy=policy,
            schedule=schedule,
            ema_decay=ema_decay,
        )


def create_train_state(cfg: Config, model: Any, example_x: Any) -> TrainState:
    """The state of a fresh run: params from PRNGKey(seed), the config's optimizer, policy and EMA."""
    init_rng, step_rng = jax.random.split(jax.random.PRNGKey(cfg.seed))
    return TrainState.create(
        apply_fn=model.apply,
        params=init_params(model, init_rng, example_x),
        tx=make_optimizer(cfg),
        rng=step_rng,
        policy=get_policy(cfg.precision),
        schedule=make_schedule(cfg),
        ema_decay=cfg.optim.ema_decay,
    )


def state_digest(state: TrainState) -> str:
    """sha256 over the bytes of params and optimizer state, leaf by leaf in key-path order.

    Equal digests mean bit-identical weights and optimizer state (the resume contract).
    """
    import hashlib

    import numpy as np

    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path((state.params, state.opt_state))[0]:
        a = np.asarray(jax.device_get(leaf))
        h.update(jax.tree_util.keystr(path).encode())
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()
