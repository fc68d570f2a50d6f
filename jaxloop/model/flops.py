"""Model FLOPs per token, the devices' peak FLOP/s and MFU (docs/language-models.md, "Tokens/s and MFU").

FLOPs per token of the built-in GPT's training update (forward and backward), PaLM's count (Chowdhery et al.
2022, appendix B), which nanoGPT's estimate_mfu uses:

    6 N + 12 L T d

N: the parameters that multiply activations: all of them but the position embedding, and but the token
embedding when the head is untied (an embedding lookup computes nothing; tied, the matrix is the head's
matmul and counts once). This is nanoGPT's get_num_params(non_embedding=True) for its tied GPT; LayerNorm
scales and biases are counted too (tiny). 12 L T d: attention's two T x T products per layer (q k^T and
weights @ v, 2 T d FLOPs per token each, times 3 for forward and backward), counted in full although the
causal mask makes half of them unneeded (llm.c counts 6 L T d, half: its MFU reads lower than this count
for the same speed). T is model.context (every sequence is full length).

MFU = tokens/s x FLOPs per token / (peak FLOP/s per device x devices). The peak: a table of the dense
(no sparsity) tensor-core rates vendors publish, for the precision's matmul dtype (bf16 for bf16,
bf16_full and fp16, which run at the same rate on these GPUs; fp32 without TF32, as jaxloop pins float32
matmuls), or, on a CPU, the rate of a jitted square matmul measured when the run starts.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from jaxloop.config.run import ModelConfig, padded_vocab

COUNT = "6N + 12*L*T*d"
"""The count of flops_per_token (the module doc), as the run's metadata names it."""

# (regex over jax's device_kind, lower case; {matmul dtype: FLOP/s per device}), first match wins. Dense
# rates from the vendors' data sheets: NVIDIA H100 (SXM5 / PCIe / NVL), H200, A100, L4; Google Cloud TPU
# v4, v5e ("TPU v5 lite"), v5p ("TPU v5"), v6e ("TPU v6 lite"), one jax device per chip.
PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"h100.*pcie", {"bf16": 756e12, "fp32": 51.2e12}),
    (r"h100.*nvl", {"bf16": 835.5e12, "fp32": 60e12}),
    (r"h100", {"bf16": 989.4e12, "fp32": 66.9e12}),
    (r"h200", {"bf16": 989.4e12, "fp32": 66.9e12}),
    (r"a100", {"bf16": 312e12, "fp32": 19.5e12}),
    (r"\bl4\b", {"bf16": 121e12, "fp32": 30.3e12}),
    (r"tpu v4", {"bf16": 275e12}),
    (r"tpu v5 ?lite|tpu v5e", {"bf16": 197e12}),
    (r"tpu v5p?$", {"bf16": 459e12}),
    (r"tpu v6 ?lite|tpu v6e", {"bf16": 918e12}),
)
MATMUL_DTYPE = {"fp32": "fp32", "bf16": "bf16", "bf16_full": "bf16", "fp16": "bf16", "fp64": "fp64"}


def gpt_params(m: ModelConfig, vocab: int) -> dict[str, int]:
    """Parameter counts of the built-in GPT (jaxloop.model.builtin.GPT) for config m over a `vocab` from the data:
    total, tok_embed, pos_embed, and matmul (N of the module doc)."""
    v, d, L, f = padded_vocab(m, vocab), m.d_model, m.n_layers, m.mlp_ratio * m.d_model
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)  # ln1, ln2, qkv, proj, mlp
    tok, pos = v * d, m.context * d
    head = 0 if m.tie_embeddings else d * v
    total = tok + pos + L * block + 2 * d + head
    return {
        "total": total,
        "tok_embed": tok,
        "pos_embed": pos,
        "matmul": total - pos - (0 if m.tie_embeddings else tok),
    }


def flops_per_token(m: ModelConfig, vocab: int) -> float:
    """Training FLOPs per token of the built-in GPT: 6 N + 12 L T d (the module doc)."""
    return 6.0 * gpt_params(m, vocab)["matmul"] + 12.0 * m.n_layers * m.context * m.d_model


@dataclass(frozen=True)
class Peak:
    """The peak FLOP/s of one device in the run's matmul dtype, how many devices share the work, and where
    the figure comes from."""

    flops_per_s: float
    devices: int
    source: str

    def mfu(self, tokens_per_s: float, flops_per_token: float) -> float:
        """Model-FLOPs utilisation: the model's FLOPs per second over the devices' summed peak."""
        return tokens_per_s * flops_per_token / (self.flops_per_s * self.devices)


def table_peak(device_kind: str, precision: str) -> float | None:
    """The PEAKS entry for a device kind and config.precision, or None (unknown device or dtype)."""
    dtype = MATMUL_DTYPE.get(precision)
    for pattern, rates in PEAKS:
        if re.search(pattern, device_kind.strip().lower()):
            return rates.get(dtype) if dtype else None
    return None


def measured_peak(precision: str, n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of a jitted n x n x n matmul on this backend in the precision's float dtype (float32; float64
    under fp64), at full precision: the best of `repeats` timed calls after a warm-up."""
    import jax
    import jax.numpy as jnp

    dtype = jnp.float64 if precision == "fp64" else jnp.float32
    a = jnp.ones((n, n), dtype) / n
    dot = jax.jit(lambda x, y: jnp.dot(x, y, precision=jax.lax.Precision.HIGHEST))
    jax.block_until_ready(dot(a, a))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(dot(a, a))
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def device_peak(precision: str, devices: Any = None) -> Peak | None:
    """The run's Peak: from PEAKS for a known accelerator, measured on a CPU; None for an accelerator the
    table lacks (no MFU is then reported)."""
    import jax

    devices = list(devices) if devices is not None else jax.devices()
    first = devices[0]
    if first.platform == "cpu":
        rate = measured_peak(precision)
        dtype = "float64" if precision == "fp64" else "float32"
        return Peak(
            rate,
            1,
            f"measured: a jitted 1024^3 {dtype} matmul on this CPU at run start "
            f"({rate / 1e9:.1f} GFLOP/s; all cores, one jax device)",
        )
    rate = table_peak(first.device_kind, precision)
    if rate is None:
        return None
    return Peak(
        rate,
        len(devices),
        f"table: {first.device_kind}, {MATMUL_DTYPE[precision]} dense "
        f"{rate / 1e12:g} TFLOP/s per device (jaxloop.model.flops.PEAKS)",
    )


def device_memory() -> dict[str, int] | None:
    """The first local device's bytes in use, peak and limit where it reports them (memory_stats())."""
    import jax

    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory statistics
        return None
    if not stats or "bytes_limit" not in stats:
        return None
    return {k: int(stats[k]) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in stats}


def gpt_facts(cfg: Any, vocab: int) -> dict[str, Any]:
    """What the run's metadata.json records of a built-in GPT run (precision already resolved): the attention
    chosen and why, the FLOPs count and the peak (None when unknown); LogTrain reads them back."""
    from jaxloop.model.builtin import attention_choice

    m = cfg.model
    counts = gpt_params(m, vocab)
    choice = attention_choice(m, cfg.precision)
    peak = device_peak(cfg.precision)
    return {
        "attention": {"requested": m.attention, "used": choice.implementation, "why": choice.reason},
        "vocab": {"data": vocab, "model": padded_vocab(m, vocab)},
        "params": counts,
        "flops_per_token": flops_per_token(m, vocab),
        "flops_count": COUNT,
        "peak": None
        if peak is None
        else {"flops_per_s": peak.flops_per_s, "devices": peak.devices, "source": peak.source},
    }


def peak_of(facts: dict[str, Any] | None) -> Peak | None:
    """The Peak that gpt_facts recorded (None when none was)."""
    p = (facts or {}).get("peak")
    return None if p is None else Peak(float(p["flops_per_s"]), int(p["devices"]), str(p["source"]))


def mfu_inputs(facts: dict[str, Any] | None) -> dict[str, Any]:
    """LogTrain's MFU arguments from what gpt_facts recorded: flops_per_token and peak (none for other runs)."""
    if not facts:
        return {}
    return {"flops_per_token": float(facts["flops_per_token"]), "peak": peak_of(facts)}
