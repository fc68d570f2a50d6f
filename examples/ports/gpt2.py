"""Hugging Face transformers' GPT-2 and a Flax Linen translation of it, checked against each other.

    python -m jaxloop.parity examples/ports/gpt2.py:make

The torch side is transformers' own GPT2LMHeadModel, built from a small config with random weights
(no download). Its Conv1D layers store weights (in, out), the attention's q, k and v come from one
fused projection (c_attn), and the output head is tied to the token embedding; the Flax port below
keeps all three (the head is `wte.attend`). Everything numeric is read from `Settings`, which
`Settings.of(config)` fills from the transformers config: a setting changed on the Flax side only is
a port bug the check must find (tests/test_port_planted.py plants them).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

from jaxloop.parity import Port

VOCAB, CONTEXT, WIDTH, LAYERS, HEADS, BATCH = 64, 16, 32, 2, 4, 4


@dataclass(frozen=True)
class Settings:
    vocab_size: int
    n_positions: int
    n_embd: int
    n_layer: int
    n_head: int
    layer_norm_epsilon: float = 1e-5
    activation_function: str = "gelu_new"  # transformers' name: "gelu_new" is the tanh approximation
    scale_attn_weights: bool = True  # scale attention logits by 1/sqrt(head_dim)
    use_bias: bool = True  # every GPT-2 projection has a bias

    @classmethod
    def of(cls, config: Any, **changes: Any) -> Settings:
        s = cls(
            config.vocab_size,
            config.n_positions,
            config.n_embd,
            config.n_layer,
            config.n_head,
            config.layer_norm_epsilon,
            config.activation_function,
            config.scale_attn_weights,
        )
        return replace(s, **changes)


ACTIVATIONS = {
    "gelu_new": lambda x: nn.gelu(x, approximate=True),
    "gelu": lambda x: nn.gelu(x, approximate=False),
    "relu": nn.relu,
}


class Attention(nn.Module):
    s: Settings
    proj = nn.Dense  # the output projection's class (a test swaps in a faulty one)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        s = self.s
        b, t, e = x.shape
        h, d = s.n_head, e // s.n_head
        q, k, v = jnp.split(nn.Dense(3 * e, use_bias=s.use_bias, name="c_attn")(x), 3, axis=-1)
        q, k, v = (a.reshape(b, t, h, d) for a in (q, k, v))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (d**-0.5 if s.scale_attn_weights else 1.0)
        causal = jnp.tril(jnp.ones((t, t), bool))
        weights = jax.nn.softmax(jnp.where(causal, logits, jnp.finfo(logits.dtype).min), axis=-1)
        y = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, e)
        return self.proj(e, use_bias=s.use_bias, name="c_proj")(y)


class MLP(nn.Module):
    s: Settings

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        e = x.shape[-1]
        x = nn.Dense(4 * e, use_bias=self.s.use_bias, name="c_fc")(x)
        return nn.Dense(e, use_bias=self.s.use_bias, name="c_proj")(ACTIVATIONS[self.s.activation_function](x))


class Block(nn.Module):
    s: Settings
    attention = Attention

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        eps = self.s.layer_norm_epsilon
        x = x + self.attention(self.s, name="attn")(nn.LayerNorm(epsilon=eps, name="ln_1")(x))
        return x + MLP(self.s, name="mlp")(nn.LayerNorm(epsilon=eps, name="ln_2")(x))


class GPT2LMHead(nn.Module):
    """GPT-2 with its head tied to the token embedding: logits [batch, time, vocab] for tokens [batch, time]."""

    s: Settings
    block = Block

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        s = self.s
        wte = nn.Embed(s.vocab_size, s.n_embd, name="wte")
        x = wte(tokens) + nn.Embed(s.n_positions, s.n_embd, name="wpe")(jnp.arange(tokens.shape[1]))
        for i in range(s.n_layer):
            x = self.block(s, name=f"h_{i}")(x)
        return wte.attend(nn.LayerNorm(epsilon=s.layer_norm_epsilon, name="ln_f")(x))


def torch_model(seed: int = 0) -> Any:
    """transformers' GPT2LMHeadModel from a small config: torch's init, then every 1-d weight (LayerNorm
    scales, biases) moved off its 1/0 start so that the forward pass depends on each of them."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=CONTEXT,
        n_embd=WIDTH,
        n_layer=LAYERS,
        n_head=HEADS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def batch(i: int, batch_size: int = BATCH) -> dict[str, np.ndarray]:
    """Batch i of random tokens: x [batch, CONTEXT] and y the next tokens."""
    tokens = np.random.default_rng(1000 + i).integers(0, VOCAB, (batch_size, CONTEXT + 1))
    return {"x": tokens[:, :-1], "y": tokens[:, 1:]}


def torch_loss(model: Any, b: dict[str, Any]) -> Any:
    import torch.nn.functional as F

    logits = model(input_ids=b["x"]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b["y"].reshape(-1))


def flax_loss(model: Any, b: dict[str, jax.Array], train: bool) -> tuple[jax.Array, dict]:
    logits = model(b["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean(), {}


def make(**flax_changes: Any) -> Port:
    """The pair: transformers' GPT-2 and the Flax port (with `flax_changes` applied to its Settings)."""
    tm = torch_model()
    return Port(
        tm,
        GPT2LMHead(Settings.of(tm.config, **flax_changes)),
        batch(0),
        torch_loss,
        flax_loss,
        batches=batch,
        name="transformers GPT-2 (2 layers, width 32) vs a Flax Linen port",
    )
