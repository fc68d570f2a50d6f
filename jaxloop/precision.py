"""Precision policies, applied in one place: the model call inside the step.

fp32: everything float32.
bf16: torch.autocast's way, op by op: params, optimizer state, inputs, embeddings, LayerNorm, softmax,
      the residual stream, logits and loss in float32; the matmuls (dense layers, the tied head, the
      attention products) in bfloat16 with float32 accumulation and one rounding of each result. The
      built-in models do the per-op casting (Policy.matmul_dtype, read by jaxloop.models.make_model);
      a model of your own gets it by passing `policy.matmul_dtype` to its layers (e.g. a Dense layer's
      inputs and kernel cast to it) and float32 everywhere else.
bf16_full: the whole model in bfloat16: params and floating inputs cast to bfloat16 for the forward and
      backward pass (LayerNorm, softmax inputs and the residual stream included); logits and loss float32.
      Cheaper in memory traffic, further from torch.autocast (the parity suite measures both).
fp16: as bf16 (autocast-like, op by op) with float16 matmuls, plus dynamic loss scaling with
      torch.amp.GradScaler's rule, its state kept in the TrainState.
fp64: everything float64 (needs jax x64), used by the parity suite.

float32 matmuls run at full float32 precision: importing this module sets jax's default matmul
precision to "highest" (no TF32 or bf16 passes on GPUs/TPUs), and the built-in models also pass
lax.Precision.HIGHEST to each of their matmuls. torch_ref pins torch the same way (no TF32).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

jax.config.update("jax_default_matmul_precision", "highest")

# torch.amp.GradScaler's defaults, the rule fp16 follows.
INIT_SCALE = 2.0**16
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000


@dataclasses.dataclass(frozen=True)
class Policy:
    """Dtypes of params, compute and outputs, and whether the loss is dynamically scaled."""

    name: str
    param_dtype: Any
    compute_dtype: Any
    output_dtype: Any
    dynamic_scale: bool = False
    matmul_dtype: Any = None
    """autocast-like policies: the dtype of the model's matmuls (the model casts per op); else None."""

    def cast_to_compute(self, tree: Any) -> Any:
        return _cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        return _cast_floating(tree, self.output_dtype)

    def cast_to_param(self, tree: Any) -> Any:
        return _cast_floating(tree, self.param_dtype)

    def wrap_apply(self, apply_fn: Callable[..., Any]) -> Callable[..., Any]:
        """apply_fn running in the compute dtype, returning outputs in the output dtype."""

        def apply(variables: Any, *args: Any, **kwargs: Any) -> Any:
            out = apply_fn(self.cast_to_compute(variables), *self.cast_to_compute(args), **kwargs)
            return self.cast_to_output(out)

        return apply


def get_policy(name: str) -> Policy:
    """The policy for config.precision."""
    f32 = jnp.float32
    if name == "fp32":
        return Policy("fp32", f32, f32, f32)
    if name == "bf16":
        return Policy("bf16", f32, f32, f32, matmul_dtype=jnp.bfloat16)
    if name == "bf16_full":
        return Policy("bf16_full", f32, jnp.bfloat16, f32)
    if name == "fp16":
        return Policy("fp16", f32, f32, f32, dynamic_scale=True, matmul_dtype=jnp.float16)
    if name == "fp64":
        if not jax.config.jax_enable_x64:
            raise ValueError("precision=fp64 needs 64-bit JAX: set JAX_ENABLE_X64=1")
        return Policy("fp64", jnp.float64, jnp.float64, jnp.float64)
    raise ValueError(f"precision={name!r} is not allowed: one of fp32, bf16, bf16_full, fp16, fp64")


def _cast_floating(tree: Any, dtype: Any) -> Any:
    def cast(x: Any) -> Any:
        if isinstance(x, (jax.Array, jnp.ndarray)) and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


class LossScale(struct.PyTreeNode):
    """Dynamic loss scale (GradScaler's rule); a constant 1 for policies without scaling."""

    scale: jax.Array
    good_steps: jax.Array

    @classmethod
    def create(cls, dynamic: bool) -> "LossScale":
        scale = INIT_SCALE if dynamic else 1.0
        return cls(scale=jnp.asarray(scale, jnp.float32), good_steps=jnp.zeros([], jnp.int32))

    def after_update(self, emitted: jax.Array, skipped: jax.Array, dynamic: bool) -> "LossScale":
        """Advance at an update boundary: halve on a skipped update, double after GROWTH_INTERVAL good ones."""
        if not dynamic:
            return self
        good = jnp.where(emitted, self.good_steps + 1, self.good_steps)
        grow = emitted & (good >= GROWTH_INTERVAL)
        scale = jnp.where(grow, self.scale * GROWTH_FACTOR, self.scale)
        scale = jnp.where(skipped, self.scale * BACKOFF_FACTOR, scale)
        good = jnp.where(grow | skipped, 0, good)
        return LossScale(scale=scale, good_steps=good.astype(jnp.int32))
