"""The memory plan of the update: how much the compiled call needs, what the device has, and a smaller plan.

A plan is a MemoryConfig: `split` (each micro-batch split inside the step into that many sub-batches whose
gradients are averaged: fewer activations alive at once, the same update for a mean loss up to rounding)
and `remat` (activations recomputed in the backward pass: the model's blocks under nn.remat, or a
jax.checkpoint policy around the loss). Neither changes which records an update sees, the schedule or the
checkpoints, so a resume may change the plan.

Before the first update the loop compares the compiled call's footprint (XLA's memory_analysis: arguments
+ outputs + temporaries - aliased, i.e. donated, bytes) with the limit (`memory.budget`; else the device's
`bytes_limit`; on a CPU the available RAM beside the arguments, which are resident already), and with
memory.auto_fit tries `candidates` in order until one fits. An out-of-memory error at run time (XLA's
RESOURCE_EXHAUSTED) makes the loop reload its last checkpoint and go on with the next candidate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from jaxloop.config.errors import OutOfMemoryError
from jaxloop.config.run import REMATS, ConfigError, MemoryConfig

REMAT_ORDER = REMATS
"""The order re-planning tries rematerialisation in, after splitting (see `candidates`): none, blocks,
dots_saveable, full."""


@dataclass(frozen=True)
class Footprint:
    """XLA's accounting of a compiled call's device memory (bytes)."""

    arguments: int
    outputs: int
    temporaries: int
    aliased: int  # outputs written into donated arguments: counted once

    @classmethod
    def of(cls, compiled: Any) -> Footprint:
        m = compiled.memory_analysis()
        return cls(
            int(m.argument_size_in_bytes),
            int(m.output_size_in_bytes),
            int(m.temp_size_in_bytes),
            int(m.alias_size_in_bytes),
        )

    @property
    def total(self) -> int:
        return self.arguments + self.outputs + self.temporaries - self.aliased

    def describe(self) -> str:
        return (
            f"{size(self.total)} ({size(self.arguments)} arguments, {size(self.outputs - self.aliased)} new "
            f"outputs, {size(self.temporaries)} temporaries)"
        )

    def as_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "total": self.total}


@dataclass(frozen=True)
class Limit:
    """What a footprint is compared with: bytes, and where that number comes from."""

    bytes: int
    source: str

    def fits(self, footprint: Footprint) -> bool:
        return footprint.total <= self.bytes


def size(n: float) -> str:
    """Bytes as KiB / MiB / GiB with one decimal."""
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def device_limit(budget: int, arguments: int = 0) -> Limit:
    """memory.budget if set; else the first local device's bytes_limit (an accelerator); else, on a CPU,
    the RAM psutil reports available plus `arguments` (the call's arguments are in memory already)."""
    if budget:
        return Limit(int(budget), "memory.budget")
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory statistics
        stats = {}
    if "bytes_limit" in stats:
        return Limit(int(stats["bytes_limit"]), f"{jax.local_devices()[0].device_kind} bytes_limit")
    import psutil

    return Limit(int(psutil.virtual_memory().available) + int(arguments), "available RAM (psutil) + the arguments")


def rows_per_device(batch_size: int) -> int:
    """The rows of a micro-batch each device computes (the batch is split over all devices)."""
    return batch_size // max(jax.device_count(), 1)


def candidates(memory: MemoryConfig, batch_size: int, blocks: bool) -> list[MemoryConfig]:
    """Smaller plans than `memory`, in the order re-planning tries them: split x2, x4, ... (while it divides
    the rows per device) at the current remat; then each later remat of REMAT_ORDER ("blocks" only where the
    model supports it) with split from its current value up."""
    rows = rows_per_device(batch_size)

    def splits(start: int) -> list[int]:
        out, s = [], start
        while rows % s == 0 and s <= rows:
            out.append(s)
            s *= 2
        return out

    plans = [dataclasses.replace(memory, split=s) for s in splits(memory.split)[1:]]
    later = REMAT_ORDER[REMAT_ORDER.index(memory.remat) + 1 :]
    for remat in later:
        if remat == "blocks" and not blocks:
            continue
        plans += [dataclasses.replace(memory, split=s, remat=remat) for s in splits(memory.split)]
    return plans


def check_plan(memory: MemoryConfig, batch_size: int, model: Any) -> None:
    """ConfigError, before anything is written, for a plan this run cannot use: a split that does not divide
    each device's rows, or remat=blocks for a model that cannot rematerialise its blocks."""
    rows = rows_per_device(batch_size)
    if rows % memory.split:
        raise ConfigError(
            "memory.split",
            memory.split,
            f"a divisor of the {rows} rows of a micro-batch on each of "
            f"the {jax.device_count()} device(s) (batch_size {batch_size})",
        )
    if memory.remat == "blocks" and not supports_blocks(model):
        remat_blocks(model)  # raises the ConfigError that says what blocks needs


def describe_plan(memory: MemoryConfig) -> str:
    return f"split {memory.split}, remat {memory.remat}"


def plan_dict(memory: MemoryConfig) -> dict[str, Any]:
    return {"split": memory.split, "remat": memory.remat}


@dataclass(frozen=True)
class Fit:
    """The outcome of fit(): the compiled call to run, its plan and footprint, and the plan asked for's."""

    compiled: Any
    memory: MemoryConfig
    footprint: Footprint
    asked: MemoryConfig
    asked_footprint: Footprint
    limit: Limit

    @property
    def replanned(self) -> bool:
        return self.memory != self.asked

    def message(self, what: str) -> str | None:
        """The line to log (None when the plan asked for fits)."""
        if self.limit.fits(self.asked_footprint):
            return None
        said = (
            f"memory: {what} needs {self.asked_footprint.describe()}, more than the {size(self.limit.bytes)} of "
            f"{self.limit.source} (plan: {describe_plan(self.asked)})"
        )
        if not self.replanned:
            return f"{said}; memory.auto_fit is off: going on with this plan"
        return f"{said}; re-planned to {describe_plan(self.memory)}: {self.footprint.describe()}"

    def record(self, at_update: int) -> dict[str, Any]:
        """The re-plan, for metadata.json and the summary."""
        return {
            "at_update": at_update,
            "reason": "fit",
            "from": plan_dict(self.asked),
            "to": plan_dict(self.memory),
            "bytes_before": self.asked_footprint.total,
            "bytes_after": self.footprint.total,
        }


def fit(compile: Callable[[MemoryConfig], Any], memory: MemoryConfig, batch_size: int, blocks: bool, what: str) -> Fit:
    """compile(memory)'s call if its footprint fits the limit (device_limit); else, with memory.auto_fit, the
    first of `candidates` whose call fits. A policy that saves under 2% against the same split without it
    (XLA:CPU's remat, say) is not tried at larger splits. OutOfMemoryError with the numbers when none fits."""
    compiled = compile(memory)
    footprint = Footprint.of(compiled)
    limit = device_limit(memory.budget, footprint.arguments)
    if limit.fits(footprint) or not memory.auto_fit:
        return Fit(compiled, memory, footprint, memory, footprint, limit)
    totals = {(memory.split, memory.remat): footprint.total}
    useless: set[str] = set()
    for plan in candidates(memory, batch_size, blocks):
        if plan.remat in useless:
            continue
        smaller = compile(plan)
        fitted = Footprint.of(smaller)
        totals[(plan.split, plan.remat)] = fitted.total
        if limit.fits(fitted):
            return Fit(smaller, plan, fitted, memory, footprint, limit)
        if plan.remat != memory.remat and fitted.total >= 0.98 * totals.get((plan.split, memory.remat), 0):
            useless.add(plan.remat)
    (split, remat), least = min(totals.items(), key=lambda kv: kv[1])
    raise OutOfMemoryError(
        f"memory: {what} needs {footprint.describe()}, more than the {size(limit.bytes)} of {limit.source} (plan: "
        f"{describe_plan(memory)}); no plan fits: the smallest of the {len(totals)} tried needs {size(least)} "
        f"(split {split}, remat {remat}): lower batch_size or the model's size"
        + (", or raise memory.budget" if memory.budget else "")
    )


# ----------------------------------------------------------------------------- rematerialisation


def checkpoint_policy(remat: str) -> Any:
    """The jax.checkpoint policy of a remat choice around the whole loss (None: no jax.checkpoint)."""
    if remat == "dots_saveable":
        return jax.checkpoint_policies.dots_saveable
    if remat == "full":
        return jax.checkpoint_policies.nothing_saveable
    return None


def supports_blocks(model: Any) -> bool:
    """Whether remat="blocks" can be applied to `model` (a Task's module, or the state's LinenModel): a
    Linen module with a boolean `remat` field that puts its blocks under nn.remat, as jaxloop.model.builtin.GPT
    does. An NNX module, or a Linen one without the field, cannot be told to (use dots_saveable or full)."""
    import flax.linen as nn

    module = getattr(model, "module", model)
    return (
        isinstance(module, nn.Module)
        and any(f.name == "remat" for f in dataclasses.fields(module))
        and isinstance(getattr(module, "remat", None), bool)
    )


def remat_blocks(model: Any) -> Any:
    """The state's model with its blocks rematerialised (the same parameters: nn.remat keeps the names)."""
    if not supports_blocks(model):  # ConfigError: the field, the value, what is allowed
        raise ConfigError(
            "memory.remat",
            "blocks",
            "none, dots_saveable or full for this model: blocks needs a "
            "Linen module with a `remat: bool` field that wraps its blocks in nn.remat (as "
            "jaxloop.model.builtin.GPT does)",
        )
    return dataclasses.replace(model, module=model.module.clone(remat=True))


def is_out_of_memory(error: BaseException) -> bool:
    """Whether an error from a device call is XLA's out-of-memory (RESOURCE_EXHAUSTED) error."""
    return isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error)
