"""jaxloop: a JAX/Flax training loop with a PyTorch-parity harness. Everything a user writes comes from here:

    import jaxloop
    cfg = jaxloop.Config(steps=300, optim=jaxloop.OptimConfig(peak_lr=1e-2), log=jaxloop.LogConfig(progress="off"))
    result = jaxloop.run(cfg, jaxloop.Task(model, loss, train_records, val_records), hooks=[jaxloop.Hook(fn, every=200)])
    result.state, result["final"]["val_loss"]                    # the trained state; the summary
    state = jaxloop.init_state(model, loss, example_batch, optax.adamw(1e-3), seed=0)   # a loop of your own:
    state, metrics = jax.jit(jaxloop.train_step, donate_argnums=0)(state, batch)
    except jaxloop.errors.ConfigError: ...                      # the library's exceptions (jaxloop.errors)
    jaxloop.parity.compare(torch_module, flax_module, batch, torch_loss, flax_loss)   # check your own port

The config classes live in the jax-free package `jaxloop.config` (shared with torch_ref) and are re-exported
here; `jaxloop.Config` and `jaxloop.errors` import no jax, tyro or torch. Importing jaxloop imports nothing
heavy and changes no global state: each name is imported on first use (the loop's Orbax and grain only
with `run`), and process-wide settings are made by `run` itself, jax's put back when it ends.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the public names, for editors and type checkers; at run time each is imported on first use
    # running: the loop, a Task, hooks and actions of one's own
    from jaxloop import errors, parity
    from jaxloop.checkpoint.manager import load_model
    from jaxloop.config.errors import ConfigError

    # records and token shards: jax-free
    from jaxloop.config.optimizers import (
        AdagradConfig,
        AdamConfig,
        AdamWConfig,
        LionConfig,
        RMSpropConfig,
        SGDConfig,
    )

    # the config tree, an optimizer's and a schedule's config (optim.optimizer, optim.lr_schedule): jax-free
    from jaxloop.config.run import (
        CheckpointConfig,
        Config,
        DataConfig,
        DistributedConfig,
        LogConfig,
        MemoryConfig,
        ModelConfig,
        OptimConfig,
        from_dict,
        preset,
        to_dict,
        validate,
    )
    from jaxloop.config.schedules import (
        ConstantConfig,
        CosineRestartsConfig,
        ExponentialConfig,
        InverseSqrtConfig,
        LinearConfig,
        MultiStepConfig,
        OneCycleConfig,
        PlateauConfig,
        PolynomialConfig,
        StepConfig,
        WarmupCosineConfig,
        WSDConfig,
    )
    from jaxloop.data.shards import write_shard
    from jaxloop.data.sources import SequenceRecords, load_splits, read_vocab
    from jaxloop.loop.actions import Action, Boundary, Hook, RunContext, StepInfo, every
    from jaxloop.loop.runner import RunResult, run
    from jaxloop.loop.task import Task
    from jaxloop.model.flops import flops_per_token, gpt_params
    from jaxloop.model.precision import get_policy

    # a loop of one's own: the state, the step, the optimizer, the schedule, precision, host memory on a CPU
    from jaxloop.runtime.host_memory import retain_freed_memory, run_cpu_calls_inline
    from jaxloop.sample import generate
    from jaxloop.update.optimizer import make_optimizer
    from jaxloop.update.schedules import rates
    from jaxloop.update.state import TrainState, init_state, state_digest
    from jaxloop.update.step import cross_entropy_loss, eval_step, make_train_step, train_step, weighted_mean


def _lazy_exports() -> dict[str, str]:
    """{name: module} read from the TYPE_CHECKING block above: the names are listed once, where tools read them."""
    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", None) == "TYPE_CHECKING")
    return {
        alias.name: node.module
        for node in block.body
        if isinstance(node, ast.ImportFrom) and node.module is not None and node.module != "jaxloop"
        for alias in node.names
    }


_EXPORTS = _lazy_exports()
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
