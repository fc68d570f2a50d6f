"""jaxloop's attention core (jaxloop.model.attention, model.attention=xla) against torch's
F.scaled_dot_product_attention, the kernel torch_ref's GPT runs: the output and the gradients of q, k and v,
in float64 and float32 on the CPU, with the causal mask alone and with a padding mask (keys at and past each
sequence's length left out) on top.

Measured: the largest absolute difference over the largest magnitude of torch's value (a relative error of
the tensor). Tolerances: fp64 at 2^-45 (the two sum in other orders, within ~1e-15 here; a softmax in float32
would be ~1e-8 off, and jax.nn.dot_product_attention's is: the note records it); fp32 at 2^-20 (a few ulps
after two products and a softmax of T=16, measured <= 3e-7).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from jaxloop.model.attention import dot_product_attention
from parity_tests.harness import jax_mode

TOL = {"fp64": 2.0**-45, "fp32": 2.0**-20}
DTYPES = {"fp64": (np.float64, torch.float64), "fp32": (np.float32, torch.float32)}
B, T, H, D = 3, 16, 2, 8
LENGTHS = np.array([16, 9, 1], np.int32)  # one full sequence, one padded, one of a single key


def _inputs(precision: str) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal((B, T, H, D)).astype(DTYPES[precision][0]) for _ in range(4)]  # q, k, v, cotangent


@functools.partial(jax.jit, static_argnames="implementation")
def _jax_vjp(q, k, v, g, lengths, implementation: str) -> tuple[jax.Array, ...]:
    """The output and its vjp with g, as one program (one XLA compile per precision and mask, not one per op)."""

    def f(q, k, v):
        if implementation == "jax":
            return jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation="xla", key_value_seq_lengths=lengths
            )
        return dot_product_attention(q, k, v, "xla", kv_lengths=lengths)

    out, pull = jax.vjp(f, q, k, v)
    return (out, *pull(g))


def _jax(q, k, v, g, lengths, implementation: str = "xla") -> list[np.ndarray]:
    """Output and gradients of sum(out * g) for q, k, v, by jaxloop's attention (or jax's own for `jax`)."""
    return [np.asarray(x) for x in _jax_vjp(q, k, v, g, lengths, implementation=implementation)]


def _torch(q, k, v, g, lengths) -> list[np.ndarray]:
    """The same by F.scaled_dot_product_attention ([B, H, T, D] layout) with a boolean mask."""
    tq, tk, tv = (torch.from_numpy(a).transpose(1, 2).requires_grad_() for a in (q, k, v))
    keep = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    if lengths is not None:
        keep = keep & (torch.arange(T)[None, None, None, :] < torch.from_numpy(lengths)[:, None, None, None])
    out = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=keep)
    out.backward(torch.from_numpy(g).transpose(1, 2))
    return [x.detach().transpose(1, 2).numpy() for x in (out, tq.grad, tk.grad, tv.grad)]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("padding", [False, True], ids=["causal", "causal+padding"])
@pytest.mark.parametrize("precision", ["fp64", "fp32"])
def test_attention_matches_torch_sdpa(precision, padding, parity):
    lengths = LENGTHS if padding else None
    q, k, v, g = _inputs(precision)
    with jax_mode(precision):
        ours = _jax(q, k, v, g, lengths)
    theirs = _torch(q, k, v, g, lengths)
    mask = "causal + padding" if padding else "causal"
    for name, a, b in zip(("output", "grad q", "grad k", "grad v"), ours, theirs):
        assert a.dtype == b.dtype == DTYPES[precision][0]
        parity.check(
            f"attention {precision} {mask}: {name}, jaxloop xla vs torch SDPA",
            _rel(a, b),
            TOL[precision],
            "the same products and softmax summed in other orders",
        )


def test_jax_dot_product_attention_softmax_is_float32_even_in_fp64(parity):
    # why model.attention=xla is jaxloop's own form: jax.nn.dot_product_attention rounds its softmax to float32
    q, k, v, g = _inputs("fp64")
    with jax_mode("fp64"):
        jax_own = _jax(q, k, v, g, None, implementation="jax")
    theirs = _torch(q, k, v, g, None)
    gap = _rel(jax_own[0], theirs[0])
    parity.note("attention fp64: jax.nn.dot_product_attention(xla) output vs torch SDPA", gap)
    assert gap > TOL["fp64"] * 1e3  # float32's rounding shows: far outside the fp64 tolerance jaxloop's path meets
