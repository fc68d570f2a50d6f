"""Precision policies, applied in one place: the model call inside the step.

fp32: everything float32.
bf16: torch.autocast's way, op by op: params, optimizer state, inputs, embeddings, LayerNorm, softmax,
      the residual stream, logits and loss in float32; the matmuls (dense layers, the tied head, the
      attention products) in bfloat16 with float32 accumulation and one rounding of each result. The
      built-in models do the per-op casting (Policy.matmul_dtype, read by jaxloop.model.builtin.make_model);
      a model of your own gets it by passing `policy.matmul_dtype` to its layers (e.g. a Dense layer's
      inputs and kernel cast to it) and float32 everywhere else.
bf16_full: the whole model in bfloat16: params and floating inputs cast to bfloat16 for the forward and
      backward pass (LayerNorm, softmax inputs and the residual stream included); logits and loss float32.
      Cheaper in memory traffic, further from torch.autocast (the parity suite measures both).
fp16: as bf16 (autocast-like, op by op) with float16 matmuls, plus dynamic loss scaling with
      torch.amp.GradScaler's rule (jaxloop.update.optimizer.dynamic_loss_scale; its state in the optimizer's).
fp64: everything float64 (needs jax x64), used by the parity suite.
auto: bf16 on an accelerator, fp32 on a CPU (auto_precision; jaxloop.run records the one chosen in the config).

float32 matmuls run at full float32 precision inside jaxloop's own computations: the train and eval steps
trace under `pinned_matmuls()` (jax.default_matmul_precision("highest"): no TF32 or bf16 passes on
GPUs/TPUs, for your model too while jaxloop trains it), and the built-in models also pass
lax.Precision.HIGHEST to each of their matmuls. Nothing is set process-wide: importing jaxloop leaves
jax's configuration as it was. torch_ref pins torch the same way (no TF32).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

MATMUL_PRECISION = "highest"
"""The matmul precision of jaxloop's computations (float32 matmuls at full precision, as torch without TF32)."""

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


def pinned_matmuls() -> contextlib.AbstractContextManager:
    """A context in which traced matmuls without an explicit precision run at MATMUL_PRECISION; it acts
    at trace time, so it belongs inside a jitted function (jaxloop's steps enter it there)."""
    return jax.default_matmul_precision(MATMUL_PRECISION)


def auto_precision() -> str:
    """precision=auto: bf16 where jax's default backend is an accelerator (GPU, TPU), fp32 on a CPU."""
    return "fp32" if jax.default_backend() == "cpu" else "bf16"


def resolve_precision(cfg: Any) -> Any:
    """cfg with precision=auto replaced by auto_precision() (call once jax may start its backend)."""
    return dataclasses.replace(cfg, precision=auto_precision()) if cfg.precision == "auto" else cfg


def get_policy(name: str) -> Policy:
    """The policy for config.precision (auto: auto_precision()'s)."""
    f32 = jnp.float32
    if name == "auto":
        name = auto_precision()
    if name == "fp32":
        return Policy("fp32", f32, f32, f32)
    if name == "bf16":
        return Policy("bf16", f32, f32, f32, matmul_dtype=jnp.bfloat16)
    if name == "bf16_full":
        return Policy("bf16_full", f32, jnp.bfloat16, f32)
    if name == "fp16":
        return Policy("fp16", f32, f32, f32, dynamic_scale=True, matmul_dtype=jnp.float16)
    if name == "fp64":
        if not jax.config.jax_enable_x64:  # pyright: ignore[reportAttributeAccessIssue]  # jax adds config options at run time
            raise ValueError("precision=fp64 needs 64-bit JAX: set JAX_ENABLE_X64=1")
        return Policy("fp64", jnp.float64, jnp.float64, jnp.float64)
    raise ValueError(f"precision={name!r} is not allowed: one of fp32, bf16, bf16_full, fp16, fp64, auto")


def _cast_floating(tree: Any, dtype: Any) -> Any:
    def cast(x: Any) -> Any:
        if isinstance(x, (jax.Array, jnp.ndarray)) and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)
