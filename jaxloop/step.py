"""train_step and eval_step: pure, jitted functions of (state, batch).

One call consumes one micro-batch; optax.MultiSteps accumulates K of them into one update. Non-finite
policy: a micro-batch whose loss or gradient is not finite marks its accumulation window; the update
that closes the window is then skipped as a whole (params, moments, update count and schedule stay;
the accumulator is discarded), counted, and the fp16 loss scale halved: torch.amp.GradScaler's
semantics, since an overflow in any micro-batch makes torch's accumulated .grad non-finite. An update
whose result would not be finite is skipped the same way, so the state stays finite.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxloop.state import TrainState

Batch = dict[str, jax.Array]
# loss_fn(apply, params, batch, rng) -> (scalar loss, aux metrics); rng is None for evaluation.
LossFn = Callable[[Callable[..., Any], Any, Batch, jax.Array | None], tuple[jax.Array, dict[str, jax.Array]]]


def cross_entropy_loss(apply: Callable[..., Any], params: Any, batch: Batch, rng: jax.Array | None):
    """Mean softmax cross-entropy of the built-in tasks (labels y for inputs x; any label shape).

    An optional per-record `weight` (0 for padding in validation batches) weights the mean.
    Aux: `acc` (weighted accuracy) and `weight` (the total weight, for averaging over batches).
    """
    train = rng is not None
    logits = apply({"params": params}, batch["x"], train=train, rngs={"dropout": rng} if train else None)
    labels = batch["y"]
    per_label = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(per_label.dtype)
    weight = batch.get("weight")
    if weight is None:
        return per_label.mean(), {"acc": correct.mean(), "weight": jnp.asarray(labels.shape[0], per_label.dtype)}
    w = jnp.broadcast_to(weight.reshape(weight.shape + (1,) * (labels.ndim - 1)), labels.shape).astype(per_label.dtype)
    total = jnp.maximum(w.sum(), 1)
    return (per_label * w).sum() / total, {"acc": (correct * w).sum() / total, "weight": weight.sum().astype(per_label.dtype)}


def _tree_where(cond: jax.Array, a: Any, b: Any) -> Any:
    return jax.tree.map(lambda x, y: jnp.where(cond, x, y), a, b)


def _all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def make_train_step(loss_fn: LossFn, jit: bool = True) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
    """A train_step(state, batch) -> (state, metrics) for your own loss; jitted with the state donated.

    Metrics (device arrays; fetch them only when you log): loss (this micro-batch, unscaled),
    lr (the rate of the update this micro-batch belongs to), grad_norm (pre-clip norm of the mean
    gradient of the window so far: at the last micro-batch, of the update), updated (an update was
    applied), skipped (skipped updates so far), bad_streak, loss_scale, and loss_fn's aux metrics.
    """

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        policy, opt = state.policy, state.opt_state
        rng = jax.random.fold_in(jax.random.fold_in(state.rng, opt.gradient_step), opt.mini_step)
        apply = policy.wrap_apply(state.apply_fn)
        scale = state.loss_scale.scale

        def scaled(params: Any):
            loss, aux = loss_fn(apply, params, batch, rng)
            loss = policy.cast_to_output(loss)
            return loss * scale.astype(loss.dtype), (loss, aux)

        grads, (loss, aux) = jax.grad(scaled, has_aux=True)(state.params)
        grads = jax.tree.map(lambda g: (g / scale.astype(g.dtype)).astype(g.dtype), grads)
        finite = jnp.isfinite(loss) & _all_finite(grads)
        grads = _tree_where(finite, grads, jax.tree.map(jnp.zeros_like, grads))
        mean_grads = jax.tree.map(lambda g, a: a + (g - a) / (opt.mini_step + 1), grads, opt.acc_grads)

        updates, new_opt = state.tx.update(grads, opt, state.params)
        new_params = optax.apply_updates(state.params, updates)
        emitted = new_opt.gradient_step != opt.gradient_step
        poisoned = state.poisoned | ~finite
        # An update that would itself make the state non-finite (e.g. an overflowing moment) is skipped
        # too, so a state out of this step is always finite and safe to checkpoint.
        result_finite = _all_finite((new_params, new_opt.inner_opt_state))
        skip = emitted & (poisoned | ~result_finite)
        applied = emitted & ~skip
        discard = opt._replace(mini_step=jnp.zeros_like(opt.mini_step), acc_grads=jax.tree.map(jnp.zeros_like, opt.acc_grads))
        new_opt = _tree_where(skip, discard, new_opt)
        new_params = _tree_where(skip, state.params, new_params)
        ema = state.ema_params
        if ema is not None:
            d = state.ema_decay
            ema = _tree_where(applied, jax.tree.map(lambda e, p: d * e + (1 - d) * p, ema, new_params), ema)

        new_state = state.replace(
            params=new_params,
            opt_state=new_opt,
            ema_params=ema,
            loss_scale=state.loss_scale.after_update(emitted, skip, policy.dynamic_scale),
            poisoned=poisoned & ~emitted,
            bad_streak=jnp.where(skip, state.bad_streak + 1, jnp.where(applied, 0, state.bad_streak)),
            skipped=state.skipped + skip.astype(jnp.int32),
        )
        metrics = {
            "loss": loss,
            "grad_norm": optax.global_norm(mean_grads),
            "updated": applied,
            "skipped": new_state.skipped,
            "bad_streak": new_state.bad_streak,
            "loss_scale": scale,
            **{k: v for k, v in aux.items() if k != "weight"},
        }
        if state.schedule is not None:
            metrics["lr"] = jnp.asarray(state.schedule(opt.gradient_step))
        return new_state, metrics

    return jax.jit(train_step, donate_argnums=0) if jit else train_step


def make_eval_step(loss_fn: LossFn, jit: bool = True) -> Callable[[TrainState, Batch], dict]:
    """An eval_step(state, batch) -> {loss, aux...}: the loss without gradients or dropout."""

    def eval_step(state: TrainState, batch: Batch) -> dict:
        apply = state.policy.wrap_apply(state.apply_fn)
        loss, aux = loss_fn(apply, jax.lax.stop_gradient(state.params), batch, None)
        return {"loss": state.policy.cast_to_output(loss), **aux}

    return jax.jit(eval_step) if jit else eval_step


train_step = make_train_step(cross_entropy_loss)
"""The train step of the built-in tasks (batches {x, y}: digits / npz features or characters)."""
eval_step = make_eval_step(cross_entropy_loss)
"""The eval step of the built-in tasks; aux `weight` lets the loop average exactly over batches."""
