"""Known porting conventions that explain a divergence: each diagnosis reads the two modules' attributes
or recomputes the suspect step from the captured tensors, and returns a sentence (or nothing).

At the first diverging layer (clean input, different output): normalisation eps (torch 1e-5, Flax
1e-6), conv geometry (padding 'SAME' against torch's explicit padding, strides, dilation), a kernel
applied transposed, a bias not added, a layer computing in another dtype (bf16, float32 in a float64
check) or with a matmul precision set below "highest" (TF32/bf16 passes). Between two modules (the
input of a layer already differs while the previous layer's output agrees): an activation applied
differently (GELU's tanh approximation against erf, ...) and attention scores scaled or masked
differently (the scale and causality each side used are recovered from q, k, v and the attention's
output). In train-mode buffers: BatchNorm momentum (torch's 0.1 is Flax's 0.9) and the running
variance's update with the unbiased (torch) or biased (Flax's own BatchNorm) batch variance.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from jaxloop.parity.layers import Capture, Divergence, LayerDiff, ModuleCall
from jaxloop.parity.measures import rel_diff

CLOSE = {"fp64": 1e-9, "fp32": 1e-4}
"""Relative difference under which a recomputed candidate "is" what a side computed: far above the
rounding of one layer (1e-16 / 1e-7 relative), far below what a different convention gives (>1e-3)."""


def _close(a: np.ndarray | None, b: np.ndarray | None, precision: str) -> bool:
    if a is None or b is None or np.shape(a) != np.shape(b):
        return False
    r = rel_diff(a, b)
    return r <= CLOSE[precision]


def _attr(obj: Any, *names: str) -> Any:
    for n in names:
        if obj is not None and hasattr(obj, n):
            return getattr(obj, n)
    return None


def _to_flax_layout(t: np.ndarray, f: np.ndarray) -> np.ndarray | None:
    if t.shape == f.shape:
        return t
    if t.ndim >= 3 and np.moveaxis(t, 1, -1).shape == f.shape:
        return np.moveaxis(t, 1, -1)
    return None


# ----------------------------------------------------------------------------- at a layer


def at_layer(tc: ModuleCall, fc: ModuleCall, leaves: dict[str, np.ndarray], precision: str) -> list[str]:
    """Diagnoses of a layer whose input agrees and whose output does not; `leaves` are the Flax module's
    own variables by leaf name (kernel, bias, scale...)."""
    out = [
        d
        for d in (
            norm_eps(tc, fc),
            batch_norm_statistics(tc, fc, leaves, precision),
            conv_geometry(tc, fc),
            transposed_kernel(tc, fc, leaves, precision),
            missing_bias(tc, fc, leaves, precision),
            compute_dtype(tc, fc, precision),
            matmul_precision(fc),
        )
        if d
    ]
    if not out:
        out.append(
            f"no known convention explains it; compare the two definitions: torch {_describe_torch(tc.module)}, "
            f"Flax {_describe_flax(fc.module)}"
        )
    return out


def norm_eps(tc: ModuleCall, fc: ModuleCall) -> str | None:
    te, fe = _attr(tc.module, "eps"), _attr(fc.module, "epsilon", "eps")
    if te is None or fe is None or not isinstance(te, (int, float)) or float(te) == float(fe):
        return None
    default = " (Flax's LayerNorm/BatchNorm default is 1e-6, torch's 1e-5)" if float(fe) == 1e-6 else ""
    return f"{tc.type} eps: torch {te:g}, Flax epsilon={fe:g}{default}: pass epsilon={te:g} to the Flax module"


def batch_norm_statistics(tc: ModuleCall, fc: ModuleCall, leaves: dict[str, np.ndarray], precision: str) -> str | None:
    """Which statistics each side's BatchNorm normalised with, recomputed from the captured input: the
    batch's (train mode) or the running ones (eval mode); a diagnosis when they differ."""
    if "BatchNorm" not in tc.type or tc.input is None or tc.output is None or fc.output is None:
        return None
    if not {"mean", "var"} <= leaves.keys():
        return None
    x = np.asarray(tc.input, np.float64)
    if x.ndim < 2 or x.shape[1] != leaves["mean"].shape[0]:
        return None
    axes = tuple(i for i in range(x.ndim) if i != 1)
    shape = [1] * x.ndim
    shape[1] = x.shape[1]
    eps = float(_attr(tc.module, "eps") or 1e-5)
    scale = leaves.get("scale", np.ones(x.shape[1])).reshape(shape)
    bias = leaves.get("bias", np.zeros(x.shape[1])).reshape(shape)

    def normalised(mean: np.ndarray, var: np.ndarray) -> np.ndarray:
        return (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + eps) * scale + bias

    options = {
        "the batch's statistics (train mode)": normalised(x.mean(axes), x.var(axes)),
        "its running statistics (eval mode)": normalised(leaves["mean"], leaves["var"]),
    }
    f_out = _to_torch_layout_of(fc.output, tc.output)
    t, f = _which_value(options, tc.output, precision), _which_value(options, f_out, precision)
    if t is None or f is None or t == f:
        return None
    fix = (
        "the Flax BatchNorm got use_running_average=True while training: a `train`/`deterministic` flag not "
        "passed down to it (or to the module holding it)"
        if f.startswith("its running")
        else "the Flax BatchNorm got use_running_average=False in eval mode: pass use_running_average=not train"
    )
    return f"BatchNorm statistics: torch normalised with {t}, Flax with {f}: {fix}"


def _which_value(options: dict[str, np.ndarray], y: np.ndarray | None, precision: str) -> str | None:
    if y is None:
        return None
    diffs = {k: rel_diff(v, y) for k, v in options.items() if np.shape(v) == np.shape(y)}
    if not diffs:
        return None
    best = min(diffs, key=lambda k: diffs[k])
    return best if diffs[best] <= CLOSE[precision] else None


def _to_torch_layout_of(f: np.ndarray, t: np.ndarray) -> np.ndarray | None:
    if f.shape == t.shape:
        return f
    if f.ndim >= 3 and np.moveaxis(f, -1, 1).shape == t.shape:
        return np.moveaxis(f, -1, 1)
    return None


def _explicit_pads(
    padding: Any,
    in_spatial: tuple[int, ...],
    kernel: tuple[int, ...],
    strides: tuple[int, ...],
    dilation: tuple[int, ...],
) -> list[tuple[int, int]] | None:
    import jax

    n = len(in_spatial)
    if isinstance(padding, str):
        if padding.upper() in ("SAME", "VALID", "SAME_LOWER"):
            dilated = tuple((k - 1) * d + 1 for k, d in zip(kernel, dilation))
            return [(lo, hi) for lo, hi in jax.lax.padtype_to_pads(in_spatial, dilated, strides, padding.upper())]
        return None
    if isinstance(padding, int):
        return [(padding, padding)] * n
    pads = list(padding)
    if all(isinstance(p, int) for p in pads):
        return [(p, p) for p in pads]
    return [tuple(p) for p in pads]


def _tuple(x: Any, n: int, default: int = 1) -> tuple[int, ...]:
    if x is None:
        return (default,) * n
    if isinstance(x, int):
        return (x,) * n
    return tuple(int(v) for v in x)


def conv_geometry(tc: ModuleCall, fc: ModuleCall) -> str | None:
    """Conv padding, strides and dilation, torch's against the Flax module's (padding made explicit for
    this input's size)."""
    tm, fm = tc.module, fc.module
    if not type(tm).__name__.startswith("Conv") or not hasattr(tm, "padding") or fc.input is None:
        return None
    kernel = tuple(tm.kernel_size)
    n = len(kernel)
    in_spatial = tuple(fc.input.shape[1 : 1 + n]) if fc.input.ndim == n + 2 else None
    if in_spatial is None or _attr(fm, "padding") is None:
        return None
    issues = []
    t_strides, f_strides = tuple(tm.stride), _tuple(_attr(fm, "strides"), n)
    if t_strides != f_strides:
        issues.append(f"strides: torch {t_strides}, Flax {f_strides}")
    t_dil, f_dil = tuple(tm.dilation), _tuple(_attr(fm, "kernel_dilation"), n)
    if t_dil != f_dil:
        issues.append(f"dilation: torch {t_dil}, Flax kernel_dilation={f_dil}")
    if type(tm).__name__.startswith("ConvTranspose"):
        return "; ".join(issues) or None
    if isinstance(tm.padding, str):
        t_pads = _explicit_pads("SAME" if tm.padding == "same" else "VALID", in_spatial, kernel, t_strides, t_dil)
        assert t_pads is not None, "SAME and VALID always have explicit pads"
        if tm.padding == "same":  # torch puts the odd extra pad on the right too, but splits total // 2 left
            t_pads = [((k - 1) * d // 2, (k - 1) * d - (k - 1) * d // 2) for k, d in zip(kernel, t_dil)]
    else:
        t_pads = [(p, p) for p in tm.padding]
    f_pads = _explicit_pads(fm.padding, in_spatial, kernel, f_strides, f_dil)
    if f_pads is not None and [tuple(p) for p in f_pads] != [tuple(p) for p in t_pads]:
        issues.append(
            f"padding: torch pads {t_pads} (padding={tm.padding!r}), Flax padding={fm.padding!r} pads "
            f"{f_pads} for this {in_spatial} input with strides {f_strides}: pass padding={t_pads} to the "
            "Flax conv ('SAME' centres the window differently when the stride does not divide the input)"
        )
    if getattr(tm, "padding_mode", "zeros") != "zeros":
        issues.append(f"torch padding_mode={tm.padding_mode!r} (Flax pads with zeros unless padding='CIRCULAR')")
    return ("conv " + "; ".join(issues)) if issues else None


def _linear_like(fc: ModuleCall, leaves: dict[str, np.ndarray]) -> np.ndarray | None:
    k = leaves.get("kernel")
    if k is None or k.ndim != 2 or fc.input is None or fc.input.shape[-1] != k.shape[0]:
        return None
    return k


def transposed_kernel(tc: ModuleCall, fc: ModuleCall, leaves: dict[str, np.ndarray], precision: str) -> str | None:
    """A square kernel applied the other way round on one side: x @ K.T instead of x @ K."""
    k = _linear_like(fc, leaves)
    if k is None or k.shape[0] != k.shape[1] or tc.output is None or fc.output is None:
        return None
    x = np.asarray(fc.input, np.float64)
    b = leaves.get("bias", 0.0)
    straight, crossed = x @ k + b, x @ k.T + b
    t_out = _to_flax_layout(tc.output, fc.output)
    if _close(fc.output, crossed, precision) and _close(t_out, straight, precision):
        return (
            "the Flax layer applies its kernel transposed (x @ kernel.T): a Flax kernel is (in, out), a torch "
            "Linear weight (out, in) and transformers' Conv1D (in, out); the mapping already moved the weight "
            "into Flax's layout, so the layer must use it as x @ kernel"
        )
    if _close(fc.output, straight, precision) and _close(t_out, crossed, precision):
        return (
            "torch applies this weight transposed relative to the mapped kernel: a transpose is missing in the "
            "mapping (an override's layout, or a module the mapper took for another kind): map it with layout "
            "'transpose'"
        )
    return None


def missing_bias(tc: ModuleCall, fc: ModuleCall, leaves: dict[str, np.ndarray], precision: str) -> str | None:
    """The output differs from torch's by exactly the bias: the Flax layer leaves it out (or adds it twice)."""
    b = leaves.get("bias")
    if b is None or tc.output is None or fc.output is None:
        return None
    t_out = _to_flax_layout(tc.output, fc.output)
    if t_out is None or fc.output.shape[-1] != b.shape[-1]:
        return None
    d = t_out - fc.output
    target = np.broadcast_to(b, d.shape)
    if _close(d, target, precision):
        return "the Flax layer does not add its bias (the outputs differ by exactly the bias)"
    if _close(-d, target, precision):
        return "the Flax layer adds its bias twice (the outputs differ by exactly the bias)"
    return None


def compute_dtype(tc: ModuleCall, fc: ModuleCall, precision: str) -> str | None:
    want = "float64" if precision == "fp64" else "float32"
    if fc.output_dtype and fc.output_dtype != want:
        field = _attr(fc.module, "dtype")
        if field is not None and str(np.dtype(field)) == fc.output_dtype:
            fix = (
                f"its dtype field is {fc.output_dtype}"
                + (
                    " (Hugging Face's Flax modules default to jnp.float32 and pass their dtype to every submodule)"
                    if fc.output_dtype == "float32"
                    else ""
                )
                + f": build it with dtype=jnp.{want} for the check (the check pins the top module's dtype "
                "field itself; this layer has its own)"
            )
        else:
            fix = (
                "its dtype or param_dtype is set (bf16/fp16 matmuls are a mixed-precision choice, not a port): "
                "leave them None for the check"
            )
        return f"the Flax layer computes in {fc.output_dtype} (torch in {tc.output_dtype or want}): {fix}"
    return None


def matmul_precision(fc: ModuleCall) -> str | None:
    p = _attr(fc.module, "precision")
    if p is None:
        return None
    name = str(p).lower()
    if "highest" in name or name.endswith(".float32") or "hifi" in name:
        return None
    return (
        f"the Flax layer sets precision={p} (on GPUs and TPUs a float32 matmul then runs in TF32 or bf16 passes; "
        "torch's default on GPUs allows TF32 too): the check pins both to 'highest'"
    )


def _describe_torch(m: Any) -> str:
    return repr(m).split("\n")[0] if m is not None else "?"


def _describe_flax(m: Any) -> str:
    if m is None:
        return "?"
    import dataclasses

    if dataclasses.is_dataclass(m):
        fields = {f.name: getattr(m, f.name) for f in dataclasses.fields(m) if f.name not in ("parent", "name")}
        return f"{type(m).__name__}({', '.join(f'{k}={v!r}' for k, v in fields.items())})"
    attrs = {
        k: v for k, v in vars(m).items() if isinstance(v, (int, float, str, bool, tuple)) and not k.startswith("_")
    }
    return f"{type(m).__name__}({', '.join(f'{k}={v!r}' for k, v in attrs.items())})"


# ----------------------------------------------------------------------------- between two modules


_SQRT_2_PI = math.sqrt(2.0 / math.pi)


def _erf(x: np.ndarray) -> np.ndarray:
    from scipy.special import erf  # scipy comes with scikit-learn, a jaxloop dependency

    return erf(x)


ACTIVATIONS: dict[str, Any] = {
    "identity": lambda x: x,
    "relu": lambda x: np.maximum(x, 0.0),
    "GELU, exact (erf)": lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))),
    "GELU, tanh approximation": lambda x: 0.5 * x * (1.0 + np.tanh(_SQRT_2_PI * (x + 0.044715 * x**3))),
    "SiLU": lambda x: x / (1.0 + np.exp(-x)),
    "GELU, tanh with 1.702 (gelu_fast)": lambda x: (
        0.5 * x * (1.0 + np.tanh(0.7978845608 * x * (1.0 + 0.044715 * x * x)))
    ),
    "quick GELU (x sigmoid(1.702 x))": lambda x: x / (1.0 + np.exp(-1.702 * x)),
    "tanh": np.tanh,
    "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
}


def _which(fns: dict[str, Any], x: np.ndarray, y: np.ndarray, precision: str) -> str | None:
    """The candidate closest to y (relative difference within CLOSE), or None: the closest, not the first
    within reach (in float32, GELU's erf and tanh forms can both come within CLOSE of one side)."""
    with np.errstate(over="ignore", invalid="ignore"):
        diffs = {
            name: rel_diff(fn(np.asarray(x, np.float64)), y) for name, fn in fns.items() if np.shape(x) == np.shape(y)
        }
    diffs = {k: v for k, v in diffs.items() if not math.isnan(v)}
    if not diffs:
        return None
    name = min(diffs, key=lambda k: diffs[k])
    return name if diffs[name] <= CLOSE[precision] else None


def activation_between(
    prev_t: np.ndarray | None,
    prev_f: np.ndarray | None,
    next_t: np.ndarray | None,
    next_f: np.ndarray | None,
    precision: str,
) -> str | None:
    """Which elementwise activation takes each side from the previous layer's output to the next layer's
    input; a diagnosis when they differ."""
    if (
        prev_t is None
        or prev_f is None
        or next_t is None
        or next_f is None
        or prev_t.shape != next_t.shape
        or prev_f.shape != next_f.shape
    ):
        return None
    t, f = _which(ACTIVATIONS, prev_t, next_t, precision), _which(ACTIVATIONS, prev_f, next_f, precision)
    if t is None or f is None or t == f:
        return None
    hint = ""
    if {t, f} == {"GELU, exact (erf)", "GELU, tanh approximation"}:
        hint = (
            ": torch's F.gelu and nn.GELU() are exact (erf) unless approximate='tanh' (transformers' "
            "'gelu_new' and Flax's 'gelu_new' are tanh, its 'gelu' erf); Flax's nn.gelu defaults to "
            f"approximate=True (tanh): pass approximate={t != 'GELU, exact (erf)'}"
        )
    return f"activation: torch applies {t}, Flax {f}{hint}"


def attention_scale_and_mask(
    qkv: np.ndarray, core: np.ndarray, heads: int, precision: str
) -> tuple[str, float, bool] | None:
    """(label, scale, causal) of the scaled dot-product attention taking a fused [q | k | v] (batch, time,
    3 width) to `core` (batch, time, width), tried over the usual scales and with or without a causal mask."""
    if qkv.ndim != 3 or core.ndim != 3 or qkv.shape[-1] != 3 * core.shape[-1] or core.shape[-1] % heads:
        return None
    b, t, e3 = qkv.shape
    e = e3 // 3
    d = e // heads
    q, k, v = (a.reshape(b, t, heads, d).astype(np.float64) for a in np.split(qkv, 3, axis=-1))
    scores = np.einsum("bqhd,bkhd->bhqk", q, k)
    candidates = {
        f"1/sqrt(head_dim={d})": d**-0.5,
        f"1/head_dim={d}": 1.0 / d,
        "1 (unscaled)": 1.0,
        f"1/sqrt(width={e})": e**-0.5,
        f"sqrt(head_dim={d})": d**0.5,
    }
    for causal in (True, False):
        mask = np.tril(np.ones((t, t), bool)) if causal else np.ones((t, t), bool)
        for label, s in candidates.items():
            z = np.where(mask, scores * s, -np.inf)
            w = np.exp(z - z.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            y = np.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, t, e)
            if _close(core, y, precision):
                return label, s, causal
    return None


def attention_between(
    prev_t: np.ndarray | None,
    prev_f: np.ndarray | None,
    next_t: np.ndarray | None,
    next_f: np.ndarray | None,
    heads: int | None,
    precision: str,
) -> str | None:
    """The attention scale and mask each side applied between the fused projection and the output one."""
    if heads is None or prev_t is None or prev_f is None or next_t is None or next_f is None:
        return None
    t = attention_scale_and_mask(prev_t, next_t, heads, precision)
    f = attention_scale_and_mask(prev_f, next_f, heads, precision)
    return _attention_sentence(t, f)


def _attention_sentence(t: tuple[str, float, bool] | None, f: tuple[str, float, bool] | None) -> str | None:
    if t is None or f is None or t == f:
        return None
    parts = []
    if t[1] != f[1]:
        parts.append(f"scores scaled by {t[0]} in torch, by {f[0]} in Flax")
    if t[2] != f[2]:
        parts.append(f"a causal mask in {'torch' if t[2] else 'Flax'} only")
    return "attention: " + "; ".join(parts)


def heads_of(modules: list[Any]) -> int | None:
    """The head count of the first torch module with one (MultiheadAttention, transformers' attentions)."""
    for m in modules:
        h = _attr(m, "num_heads", "n_head", "nhead", "num_attention_heads")
        if isinstance(h, int) and h > 0:
            return h
    return None


def mha_container(tc: ModuleCall, fcap: Capture, fname: str, precision: str) -> str | None:
    """torch nn.MultiheadAttention (scale 1/sqrt(head_dim), no mask unless given) against the Flax attention
    module paired with it: the scale the Flax side used, from its fused projection's output and the output
    projection's input."""
    if tc.type != "MultiheadAttention":
        return None
    inside = sorted(
        (c for n, c in fcap.calls.items() if n.startswith(fname + "/") and ":" not in n), key=lambda c: c.start
    )
    e = tc.module.embed_dim
    qkv = next((c.output for c in inside if c.output is not None and c.output.shape[-1] == 3 * e), None)
    core = inside[-1].input if inside else None
    if qkv is None or core is None:
        return None
    h = tc.module.num_heads
    f = attention_scale_and_mask(qkv, core, h, precision)
    d = e // h
    t = (f"1/sqrt(head_dim={d})", d**-0.5, f[2] if f else False)  # torch's own scale; the mask as given
    return _attention_sentence(t, f)


def between(div: Divergence, tcap: Capture, fcap: Capture, precision: str) -> list[str]:
    """Diagnoses of a difference that arises between the previous agreeing pair and the first diverging one."""
    prev, d = div.previous, div.layer
    out = []
    if prev is not None:
        pt, pf = tcap.calls[prev.torch].output, fcap.calls[prev.flax].output
        nt, nf = tcap.calls[d.torch].input, fcap.calls[d.flax].input
        pf_t = _to_torch_layout(pf, pt)
        nf_t = _to_torch_layout(nf, nt)
        region = [
            c.module
            for n, c in sorted(tcap.calls.items(), key=lambda kv: -len(kv[0]))
            if (div.region == "" or n == div.region or n.startswith(div.region + "."))
        ]
        heads = heads_of(region + [c.module for c in tcap.calls.values()])
        out += [
            x
            for x in (
                activation_between(pt, pf_t, nt, nf_t, precision),
                attention_between(pt, pf_t, nt, nf_t, heads, precision),
            )
            if x
        ]
    for name, c in fcap.calls.items():
        if (
            (div.layer.flax == "" or name.startswith(div.layer.flax))
            and c.output_dtype
            and c.output_dtype not in ("float64", "float32")
        ):
            out.append(f"the Flax module {name} computes in {c.output_dtype}")
            break
    if not out:
        out.append(
            f"no known convention explains it: compare the code of {div.region or 'the model'} between "
            f"{prev.torch if prev else 'its input'} and {d.torch} (activations, residual additions, "
            "reshapes and transposes, pooling, masking) line by line"
        )
    return out


def _to_torch_layout(f: np.ndarray | None, t: np.ndarray | None) -> np.ndarray | None:
    if f is None or t is None:
        return None
    if f.shape == t.shape:
        return f
    if f.ndim >= 3 and np.moveaxis(f, -1, 1).shape == t.shape:
        return np.moveaxis(f, -1, 1)
    return None


def inside_container(
    div: Divergence, diffs: list[LayerDiff], tcap: Capture, fcap: Capture, precision: str
) -> list[str]:
    """A container (a module holding a layer and more code) whose input agrees and whose output does not,
    while the last paired module inside it agrees: what its own code does after that module (an
    activation such as Hugging Face's `intermediate`: dense, then the activation)."""
    name = div.layer.torch
    inner = [d for d in diffs if name == "" or d.torch.startswith(name + ".")]
    inner = [d for d in inner if d.torch != name and d.out_diff <= div.tolerance]
    if not inner:
        return []
    last = max(inner, key=lambda d: d.end)
    pt, pf = tcap.calls[last.torch].output, fcap.calls[last.flax].output
    nt, nf = tcap.calls[name].output, fcap.calls[div.layer.flax].output
    found = activation_between(pt, _to_torch_layout(pf, pt), nt, _to_torch_layout(nf, nt), precision)
    return [f"{found} (inside {name or 'the model'}, after {last.torch})"] if found else []


def diagnose(
    div: Divergence,
    tcap: Capture,
    fcap: Capture,
    flax_leaves: dict[str, np.ndarray],
    module_leaves: dict[str, str],
    precision: str,
    diffs: list[LayerDiff] | None = None,
) -> list[str]:
    """The diagnoses of a divergence; `module_leaves` maps each leaf name of the diverging Flax module
    (kernel, bias...) to its full Flax name; `diffs` (every paired module) lets a container's own code be
    diagnosed after the last module inside it that agrees."""
    tc, fc = tcap.calls[div.layer.torch], fcap.calls[div.layer.flax]
    if div.clean_input:
        leaves = {leaf: np.asarray(flax_leaves[full], np.float64) for leaf, full in module_leaves.items()}
        found = [x for x in (mha_container(tc, fcap, div.layer.flax, precision),) if x]
        found += inside_container(div, diffs or [], tcap, fcap, precision)
        return found if found else at_layer(tc, fc, leaves, precision)
    return between(div, tcap, fcap, precision)


# ----------------------------------------------------------------------------- buffers


def batch_norm_update(
    tm: Any,
    fmod: Any,
    x: np.ndarray | None,
    old: dict[str, np.ndarray],
    new_t: dict[str, np.ndarray],
    new_f: dict[str, np.ndarray],
    precision: str,
) -> list[str]:
    """Why a BatchNorm's running statistics differ after a train-mode step: the momentum convention
    (attributes, and the fraction each side moved) and the running variance's unbiased or biased batch
    variance (recomputed from the layer's train-mode input `x`, torch layout)."""
    out = []
    tmom = _attr(tm, "momentum")
    fmom = _attr(fmod, "momentum")
    if isinstance(tmom, float) and isinstance(fmom, (int, float)) and abs(float(fmom) - (1 - tmom)) > 1e-12:
        if abs(float(fmom) - tmom) <= 1e-12:
            out.append(
                f"BatchNorm momentum: torch's momentum={tmom:g} weights the batch (new = {1 - tmom:g} old + "
                f"{tmom:g} batch), Flax's weights the old value (new = momentum old + (1 - momentum) batch): "
                f"pass momentum={1 - tmom:g} to the Flax BatchNorm"
            )
        else:
            out.append(
                f"BatchNorm momentum: torch's {tmom:g} is Flax's momentum={1 - tmom:g}; the Flax module has {fmom:g}"
            )
    if x is None or x.ndim < 2 or not {"mean", "var"} <= old.keys():
        return out
    axes = tuple(i for i in range(x.ndim) if i != 1)
    x = np.asarray(x, np.float64)
    mean_b, var_b = x.mean(axes), x.var(axes)
    n = x.size // x.shape[1]

    def fraction(new_mean: np.ndarray) -> float:
        step, full = new_mean - old["mean"], mean_b - old["mean"]
        return float(np.dot(step, full) / np.dot(full, full)) if np.dot(full, full) else math.nan

    def variance_kind(new_var: np.ndarray, a: float) -> str | None:
        # the closer of the two (they differ by a n/(n-1) - a, within float32's CLOSE for large n): in
        # every precision, when the closer one is within CLOSE and the other at least 3 times as far
        d = {
            label: rel_diff(new_var, (1 - a) * old["var"] + a * v)
            for label, v in (("unbiased", var_b * n / (n - 1)), ("biased", var_b))
        }
        best, other = sorted(d, key=lambda k: d[k])
        return best if d[best] <= CLOSE[precision] and d[other] >= 3 * d[best] else None

    at, af = fraction(new_t["mean"]), fraction(new_f["mean"])
    if not out and not math.isnan(at) and not math.isnan(af) and abs(at - af) > 1e-6:
        out.append(
            f"BatchNorm running statistics move by {at:.3g} of the batch's in torch, {af:.3g} in Flax "
            f"(a momentum of {1 - at:.3g} in Flax's convention)"
        )
    vt, vf = variance_kind(new_t["var"], at), variance_kind(new_f["var"], af)
    if vt and vf and vt != vf:
        out.append(
            f"BatchNorm running variance: torch updates it with the {vt} batch variance, Flax with the {vf} "
            f"one (x n/(n-1), n = {n} values per channel here; flax's linen.BatchNorm and nnx.BatchNorm use the "
            "biased one): a BatchNorm that uses n/(n-1) for its running variance matches torch"
        )
    return out
