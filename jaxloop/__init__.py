"""jaxloop: a JAX/Flax training loop with a PyTorch-parity harness.

    from jaxloop import Config, TrainState, make_optimizer, make_schedule, make_train_step, train_step

The config tree lives in the jax-free package `loopcore` (shared with torch_ref); it is re-exported here.
"""

from jaxloop.optim import make_optimizer
from jaxloop.precision import get_policy
from jaxloop.schedule import make_schedule
from jaxloop.state import TrainState, create_train_state, state_digest
from jaxloop.step import cross_entropy_loss, eval_step, make_eval_step, make_train_step, train_step
from loopcore.config import Config, ConfigError, preset, validate

__all__ = [
    "Config", "ConfigError", "TrainState", "create_train_state", "cross_entropy_loss", "eval_step",
    "get_policy", "make_eval_step", "make_optimizer", "make_schedule", "make_train_step", "preset",
    "state_digest", "train_step", "validate",
]
