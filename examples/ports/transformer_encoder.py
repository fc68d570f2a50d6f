"""PyTorch's own nn.TransformerEncoder (pre-norm, GELU) and a Flax NNX translation of it.

    python -m jaxloop.parity examples/ports/transformer_encoder.py:make

The torch side is torch.nn.TransformerEncoder of two nn.TransformerEncoderLayer(norm_first=True,
activation="gelu", batch_first=True) with a final LayerNorm, trained to map random sequences onto
random targets (mean squared error). The NNX port names its parts its own way (blocks, attn_norm,
attn.qkv, mlp_in...), so the weights map by structure and execution order, not by name; torch's
fused in_proj_weight (3 width, width) becomes the qkv kernel (width, 3 width). torch's "gelu" is the
exact (erf) GELU, Flax's nn.gelu defaults to the tanh approximation: the port passes approximate=False.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxloop.parity import Port

WIDTH, HEADS, FFN, LAYERS, TIME, BATCH = 32, 4, 64, 2, 12, 4


class SelfAttention(nnx.Module):
    def __init__(self, width: int, heads: int, scale: float | None, rngs: nnx.Rngs):
        self.heads, self.scale = heads, scale if scale is not None else (width // heads) ** -0.5
        self.qkv = nnx.Linear(width, 3 * width, rngs=rngs)
        self.out = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, e = x.shape
        q, k, v = (a.reshape(b, t, self.heads, e // self.heads) for a in jnp.split(self.qkv(x), 3, axis=-1))
        weights = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) * self.scale, axis=-1)
        return self.out(jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, e))


class EncoderBlock(nnx.Module):
    """Pre-norm: x + attn(attn_norm(x)), then x + mlp(mlp_norm(x))."""

    def __init__(
        self, width: int, heads: int, ffn: int, eps: float, approximate_gelu: bool, scale: float | None, rngs: nnx.Rngs
    ):
        self.attn_norm = nnx.LayerNorm(width, epsilon=eps, rngs=rngs)
        self.attn = SelfAttention(width, heads, scale, rngs)
        self.mlp_norm = nnx.LayerNorm(width, epsilon=eps, rngs=rngs)
        self.mlp_in = nnx.Linear(width, ffn, rngs=rngs)
        self.mlp_out = nnx.Linear(ffn, width, rngs=rngs)
        self.approximate_gelu = approximate_gelu

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x)), approximate=self.approximate_gelu))


class Encoder(nnx.Module):
    """nn.TransformerEncoder(norm_first layers, final norm) for inputs [batch, time, width]."""

    def __init__(
        self,
        width: int = WIDTH,
        heads: int = HEADS,
        ffn: int = FFN,
        layers: int = LAYERS,
        eps: float = 1e-5,
        approximate_gelu: bool = False,
        attention_scale: float | None = None,
        rngs: nnx.Rngs | None = None,
    ):
        rngs = rngs or nnx.Rngs(0)
        self.blocks = nnx.List(
            [EncoderBlock(width, heads, ffn, eps, approximate_gelu, attention_scale, rngs) for _ in range(layers)]
        )
        self.final_norm = nnx.LayerNorm(width, epsilon=eps, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return self.final_norm(x)


def torch_model(seed: int = 0) -> Any:
    """torch.nn.TransformerEncoder: torch's init, LayerNorm scales and biases moved off 1 and 0."""
    import torch

    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(
        WIDTH, HEADS, dim_feedforward=FFN, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
    )
    model = torch.nn.TransformerEncoder(layer, LAYERS, norm=torch.nn.LayerNorm(WIDTH), enable_nested_tensor=False)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def batch(i: int, batch_size: int = BATCH) -> dict[str, np.ndarray]:
    """Batch i: random sequences x and targets y, [batch, time, width]."""
    rng = np.random.default_rng(3000 + i)
    return {
        "x": rng.normal(size=(batch_size, TIME, WIDTH)).astype(np.float32),
        "y": rng.normal(size=(batch_size, TIME, WIDTH)).astype(np.float32),
    }


def torch_loss(model: Any, b: dict[str, Any]) -> Any:
    return ((model(b["x"]) - b["y"]) ** 2).mean()


def flax_loss(model: Any, b: dict[str, jax.Array], train: bool) -> tuple[jax.Array, dict]:
    return jnp.mean((model(b["x"]) - b["y"]) ** 2), {}


def make(**flax_changes: Any) -> Port:
    """The pair: torch's TransformerEncoder and the NNX port (keyword arguments of Encoder changed by flax_changes)."""
    return Port(
        torch_model(),
        Encoder(**flax_changes),
        batch(0),
        torch_loss,
        flax_loss,
        batches=batch,
        name="torch nn.TransformerEncoder (2 pre-norm GELU layers, width 32) vs a Flax NNX port",
    )
