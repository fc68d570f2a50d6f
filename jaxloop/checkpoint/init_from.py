"""--init_from: a fresh run's params read from another run's checkpoint (e.g. one written by
parity_tests/convert.py from a torch_ref run).

`init_params_from(path, target_params)`: path is a run_dir or its checkpoints directory; the newest
checkpoint is read with jaxloop's one reader (jaxloop.checkpoint.manager.read_checkpoint: no model or optimizer
needed, so any optimizer or precision it was saved with will do) and only its params are kept, checked
leaf for leaf against the target's paths and shapes (a ConfigError otherwise; jaxloop.run checks it before
writing anything, jaxloop.loop.model_check) and cast to the target's dtypes and shardings.
Nothing else (optimizer state, step, data position, EMA) is taken: the run starts at update 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxloop.core.config import ConfigError


def init_params_from(path: str | Path, target_params: Any) -> Any:
    """target_params replaced by the params of the newest checkpoint under `path` (see the module doc)."""
    from jaxloop.checkpoint.manager import read_checkpoint

    try:
        # a damaged step (unreadable, or failing its digest) is skipped with a warning, the previous one read
        _, _, saved = read_checkpoint(path, "latest", follow_x64=False)  # cast to the target's dtypes below
    except FileNotFoundError:
        raise FileNotFoundError(f"init_from: {path} holds no checkpoint") from None
    params = saved["params"]
    flat_target = jax.tree_util.tree_flatten_with_path(target_params)[0]
    flat_saved = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    want = {jax.tree_util.keystr(k) for k, _ in flat_target}
    if set(flat_saved) != want:
        raise ConfigError("init_from", str(path), f"a run of this model's params: missing "
                          f"{sorted(want - set(flat_saved))}, unexpected {sorted(set(flat_saved) - want)}")
    leaves = []
    for key, leaf in flat_target:
        value = np.asarray(flat_saved[jax.tree_util.keystr(key)])
        if value.shape != leaf.shape:
            raise ConfigError("init_from", str(path), f"a run of this model's shapes: {jax.tree_util.keystr(key)} has "
                              f"shape {value.shape} there, {leaf.shape} in this model")
        sharding = getattr(leaf, "sharding", None)
        array = jnp.asarray(value, dtype=leaf.dtype)
        leaves.append(jax.device_put(array, sharding) if sharding is not None else array)
    return jax.tree.unflatten(jax.tree.structure(target_params), leaves)
