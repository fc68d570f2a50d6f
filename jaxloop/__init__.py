"""jaxloop: a JAX/Flax training loop with a PyTorch-parity harness.

    from jaxloop import Config, TrainState, make_optimizer, make_schedule, make_train_step, train_step

The names below load on first use, so `import jaxloop.config` (read by torch_ref) never imports jax.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "Config": "jaxloop.config",
    "ConfigError": "jaxloop.config",
    "preset": "jaxloop.config",
    "validate": "jaxloop.config",
    "make_optimizer": "jaxloop.optim",
    "get_policy": "jaxloop.precision",
    "make_schedule": "jaxloop.schedule",
    "TrainState": "jaxloop.state",
    "create_train_state": "jaxloop.state",
    "state_digest": "jaxloop.state",
    "cross_entropy_loss": "jaxloop.step",
    "eval_step": "jaxloop.step",
    "make_eval_step": "jaxloop.step",
    "make_train_step": "jaxloop.step",
    "train_step": "jaxloop.step",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxloop' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return __all__
