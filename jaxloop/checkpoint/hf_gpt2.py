"""A Hugging Face GPT-2 directory <-> the built-in GPT (jaxloop.model.builtin.GPT): shape, weights, check.

In: `--init_from DIR` where DIR holds config.json and model.safetensors (read without pickle) or
pytorch_model.bin (torch.load(weights_only=True)), as `save_pretrained` writes them; any GPT-2 size.
`model_fields` turns config.json into model.* fields (layers, heads, width, context, vocabulary, GELU
variant, LayerNorm eps, tied head); `to_params` maps the tensors onto the GPT's params and `from_params`
back. The mapping is a table (RULES): the one the port check (jaxloop.parity.map_weights) derives by itself
from transformers' GPT2LMHeadModel and the built-in GPT, leaf for leaf (tests/test_hf_gpt2.py proves
the two equal; this layer sits below the port check and cannot call it). `check_logits` compares the
loaded GPT's logits with transformers' GPT2LMHeadModel's on a fixed batch (needs torch and transformers).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from jaxloop.config.run import ConfigError, ModelConfig, is_hf_model_dir

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
TORCH_FILE = "pytorch_model.bin"

GELUS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "exact"}
"""transformers' activation_function -> model.gelu (gelu_new, gelu_fast and gelu_pytorch_tanh are all GELU's
tanh approximation, written differently)."""

# (GPT-2 tensor name without its "transformer." prefix, the built-in GPT's leaf, layout); {i} is a block's index.
# transformers' Conv1D stores (in, out) as a Flax Dense kernel does: "as is"; the untied head is a Linear.
RULES: tuple[tuple[str, str, str], ...] = (
    ("wte.weight", "tok_embed/embedding", "as is"),
    ("wpe.weight", "pos_embed/embedding", "as is"),
    ("h.{i}.ln_1.weight", "block_{i}/ln1/scale", "as is"),
    ("h.{i}.ln_1.bias", "block_{i}/ln1/bias", "as is"),
    ("h.{i}.attn.c_attn.weight", "block_{i}/attn/qkv/kernel", "as is"),  # [q | k | v] columns in both
    ("h.{i}.attn.c_attn.bias", "block_{i}/attn/qkv/bias", "as is"),
    ("h.{i}.attn.c_proj.weight", "block_{i}/attn/proj/kernel", "as is"),
    ("h.{i}.attn.c_proj.bias", "block_{i}/attn/proj/bias", "as is"),
    ("h.{i}.ln_2.weight", "block_{i}/ln2/scale", "as is"),
    ("h.{i}.ln_2.bias", "block_{i}/ln2/bias", "as is"),
    ("h.{i}.mlp.c_fc.weight", "block_{i}/mlp_fc/kernel", "as is"),
    ("h.{i}.mlp.c_fc.bias", "block_{i}/mlp_fc/bias", "as is"),
    ("h.{i}.mlp.c_proj.weight", "block_{i}/mlp_proj/kernel", "as is"),
    ("h.{i}.mlp.c_proj.bias", "block_{i}/mlp_proj/bias", "as is"),
    ("ln_f.weight", "ln_f/scale", "as is"),
    ("ln_f.bias", "ln_f/bias", "as is"),
    ("lm_head.weight", "head/kernel", "transpose"),  # untied only: a tied head is wte itself
)
DROPPED = r"h\.\d+\.attn\.(bias|masked_bias)"
"""Buffers older GPT-2 checkpoints carry (the causal mask): nothing to map, the GPT builds its own mask."""
TRANSFORMER = "transformer."


class HFError(ConfigError):
    """A Hugging Face directory the built-in GPT cannot take (a ConfigError of init_from, or export's input)."""


def is_hf_dir(path: str | Path) -> bool:
    """Whether `path` is a Hugging Face model directory: config.json and model.safetensors or pytorch_model.bin."""
    return is_hf_model_dir(path)


def read_config(path: str | Path) -> dict[str, Any]:
    """config.json of a Hugging Face directory, as a dict (HFError when it is not a readable JSON object)."""
    try:
        hf = json.loads((Path(path) / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise HFError(
            "init_from", str(path), f"a Hugging Face GPT-2 directory with a readable {CONFIG_FILE} ({e})"
        ) from None
    if not isinstance(hf, dict):
        raise HFError("init_from", str(path), f"a Hugging Face GPT-2 directory ({CONFIG_FILE} is not a JSON object)")
    return hf


def model_fields(hf: dict[str, Any], path: str = "") -> dict[str, Any]:
    """The model.* fields of the built-in GPT that GPT-2's config.json describes; HFError naming the first
    config.json field the built-in GPT does not implement."""

    def refuse(what: str) -> HFError:
        return HFError("init_from", path, f"a GPT-2 the built-in GPT implements: {CONFIG_FILE} has {what}")

    if hf.get("model_type") != "gpt2":
        raise refuse(f"model_type={hf.get('model_type')!r} (allowed: 'gpt2')")
    fixed = {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False}
    for name, want in fixed.items():
        if hf.get(name, want) != want:
            raise refuse(f"{name}={hf[name]!r} (allowed: {want!r})")
    act = hf.get("activation_function", "gelu_new")
    if act not in GELUS:
        raise refuse(f"activation_function={act!r} (allowed: {', '.join(GELUS)})")
    try:
        d, n_inner = int(hf["n_embd"]), hf.get("n_inner")
        fields = dict(
            kind="gpt",
            context=int(hf["n_positions"]),
            d_model=d,
            n_layers=int(hf["n_layer"]),
            n_heads=int(hf["n_head"]),
            vocab_size=int(hf["vocab_size"]),
            vocab_multiple=1,
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
            gelu=GELUS[act],
            ln_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise refuse(f"no usable {e} (GPT-2 configs give n_embd, n_positions, n_layer, n_head, vocab_size)") from None
    if n_inner is not None and (int(n_inner) % d or int(n_inner) <= 0):
        raise refuse(f"n_inner={n_inner!r} (allowed: null or a positive multiple of n_embd={d})")
    fields["mlp_ratio"] = int(n_inner) // d if n_inner is not None else 4
    return fields


SHAPE_FIELDS = (
    "kind",
    "context",
    "d_model",
    "n_layers",
    "n_heads",
    "mlp_ratio",
    "vocab_size",
    "vocab_multiple",
    "tie_embeddings",
    "gelu",
    "ln_eps",
)
"""The model.* fields a Hugging Face checkpoint decides (model_fields' keys)."""


def with_checkpoint_shape(m: ModelConfig, default: ModelConfig, path: str) -> ModelConfig:
    """m with the shape of the GPT-2 in `path`: each field of SHAPE_FIELDS taken from its config.json; a field
    given a value other than both the preset's (`default`) and the checkpoint's is a ConfigError."""
    from dataclasses import replace

    fields = model_fields(read_config(path), path)
    for name, value in fields.items():
        given = getattr(m, name)
        if given != value and given != getattr(default, name):
            raise ConfigError(
                f"model.{name}",
                given,
                f"the value of the Hugging Face checkpoint --init_from names "
                f"({value!r} in {Path(path) / CONFIG_FILE}), or left out",
            )
    return replace(m, **fields)


# ----------------------------------------------------------------------------- tensors


def read_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """The directory's tensors by name: model.safetensors (no pickle), else pytorch_model.bin through
    torch.load(weights_only=True) (HFError without torch)."""
    p = Path(path)
    if (p / SAFETENSORS_FILE).is_file():
        from safetensors.numpy import load_file

        try:
            return load_file(p / SAFETENSORS_FILE)
        except Exception as e:  # noqa: BLE001 - a damaged or non-numpy (bf16) file: said in one line
            raise HFError("init_from", str(path), f"a readable {SAFETENSORS_FILE} ({type(e).__name__}: {e})") from None
    try:
        import torch
    except ImportError:
        raise HFError(
            "init_from", str(path), f"a {SAFETENSORS_FILE} (its {TORCH_FILE} needs torch, which is not installed)"
        ) from None
    try:  # weights_only: tensors and containers of them, never an arbitrary pickled object
        state = torch.load(p / TORCH_FILE, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch's UnpicklingError names the object it refused
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HFError(
            "init_from",
            str(path),
            f"a {TORCH_FILE} of tensors only (torch.load(weights_only=True) refused it: {first})",
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise HFError("init_from", str(path), f"a {TORCH_FILE} holding a state_dict of tensors")
    return {
        k: v.detach().float().numpy() if v.dtype == torch.bfloat16 else v.detach().numpy() for k, v in state.items()
    }


def tensor_shapes(path: str | Path) -> dict[str, np.ndarray]:
    """The directory's tensors as zero-stride stand-ins of their shapes, read from model.safetensors' header
    alone (no tensor is read); pytorch_model.bin's are read whole (read_tensors)."""
    p = Path(path)
    if not (p / SAFETENSORS_FILE).is_file():
        return read_tensors(path)
    from safetensors import safe_open

    try:
        with safe_open(p / SAFETENSORS_FILE, framework="numpy") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - a damaged header: said in one line
        raise HFError("init_from", str(path), f"a readable {SAFETENSORS_FILE} ({type(e).__name__}: {e})") from None
    return {k: np.broadcast_to(np.float32(0), s) for k, s in shapes.items()}


def _translate(name: str, source: int) -> tuple[str, str] | None:
    """RULES read from column `source` (0: GPT-2's name, 1: the GPT's leaf): (the other name, layout), or None."""
    for rule in RULES:
        pattern = re.escape(rule[source]).replace(re.escape("{i}"), r"(?P<i>\d+)")
        match = re.fullmatch(pattern, name)
        if match:
            return rule[1 - source].format(**match.groupdict()), rule[2]
    return None


def _leaf(key: str) -> tuple[str, str] | None:
    """(leaf, layout) of a GPT-2 tensor name (with or without "transformer."); None for a dropped buffer,
    ("", "") for a name that maps nowhere."""
    name = key[len(TRANSFORMER) :] if key.startswith(TRANSFORMER) else key
    if re.fullmatch(DROPPED, name):
        return None
    return _translate(name, 0) or ("", "")


def hf_name(leaf: str) -> tuple[str, str]:
    """(GPT-2 tensor name as GPT2LMHeadModel's state_dict has it, layout) of a built-in GPT leaf."""
    got = _translate(leaf, 1)
    if got is None:
        raise HFError("checkpoint", leaf, "a leaf of the built-in GPT (these params are not the built-in GPT's)")
    name, layout = got
    return (name if name.startswith("lm_head") else TRANSFORMER + name), layout


def to_params(tensors: dict[str, np.ndarray], m: ModelConfig, path: str = "") -> dict[str, Any]:
    """The built-in GPT's params (nested dicts of numpy arrays) from GPT-2's tensors; HFError naming the first
    tensor that maps nowhere, a leaf no tensor fills, or a shape that differs from the GPT that `m` describes."""
    want = expected_shapes(m)
    flat: dict[str, np.ndarray] = {}
    for key, value in tensors.items():
        got = _leaf(key)
        if got is None or (key.endswith("lm_head.weight") and m.tie_embeddings):
            continue  # a causal-mask buffer; a tied head's saved copy of wte
        leaf, layout = got
        if leaf not in want:
            raise HFError(
                "init_from",
                path,
                f"a GPT-2 checkpoint: tensor {key} {tuple(value.shape)} has no place in the built-in GPT",
            )
        value = value.T if layout == "transpose" else value
        if tuple(value.shape) != want[leaf]:
            raise HFError(
                "init_from",
                path,
                f"a GPT-2 checkpoint matching its {CONFIG_FILE}: {key} has shape "
                f"{tuple(value.shape)} as {leaf}, which is {want[leaf]} in the GPT it describes",
            )
        flat[leaf] = value
    missing = sorted(set(want) - set(flat))
    if missing:
        raise HFError(
            "init_from",
            path,
            f"a GPT-2 checkpoint with every tensor of the GPT its {CONFIG_FILE} describes;"
            f" missing: {', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}",
        )
    out: dict[str, Any] = {}
    for leaf, value in flat.items():
        node = out
        *parents, last = leaf.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def from_params(params: dict[str, Any]) -> dict[str, np.ndarray]:
    """GPT-2's tensors (named as GPT2LMHeadModel.save_pretrained names them) from the built-in GPT's params
    (nested dicts); a tied head is left out, as save_pretrained leaves it out."""
    out: dict[str, np.ndarray] = {}
    for path, value in _flatten(params):
        key, layout = hf_name("/".join(path))
        value = np.asarray(value)
        out[key] = np.ascontiguousarray(value.T if layout == "transpose" else value)
    return out


def _flatten(tree: Any, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    if isinstance(tree, dict):
        return [item for k in tree for item in _flatten(tree[k], prefix + (str(k),))]
    return [(prefix, tree)]


def expected_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every leaf of the built-in GPT that `m` describes (vocabulary m.vocab_size) and its shape."""
    d, v, f = m.d_model, m.vocab_size, m.mlp_ratio * m.d_model
    out = {"tok_embed/embedding": (v, d), "pos_embed/embedding": (m.context, d), "ln_f/scale": (d,), "ln_f/bias": (d,)}
    for i in range(m.n_layers):
        b = f"block_{i}/"
        out.update(
            {
                b + "ln1/scale": (d,),
                b + "ln1/bias": (d,),
                b + "ln2/scale": (d,),
                b + "ln2/bias": (d,),
                b + "attn/qkv/kernel": (d, 3 * d),
                b + "attn/qkv/bias": (3 * d,),
                b + "attn/proj/kernel": (d, d),
                b + "attn/proj/bias": (d,),
                b + "mlp_fc/kernel": (d, f),
                b + "mlp_fc/bias": (f,),
                b + "mlp_proj/kernel": (f, d),
                b + "mlp_proj/bias": (d,),
            }
        )
    if not m.tie_embeddings:
        out["head/kernel"] = (d, v)
    return out


def hf_config(m: ModelConfig, vocab_size: int) -> dict[str, Any]:
    """config.json of the GPT-2 that the built-in GPT `m` (vocabulary `vocab_size`) is, for GPT2LMHeadModel."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab_size,
        "n_positions": m.context,
        "n_embd": m.d_model,
        "n_layer": m.n_layers,
        "n_head": m.n_heads,
        "n_inner": None if m.mlp_ratio == 4 else m.mlp_ratio * m.d_model,
        "activation_function": "gelu_new" if m.gelu == "tanh" else "gelu",
        "layer_norm_epsilon": m.ln_eps,
        "tie_word_embeddings": m.tie_embeddings,
        "resid_pdrop": m.dropout,
        "embd_pdrop": m.dropout,
        "attn_pdrop": m.dropout,
        "scale_attn_weights": True,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
    }


# ----------------------------------------------------------------------------- the check against transformers

CHECK_TOLERANCE = {"fp64": 1e-10, "fp32": 1e-5}
"""Largest relative difference of the logits (max |a - b| / max |b|) the load check accepts, by precision."""


def check_batch(m: ModelConfig, seed: int = 0) -> np.ndarray:
    """The fixed batch the load check runs: 2 sequences of min(16, context) tokens drawn from the vocabulary."""
    return np.random.default_rng(seed).integers(0, m.vocab_size, (2, min(16, m.context))).astype(np.int64)


def gpt_logits(params: dict[str, Any], m: ModelConfig, tokens: np.ndarray, precision: str = "fp32") -> np.ndarray:
    """The built-in GPT's logits for `tokens` in precision fp32 or fp64 (fp64 inside jax's x64 mode, scoped)."""
    import contextlib

    import jax
    import jax.numpy as jnp

    from jaxloop.model.builtin import make_model

    dtype = np.float64 if precision == "fp64" else np.float32
    vocab = int(np.shape(params["tok_embed"]["embedding"])[0])  # the params' own (a padded vocabulary too)
    fields = {**_fields(m), "attention": "xla", "dropout": 0.0, "vocab_size": vocab, "vocab_multiple": 1}
    with jax.enable_x64(True) if precision == "fp64" else contextlib.nullcontext():
        model = make_model(ModelConfig(**fields), vocab, precision)
        p = jax.tree.map(lambda a: jnp.asarray(np.asarray(a, dtype)), params)
        return np.asarray(jax.jit(lambda p, x: model.apply({"params": p}, x))(p, jnp.asarray(tokens, jnp.int32)))


def _fields(m: ModelConfig) -> dict[str, Any]:
    from dataclasses import fields

    return {f.name: getattr(m, f.name) for f in fields(m)}


def transformers_logits(path: str | Path, tokens: np.ndarray, precision: str = "fp32") -> np.ndarray:
    """transformers' GPT2LMHeadModel.from_pretrained(path)'s logits for `tokens` (eval mode, CPU)."""
    import torch
    from transformers import GPT2LMHeadModel

    dtype = torch.float64 if precision == "fp64" else torch.float32
    model = GPT2LMHeadModel.from_pretrained(str(path), dtype=dtype, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(tokens)).logits.numpy()


def rel_diff(a: np.ndarray, b: np.ndarray) -> float:
    """max |a - b| / max |b| in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), math.ulp(1.0)))


def check_logits(path: str | Path, params: dict[str, Any], m: ModelConfig, precision: str = "fp32") -> str:
    """The load check, one line: the GPT's logits against transformers' GPT2LMHeadModel's on check_batch, in
    `precision` (HFError beyond CHECK_TOLERANCE), or what was checked where torch or transformers is missing."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return (
            "every tensor mapped with the GPT's shapes; logits not compared with transformers' GPT2LMHeadModel "
            "(torch and transformers are not both installed)"
        )
    tokens = check_batch(m)
    diff = rel_diff(gpt_logits(params, m, tokens, precision), transformers_logits(path, tokens, precision))
    tol = CHECK_TOLERANCE[precision]
    if not diff <= tol:
        raise HFError(
            "init_from",
            str(path),
            f"a GPT-2 the built-in GPT reproduces: its logits differ from "
            f"transformers' GPT2LMHeadModel's by {diff:.3g} (relative, {precision}; at most {tol:g} allowed)",
        )
    return (
        f"logits equal transformers' GPT2LMHeadModel's on a fixed batch of {tokens.shape[0]}x{tokens.shape[1]} "
        f"tokens ({precision}: max relative difference {diff:.2g} <= {tol:g})"
    )


def describe(m: ModelConfig) -> str:
    """The GPT-2's shape in words."""
    return (
        f"{m.n_layers} layers, {m.n_heads} heads, width {m.d_model}, context {m.context}, vocabulary "
        f"{m.vocab_size}, {'tied' if m.tie_embeddings else 'untied'} head, GELU {m.gelu}, LayerNorm eps {m.ln_eps:g}"
    )
