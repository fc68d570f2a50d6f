"""--init_from: a fresh run's params read from another run's checkpoint (e.g. one written by
parity_tests/convert.py from a torch_ref run).

`init_params_from(path, target_params)`: path is a run_dir or its checkpoints directory; the newest
checkpoint is read with jaxloop's one reader (jaxloop.checkpoint.manager.read_checkpoint: no model or optimizer
needed, so any optimizer or precision it was saved with will do) and only its params are kept, checked
leaf for leaf against the target's paths and shapes (a ConfigError otherwise; jaxloop.run checks it before
writing anything, jaxloop.loop.model_check) and cast to the target's dtypes and shardings.
Nothing else (optimizer state, step, data position, EMA) is taken: the run starts at update 0.

A Hugging Face GPT-2 directory (config.json and model.safetensors or pytorch_model.bin; jaxloop.checkpoint.hf_gpt2)
initialises the built-in GPT: `shaped_by_init_from` gives the model the checkpoint's shape before the run is set
up, and `initial_params` maps its tensors onto the params and checks the loaded model's logits against
transformers' GPT2LMHeadModel (where torch is installed), saying which check ran.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxloop.checkpoint import hf_gpt2
from jaxloop.config.run import Config, ConfigError, ModelConfig, preset


def init_params_from(path: str | Path, target_params: Any) -> Any:
    """target_params replaced by the params of the newest checkpoint under `path` (see the module doc)."""
    from jaxloop.checkpoint.manager import read_checkpoint

    try:
        # a damaged step (unreadable, or failing its digest) is skipped with a warning, the previous one read
        _, _, saved = read_checkpoint(path, "latest", follow_x64=False)  # cast to the target's dtypes below
    except FileNotFoundError:
        raise FileNotFoundError(f"init_from: {path} holds no checkpoint") from None
    return _placed(saved["params"], target_params, path)


def _placed(params: Any, target_params: Any, path: str | Path) -> Any:
    """`params` checked leaf for leaf against the target's paths and shapes, cast to its dtypes and shardings."""
    flat_target = jax.tree_util.tree_flatten_with_path(target_params)[0]
    flat_saved = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    want = {jax.tree_util.keystr(k) for k, _ in flat_target}
    if set(flat_saved) != want:
        raise ConfigError(
            "init_from",
            str(path),
            f"a run of this model's params: missing "
            f"{sorted(want - set(flat_saved))}, unexpected {sorted(set(flat_saved) - want)}",
        )
    leaves = []
    for key, leaf in flat_target:
        value = np.asarray(flat_saved[jax.tree_util.keystr(key)])
        if value.shape != leaf.shape:
            raise ConfigError(
                "init_from",
                str(path),
                f"a run of this model's shapes: {jax.tree_util.keystr(key)} has "
                f"shape {value.shape} there, {leaf.shape} in this model",
            )
        sharding = getattr(leaf, "sharding", None)
        array = jnp.asarray(value, dtype=leaf.dtype)
        leaves.append(jax.device_put(array, sharding) if sharding is not None else array)
    return jax.tree.unflatten(jax.tree.structure(target_params), leaves)


def shaped_by_init_from(cfg: Config, own_task: bool) -> Config:
    """cfg with the model shape of the Hugging Face GPT-2 that --init_from names (hf_gpt2.with_checkpoint_shape;
    the preset's model gives the defaults a flag may have left); cfg itself for any other init_from. A Task
    of one's own cannot take a Hugging Face directory (ConfigError)."""
    if not cfg.init_from or not hf_gpt2.is_hf_dir(cfg.init_from):
        return cfg
    if own_task:
        raise ConfigError(
            "init_from",
            cfg.init_from,
            "a jaxloop run directory when the Task is one's own (a Hugging "
            "Face GPT-2 directory initialises the built-in GPT, model.kind=gpt)",
        )
    from dataclasses import replace

    return replace(cfg, model=hf_gpt2.with_checkpoint_shape(cfg.model, preset(cfg.preset).model, cfg.init_from))


def initial_params(path: str | Path, target_params: Any, model: ModelConfig, precision: str) -> tuple[Any, str | None]:
    """(params, the line that says what was checked, or None) for --init_from `path`: a jaxloop run's newest
    params (init_params_from), or a Hugging Face GPT-2's, mapped and checked against transformers'
    GPT2LMHeadModel in fp64 when the run is fp64, else fp32 (hf_gpt2.check_logits)."""
    if not hf_gpt2.is_hf_dir(path):
        return init_params_from(path, target_params), None
    params = hf_gpt2.to_params(hf_gpt2.read_tensors(path), model, str(path))
    check = hf_gpt2.check_logits(path, params, model, "fp64" if precision == "fp64" else "fp32")
    return (
        _placed(params, target_params, path),
        f"init_from: Hugging Face GPT-2 {path} ({hf_gpt2.describe(model)}): {check}",
    )
