"""--init_from: a fresh run's params read from another run's checkpoint (e.g. one written by
parity_tests/convert.py from a torch_ref run).

`init_params_from(path, target_params)`: path is a run_dir (its checkpoints/ is used) or a checkpoints
directory; the newest step's saved TrainState is read with Orbax without a target (so any optimizer or
precision it was saved with will do) and only its params are kept, checked leaf for leaf against the
target's paths and shapes and cast to the target's dtypes and shardings. Nothing else (optimizer state,
step, data position, EMA) is taken: the run starts at update 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _checkpoints_dir(path: Path) -> Path:
    if (path / "checkpoints").is_dir():
        return path / "checkpoints"
    return path


def init_params_from(path: str | Path, target_params: Any) -> Any:
    """target_params replaced by the params of the newest checkpoint under `path` (see the module doc)."""
    import orbax.checkpoint as ocp

    directory = _checkpoints_dir(Path(path))
    steps = sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit()) \
        if directory.is_dir() else []
    if not steps:
        raise FileNotFoundError(f"init_from: {path} holds no checkpoint")
    saved = ocp.StandardCheckpointer().restore((directory / str(steps[-1]) / "state").resolve())
    params = saved["params"]
    flat_target = jax.tree_util.tree_flatten_with_path(target_params)[0]
    flat_saved = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    want = {jax.tree_util.keystr(k) for k, _ in flat_target}
    if set(flat_saved) != want:
        raise ValueError(f"init_from: {path}'s params do not match the model: missing "
                         f"{sorted(want - set(flat_saved))}, unexpected {sorted(set(flat_saved) - want)}")
    leaves = []
    for key, leaf in flat_target:
        value = np.asarray(flat_saved[jax.tree_util.keystr(key)])
        if value.shape != leaf.shape:
            raise ValueError(f"init_from: {jax.tree_util.keystr(key)} has shape {value.shape}, the model {leaf.shape}")
        sharding = getattr(leaf, "sharding", None)
        array = jnp.asarray(value, dtype=leaf.dtype)
        leaves.append(jax.device_put(array, sharding) if sharding is not None else array)
    return jax.tree.unflatten(jax.tree.structure(target_params), leaves)
