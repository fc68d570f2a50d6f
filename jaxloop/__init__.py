"""jaxloop: a JAX/Flax training loop with a PyTorch-parity harness. Everything a user writes comes from here:

    import jaxloop
    cfg = jaxloop.Config(steps=300, optim=jaxloop.OptimConfig(peak_lr=1e-2), log=jaxloop.LogConfig(progress="off"))
    result = jaxloop.run(cfg, jaxloop.Task(model, loss, train_records, val_records), hooks=[jaxloop.Hook(fn, every=200)])
    result.state, result["final"]["val_loss"]                    # the trained state; the summary
    state = jaxloop.init_state(model, loss, example_batch, optax.adamw(1e-3), seed=0)   # a loop of your own:
    state, metrics = jax.jit(jaxloop.train_step, donate_argnums=0)(state, batch)
    except jaxloop.errors.ConfigError: ...                      # the library's exceptions (jaxloop.errors)
    jaxloop.parity.compare(torch_module, flax_module, batch, torch_loss, flax_loss)   # check your own port

The config classes live in the jax-free package `jaxloop.core` (shared with torch_ref) and are re-exported
here; `jaxloop.Config` and `jaxloop.errors` import no jax, tyro or torch. Importing jaxloop imports nothing
heavy and changes no global state: each name is imported on first use (the loop's Orbax and grain only
with `run`), and process-wide settings are made by `run` itself, jax's put back when it ends.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {  # module: the names it gives the namespace
    # running: the loop, a Task, hooks and actions of one's own
    "jaxloop.loop.runner": ("run", "RunResult"),
    "jaxloop.loop.task": ("Task", "builtin_task"),
    "jaxloop.loop.actions": ("Hook", "StepInfo", "every", "Action", "Boundary", "RunContext"),
    "jaxloop.checkpoint.manager": ("load_model",),
    "jaxloop.sample": ("generate",),
    # a loop of one's own: the state, the step, the optimizer, the schedule, precision
    "jaxloop.update.state": ("TrainState", "init_state", "state_digest"),
    "jaxloop.update.step": ("train_step", "eval_step", "make_train_step", "make_eval_step", "scan_steps",
                            "cross_entropy_loss", "weighted_mean"),
    "jaxloop.update.optimizer": ("make_optimizer",),
    "jaxloop.update.schedules": ("make_schedule", "rates"),
    "jaxloop.model.precision": ("get_policy",),
    "jaxloop.model.flops": ("flops_per_token", "gpt_params"),
    # the config tree, an optimizer's and a schedule's config (optim.optimizer, optim.lr_schedule): jax-free
    "jaxloop.core.config": ("Config", "OptimConfig", "ModelConfig", "DataConfig", "CheckpointConfig", "LogConfig",
                            "DistributedConfig", "MemoryConfig", "preset", "from_dict", "to_dict", "validate"),
    "jaxloop.core.optimizers_config": ("AdamWConfig", "AdamConfig", "SGDConfig", "RMSpropConfig", "AdagradConfig",
                                       "LionConfig"),
    "jaxloop.core.schedules_config": ("WarmupCosineConfig", "ConstantConfig", "LinearConfig", "StepConfig",
                                      "MultiStepConfig", "PolynomialConfig", "ExponentialConfig",
                                      "CosineRestartsConfig", "OneCycleConfig", "WSDConfig", "InverseSqrtConfig",
                                      "PlateauConfig"),
    "jaxloop.core.errors": ("ConfigError",),
    # records, token shards, the run_dir's lock: jax-free
    "jaxloop.core.sources": ("SequenceRecords", "load_splits", "read_vocab"),
    "jaxloop.core.shards": ("read_shard", "write_shard"),
    "jaxloop.core.lock": ("RunLock",),
}
_EXPORTS = {name: module for module, names in _PUBLIC.items() for name in names}
_SUBMODULES = ("errors", "parity")  # jaxloop.errors (jax-free); jaxloop.parity (the port check, needs torch)

__all__ = sorted([*_EXPORTS, "errors"])


def __getattr__(name: str) -> Any:
    """The public names, each imported from its module on first use (PEP 562); the submodules
    `jaxloop.errors` and `jaxloop.parity` (the port check against PyTorch, which needs torch) likewise."""
    if name in _SUBMODULES:
        return importlib.import_module(f"jaxloop.{name}")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxloop' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))
