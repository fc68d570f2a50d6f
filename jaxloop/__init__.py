"""jaxloop: a JAX/Flax training loop with a PyTorch-parity harness.

    import jaxloop
    jaxloop.run(cfg, jaxloop.Task(model, loss, train_records, val_records), hooks=[jaxloop.Hook(fn, every=200)])
    from jaxloop import TrainState, make_optimizer, make_schedule, make_train_step, train_step

The config tree lives in the jax-free package `loopcore` (shared with torch_ref); it is re-exported here.
Importing jaxloop imports nothing heavy and changes no global state: each name is imported on first use
(the loop's Orbax and grain only with `run`), and process-wide settings are made by `run` itself.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "run": "jaxloop.runner", "Hook": "jaxloop.actions", "StepInfo": "jaxloop.actions", "every": "jaxloop.actions",
    "Task": "jaxloop.task", "builtin_task": "jaxloop.task", "create_train_state": "jaxloop.task",
    "init_state": "jaxloop.task", "load_model": "jaxloop.checkpoint", "make_optimizer": "jaxloop.optim",
    "get_policy": "jaxloop.precision", "make_schedule": "jaxloop.schedule", "TrainState": "jaxloop.state",
    "state_digest": "jaxloop.state", "cross_entropy_loss": "jaxloop.step", "eval_step": "jaxloop.step",
    "make_eval_step": "jaxloop.step", "make_train_step": "jaxloop.step", "scan_steps": "jaxloop.step",
    "train_step": "jaxloop.step", "weighted_mean": "jaxloop.step",
    "Config": "loopcore.config", "ConfigError": "loopcore.config", "preset": "loopcore.config",
    "validate": "loopcore.config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """The public names, each imported from its module on first use (PEP 562)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxloop' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
