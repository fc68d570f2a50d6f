"""One interface over a Flax Linen module or a Flax NNX module, so one pure step trains either.

A model is kept as (params, model_state) pytrees in the TrainState: params are what the optimizer
updates (Linen's "params" collection; NNX's nnx.Param variables), model_state everything else the
model carries (Linen's other collections such as batch_stats; NNX's batch statistics and its own
nnx.Rngs counters). `bind(params, model_state, train, rng, policy)` gives the callable a loss calls
(`model(x, ...)`; a Linen one also has `model.params`) and, after the call, the updated model_state: a pure function
of its inputs, so it
runs inside jit and grad. Losses have the signature `loss(model, batch, train) -> (scalar, aux dict)`.

Linen: `model(*args, **kwargs)` is `module.apply(variables, *args, rngs={"dropout": rng}, **kwargs)`
(non-params collections mutable while training); the loss passes `train=` itself if the module takes
it. Initialisation calls the loss once with a model that initialises the module on its first call
(`module.init(rngs, *args, **kwargs)`), so the module is initialised with exactly the arguments the
loss gives it. NNX: `model` is the module, merged from the state and set to train() or eval() mode.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxloop.model.precision import Policy

LossFn = Callable[[Callable[..., Any], dict[str, Any], bool], tuple[jax.Array, dict[str, jax.Array]]]


class Bound:
    """A Linen module bound to its variables: call it like the module; `params` for regularisers."""

    def __init__(self, call: Callable[..., Any], params: Any):
        self._call, self.params = call, params

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)


@dataclass(frozen=True, eq=False)
class LinenModel:
    """A flax.linen Module (or any Linen-style `apply(variables, *args, rngs=, mutable=, **kwargs)`)."""

    module: Any = None
    apply_fn: Callable[..., Any] | None = None

    def init(self, rng: jax.Array, loss_fn: LossFn, batch: dict[str, Any]) -> tuple[Any, Any]:
        """(params, model_state) of the module, initialised from rng by one (jitted) call of the loss."""
        module = self.module

        def variables_of(key: jax.Array, batch: dict[str, Any]) -> dict[str, Any]:
            made: dict[str, Any] = {}

            def model(*args: Any, **kwargs: Any) -> Any:
                if "variables" not in made:  # params drawn from `key` itself, as module.init(key, ...) does
                    made["variables"] = module.init(
                        {"params": key, "dropout": jax.random.fold_in(key, 1)}, *args, **kwargs
                    )
                return module.apply(made["variables"], *args, rngs={"dropout": key}, mutable=False, **kwargs)

            loss_fn(model, batch, False)
            return made["variables"]

        variables = dict(jax.jit(variables_of)(rng, batch))
        return variables.pop("params"), variables

    def bind(
        self, params: Any, model_state: Any, train: bool, rng: jax.Array | None, policy: Policy
    ) -> tuple[Callable[..., Any], Callable[[], Any]]:
        apply = self.apply_fn or self.module.apply
        variables = policy.cast_to_compute({"params": params, **model_state})
        mutable = list(model_state) if train and model_state else False
        rngs = {"dropout": rng} if rng is not None else None
        updated: dict[str, Any] = {}

        def call(*args: Any, **kwargs: Any) -> Any:
            out = apply(variables, *policy.cast_to_compute(args), rngs=rngs, mutable=mutable, **kwargs)
            if mutable:
                out, updated["state"] = out
            return policy.cast_to_output(out)

        def new_state() -> Any:
            return policy.cast_to_param(dict(updated["state"])) if "state" in updated else model_state

        return Bound(call, variables["params"]), new_state

    def merge(self, params: Any, model_state: Any) -> Any:
        """What a user gets back: the Linen variables dict."""
        return {"params": params, **model_state}


@dataclass(frozen=True, eq=False)
class NnxModel:
    """A flax.nnx Module, split once into its graph (static) and its state.

    Typed PRNG keys in the state (an nnx.Rngs stream's key) are kept as their raw key data, so the
    state checkpoints like any array; `keys` names them and their implementation.
    """

    graphdef: Any
    keys: tuple[tuple[str, str], ...] = ()  # (key path, PRNG implementation name) of each typed key

    @classmethod
    def split(cls, module: Any) -> tuple[NnxModel, Any, Any]:
        from flax import nnx

        graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        keys = tuple(
            (jax.tree_util.keystr(path), str(jax.random.key_impl(leaf)))
            for path, leaf in jax.tree_util.tree_flatten_with_path(rest)[0]
            if _is_key(leaf)
        )
        # copies: the loop donates the state's buffers, and the module passed in must stay usable
        return cls(graphdef, keys), jax.tree.map(jnp.copy, params), jax.tree.map(jnp.copy, _key_data(rest))

    def _typed(self, model_state: Any) -> Any:
        impls = dict(self.keys)
        return jax.tree_util.tree_map_with_path(
            lambda path, a: (
                jax.random.wrap_key_data(a, impl=impls[k]) if (k := jax.tree_util.keystr(path)) in impls else a
            ),
            model_state,
        )

    def bind(
        self, params: Any, model_state: Any, train: bool, rng: jax.Array | None, policy: Policy
    ) -> tuple[Callable[..., Any], Callable[[], Any]]:
        from flax import nnx

        del rng  # an NNX module draws from its own nnx.Rngs, whose counters are in model_state
        module = nnx.merge(self.graphdef, policy.cast_to_compute(params), self._typed(model_state))
        module.train() if train else module.eval()

        def model(*args: Any, **kwargs: Any) -> Any:
            return policy.cast_to_output(module(*policy.cast_to_compute(args), **kwargs))

        def new_state() -> Any:
            return policy.cast_to_param(_key_data(nnx.split(module, nnx.Param, ...)[2]))

        return model, new_state

    def merge(self, params: Any, model_state: Any) -> Any:
        """What a user gets back: the NNX module with these weights (in eval mode)."""
        from flax import nnx

        module = nnx.merge(self.graphdef, params, self._typed(model_state))
        module.eval()
        return module


def _is_key(leaf: Any) -> bool:
    return hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _key_data(tree: Any) -> Any:
    return jax.tree.map(lambda a: jax.random.key_data(a) if _is_key(a) else a, tree)


def is_nnx(model: Any) -> bool:
    """Whether model is a flax.nnx Module. Read without importing flax.nnx (0.2 s of every run's start-up):
    no object is an nnx.Module unless the module defining that class has been imported."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(model, nnx.Module)
