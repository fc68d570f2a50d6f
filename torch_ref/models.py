"""The built-in models in PyTorch, layer for layer the same as jaxloop/model/builtin.py.

MLP: Linear layers with an activation between them (GELU is the tanh approximation, as in jaxloop).
GPT: token + position embeddings, dropout, pre-LayerNorm blocks (x + attn(ln1(x)), then
x + mlp(ln2(x))), final LayerNorm, and a head tied to the token embedding (x @ E^T) or untied (no bias).
Attention: one qkv projection split [q | k | v], heads from a reshape, and torch's
F.scaled_dot_product_attention (causal; dropout on the weights while training), the kernel torch users
run; parity_tests hold jaxloop's attention (jaxloop.model.attention) to it in fp32 and fp64. Under
torch.autocast (precision bf16, fp16) it is written out instead, as jaxloop's is, op by op: scores
q.k^T in bf16, / sqrt(d), softmax in float32, weights in bf16, weights.v in bf16. SDPA's kernels round
otherwise there (the scores stay float32; the CPU flash kernel rounds unnormalised weights), which moved
parity_tests' bf16 trajectory check to 2.2e-5 against its bound of 9.5e-6 (0.25 x the frameworks' own
bf16 gaps; docs/language-models.md, "Attention").
LayerNorm eps is 1e-5 in both (torch's default; flax's own default would be 1e-6).

Weights move between the two with `load_jax_params` / `export_jax_params`: Flax Dense kernels are
(in, out) and torch Linear weights are (out, in), so matrices are transposed; embeddings and LayerNorm
(scale -> weight, bias -> bias) are copied as they are. The round trip is exact.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from jaxloop.config.run import Config, padded_vocab

LN_EPS = 1e-5  # as jaxloop.model.builtin.LN_EPS
INIT_STD = 0.02  # GPT-2 initialisation of GPT matrices and embeddings, as in jaxloop

ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "tanh": torch.tanh,
}


class MLP(nn.Module):
    """Linear layers with an activation between them; returns logits."""

    def __init__(self, in_features: int, hidden: tuple[int, ...], classes: int, activation: str = "gelu"):
        super().__init__()
        widths = [in_features, *hidden]
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.out = nn.Linear(widths[-1], classes)
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.hidden:
            x = self.act(layer(x))
        return self.out(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h, d = self.n_heads, c // self.n_heads
        q, k, v = self.qkv(x).split(c, dim=-1)
        q, k, v = (a.reshape(b, t, h, d).transpose(1, 2) for a in (q, k, v))  # [B, H, T, D]
        if torch.is_autocast_enabled(x.device.type):
            y = self._autocast_attention(q, k, v)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.attn_drop.p if self.training else 0.0
            )
        return self.proj(y.transpose(1, 2).reshape(b, t, c))

    def _autocast_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention written out, under autocast: jaxloop's per-op roundings (the module doc)."""
        t, d = q.shape[-2], q.shape[-1]
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d)
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32)).masked_fill(~causal, -math.inf)
        weights = self.attn_drop(torch.softmax(scores, dim=-1).to(v.dtype))
        return weights @ v


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model, eps=LN_EPS)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model, eps=LN_EPS)
        self.mlp_fc = nn.Linear(d_model, mlp_ratio * d_model)
        self.mlp_proj = nn.Linear(mlp_ratio * d_model, d_model)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.resid_drop(self.attn(self.ln1(x)))
        y = self.mlp_proj(F.gelu(self.mlp_fc(self.ln2(x)), approximate="tanh"))
        return x + self.resid_drop(y)


class GPT(nn.Module):
    """Token + position embeddings, pre-LN blocks, final LayerNorm, tied or untied head; returns logits."""

    def __init__(
        self,
        vocab_size: int,
        context: int,
        d_model: int,
        n_layers: int,
        n_heads: int,
        mlp_ratio: int = 4,
        dropout: float = 0.0,
        tie_embeddings: bool = True,
        remat: bool = False,
    ):
        super().__init__()
        self.tie_embeddings, self.remat = tie_embeddings, remat
        self.tok_embed = nn.Embedding(vocab_size, d_model)
        self.pos_embed = nn.Embedding(context, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, mlp_ratio, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model, eps=LN_EPS)
        self.head = None if tie_embeddings else nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.tok_embed(tokens) + self.pos_embed(torch.arange(t, device=tokens.device))[None]
        x = self.drop(x)
        for block in self.blocks:
            if self.remat and self.training:
                # Recompute the block in the backward pass (dropout masks are replayed: RNG preserved).
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        x = self.ln_f(x)
        if self.tie_embeddings:
            return F.linear(x, self.tok_embed.weight)  # x @ E^T, flax's Embed.attend
        return self.head(x)


def make_model(cfg: Config, num_classes: int, example_x: Any) -> nn.Module:
    """The model the config names, initialised like jaxloop's (from torch's global RNG).

    num_classes is the label count or vocabulary size from the data; example_x (one batch of inputs)
    gives the MLP its input width.
    """
    m = cfg.model
    if m.kind == "mlp":
        in_features = int(np.prod(np.shape(example_x)[1:]))
        model = MLP(in_features, tuple(m.hidden), m.vocab_size or num_classes, m.activation)
    else:
        model = GPT(
            padded_vocab(m, num_classes),
            m.context,
            m.d_model,
            m.n_layers,
            m.n_heads,
            m.mlp_ratio,
            m.dropout,
            m.tie_embeddings,
            cfg.memory.remat == "blocks",
        )
    init_like_flax(model, m.init)
    return model


# ----------------------------------------------------------------------------- initialisation


def _lecun_normal_(weight: torch.Tensor) -> None:
    """flax's default Dense kernel init: variance_scaling(1, fan_in, truncated normal at +-2 std)."""
    fan_in = weight.shape[1]
    std = math.sqrt(1.0 / fan_in) / 0.87962566103423978  # std of a unit normal truncated at +-2
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-2.0 * std, b=2.0 * std)


@torch.no_grad()
def init_like_flax(model: nn.Module, init: str = "normal") -> None:
    """The same distributions as jaxloop's initialisers (not the same numbers: those are transferred).

    MLP: lecun_normal kernels, zero biases. GPT: normal(0.02) embeddings and matrices, zero biases,
    LayerNorm scale 1 and bias 0; init="gpt2" (model.init): attn.proj and mlp_proj at 0.02 / sqrt(2 L).
    """
    if isinstance(model, MLP):
        for layer in [*model.hidden, model.out]:
            _lecun_normal_(layer.weight)
            nn.init.zeros_(layer.bias)
        return
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
    if init == "gpt2":
        std = INIT_STD / math.sqrt(2 * len(model.blocks))
        for block in model.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=std)
            nn.init.normal_(block.mlp_proj.weight, mean=0.0, std=std)


# ----------------------------------------------------------------------------- jax <-> torch weights


def param_map(model: nn.Module) -> Iterator[tuple[tuple[str, ...], str, bool]]:
    """(flax path, torch parameter name, transpose) for every parameter, in the flax tree's key order."""
    rows: list[tuple[tuple[str, ...], str, bool]] = []

    def dense(path: tuple[str, ...], name: str, bias: bool = True) -> None:
        rows.append((path + ("kernel",), f"{name}.weight", True))
        if bias:
            rows.append((path + ("bias",), f"{name}.bias", False))

    def layer_norm(path: tuple[str, ...], name: str) -> None:
        rows.append((path + ("scale",), f"{name}.weight", False))
        rows.append((path + ("bias",), f"{name}.bias", False))

    if isinstance(model, MLP):
        for i in range(len(model.hidden)):
            dense((f"hidden_{i}",), f"hidden.{i}")
        dense(("out",), "out")
    elif isinstance(model, GPT):
        rows.append((("tok_embed", "embedding"), "tok_embed.weight", False))
        rows.append((("pos_embed", "embedding"), "pos_embed.weight", False))
        for i in range(len(model.blocks)):
            j, t = (f"block_{i}",), f"blocks.{i}"
            layer_norm(j + ("ln1",), f"{t}.ln1")
            dense(j + ("attn", "qkv"), f"{t}.attn.qkv")
            dense(j + ("attn", "proj"), f"{t}.attn.proj")
            layer_norm(j + ("ln2",), f"{t}.ln2")
            dense(j + ("mlp_fc",), f"{t}.mlp_fc")
            dense(j + ("mlp_proj",), f"{t}.mlp_proj")
        layer_norm(("ln_f",), "ln_f")
        if not model.tie_embeddings:
            dense(("head",), "head", bias=False)
    else:
        raise TypeError(f"no flax parameter map for {type(model).__name__}")
    return iter(sorted(rows))


def _flatten(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out: dict[tuple[str, ...], Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, prefix + (str(key),)))
        else:
            out[prefix + (str(key),)] = value
    return out


@torch.no_grad()
def load_jax_params(model: nn.Module, params: Mapping[str, Any]) -> nn.Module:
    """Copy a flax params tree (nested mapping of arrays, e.g. jax.device_get(params)) into the model.

    Every flax leaf must map to a parameter of the same shape (after transposing kernels) and every
    parameter must be covered; values are converted to the parameter's dtype (exact for float32 ->
    float32 and float32 -> float64).
    """
    flat = {path: np.asarray(v) for path, v in _flatten(params).items()}
    named = dict(model.named_parameters())
    expected = set()
    for path, name, transpose in param_map(model):
        expected.add(path)
        if path not in flat:
            raise KeyError(f"flax params lack {'/'.join(path)} (for torch {name})")
        value = flat[path].T if transpose else flat[path]
        param = named[name]
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(
                f"{'/'.join(path)}: flax shape {flat[path].shape} does not fit torch {name} "
                f"{tuple(param.shape)}{' (transposed)' if transpose else ''}"
            )
        param.copy_(torch.from_numpy(np.array(value, copy=True)).to(param.dtype))
    extra = sorted("/".join(p) for p in set(flat) - expected)
    if extra:
        raise KeyError(f"flax params have leaves the torch model lacks: {', '.join(extra)}")
    return model


@torch.no_grad()
def export_jax_params(model: nn.Module) -> dict[str, Any]:
    """A copy of the model's parameters as a flax params tree: nested dicts of numpy arrays (kernels (in, out))."""
    named = dict(model.named_parameters())
    tree: dict[str, Any] = {}
    for path, name, transpose in param_map(model):
        value = named[name].detach().cpu().numpy()
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        # a copy: .numpy() shares the parameter's memory, which the next optimizer step overwrites
        node[path[-1]] = np.array(value.T if transpose else value, order="C", copy=True)
    return tree
