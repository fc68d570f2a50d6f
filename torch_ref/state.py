"""TrainState: everything a torch_ref run needs to continue, mirroring jaxloop/update/state.py.

jaxloop keeps one pytree (params, optax state, rng, loss scale, EMA, non-finite counters). Here the same
things are the usual PyTorch objects side by side: the model (its parameters), the optimizer (e.g. AdamW's
moments and per-parameter step), the scheduler (the schedule position; ReduceLROnPlateau's decision state), the GradScaler (fp16
loss scale), the EMA copy of the parameters, the counters, and torch's / numpy's / Python's RNG states.
`state_dict()` / `load_state_dict()` are what a checkpoint holds.
"""

from __future__ import annotations

import hashlib
import os
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from jaxloop.config.run import Config
from jaxloop.data.sources import Splits
from torch_ref.models import load_jax_params, make_model
from torch_ref.optim import make_optimizer
from torch_ref.precision import Policy, get_policy
from torch_ref.schedule import make_scheduler


@dataclass
class TrainState:
    cfg: Config
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any  # torch_ref.schedule.make_scheduler's
    scaler: torch.amp.GradScaler
    policy: Policy
    device: torch.device
    ema: list[torch.Tensor] | None = None
    step: int = 0
    """Optimizer updates applied (skipped updates do not count), as jaxloop's TrainState.step."""
    position: int = 0
    """Micro-batches consumed (by applied and skipped updates alike): the data loader's position."""
    skipped: int = 0
    """Updates skipped in the whole run for a non-finite loss or gradient."""
    bad_streak: int = 0
    """Consecutive skipped updates."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Loop state saved with the checkpoint (e.g. the best-metric tracker)."""

    def state_dict(self) -> dict[str, Any]:
        """Everything to continue the run bit for bit (loadable with torch.load(weights_only=True))."""
        np_state = np.random.get_state()
        return {
            "step": self.step,
            "position": self.position,
            "skipped": self.skipped,
            "bad_streak": self.bad_streak,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "ema": None if self.ema is None else [e.clone() for e in self.ema],
            "rng": {
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                "numpy": {
                    "name": np_state[0],
                    "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                    "pos": int(np_state[2]),
                    "has_gauss": int(np_state[3]),
                    "cached_gaussian": float(np_state[4]),
                },
                "python": random.getstate(),
            },
            "extra": dict(self.extra),
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.step, self.position = int(saved["step"]), int(saved["position"])
        self.skipped, self.bad_streak = int(saved["skipped"]), int(saved["bad_streak"])
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        if self.scaler.is_enabled():
            self.scaler.load_state_dict(saved["scaler"])
        if self.ema is not None:
            with torch.no_grad():
                for e, s in zip(self.ema, saved["ema"]):
                    e.copy_(s)
        rng = saved["rng"]
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        n = rng["numpy"]
        np.random.set_state(
            (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
        )
        random.setstate(_as_tuples(rng["python"]))
        self.extra = dict(saved.get("extra", {}))


def _as_tuples(obj: Any) -> Any:
    return tuple(_as_tuples(o) for o in obj) if isinstance(obj, (list, tuple)) else obj


def seed_everything(seed: int, device_type: str = "cpu") -> None:
    """Seed torch, numpy and Python's RNGs and make torch's algorithms deterministic.

    On CPU an op without a deterministic implementation is an error. On CUDA it is a warning (the CUDA
    kernels are not part of the bit-exact contract), and deterministic cuBLAS needs
    CUBLAS_WORKSPACE_CONFIG, set here unless the caller did.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=device_type != "cpu")


def create_torch_state(
    cfg: Config, splits: Splits, init_params: Any = None, device: torch.device | str = "cpu"
) -> TrainState:
    """The state of a fresh run: the model initialised from torch.manual_seed(seed), or from
    `init_params` (a flax params tree, e.g. jaxloop's, so both frameworks start from the same weights);
    then the policy's dtype, the optimizer, the schedule, the loss scaler and the EMA."""
    device = torch.device(device)
    seed_everything(cfg.seed, device.type)
    policy = get_policy(cfg.precision)
    # In the policy's dtype before loading: float64 init_params (an fp64 run's) would be rounded to
    # float32 if loaded into the float32 model make_model builds.
    model = policy.prepare_model(make_model(cfg, splits.num_classes, splits.example_x))
    if init_params is not None:
        load_jax_params(model, init_params)
    model = model.to(device)
    optimizer = make_optimizer(cfg, model)
    ema = [p.detach().clone() for p in model.parameters()] if cfg.optim.ema_decay > 0 else None
    return TrainState(
        cfg=cfg,
        model=model,
        optimizer=optimizer,
        scheduler=make_scheduler(cfg, optimizer),
        scaler=policy.make_scaler(device.type),
        policy=policy,
        device=device,
        ema=ema,
    )


def state_digest(state: TrainState) -> str:
    """sha256 over the bytes of the params and the optimizer state, parameter by parameter in
    named_parameters order (then each parameter's AdamW step, exp_avg, exp_avg_sq), plus the update
    count. Equal digests mean bit-identical weights and optimizer state (the resume contract)."""
    h = hashlib.sha256()

    def add(label: str, t: torch.Tensor) -> None:
        a = t.detach().cpu().contiguous().numpy()
        h.update(f"{label}:{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())

    h.update(f"step={state.step}".encode())
    for name, p in state.model.named_parameters():
        add(name, p)
    for name, p in state.model.named_parameters():
        for key, value in sorted(state.optimizer.state.get(p, {}).items()):
            add(f"{name}.{key}", value if isinstance(value, torch.Tensor) else torch.tensor(value))
    return h.hexdigest()
