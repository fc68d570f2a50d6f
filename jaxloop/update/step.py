"""train_step and eval_step: pure functions of (state, batch), and the multi-update call the loop jits.

`train_step(state, batch) -> (state, metrics)` trains the loss the state carries (jaxloop.init_state's):
a user's own model and loss as well as the built-in tasks' cross-entropy. One train_step consumes one
micro-batch; the optimizer (jaxloop.update.optimizer) accumulates K of them into an update, skips non-finite windows
and scales the fp16 loss, so the step itself only differentiates the loss and hands the gradients over.
A loss is `loss(model, batch, train) -> (scalar, aux)`, with
`model` bound to the params being differentiated (see jaxloop.model.interface).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxloop.config.run import MemoryConfig
from jaxloop.model.interface import LossFn
from jaxloop.model.precision import pinned_matmuls
from jaxloop.update.memory_plan import checkpoint_policy, remat_blocks
from jaxloop.update.optimizer import loss_scale, optimizer_metrics
from jaxloop.update.state import TrainState

Batch = dict[str, jax.Array]
StepFn = Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]


def weighted_mean(values: jax.Array, batch: Batch) -> jax.Array:
    """Mean of per-record `values` [n, ...], weighted by batch["weight"] when present (0 for the padding
    of the last validation batch), so a loss built on it evaluates exactly."""
    weight = batch.get("weight")
    if weight is None:
        return values.mean()
    w = jnp.broadcast_to(weight.reshape(weight.shape + (1,) * (values.ndim - 1)), values.shape).astype(values.dtype)
    return (values * w).sum() / jnp.maximum(w.sum(), 1)


def cross_entropy_loss(model: Callable[..., Any], batch: Batch, train: bool) -> tuple[jax.Array, dict]:
    """Mean softmax cross-entropy of the built-in tasks (labels y for inputs x; any label shape).

    An optional per-record `weight` (0 for padding in validation batches) weights the mean.
    Aux: `acc` (weighted accuracy) and `weight` (the total weight, for averaging over batches).
    """
    logits = model(batch["x"], train=train)
    labels = batch["y"]
    per_label = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(per_label.dtype)
    weight = batch["weight"].sum() if "weight" in batch else labels.shape[0]
    aux = {"acc": weighted_mean(correct, batch), "weight": jnp.asarray(weight, per_label.dtype)}
    return weighted_mean(per_label, batch), aux


def _loss_of(state: TrainState, loss_fn: LossFn | None) -> LossFn:
    """loss_fn, or else the loss the state carries."""
    if loss_fn is not None:
        return loss_fn
    if state.loss is None:
        raise TypeError(
            "this TrainState carries no loss: build it with jaxloop.init_state(model, loss, example_batch, "
            "tx), or pass TrainState.create(loss=...)"
        )
    return state.loss


def make_train_step(loss_fn: LossFn | None = None, memory: MemoryConfig | None = None) -> StepFn:
    """A pure train_step(state, batch) -> (state, metrics) under a memory plan (jit it with donate_argnums=0);
    it differentiates loss_fn if given, else the loss the state carries.

    Metrics (device arrays; fetch them only when you log): loss (this micro-batch, unscaled), updated
    (this micro-batch closed an applied update), the optimizer's lr, grad_norm, skipped and bad_streak
    after it (jaxloop.update.optimizer.optimizer_metrics), loss_scale (the scale this micro-batch's loss used), and
    the loss's aux metrics.

    `memory` (jaxloop.update.memory_plan), the plan: split the micro-batch into memory.split sub-batches (records
    j, j + split, ...: each device keeps its own rows) whose gradients are averaged in a lax.scan, each
    with its own dropout key; the loss and aux metrics are their means. remat: the model's blocks under
    nn.remat ("blocks"), or a jax.checkpoint policy around the loss. The default plan is the plain step.
    """
    split = memory.split if memory is not None else 1
    remat = memory.remat if memory is not None else "none"
    policy = checkpoint_policy(remat)

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        with pinned_matmuls():  # float32 matmuls at full precision in this trace (jaxloop.model.precision)
            return _train_step(state, batch)

    def _train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        loss_of = _loss_of(state, loss_fn)
        rng = jax.random.fold_in(state.rng, state.micro_steps)
        scale = loss_scale(state.opt_state)
        model = remat_blocks(state.model) if remat == "blocks" else state.model

        def scaled_loss(params: Any, model_state: Any, batch: Batch, rng: jax.Array) -> tuple[jax.Array, tuple]:
            bound, new_model_state = model.bind(params, model_state, True, rng, state.policy)
            loss, aux = loss_of(bound, batch, True)
            loss = state.policy.cast_to_output(loss)
            return loss * scale.astype(loss.dtype), (loss, aux, new_model_state())

        if policy is not None:
            scaled_loss = jax.checkpoint(scaled_loss, policy=policy)
        grad_fn = jax.grad(scaled_loss, has_aux=True)
        if split == 1:
            grads, (loss, aux, model_state) = grad_fn(state.params, state.model_state, batch, rng)
        else:
            grads, (loss, aux, model_state) = _split_grads(grad_fn, state, batch, rng, split)
        # A non-finite loss marks its window as a non-finite gradient would (the optimizer skips it).
        grads = jax.tree.map(lambda g: jnp.where(jnp.isfinite(loss), g, jnp.nan), grads)
        new_state = state.apply_gradients(grads, model_state)
        metrics = {
            "loss": loss,
            "updated": new_state.step > state.step,
            **optimizer_metrics(new_state.opt_state),
            "loss_scale": optimizer_metrics(state.opt_state)["loss_scale"],
        }  # the scale this loss used
        return new_state, {**metrics, **{k: v for k, v in aux.items() if k != "weight"}}

    return train_step


def _split_grads(
    grad_fn: Callable[..., Any], state: TrainState, batch: Batch, rng: jax.Array, split: int
) -> tuple[Any, tuple]:
    """The mean gradient of `split` sub-batches of `batch` (one at a time, lax.scan), the mean loss and aux,
    and the model state threaded through them. Sub-batch j holds rows j, j + split, ...: a device's block
    of rows [d * n, (d + 1) * n) reshapes in place, so each sub-batch stays spread over every device."""
    sub = jax.tree.map(lambda a: a.reshape((a.shape[0] // split, split) + a.shape[1:]).swapaxes(0, 1), batch)
    acc = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32)), state.params)

    def one(carry: tuple, xs: tuple) -> tuple[tuple, tuple]:
        total, model_state = carry
        j, b = xs
        g, (loss, aux, model_state) = grad_fn(state.params, model_state, b, jax.random.fold_in(rng, j))
        return (jax.tree.map(lambda t, x: t + x.astype(t.dtype), total, g), model_state), (loss, aux)

    (total, model_state), (losses, auxes) = jax.lax.scan(one, (acc, state.model_state), (jnp.arange(split), sub))
    grads = jax.tree.map(lambda t, p: (t / split).astype(p.dtype), total, state.params)
    return grads, (losses.mean(), jax.tree.map(lambda a: a.mean(axis=0), auxes), model_state)


def make_eval_step(loss_fn: LossFn | None = None) -> Callable[[TrainState, Batch], dict]:
    """A pure eval_step(state, batch) -> {loss, aux...}: loss_fn (else the state's loss) without gradients,
    dropout or updates."""

    def eval_step(state: TrainState, batch: Batch) -> dict:
        with pinned_matmuls():
            return _eval_step(state, batch)

    def _eval_step(state: TrainState, batch: Batch) -> dict:
        model, _ = state.model.bind(jax.lax.stop_gradient(state.params), state.model_state, False, None, state.policy)
        loss, aux = _loss_of(state, loss_fn)(model, batch, False)
        return {"loss": state.policy.cast_to_output(loss), **aux}

    return eval_step


def scan_steps(step: StepFn) -> StepFn:
    """Several micro-batches in one call: step over the leading axis of `batches` (lax.scan), the
    metrics of every micro-batch stacked. What the loop dispatches: one call per K x U micro-batches."""

    def steps(state: TrainState, batches: Batch) -> tuple[TrainState, dict]:
        return jax.lax.scan(step, state, batches)

    return steps


train_step = make_train_step()
"""train_step(state, batch) -> (state, metrics): one micro-batch of the loss the state carries (your own
model's, from jaxloop.init_state, or a built-in task's cross-entropy). A pure function, not jitted (as the
Flax examples' train_step): the state passed in stays valid. Jit it where you call it, donating the state
as the loop does: `step = jax.jit(jaxloop.train_step, donate_argnums=0)`; it also runs inside your own
lax.scan or vmap."""
eval_step = jax.jit(make_eval_step())
"""eval_step(state, batch) -> {loss, aux...}: the state's loss in eval mode, jitted (aux `weight`, where the loss
gives it, lets a loop average exactly over batches)."""
