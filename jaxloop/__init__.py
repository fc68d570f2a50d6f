"""jaxloop: a JAX/Flax training loop with a PyTorch-parity harness. Everything a user writes comes from here:

    import jaxloop
    cfg = jaxloop.Config(steps=300, optim=jaxloop.OptimConfig(peak_lr=1e-2), log=jaxloop.LogConfig(progress="off"))
    result = jaxloop.run(cfg, jaxloop.Task(model, loss, train_records, val_records), hooks=[jaxloop.Hook(fn, every=200)])
    result.state, result["final"]["val_loss"]                    # the trained state; the summary
    state = jaxloop.init_state(model, loss, example_batch, optax.adamw(1e-3), seed=0)   # a loop of your own:
    state, metrics = jax.jit(jaxloop.train_step, donate_argnums=0)(state, batch)
    except jaxloop.errors.ConfigError: ...                      # the library's exceptions (jaxloop.errors)
    jaxloop.parity.compare(torch_module, flax_module, batch, torch_loss, flax_loss)   # check your own port

The config classes live in the jax-free package `loopcore` (shared with torch_ref) and are re-exported
here; `jaxloop.Config` and `jaxloop.errors` import no jax, tyro or torch. Importing jaxloop imports nothing
heavy and changes no global state: each name is imported on first use (the loop's Orbax and grain only
with `run`), and process-wide settings are made by `run` itself.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "run": "jaxloop.runner", "RunResult": "jaxloop.runner",
    "Hook": "jaxloop.actions", "StepInfo": "jaxloop.actions", "every": "jaxloop.actions",
    "Task": "jaxloop.task", "builtin_task": "jaxloop.task", "load_model": "jaxloop.checkpoint",
    "make_optimizer": "jaxloop.optim", "get_policy": "jaxloop.precision", "make_schedule": "jaxloop.schedule",
    "TrainState": "jaxloop.state", "init_state": "jaxloop.state", "state_digest": "jaxloop.state",
    "cross_entropy_loss": "jaxloop.step", "eval_step": "jaxloop.step", "make_eval_step": "jaxloop.step",
    "make_train_step": "jaxloop.step", "scan_steps": "jaxloop.step", "train_step": "jaxloop.step",
    "weighted_mean": "jaxloop.step",
    # the config tree (jax-free)
    "Config": "loopcore.config", "OptimConfig": "loopcore.config",
    # an optimizer's and a schedule's config (optim.optimizer, optim.lr_schedule; jax-free)
    **{name: "loopcore.optimizers_config" for name in (
        "AdamWConfig", "AdamConfig", "SGDConfig", "RMSpropConfig", "AdagradConfig", "LionConfig")},
    **{name: "loopcore.schedules_config" for name in (
        "WarmupCosineConfig", "ConstantConfig", "LinearConfig", "StepConfig", "MultiStepConfig", "PolynomialConfig",
        "ExponentialConfig", "CosineRestartsConfig", "OneCycleConfig", "WSDConfig", "InverseSqrtConfig",
        "PlateauConfig")},
    "ModelConfig": "loopcore.config", "DataConfig": "loopcore.config", "CheckpointConfig": "loopcore.config",
    "LogConfig": "loopcore.config", "DistributedConfig": "loopcore.config", "MemoryConfig": "loopcore.config",
    "preset": "loopcore.config", "from_dict": "loopcore.config", "to_dict": "loopcore.config",
    "validate": "loopcore.config", "ConfigError": "loopcore.errors",
    # records, the run_dir's lock (jax-free)
    "SequenceRecords": "loopcore.sources", "load_splits": "loopcore.sources", "read_vocab": "loopcore.sources",
    "RunLock": "loopcore.lock",
    # token shards (jax-free) and the language models' FLOPs count
    "read_shard": "loopcore.shards", "write_shard": "loopcore.shards",
    "flops_per_token": "jaxloop.flops", "gpt_params": "jaxloop.flops",
}
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
