"""TrainState: everything a run needs to continue, as one pytree; `init_state`, the one way to build it.

Leaves: params, model_state (a model's non-trainable variables), opt_state (the whole optax state:
update count, moments, accumulator, applied rate, skip counters, loss scale), rng, micro_steps (the
micro-batches trained on, which seeds each one's dropout), and the optional EMA of params. Static
(not saved): the model (Linen or NNX, see jaxloop.model.interface), its loss (what jaxloop.train_step
differentiates), the optimizer, the precision policy and the EMA decay.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from jaxloop.model.interface import LinenModel, LossFn, NnxModel, is_nnx
from jaxloop.model.precision import Policy, get_policy
from jaxloop.update.optimizer import SkipWindowsState, find_state, for_the_loop, updates_applied

HASH_THREADS = 8
"""At most this many threads hash a checkpoint's leaves (leaf_digests)."""


class TrainState(struct.PyTreeNode):
    params: Any
    model_state: Any
    opt_state: Any
    rng: jax.Array
    micro_steps: jax.Array
    ema_params: Any
    model: LinenModel | NnxModel = struct.field(pytree_node=False)
    tx: optax.GradientTransformation = struct.field(pytree_node=False)
    policy: Policy = struct.field(pytree_node=False)
    ema_decay: float = struct.field(pytree_node=False, default=0.0)
    loss: LossFn | None = struct.field(pytree_node=False, default=None)  # loss(model, batch, train) -> (scalar, aux)

    @property
    def step(self) -> jax.Array:
        """Optimizer updates applied so far (skipped ones not counted)."""
        return updates_applied(self.opt_state)

    @classmethod
    def create(
        cls,
        *,
        params: Any,
        tx: optax.GradientTransformation,
        rng: jax.Array,
        apply_fn: Any = None,
        model: LinenModel | NnxModel | None = None,
        model_state: Any = None,
        policy: Policy | None = None,
        ema_decay: float = 0.0,
        loss: LossFn | None = None,
    ) -> TrainState:
        """The state assembled from parts already made: params drawn (or transferred) elsewhere, a model
        wrapper (or a Linen-style apply_fn) and a tx that already counts and skips updates (make_optimizer's,
        or one inside jaxloop.update.optimizer.skip_nonfinite_windows). To build a state from a model, use init_state."""
        if model is None:
            model = LinenModel(apply_fn=apply_fn)
        policy = policy or get_policy("fp32")
        params = policy.cast_to_param(params)
        if find_state(jax.eval_shape(tx.init, params), SkipWindowsState, required=False) is None:
            raise TypeError(
                "TrainState.create: tx must be jaxloop.make_optimizer's or inside "
                "jaxloop.update.optimizer.skip_nonfinite_windows (the step reads its update count); "
                "jaxloop.init_state(model, loss, example_batch, tx) takes any optax transformation"
            )
        return cls(
            params=params,
            model_state=model_state if model_state is not None else {},
            opt_state=tx.init(params),
            rng=rng,
            micro_steps=jnp.zeros([], jnp.int32),
            ema_params=jax.tree.map(jnp.copy, params) if ema_decay > 0 else None,
            model=model,
            tx=tx,
            policy=policy,
            ema_decay=ema_decay,
            loss=loss,
        )

    def apply_gradients(self, grads: Any, model_state: Any) -> TrainState:
        """One optimizer transformation of one micro-batch's gradients; the EMA follows applied updates."""
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        params = optax.apply_updates(self.params, updates)
        ema = self.ema_params
        if ema is not None:
            applied, d = updates_applied(opt_state) > self.step, self.ema_decay
            ema = jax.tree.map(lambda e, p: jnp.where(applied, d * e + (1 - d) * p, e), ema, params)
        return self.replace(
            params=params,
            model_state=model_state,
            opt_state=opt_state,
            ema_params=ema,
            micro_steps=self.micro_steps + 1,
        )

    def user_model(self, params: Any = None) -> Any:
        """The trained model as its user wrote it: an NNX module, or Linen variables {"params": ...}."""
        return self.model.merge(self.params if params is None else params, self.model_state)


def init_state(
    model: Any,
    loss: LossFn,
    example_batch: dict[str, Any],
    tx: optax.GradientTransformation,
    *,
    seed: int = 0,
    precision: str | Policy = "fp32",
    ema_decay: float = 0.0,
) -> TrainState:
    """The fresh state of `model` (a flax.linen or flax.nnx Module) trained on `loss` by `tx`: what
    jaxloop.train_step(state, batch) steps, and what jaxloop.run builds for a Task.

    loss(model, batch, train) -> (scalar, aux dict), as a Task's. A Linen module's params are drawn from
    PRNGKey(seed) by one call of loss(model, example_batch, False) (any batch of the records' shapes: only
    its shapes matter); an NNX module keeps the weights it was built with (copied: it stays usable).
    The step's dropout keys come from the same seed. tx: any optax GradientTransformation; the step runs
    it inside jaxloop.update.optimizer.skip_nonfinite_windows (an update whose gradient is not finite is skipped
    and counted), as make_optimizer's optimizer already is. precision: a policy name (fp32, bf16, fp16,
    fp64, ...; jaxloop.model.precision) or a Policy. ema_decay > 0 keeps an EMA of the params (`ema_params`).
    """
    init_rng, step_rng = jax.random.split(jax.random.PRNGKey(seed))
    policy = get_policy(precision) if isinstance(precision, str) else precision
    if is_nnx(model):
        wrapper, params, model_state = NnxModel.split(model)
    else:
        wrapper = LinenModel(module=model)
        params, model_state = wrapper.init(init_rng, loss, example_batch)
    params = policy.cast_to_param(params)
    return TrainState.create(
        model=wrapper,
        params=params,
        model_state=policy.cast_to_param(model_state),
        rng=step_rng,
        policy=policy,
        tx=for_the_loop(tx, params),
        ema_decay=ema_decay,
        loss=loss,
    )


def state_digest(state: TrainState) -> str:
    """sha256 over the bytes of params, model state and optimizer state, leaf by leaf in key-path order.

    Equal digests mean bit-identical weights and optimizer state (the resume contract).
    """
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path((state.params, state.model_state, state.opt_state))[0]:
        h.update(jax.tree_util.keystr(path).encode())
        hash_array(h, leaf)
    return h.hexdigest()


def hash_array(h: Any, leaf: Any) -> None:
    """Feed one array's dtype, shape and bytes to the hash `h` (the one encoding of every jaxloop digest).
    A jax.Array is read to the host (a whole-array copy when it is sharded or on an accelerator)."""
    if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.extended):
        leaf = jax.random.key_data(leaf)  # typed PRNG keys: their raw key bits
    a = np.asarray(jax.device_get(leaf))
    h.update(f"{a.dtype.str}{a.shape}".encode())
    h.update(np.ascontiguousarray(a).data if a.size else b"")


def leaf_digests(tree: Any) -> dict[str, str]:
    """{leaf path ("params/Dense_0/kernel"): sha256 of its dtype, shape and bytes} for every leaf of `tree`:
    what a checkpoint records of its state, checked leaf by leaf on restore (jaxloop.checkpoint.manager).
    Leaves are hashed on up to HASH_THREADS threads (hashlib releases the GIL over large buffers)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]

    def one(leaf: Any) -> str:
        h = hashlib.sha256()
        hash_array(h, leaf)
        return h.hexdigest()

    threads = min(len(flat), os.cpu_count() or 1, HASH_THREADS)
    if threads <= 1:
        digests = [one(leaf) for _, leaf in flat]
    else:
        with ThreadPoolExecutor(threads, thread_name_prefix="jaxloop-digest") as pool:
            digests = list(pool.map(one, [leaf for _, leaf in flat]))
    return {leaf_path(path): digest for (path, _), digest in zip(flat, digests)}


def leaf_path(path: Any) -> str:
    """A key path as names joined by "/" ("opt_state/inner_state/0/mu/Dense_0/kernel"): the one spelling of
    a leaf in the model record, the checkpoint digests and the messages that name a leaf."""
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def model_record(state: Any, model: Any = None) -> dict[str, Any]:
    """The structure of a TrainState (or its jax.eval_shape): every leaf's path, shape and dtype, in the
    state's order, and the class name of `model` (the user's module): the model half of a run's identity,
    kept in run_dir/model.json (jaxloop.rundir.model_identity)."""
    leaves = [
        [leaf_path(path), list(leaf.shape), str(leaf.dtype)]
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
    ]
    return {"model": None if model is None else type(model).__name__, "leaves": leaves}
