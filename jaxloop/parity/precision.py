"""The precisions a port is checked in, and the settings pinned on both sides while checking.

fp64: jax's 64-bit mode on, torch in float64 (both frameworks support it on the CPU; the differences
left are rounding, near 1e-16 per operation). fp32: jax's 64-bit mode off (a real float32 jax), and
float32 matmuls at full precision on both sides: jax's default matmul precision "highest", torch's
float32 matmul precision "highest" with TF32 off (on GPUs both frameworks would otherwise use TF32 or
bf16 passes). torch's multi-head-attention fast path is off while checking, so that every submodule
runs (and is seen by the forward hooks) in eval mode too. Everything is restored on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import numpy as np

from jaxloop.parity.torchside import require_torch

PRECISIONS = ("fp64", "fp32")


def check_precisions(precisions: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    bad = [p for p in precisions if p not in PRECISIONS]
    if bad or not precisions:
        raise ValueError(f"precisions={list(precisions)!r} is not allowed: a non-empty list of {PRECISIONS}")
    return tuple(precisions)


def np_dtype(precision: str) -> type:
    return np.float64 if precision == "fp64" else np.float32


@contextlib.contextmanager
def pinned(precision: str) -> Iterator[None]:
    """jax x64 on for fp64 and off otherwise; full-precision float32 matmuls in both frameworks."""
    torch = require_torch()
    saved = (
        torch.get_float32_matmul_precision(),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.mha.get_fastpath_enabled(),
    )
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with jax.enable_x64(precision == "fp64"), jax.default_matmul_precision("highest"):
            yield
    finally:
        torch.set_float32_matmul_precision(saved[0])
        torch.backends.cuda.matmul.allow_tf32 = saved[1]
        torch.backends.cudnn.allow_tf32 = saved[2]
        torch.backends.mha.set_fastpath_enabled(saved[3])


def settings() -> dict[str, str]:
    """The matmul settings in force (for the report's header and the TF32/bf16 diagnosis)."""
    torch = require_torch()
    # jax adds its config options as attributes at run time: its stubs do not declare them
    jax_matmul = jax.config.jax_default_matmul_precision  # pyright: ignore[reportAttributeAccessIssue]
    return {
        "torch float32 matmul precision": torch.get_float32_matmul_precision(),
        "torch TF32 (cuda matmul, cudnn)": f"{torch.backends.cuda.matmul.allow_tf32}, {torch.backends.cudnn.allow_tf32}",
        "jax default matmul precision": str(jax_matmul),
    }
