"""Weights moved with a Mapping: a torch module's into Flax variables, and trained Flax weights (a jaxloop
checkpoint's, via jaxloop.load_model) back into the torch module (train in JAX, hand the torch model on).
Every layout is a permutation, so a round trip is exact, bit for bit.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxloop.model.interface import LinenModel, NnxModel, is_nnx
from jaxloop.parity.flaxside import FlaxModel
from jaxloop.parity.torchside import load_state_dict, state_dict
from jaxloop.parity.weights import Mapping


def flax_leaves(flax_variables: Any) -> dict[str, np.ndarray]:
    """{leaf name: array} of Linen variables ({"params": ..., "batch_stats": ...}) or an NNX module, named as
    the mapping names them."""
    if is_nnx(flax_variables):
        adapter, params, model_state = NnxModel.split(flax_variables)
        return FlaxModel("nnx", adapter, params, model_state).leaves()
    variables = dict(flax_variables)
    params = variables.pop("params")
    return FlaxModel("linen", LinenModel(), params, variables).leaves()  # leaves() reads no module


def flax_variables(mapping: Mapping, torch_module: Any, nnx_module: Any = None) -> Any:
    """The torch module's weights as Flax variables: a Linen variables dict, or (given the NNX module) that
    module with its variables replaced in place."""
    leaves = mapping.to_flax(state_dict(torch_module))
    if nnx_module is not None:
        from flax import nnx

        adapter, params, model_state = NnxModel.split(nnx_module)
        filled = FlaxModel("nnx", adapter, params, model_state).with_leaves(
            leaves, "fp64" if any(np.asarray(v).dtype == np.float64 for v in leaves.values()) else "fp32"
        )
        nnx.update(nnx_module, filled.params, adapter._typed(filled.model_state))  # noqa: SLF001 (jaxloop's own helper)
        return nnx_module
    out: dict[str, Any] = {}
    for name, value in leaves.items():
        node = out
        *path, leaf = name.split("/")
        for key in path:
            node = node.setdefault(key, {})
        node[leaf] = jnp.asarray(value)
    return out


def load_into_torch(mapping: Mapping, torch_module: Any, flax_vars: Any) -> None:
    """Write Flax weights (Linen variables, e.g. jaxloop.load_model's answer, or an NNX module) into the torch
    module's tensors; tied copies follow; num_batches_tracked keeps the module's own value."""
    load_state_dict(torch_module, mapping.to_torch(flax_leaves(flax_vars), base=state_dict(torch_module)))
