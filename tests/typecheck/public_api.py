"""Pyright's check that every public name of jaxloop resolves to what it names (issue 44.5): .ci/run's
pyright reads this file (pyproject.toml's [tool.pyright] include); pytest does not run it, and
tests/test_public_names.py checks that it lists every name of `jaxloop.__all__`.

jaxloop imports its names on first use through a module `__getattr__` returning Any, so a name missing from
its TYPE_CHECKING block would still type-check as Any. `_resolved` tells the two apart: on a value pyright
knows it is Literal[True]; on Any both overloads match and pyright makes it Unknown, failing the assert_type.
"""

from __future__ import annotations

from typing import Any, Literal, assert_type, overload

import jax
import optax

import jaxloop


class _Unseen:
    """A type no public name has: the first overload matches only Any."""


# the overlap is the point: on Any both overloads match, so pyright cannot pick a return type
@overload
def _resolved(value: _Unseen) -> Literal[False]: ...  # pyright: ignore[reportOverlappingOverload]
@overload
def _resolved(value: object) -> Literal[True]: ...
def _resolved(value: object) -> bool:
    return not isinstance(value, _Unseen)


assert_type(_resolved(jaxloop.Action), Literal[True])
assert_type(_resolved(jaxloop.AdagradConfig), Literal[True])
assert_type(_resolved(jaxloop.AdamConfig), Literal[True])
assert_type(_resolved(jaxloop.AdamWConfig), Literal[True])
assert_type(_resolved(jaxloop.Boundary), Literal[True])
assert_type(_resolved(jaxloop.CheckpointConfig), Literal[True])
assert_type(_resolved(jaxloop.Config), Literal[True])
assert_type(_resolved(jaxloop.ConfigError), Literal[True])
assert_type(_resolved(jaxloop.ConstantConfig), Literal[True])
assert_type(_resolved(jaxloop.CosineRestartsConfig), Literal[True])
assert_type(_resolved(jaxloop.cross_entropy_loss), Literal[True])
assert_type(_resolved(jaxloop.DataConfig), Literal[True])
assert_type(_resolved(jaxloop.DistributedConfig), Literal[True])
assert_type(_resolved(jaxloop.errors), Literal[True])
assert_type(_resolved(jaxloop.eval_step), Literal[True])
assert_type(_resolved(jaxloop.every), Literal[True])
assert_type(_resolved(jaxloop.ExponentialConfig), Literal[True])
assert_type(_resolved(jaxloop.flops_per_token), Literal[True])
assert_type(_resolved(jaxloop.from_dict), Literal[True])
assert_type(_resolved(jaxloop.generate), Literal[True])
assert_type(_resolved(jaxloop.get_policy), Literal[True])
assert_type(_resolved(jaxloop.gpt_params), Literal[True])
assert_type(_resolved(jaxloop.Hook), Literal[True])
assert_type(_resolved(jaxloop.init_state), Literal[True])
assert_type(_resolved(jaxloop.InverseSqrtConfig), Literal[True])
assert_type(_resolved(jaxloop.LinearConfig), Literal[True])
assert_type(_resolved(jaxloop.LionConfig), Literal[True])
assert_type(_resolved(jaxloop.load_model), Literal[True])
assert_type(_resolved(jaxloop.load_splits), Literal[True])
assert_type(_resolved(jaxloop.LogConfig), Literal[True])
assert_type(_resolved(jaxloop.make_optimizer), Literal[True])
assert_type(_resolved(jaxloop.make_train_step), Literal[True])
assert_type(_resolved(jaxloop.MemoryConfig), Literal[True])
assert_type(_resolved(jaxloop.ModelConfig), Literal[True])
assert_type(_resolved(jaxloop.MultiStepConfig), Literal[True])
assert_type(_resolved(jaxloop.OneCycleConfig), Literal[True])
assert_type(_resolved(jaxloop.OptimConfig), Literal[True])
assert_type(_resolved(jaxloop.parity), Literal[True])
assert_type(_resolved(jaxloop.PlateauConfig), Literal[True])
assert_type(_resolved(jaxloop.PolynomialConfig), Literal[True])
assert_type(_resolved(jaxloop.preset), Literal[True])
assert_type(_resolved(jaxloop.rates), Literal[True])
assert_type(_resolved(jaxloop.read_vocab), Literal[True])
assert_type(_resolved(jaxloop.retain_freed_memory), Literal[True])
assert_type(_resolved(jaxloop.RMSpropConfig), Literal[True])
assert_type(_resolved(jaxloop.run), Literal[True])
assert_type(_resolved(jaxloop.run_cpu_calls_inline), Literal[True])
assert_type(_resolved(jaxloop.RunContext), Literal[True])
assert_type(_resolved(jaxloop.RunResult), Literal[True])
assert_type(_resolved(jaxloop.SequenceRecords), Literal[True])
assert_type(_resolved(jaxloop.SGDConfig), Literal[True])
assert_type(_resolved(jaxloop.state_digest), Literal[True])
assert_type(_resolved(jaxloop.StepConfig), Literal[True])
assert_type(_resolved(jaxloop.StepInfo), Literal[True])
assert_type(_resolved(jaxloop.Task), Literal[True])
assert_type(_resolved(jaxloop.to_dict), Literal[True])
assert_type(_resolved(jaxloop.train_step), Literal[True])
assert_type(_resolved(jaxloop.TrainState), Literal[True])
assert_type(_resolved(jaxloop.validate), Literal[True])
assert_type(_resolved(jaxloop.WarmupCosineConfig), Literal[True])
assert_type(_resolved(jaxloop.weighted_mean), Literal[True])
assert_type(_resolved(jaxloop.write_shard), Literal[True])
assert_type(_resolved(jaxloop.WSDConfig), Literal[True])


def user_code(model: Any, loss: Any, train: Any, val: Any, batch: dict[str, Any]) -> None:
    """What a user writes (the package docstring's lines), type-checked against the real signatures."""
    cfg = jaxloop.Config(steps=300, optim=jaxloop.OptimConfig(peak_lr=1e-2), log=jaxloop.LogConfig(progress="off"))
    hook = jaxloop.Hook(lambda info: None, every=200)
    result: jaxloop.RunResult = jaxloop.run(cfg, jaxloop.Task(model, loss, train, val), hooks=[hook])
    assert_type(result.state, jaxloop.TrainState | None)
    state = jaxloop.init_state(model, loss, batch, optax.adamw(1e-3), seed=0)
    assert_type(state, jaxloop.TrainState)
    state, metrics = jax.jit(jaxloop.train_step, donate_argnums=0)(state, batch)
