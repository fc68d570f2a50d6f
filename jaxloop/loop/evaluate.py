"""Validation: the whole validation split (or eval_batches' fixed subset) through one compiled eval step,
averaged by record weight."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import jax
from jax.sharding import Mesh

from jaxloop.model.interface import LossFn
from jaxloop.update.distributed import shard_batch, whole_params
from jaxloop.update.state import TrainState
from jaxloop.update.step import make_eval_step

Batch = dict[str, Any]


class ValidationPass:
    """eval_loss over every batch of the validation split: its loss and aux metrics, each averaged over
    the records (batches weighted by their `weight`, 0 for the padding of the last one), for the params
    and, when the state keeps one, their EMA (prefix ema_val_).

    batches: a fresh pass over the split's host batches (jaxloop.data.pipeline.run_val_batches).
    """

    def __init__(self, eval_loss: LossFn, batches: Callable[[], Iterable[Batch]], mesh: Mesh):
        self.batches, self.mesh = batches, mesh
        eval_step = make_eval_step(eval_loss)
        self.step = jax.jit(lambda state, batch: eval_step(whole_params(state, mesh), batch))

    def __call__(self, state: TrainState) -> dict[str, float]:
        out: dict[str, float] = {}
        variants = [("val_", state)] + (
            [("ema_val_", state.replace(params=state.ema_params))] if state.ema_params is not None else []
        )
        for prefix, s in variants:
            batches = list(self.batches())
            sums = [self.step(s, shard_batch(b, self.mesh)) for b in batches]
            # host waits for every validation batch's metrics
            sums = jax.device_get(sums)
            weights = [float(m.get("weight", b["weight"].sum())) for m, b in zip(sums, batches)]
            for key in ["loss"] + sorted(k for k in sums[0] if k not in ("loss", "weight")):
                out[prefix + key] = sum(float(m[key]) * w for m, w in zip(sums, weights)) / sum(weights)
        return out
