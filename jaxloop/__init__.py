"""jaxloop: a JAX/Flax training loop with a PyTorch-parity harness.

    import jaxloop
    jaxloop.run(cfg, jaxloop.Task(model, loss, train_records, val_records))   # your Linen or NNX model
    from jaxloop import TrainState, make_optimizer, make_schedule, make_train_step, train_step

The config tree lives in the jax-free package `loopcore` (shared with torch_ref); it is re-exported here.
"""

from jaxloop.checkpoint import load_model
from jaxloop.optim import make_optimizer
from jaxloop.precision import get_policy
from jaxloop.schedule import make_schedule
from jaxloop.state import TrainState, state_digest
from jaxloop.step import (cross_entropy_loss, eval_step, make_eval_step, make_train_step, scan_steps, train_step,
                          weighted_mean)
from jaxloop.task import Task, builtin_task, create_train_state, init_state
from jaxloop.loop import run
from loopcore.config import Config, ConfigError, preset, validate


def __getattr__(name: str):
    """`jaxloop.parity` (the port check against PyTorch) is imported on first use, so `import jaxloop` stays light."""
    if name == "parity":
        import importlib

        return importlib.import_module("jaxloop.parity")
    raise AttributeError(f"module 'jaxloop' has no attribute {name!r}")


__all__ = [
    "Config", "ConfigError", "Task", "TrainState", "builtin_task", "create_train_state", "cross_entropy_loss",
    "eval_step", "get_policy", "init_state", "load_model", "make_eval_step", "make_optimizer", "make_schedule",
    "make_train_step", "preset", "run", "scan_steps", "state_digest", "train_step", "validate", "weighted_mean",
]
