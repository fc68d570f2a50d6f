"""Precision policies, mirroring jaxloop/model/precision.py, the PyTorch way.

fp32: everything float32.
bf16: parameters and optimizer state float32; the forward (and so the backward) pass runs under
      torch.autocast(device_type, dtype=torch.bfloat16); logits are cast back to float32 and the loss
      is computed in float32.
fp16: as bf16 with float16, plus dynamic loss scaling by torch.amp.GradScaler with the rule jaxloop
      copies: initial scale 2**16, halved on an update whose gradients are not finite, doubled after
      2000 consecutive good updates.
fp64: the model is converted with model.double() and floating inputs are cast to float64 (parity).

jaxloop's bf16 mirrors autocast op by op (matmuls bf16 with float32 accumulation, everything else
float32), and so does its fp16 (float16 matmuls); jaxloop's bf16_full (the whole model in bf16) has no
torch_ref counterpart: the parity suite compares it against this autocast.

float32 matmuls are pinned to full float32 precision (importing this module turns TF32 off for CUDA
matmuls and cuDNN and sets torch.set_float32_matmul_precision("highest")), as jaxloop pins jax's.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from jaxloop.config.run import ConfigError

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.set_float32_matmul_precision("highest")

# torch.amp.GradScaler's rule, as in jaxloop.model.precision (those constants equal GradScaler's defaults).
INIT_SCALE = 2.0**16
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000


@dataclasses.dataclass(frozen=True)
class Policy:
    """Dtypes of params, autocast compute and outputs (logits, loss), and whether the loss is scaled."""

    name: str
    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    output_dtype: torch.dtype
    loss_scaling: bool = False

    @property
    def uses_autocast(self) -> bool:
        return self.compute_dtype != self.param_dtype

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        """The context the forward pass runs in (a no-op for fp32 and fp64)."""
        if not self.uses_autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=self.compute_dtype)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Parameters in the param dtype (float64 for fp64, else float32)."""
        return model.to(dtype=self.param_dtype)

    def cast_input(self, x: torch.Tensor) -> torch.Tensor:
        """Floating inputs in the param dtype (autocast lowers them per op); integer tokens unchanged."""
        return x.to(self.param_dtype) if x.is_floating_point() else x

    def cast_output(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits in the output dtype, so the loss is computed in float32 (float64 for fp64)."""
        return logits.to(self.output_dtype)

    def make_scaler(self, device_type: str) -> torch.amp.GradScaler:
        """GradScaler with jaxloop's constants; disabled (a pass-through with scale 1) unless fp16."""
        return torch.amp.GradScaler(
            device_type,
            init_scale=INIT_SCALE,
            growth_factor=GROWTH_FACTOR,
            backoff_factor=BACKOFF_FACTOR,
            growth_interval=GROWTH_INTERVAL,
            enabled=self.loss_scaling,
        )


def get_policy(name: str) -> Policy:
    """The policy for config.precision."""
    f32, f64 = torch.float32, torch.float64
    if name == "auto":  # as jaxloop's: bf16 on an accelerator (CUDA here), fp32 on a CPU
        name = "bf16" if torch.cuda.is_available() else "fp32"
    if name == "fp32":
        return Policy("fp32", f32, f32, f32)
    if name == "bf16":
        return Policy("bf16", f32, torch.bfloat16, f32)
    if name == "fp16":
        return Policy("fp16", f32, torch.float16, f32, loss_scaling=True)
    if name == "fp64":
        return Policy("fp64", f64, f64, f64)
    if name == "bf16_full":
        raise ConfigError(
            "precision",
            name,
            "fp32, bf16, fp16 or fp64 in torch_ref (its bf16 is torch.autocast; "
            "bf16_full, the whole model in bf16, is jaxloop's only)",
        )
    raise ValueError(f"precision={name!r} is not allowed: one of fp32, bf16, fp16, fp64")
