"""Causal self-attention's core, softmax(q k^T / sqrt(d), masked) v, and the choice of its implementation.

model.attention (docs/language-models.md, "Attention"):

xla    written out in jnp ops and compiled by XLA: jax.nn.dot_product_attention(implementation="xla")'s math,
       kept in jaxloop's own form because that form rounds as torch does and jax's does not: it divides the
       scores by sqrt(d) (jax multiplies by 1/sqrt(d)), rounds them once to bf16 under precision=bf16 as
       torch.autocast does, and keeps float64 in float64 (jax's softmax always runs in float32). Swapping
       jax's in changes the default run's gradients in their last bits (measured: docs/language-models.md).
cudnn  jax.nn.dot_product_attention(implementation="cudnn"): cuDNN's fused flash attention, which never
       materialises the T x T scores. It needs an NVIDIA GPU, bf16 or fp16 operands, a head dimension that
       is a multiple of 8 and at most 128 (256 on Hopper, compute capability 9.x), and no attention dropout.
auto   cudnn where those hold, else xla; the run's metadata.json records the choice and why.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxloop.config.run import ConfigError

IMPLEMENTATIONS = ("auto", "xla", "cudnn")
HIGHEST = jax.lax.Precision.HIGHEST


class AttentionChoice(NamedTuple):
    """The implementation a model runs (xla or cudnn) and why (for the run's metadata)."""

    implementation: str
    reason: str


def cudnn_unsupported(
    dtype: Any, head_dim: int, dropout: float, platform: str, compute_capability: str | None
) -> str | None:
    """Why cuDNN's fused attention cannot run this case, or None when it can (the rules in the module doc)."""
    if platform not in ("gpu", "cuda"):
        return f"the device is {platform}, not an NVIDIA GPU"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return (
            f"its operands would be {jnp.dtype(dtype).name} (cuDNN needs bfloat16 or float16: precision bf16, "
            "bf16_full or fp16)"
        )
    hopper = (compute_capability or "").split(".")[0] == "9"
    limit = 256 if hopper else 128
    if head_dim % 8 or head_dim > limit:
        return f"the head dimension is {head_dim} (cuDNN needs a multiple of 8, at most {limit} on this GPU)"
    if dropout > 0:
        return f"model.dropout={dropout} (cuDNN's attention through jax has no dropout on the attention weights)"
    return None


def choose(requested: str, dtype: Any, head_dim: int, dropout: float, device: Any = None) -> AttentionChoice:
    """The implementation for model.attention=`requested` on `device` (default: jax's first device); an explicit
    cudnn that cannot run is a ConfigError naming why."""
    if requested not in IMPLEMENTATIONS:
        raise ConfigError("model.attention", requested, f"one of {', '.join(IMPLEMENTATIONS)}")
    if requested == "xla":
        return AttentionChoice("xla", "model.attention=xla")
    device = device if device is not None else jax.devices()[0]
    why_not = cudnn_unsupported(dtype, head_dim, dropout, device.platform, getattr(device, "compute_capability", None))
    if why_not is None:
        return AttentionChoice("cudnn", f"model.attention={requested}: cuDNN supports this case")
    if requested == "cudnn":
        raise ConfigError("model.attention", requested, f"auto or xla here: {why_not}")
    return AttentionChoice("xla", f"model.attention=auto: {why_not}")


def mask(t: int, s: int, kv_lengths: jax.Array | None = None, q_offset: jax.Array | None = None) -> jax.Array:
    """[B or 1, 1, t, s] booleans, True where a query may attend: causal (key <= query, queries aligned to the
    last t keys, or with q_offset the query i at key position q_offset + i: a KV cache), and keys before each
    sequence's kv_lengths[b] when given (padding at the end)."""
    if q_offset is None:
        keep = jnp.tril(jnp.ones((t, s), dtype=bool), k=s - t)[None, None]
    else:
        keep = (jnp.arange(s)[None, :] <= q_offset + jnp.arange(t)[:, None])[None, None]
    if kv_lengths is not None:
        keep = keep & (jnp.arange(s)[None, None, None, :] < kv_lengths[:, None, None, None])
    return keep


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    implementation: str = "xla",
    mm_dtype: Any = None,
    kv_lengths: jax.Array | None = None,
    dropout: Callable[[jax.Array], jax.Array] | None = None,
    q_offset: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of q, k, v [B, T, H, D] -> [B, T, H, D] by `implementation` (xla or cudnn; see the
    module doc). mm_dtype: the autocast-like matmul dtype (jaxloop.model.builtin); kv_lengths: int32 [B], keys from
    kv_lengths[b] on are padding; dropout: applied to the attention weights (xla only); q_offset: the key position
    of the first query (q [B, t] against a KV cache k, v [B, S]; xla only)."""
    if implementation == "cudnn" and q_offset is None:
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=True, key_value_seq_lengths=kv_lengths, implementation="cudnn"
        )
    if implementation not in ("xla", "cudnn"):
        raise ValueError(f"implementation={implementation!r} is not allowed: xla or cudnn (resolve auto with choose())")
    d = q.shape[-1]
    scores = _einsum("bqhd,bkhd->bhqk", q, k, mm_dtype)
    if mm_dtype is None:
        scores = scores / math.sqrt(d)
    else:  # torch divides a bf16 tensor by a Python float in float32 and rounds once
        scores = (scores.astype(jnp.float32) / math.sqrt(d)).astype(scores.dtype)
    # softmax in at least float32 (bf16/fp16 compute), float64 under fp64
    scores = jnp.where(
        mask(q.shape[1], k.shape[1], kv_lengths, q_offset),
        scores.astype(jnp.promote_types(scores.dtype, jnp.float32)),
        -jnp.inf,
    )
    weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    if dropout is not None:
        weights = dropout(weights)
    return _einsum("bhqk,bkhd->bqhd", weights, v, mm_dtype)


def _einsum(spec: str, a: jax.Array, b: jax.Array, mm_dtype: Any) -> jax.Array:
    """einsum at full precision; with mm_dtype, autocast's way (operands in mm_dtype, float32 accumulation,
    one rounding to mm_dtype)."""
    if mm_dtype is None:
        return jnp.einsum(spec, a, b, precision=HIGHEST)
    return jnp.einsum(
        spec, a.astype(mm_dtype), b.astype(mm_dtype), precision=HIGHEST, preferred_element_type=jnp.float32
    ).astype(mm_dtype)
