"""Which optimizer and schedule reads which field of OptimConfig: a field set away from its default for an
optimizer or schedule that does not read it is refused (loopcore.config.validate), never silently ignored.

Jax-free and torch-free: the config's validation, jaxloop and torch_ref read the same table.
"""

from __future__ import annotations

from typing import Any

# The optimizer fields each optimizer reads (name, peak_lr, clipping, accumulation and EMA: every one).
OPTIMIZER_FIELDS: dict[str, tuple[str, ...]] = {
    "adamw": ("weight_decay", "b1", "b2", "eps"),
    "adam": ("weight_decay", "b1", "b2", "eps"),
    "sgd": ("weight_decay", "momentum", "dampening", "nesterov"),
    "rmsprop": ("weight_decay", "alpha", "eps", "momentum", "centered"),
    "adagrad": ("weight_decay", "lr_decay", "initial_accumulator_value", "eps"),
    "lion": ("weight_decay", "b1", "b2"),
}

WARMUP = ("init_lr", "warmup_steps")
# The schedule fields each schedule reads (peak_lr: every one).
SCHEDULE_FIELDS: dict[str, tuple[str, ...]] = {
    "warmup_cosine": (*WARMUP, "end_lr"),
    "constant": WARMUP,
    "linear": (*WARMUP, "end_lr"),
    "polynomial": (*WARMUP, "power"),
    "step": (*WARMUP, "step_size", "gamma"),
    "multistep": (*WARMUP, "milestones", "gamma"),
    "exponential": (*WARMUP, "gamma"),
    "cosine_restarts": (*WARMUP, "t_0", "t_mult", "end_lr"),
    "one_cycle": ("pct_start", "div_factor", "final_div_factor", "three_phase", "anneal_strategy"),
    "wsd": (*WARMUP, "decay_steps", "decay_type", "end_lr"),
    "inverse_sqrt": (*WARMUP, "timescale"),
    "plateau": ("plateau",),
}

SELECTED_BY = {"optimizer": OPTIMIZER_FIELDS, "schedule": SCHEDULE_FIELDS}


def unread_fields(optim: Any, baseline: Any) -> list[tuple[str, Any, Any, str]]:
    """(field, value, default, who ignores it) for every field of `optim` (an OptimConfig) that differs from
    `baseline` (the preset's OptimConfig) although neither optim.name nor optim.schedule reads it.
    Nested fields (plateau.*) are named by their dotted path."""
    read = set(OPTIMIZER_FIELDS[optim.name]) | set(SCHEDULE_FIELDS[optim.schedule])
    governed = {f for table in SELECTED_BY.values() for fields in table.values() for f in fields}
    out = []
    for name in sorted(governed - read):
        value, default = getattr(optim, name), getattr(baseline, name)
        if value == default:
            continue
        by_optimizer = any(name in f for f in OPTIMIZER_FIELDS.values())
        who = f"optim.name={optim.name}" if by_optimizer else f"optim.schedule={optim.schedule}"
        if hasattr(value, "__dataclass_fields__"):  # plateau: name the nested fields that differ
            for sub in value.__dataclass_fields__:
                if getattr(value, sub) != getattr(default, sub):
                    out.append((f"{name}.{sub}", getattr(value, sub), getattr(default, sub), who))
        else:
            out.append((name, value, default, who))
    return out


def readers(name: str) -> list[str]:
    """The optimizers and schedules that read field `name` (for error messages and docs)."""
    return [f"optim.name={k}" for k, v in OPTIMIZER_FIELDS.items() if name in v] + \
        [f"optim.schedule={k}" for k, v in SCHEDULE_FIELDS.items() if name in v]
