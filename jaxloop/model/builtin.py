"""The built-in Flax models: an MLP for feature vectors (digits, .npz) and a character-level GPT.

Both are written out layer by layer so that torch_ref/models.py can mirror them exactly; parameter names
are stable because torch_ref maps weights by them. The GPT's attention core is jaxloop.model.attention's:
written out (xla), or cuDNN's fused kernel (cudnn) where model.attention chooses it.

Precision. `mm_dtype` (set by make_model from the precision policy: bfloat16 for precision="bf16",
None otherwise) makes the models cast op by op as torch.autocast does: the matmuls (Dense layers, the
tied head, the attention products q.k and weights.v) take their inputs in mm_dtype, accumulate in
float32 and round their result once to mm_dtype (bias added before that rounding, as torch's addmm);
everything else stays float32: embeddings, LayerNorm, softmax, the residual stream, the activations'
arithmetic (computed in float32 from mm_dtype inputs and rounded once, as torch does for GELU on bf16),
logits and loss. With mm_dtype None every op runs in its inputs' dtype (fp32, fp64, or the whole-model
bf16_full / fp16 policies, which cast params and inputs before the call). float32 matmuls are pinned to
full precision (lax.Precision.HIGHEST: no TF32 or bf16 passes on accelerators).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxloop.config.run import ModelConfig, padded_vocab
from jaxloop.model.attention import AttentionChoice, choose, dot_product_attention

ACTIVATIONS = {
    "gelu": lambda x: nn.gelu(x, approximate=True),
    "gelu_exact": lambda x: nn.gelu(x, approximate=False),
    "relu": nn.relu,
    "tanh": jnp.tanh,
}
HIGHEST = jax.lax.Precision.HIGHEST


def _act(name: str, x: jax.Array) -> jax.Array:
    """The activation computed in at least float32 and rounded once to x's dtype (torch's way on bf16)."""
    return ACTIVATIONS[name](x.astype(jnp.promote_types(x.dtype, jnp.float32))).astype(x.dtype)


def _matmul(x: jax.Array, w: jax.Array, dims: Any, mm_dtype: Any, bias: jax.Array | None = None) -> jax.Array:
    """dot_general(x, w) (+ bias). mm_dtype None: in the promoted dtype of the operands, at full precision.
    Otherwise autocast's way: operands (and bias) in mm_dtype, float32 accumulation, one rounding to mm_dtype."""
    if mm_dtype is None:
        dtype = jnp.result_type(x, w) if bias is None else jnp.result_type(x, w, bias)
        y = jax.lax.dot_general(x.astype(dtype), w.astype(dtype), dims, precision=HIGHEST)
        if bias is not None:
            y += jnp.reshape(bias.astype(dtype), (1,) * (y.ndim - 1) + (-1,))
        return y
    y = jax.lax.dot_general(
        x.astype(mm_dtype), w.astype(mm_dtype), dims, precision=HIGHEST, preferred_element_type=jnp.float32
    )
    if bias is not None:
        y += jnp.reshape(bias.astype(mm_dtype).astype(jnp.float32), (1,) * (y.ndim - 1) + (-1,))
    return y.astype(mm_dtype)


class Dense(nn.Module):
    """flax.linen.Dense's parameters (kernel (in, out), bias; same names, initialisers and float32
    param dtype, so the same initial values) computed by _matmul (mm_dtype: see the module doc)."""

    features: int
    use_bias: bool = True
    kernel_init: Any = nn.initializers.lecun_normal()
    bias_init: Any = nn.initializers.zeros_init()
    mm_dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features), jnp.float32)
        bias = self.param("bias", self.bias_init, (self.features,), jnp.float32) if self.use_bias else None
        return _matmul(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), self.mm_dtype, bias)


LN_EPS = 1e-5  # torch.nn.LayerNorm's default; flax's is 1e-6
INIT_STD = 0.02  # GPT-2 initialisation of GPT matrices and embeddings


def _gpt_dense(features: int, name: str, mm_dtype: Any, std: float = INIT_STD) -> Dense:
    """A GPT matrix: Dense with GPT-2's normal(0.02) kernel initialisation (or normal(std))."""
    return Dense(features, kernel_init=nn.initializers.normal(std), mm_dtype=mm_dtype, name=name)


def residual_std(init: str, n_layers: int) -> float:
    """The init std of the matrices that write into the residual stream (attention's proj, mlp_proj):
    0.02, or under model.init=gpt2 0.02 / sqrt(2 * n_layers) (GPT-2's paper, nanoGPT's and llm.c's init)."""
    return INIT_STD / math.sqrt(2 * n_layers) if init == "gpt2" else INIT_STD


class MLP(nn.Module):
    """Dense layers with an activation between them; returns logits."""

    hidden: tuple[int, ...]
    classes: int
    activation: str = "gelu"
    mm_dtype: Any = None

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        for i, width in enumerate(self.hidden):
            x = _act(self.activation, Dense(width, mm_dtype=self.mm_dtype, name=f"hidden_{i}")(x))
        return Dense(self.classes, mm_dtype=self.mm_dtype, name="out")(x)


class CausalSelfAttention(nn.Module):
    """One qkv projection split [q | k | v], heads from a reshape, causal attention by `attention` (xla or
    cudnn: jaxloop.model.attention), the output projection (`proj_std`: its kernel's init std)."""

    n_heads: int
    dropout: float
    mm_dtype: Any = None
    attention: str = "xla"
    proj_std: float = INIT_STD

    @nn.compact
    def __call__(self, x: jax.Array, train: bool, cache_index: jax.Array | None = None) -> jax.Array:
        b, t, c = x.shape
        h, d = self.n_heads, c // self.n_heads
        dense = partial(_gpt_dense, mm_dtype=self.mm_dtype)
        q, k, v = jnp.split(dense(3 * c, "qkv")(x), 3, axis=-1)
        q, k, v = (a.reshape(b, t, h, d) for a in (q, k, v))
        drop = nn.Dropout(self.dropout, deterministic=not train)
        if cache_index is not None:
            k, v = self._cached(k, v, cache_index)
        y = dot_product_attention(q, k, v, self.attention, self.mm_dtype, dropout=drop, q_offset=cache_index).reshape(
            b, t, c
        )
        return dense(c, "proj", std=self.proj_std)(y)

    def _cached(self, k: jax.Array, v: jax.Array, index: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The KV cache (collection "cache"; as long as the first call's input) with k, v written from position
        `index` on: the keys and values the queries attend to."""
        cached_k = self.variable("cache", "key", jnp.zeros, k.shape, k.dtype)
        cached_v = self.variable("cache", "value", jnp.zeros, v.shape, v.dtype)
        at = (0, index, 0, 0)
        cached_k.value = jax.lax.dynamic_update_slice(cached_k.value, k.astype(cached_k.value.dtype), at)
        cached_v.value = jax.lax.dynamic_update_slice(cached_v.value, v.astype(cached_v.value.dtype), at)
        return cached_k.value, cached_v.value


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    n_heads: int
    mlp_ratio: int
    dropout: float
    mm_dtype: Any = None
    attention: str = "xla"
    proj_std: float = INIT_STD
    gelu: str = "tanh"  # model.gelu: tanh (GPT-2's gelu_new) or exact
    ln_eps: float = LN_EPS

    @nn.compact
    def __call__(self, x: jax.Array, train: bool, cache_index: jax.Array | None = None) -> jax.Array:
        c = x.shape[-1]
        drop = nn.Dropout(self.dropout, deterministic=not train)
        dense = partial(_gpt_dense, mm_dtype=self.mm_dtype)
        # the residual stream keeps x's dtype (float32 under mm_dtype: a bf16 branch is promoted by the add)
        x = x + drop(
            CausalSelfAttention(self.n_heads, self.dropout, self.mm_dtype, self.attention, self.proj_std, name="attn")(
                nn.LayerNorm(epsilon=self.ln_eps, name="ln1")(x), train, cache_index
            )
        )
        y = nn.LayerNorm(epsilon=self.ln_eps, name="ln2")(x)
        act = "gelu" if self.gelu == "tanh" else "gelu_exact"
        y = dense(c, "mlp_proj", std=self.proj_std)(_act(act, dense(self.mlp_ratio * c, "mlp_fc")(y)))
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
    mm_dtype: Any = None
    attention: str = "xla"
    """xla or cudnn (jaxloop.model.attention; make_model resolves model.attention=auto to one of them)."""
    init_scheme: str = "normal"
    """model.init: normal (every matrix normal(0.02)) or gpt2 (the residual projections at 0.02 / sqrt(2 L))."""
    gelu: str = "tanh"
    """model.gelu: tanh (GELU's tanh approximation, GPT-2's gelu_new) or exact (erf)."""
    ln_eps: float = LN_EPS
    """model.ln_eps: every LayerNorm's epsilon."""

    def block_args(self) -> tuple:
        """Block's arguments for each of this GPT's blocks (`Block(*gpt.block_args())` is one of them, unbound)."""
        return (
            self.n_heads,
            self.mlp_ratio,
            self.dropout,
            self.mm_dtype,
            self.attention,
            residual_std(self.init_scheme, self.n_layers),
            self.gelu,
            self.ln_eps,
        )

    @nn.compact
    def __call__(self, tokens: jax.Array, train: bool = False, cache_index: jax.Array | None = None) -> jax.Array:
        """Logits of `tokens` [B, T]. cache_index (decoding, jaxloop.sample): tokens sit at positions cache_index,
        ... and attend to the KV cache (mutable collection "cache", created by the first call as long as its
        tokens, e.g. model.context: apply(..., cache_index=0, mutable=["cache"])) after their keys are written."""
        init = nn.initializers.normal(INIT_STD)
        tok = nn.Embed(self.vocab_size, self.d_model, embedding_init=init, name="tok_embed")
        pos = nn.Embed(self.context, self.d_model, embedding_init=init, name="pos_embed")
        positions = jnp.arange(tokens.shape[1]) if cache_index is None else cache_index + jnp.arange(tokens.shape[1])
        x = tok(tokens) + pos(positions)[None]
        x = nn.Dropout(self.dropout, deterministic=not train)(x)
        block = nn.remat(Block, static_argnums=(2,)) if self.remat else Block
        for i in range(self.n_layers):
            x = block(*self.block_args(), name=f"block_{i}")(x, train, cache_index)
        x = nn.LayerNorm(epsilon=self.ln_eps, name="ln_f")(x)
        if self.tie_embeddings:  # x @ E^T (flax's Embed.attend), a matmul
            return _matmul(x, tok.embedding, (((x.ndim - 1,), (1,)), ((), ())), self.mm_dtype)
        return Dense(self.vocab_size, use_bias=False, kernel_init=init, mm_dtype=self.mm_dtype, name="head")(x)


def make_model(m: ModelConfig, num_classes: int, precision: str = "fp32") -> nn.Module:
    """The model `m` names; num_classes is the label count or vocabulary size from the data; the
    precision policy decides the matmul dtype of autocast-like policies."""
    from jaxloop.model.precision import get_policy

    mm_dtype = get_policy(precision).matmul_dtype
    if m.kind == "mlp":
        return MLP(
            hidden=tuple(m.hidden), classes=m.vocab_size or num_classes, activation=m.activation, mm_dtype=mm_dtype
        )
    attention = attention_choice(m, precision)
    return GPT(
        vocab_size=padded_vocab(m, num_classes),
        context=m.context,
        d_model=m.d_model,
        n_layers=m.n_layers,
        n_heads=m.n_heads,
        mlp_ratio=m.mlp_ratio,
        dropout=m.dropout,
        tie_embeddings=m.tie_embeddings,
        mm_dtype=mm_dtype,
        attention=attention.implementation,
        init_scheme=m.init,
        gelu=m.gelu,
        ln_eps=m.ln_eps,
    )


def attention_choice(m: ModelConfig, precision: str) -> AttentionChoice:
    """The attention implementation of the GPT that m names under `precision`, on jax's first device, and why
    (model.attention=auto: cudnn where it runs; jaxloop.model.attention)."""
    from jaxloop.model.precision import get_policy

    policy = get_policy(precision)
    return choose(m.attention, policy.matmul_dtype or policy.compute_dtype, m.d_model // m.n_heads, m.dropout)


def init_params(model: nn.Module, rng: jax.Array, example_x: Any) -> Any:
    """Parameters initialised deterministically from rng for inputs shaped like example_x.

    Jitted: run op by op, a small GPT's init takes seconds on a CPU; compiled, a fraction of that.
    """
    init = jax.jit(lambda key, x: model.init({"params": key}, x, train=False)["params"])
    return init(rng, example_x)
