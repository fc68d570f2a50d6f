"""The built-in Flax models: an MLP for feature vectors (digits, .npz) and a character-level GPT.

Both are written out layer by layer (no fused attention) so that torch_ref/models.py can mirror them
exactly; parameter names are stable because torch_ref maps weights by them.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from loopcore.config import Config

ACTIVATIONS = {
    "gelu": lambda x: nn.gelu(x, approximate=True),
    "relu": nn.relu,
    "tanh": jnp.tanh,
}
LN_EPS = 1e-5  # torch.nn.LayerNorm's default; flax's is 1e-6
INIT_STD = 0.02  # GPT-2 initialisation of GPT matrices and embeddings


class MLP(nn.Module):
    """Dense layers with an activation between them; returns logits."""

    hidden: tuple[int, ...]
    classes: int
    activation: str = "gelu"

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        act = ACTIVATIONS[self.activation]
        for i, width in enumerate(self.hidden):
            x = act(nn.Dense(width, name=f"hidden_{i}")(x))
        return nn.Dense(self.classes, name="out")(x)


class CausalSelfAttention(nn.Module):
    n_heads: int
    dropout: float

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        b, t, c = x.shape
        h, d = self.n_heads, c // self.n_heads
        dense = lambda n, name: nn.Dense(n, kernel_init=nn.initializers.normal(INIT_STD), name=name)
        q, k, v = jnp.split(dense(3 * c, "qkv")(x), 3, axis=-1)
        q, k, v = (a.reshape(b, t, h, d) for a in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        # softmax in at least float32 (bf16/fp16 compute), float64 under fp64
        scores = jnp.where(causal, scores.astype(jnp.promote_types(scores.dtype, jnp.float32)), -jnp.inf)
        weights = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        weights = nn.Dropout(self.dropout, deterministic=not train)(weights)
        y = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, c)
        return dense(c, "proj")(y)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    n_heads: int
    mlp_ratio: int
    dropout: float

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        c = x.shape[-1]
        drop = nn.Dropout(self.dropout, deterministic=not train)
        dense = lambda n, name: nn.Dense(n, kernel_init=nn.initializers.normal(INIT_STD), name=name)
        x = x + drop(CausalSelfAttention(self.n_heads, self.dropout, name="attn")(
            nn.LayerNorm(epsilon=LN_EPS, name="ln1")(x), train))
        y = nn.LayerNorm(epsilon=LN_EPS, name="ln2")(x)
        y = dense(c, "mlp_proj")(nn.gelu(dense(self.mlp_ratio * c, "mlp_fc")(y), approximate=True))
        return x + drop(y)


class GPT(nn.Module):
    """Token + position embeddings, pre-LN blocks, final LayerNorm, tied or untied head; returns logits."""

    vocab_size: int
    context: int
    d_model: int
    n_layers: int
    n_heads: int
    mlp_ratio: int = 4
    dropout: float = 0.0
    tie_embeddings: bool = True
    remat: bool = False
    scan_blocks: bool = False
    """Run the (identical) blocks as one jax.lax.scan over their stacked parameters: XLA compiles one
    block body instead of n_layers copies. Parameters keep their per-block names (block_0, ...), so the
    tree, torch_ref's name map and optim's decay mask (ndim >= 2) are unchanged; the stacking (and its
    transpose, slicing the gradient) happens inside the step. Dropout masks then differ from the unrolled
    form's (per-layer keys are folded from one key), everything else is the same computation."""

    @nn.compact
    def __call__(self, tokens: jax.Array, train: bool = False) -> jax.Array:
        init = nn.initializers.normal(INIT_STD)
        tok = nn.Embed(self.vocab_size, self.d_model, embedding_init=init, name="tok_embed")
        pos = nn.Embed(self.context, self.d_model, embedding_init=init, name="pos_embed")
        x = tok(tokens) + pos(jnp.arange(tokens.shape[1]))[None]
        x = nn.Dropout(self.dropout, deterministic=not train)(x)
        if self.scan_blocks and not self.is_initializing():
            x = self._scanned_blocks(x, train)
        else:
            block = nn.remat(Block, static_argnums=(2,)) if self.remat else Block
            for i in range(self.n_layers):
                x = block(self.n_heads, self.mlp_ratio, self.dropout, name=f"block_{i}")(x, train)
        x = nn.LayerNorm(epsilon=LN_EPS, name="ln_f")(x)
        if self.tie_embeddings:
            return tok.attend(x)
        return nn.Dense(self.vocab_size, use_bias=False, kernel_init=init, name="head")(x)


    def _scanned_blocks(self, x: jax.Array, train: bool) -> jax.Array:
        """The blocks as lax.scan over [n_layers, ...]-stacked copies of block_0..block_{n-1}'s params."""
        params = self.variables["params"]
        stacked = jax.tree.map(lambda *p: jnp.stack(p), *[params[f"block_{i}"] for i in range(self.n_layers)])
        block = Block(self.n_heads, self.mlp_ratio, self.dropout, parent=None)  # unbound: applied by hand
        use_rng = train and self.dropout > 0
        key = self.make_rng("dropout") if use_rng else None

        def body(h: jax.Array, layer: tuple[Any, jax.Array]) -> tuple[jax.Array, None]:
            p, i = layer
            rngs = {"dropout": jax.random.fold_in(key, i)} if use_rng else None
            return block.apply({"params": p}, h, train, rngs=rngs), None

        if self.remat:
            body = jax.checkpoint(body)
        x, _ = jax.lax.scan(body, x, (stacked, jnp.arange(self.n_layers)))
        return x


SCAN_BLOCKS = False
"""make_model's GPT default for scan_blocks (chosen by measurement: see BENCHMARKS.md)."""


def make_model(cfg: Config, num_classes: int, scan_blocks: bool | None = None) -> nn.Module:
    """The model the config names; num_classes is the label count or vocabulary size from the data.

    scan_blocks: GPT.scan_blocks (None = SCAN_BLOCKS); the parameters are the same either way.
    """
    m = cfg.model
    classes = m.vocab_size or num_classes
    if m.kind == "mlp":
        return MLP(hidden=tuple(m.hidden), classes=classes, activation=m.activation)
    return GPT(
        vocab_size=classes, context=m.context, d_model=m.d_model, n_layers=m.n_layers,
        n_heads=m.n_heads, mlp_ratio=m.mlp_ratio, dropout=m.dropout,
        tie_embeddings=m.tie_embeddings, remat=m.remat,
        scan_blocks=SCAN_BLOCKS if scan_blocks is None else scan_blocks,
    )


def init_params(model: nn.Module, rng: jax.Array, example_x: Any) -> Any:
    """Parameters initialised deterministically from rng for inputs shaped like example_x.

    Jitted: run op by op, a small GPT's init takes seconds on a CPU; compiled, a fraction of that.
    """
    init = jax.jit(lambda key, x: model.init({"params": key}, x, train=False)["params"])
    return init(rng, example_x)
