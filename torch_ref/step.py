"""One optimizer update and one evaluation, mirroring jaxloop/update/step.py.

jaxloop's train_step consumes one micro-batch and lets optax.MultiSteps accumulate K of them; here
`train_update` takes the K micro-batches of one update and spells the accumulation out, the usual
PyTorch way:

    for each micro-batch:  loss = CE(model(x), y);  scaler.scale(loss / K).backward()
    scaler.unscale_(optimizer);  norm = clip(grads)  (pre-clip global norm of the mean gradient)
    scaler.step(optimizer) / optimizer.step();  scaler.update();  scheduler.step();  zero_grad()

Accumulation: .grad sums the gradients of loss_k / K, i.e. it holds the mean of the K micro-batch
gradients, summed in micro-batch order. optax.MultiSteps keeps a running mean, a + (g - a) / (k + 1);
the two agree up to rounding (exactly when K = 1).

Non-finite policy (as jaxloop's): a micro-batch whose loss or gradient is not finite poisons its
accumulation window. The update closing the window is skipped as a whole: no optimizer.step(), no
scheduler.step() (params, moments, AdamW's step count and the schedule stay), the gradients are
discarded, and the skip is counted (state.skipped, state.bad_streak). Under fp16 the poisoned gradients
reach GradScaler as NaN, so GradScaler's own rule skips the step, halves the scale and restarts its
growth count. Because .grad accumulates, a non-finite micro-batch gradient leaves the window's
gradient non-finite, so checking the losses and the accumulated gradient at the boundary is the same
test as checking every micro-batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import functional_call

from torch_ref.optim import ClipMode, clip_gradients
from torch_ref.schedule import step_per_update
from torch_ref.state import TrainState

MicroBatch = tuple[torch.Tensor, torch.Tensor]


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean softmax cross-entropy, accuracy) over every label position (records, or characters)."""
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1).long()
    loss = F.cross_entropy(flat_logits, flat_labels)
    accuracy = (flat_logits.argmax(dim=-1) == flat_labels).to(flat_logits.dtype).mean()
    return loss, accuracy


def forward(state: TrainState, x: torch.Tensor, params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Logits in the policy's output dtype (float32, or float64 for fp64); autocast for bf16/fp16."""
    x = state.policy.cast_input(x.to(state.device, non_blocking=True))
    if not x.is_floating_point():
        x = x.long()
    with state.policy.autocast(state.device.type):
        logits = state.model(x) if params is None else functional_call(state.model, params, (x,))
    return state.policy.cast_output(logits)


def _grads_finite(params: Iterable[torch.nn.Parameter]) -> bool:
    return all(bool(torch.isfinite(p.grad).all()) for p in params if p.grad is not None)


def train_update(state: TrainState, micro_batches: Sequence[MicroBatch], clip: ClipMode = "torch") -> dict[str, Any]:
    """Apply (or skip) one optimizer update from its K micro-batches; returns its metrics.

    Metrics: loss (float64 mean of the K micro-batch losses), lr (the rate this update used, or would
    have used), grad_norm (pre-clip global norm of the mean gradient), updated (applied or skipped),
    skipped (skipped updates so far), bad_streak, loss_scale (the fp16 scale used; 1 otherwise).
    """
    cfg = state.cfg
    k = cfg.optim.accum_steps
    if len(micro_batches) != k:
        raise ValueError(f"an update takes optim.accum_steps={k} micro-batches, got {len(micro_batches)}")
    model, optimizer, scaler = state.model, state.optimizer, state.scaler
    params = [p for p in model.parameters() if p.requires_grad]
    lr = optimizer.param_groups[0]["lr"]
    loss_scale = scaler.get_scale() if scaler.is_enabled() else 1.0

    model.train()
    optimizer.zero_grad(set_to_none=True)
    losses = []
    for x, y in micro_batches:
        loss, _ = cross_entropy_loss(forward(state, x), y.to(state.device, non_blocking=True))
        scaler.scale(loss / k).backward()
        losses.append(loss.item())
    state.position += k

    poisoned = not all(math.isfinite(v) for v in losses) or not _grads_finite(params)
    if poisoned and scaler.is_enabled():
        with torch.no_grad():  # let GradScaler see the window as non-finite, whatever made it so
            for p in params:
                if p.grad is not None:
                    p.grad.fill_(math.nan)
    scaler.unscale_(optimizer)  # a no-op unless fp16
    grad_norm = clip_gradients(params, cfg.optim.clip_norm, clip).item()

    if scaler.is_enabled():
        scaler.step(optimizer)  # skips optimizer.step() itself when the gradients are not finite
        scaler.update()  # halves the scale after a skip; doubles it after GROWTH_INTERVAL good updates
    elif not poisoned:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    if poisoned:
        state.skipped += 1
        state.bad_streak += 1
    else:
        step_per_update(state.scheduler)  # ReduceLROnPlateau steps after evaluations instead
        state.step += 1
        state.bad_streak = 0
        if state.ema is not None:
            d = cfg.optim.ema_decay
            with torch.no_grad():
                for e, p in zip(state.ema, model.parameters()):
                    e.mul_(d).add_(p.detach(), alpha=1.0 - d)
    return {
        "loss": float(np.mean(np.asarray(losses, dtype=np.float64))),
        "lr": float(lr),
        "grad_norm": float(grad_norm),
        "updated": not poisoned,
        "skipped": state.skipped,
        "bad_streak": state.bad_streak,
        "loss_scale": float(loss_scale),
    }


@torch.no_grad()
def evaluate(state: TrainState, batches: Iterable[MicroBatch]) -> dict[str, float]:
    """Loss and accuracy over all of `batches` (the whole validation split), weighted by records, and
    the same for the EMA parameters when kept (prefix ema_val_)."""
    variants: list[tuple[str, dict[str, torch.Tensor] | None]] = [("val_", None)]
    if state.ema is not None:
        names = [name for name, _ in state.model.named_parameters()]
        variants.append(("ema_val_", dict(zip(names, state.ema))))
    state.model.eval()
    sums = {prefix: [0.0, 0.0, 0] for prefix, _ in variants}
    for x, y in batches:
        for prefix, params in variants:
            loss, acc = cross_entropy_loss(forward(state, x, params), y.to(state.device))
            n = x.shape[0]
            sums[prefix][0] += loss.item() * n
            sums[prefix][1] += acc.item() * n
            sums[prefix][2] += n
    out: dict[str, float] = {}
    for prefix, (loss_sum, acc_sum, n) in sums.items():
        out[prefix + "loss"] = loss_sum / n
        out[prefix + "acc"] = acc_sum / n
    return out
