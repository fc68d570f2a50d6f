"""Every check's tolerance and the reason for it, per precision (a `compare(..., tolerances=)` entry
replaces one: {(check, precision): value}).

The float64 bounds sit far above rounding (1e-16 per operation; the examples measure 1e-16 to 1e-13)
and far below any convention a port can get wrong (LayerNorm's eps moves a layer by ~5e-6, GELU's
tanh form by ~1e-4). The float32 bounds sit above the rounding measured on the shipped examples
(docs/porting.md) by a margin of 10 or more.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    value: float
    reason: str


F64_ROUNDING = "float64 rounding (~1e-16 per operation) in another operation order"

TOLERANCES: dict[tuple[str, str], Tolerance] = {
    ("forward", "fp64"): Tolerance(1e-10, F64_ROUNDING + ", through every layer"),
    ("forward", "fp32"): Tolerance(1e-5, "float32 rounding (6e-8 per operation) through every layer"),
    ("gradients", "fp64"): Tolerance(
        1e-9, F64_ROUNDING + ", through the backward pass (a tensor whose gradient nearly cancels loses digits)"
    ),
    ("gradients", "fp32"): Tolerance(
        1e-4, "float32 rounding through the forward and backward pass; nearly cancelling gradients lose digits"
    ),
    ("buffers", "fp64"): Tolerance(1e-10, F64_ROUNDING + " (batch statistics of one train-mode pass)"),
    ("buffers", "fp32"): Tolerance(1e-5, "float32 rounding of the batch statistics"),
    ("update", "fp64"): Tolerance(1e-10, F64_ROUNDING + " (the same clip and optimizer algebra)"),
    ("update", "fp32"): Tolerance(
        1e-5, "float32 rounding of clip, optimizer and schedule, about ten roundings per element"
    ),
    ("trajectory", "fp64"): Tolerance(1e-8, F64_ROUNDING + ", compounded over the updates"),
    ("trajectory", "fp32"): Tolerance(
        1e-2,
        "no float64 run in this check to measure the bound against (with one, "
        "the bound is 4 x each framework's own float32-vs-float64 gap): float32 rounding "
        "compounded over the updates, which Adam amplifies in directions the loss barely "
        "sees (the examples at 100 updates: up to 6.0e-3, docs/porting.md)",
    ),
}


def tolerance(check: str, precision: str, overrides: dict[tuple[str, str], float] | None = None) -> Tolerance:
    t = TOLERANCES[(check, precision)]
    if overrides and (check, precision) in overrides:
        return Tolerance(float(overrides[(check, precision)]), "set by the caller")
    return t
