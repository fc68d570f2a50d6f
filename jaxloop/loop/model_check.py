"""The model half of a run's identity, checked before a run writes anything (jaxloop.rundir.model_identity holds the
record and the rules): a resume whose model differs from the run's (its leaves, or what its loss computes),
or --init_from a run (or a Hugging Face GPT-2) whose params
have other shapes, is refused with a ConfigError (exit 2) naming the first
differing leaves, or that the computation changed.

What a model computes is fingerprinted from the jaxpr of its loss in training mode, traced (jax.make_jaxpr:
no compile, nothing computed) on abstract inputs of the example record's shapes: each operation's name, its
operands' shapes and dtypes, its literal constants and its parameters, nested jaxprs included, with the
variables numbered in order. Parameters that are not plain data (functions, shardings, meshes) are named by
their type only, so the fingerprint is the same in every process and on every mesh.
"""

from __future__ import annotations

import hashlib
from enum import Enum
from typing import Any

import flax
import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from jaxloop.checkpoint import hf_gpt2
from jaxloop.checkpoint.manager import Checkpointer, saved_structure
from jaxloop.config.run import Config, ConfigError
from jaxloop.data.sources import Splits
from jaxloop.loop.task import Task, run_state
from jaxloop.rundir.layout import RunLayout
from jaxloop.rundir.model_identity import check_model, first_differences, model_differences, read_model_record
from jaxloop.update.state import hash_array, model_record


def this_model(cfg: Config, task: Task, splits: Splits) -> dict[str, Any]:
    """The model record of the state this run trains and the fingerprint of its loss's computation (shapes
    only: nothing is computed or compiled)."""
    state = jax.eval_shape(lambda: run_state(cfg, task, splits))
    example = splits.train.get(np.zeros(1, np.int64))
    return {**model_record(state, task.model), "computation": computation(state, task.loss, example)}


def computation(state: Any, loss: Any, example: dict[str, Any]) -> dict[str, str]:
    """The fingerprint of what `loss` computes with the model of `state` (abstract or not) in training mode on
    a batch shaped like `example`, and the jax and flax versions that traced it."""

    def forward(params: Any, model_state: Any, batch: Any, rng: Any) -> Any:
        bound, new_state = state.model.bind(params, model_state, True, rng, state.policy)
        return loss(bound, batch, True), new_state()

    shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype),
        example,
    )
    traced = jax.make_jaxpr(forward)(state.params, state.model_state, shapes, state.rng)
    return {
        "sha256": hashlib.sha256(jaxpr_text(traced).encode()).hexdigest(),
        "traced_with": f"jax {jax.__version__}, flax {flax.__version__}",
    }


def jaxpr_text(jaxpr: Any) -> str:
    """A process-independent text of a (closed) jaxpr: operations, operand types, literals, parameters."""
    names: dict[Any, str] = {}
    lines: list[str] = []

    def var(v: Any) -> str:
        if isinstance(v, Literal):
            return f"{v.val!r}:{v.aval.str_short()}"
        if v not in names:
            names[v] = f"v{len(names)}"
        return f"{names[v]}:{v.aval.str_short()}"

    def param(value: Any) -> str:
        if isinstance(value, (ClosedJaxpr, Jaxpr)):
            return "{" + jaxpr_text(value) + "}"
        if isinstance(value, (tuple, list)):
            return "(" + ",".join(param(x) for x in value) + ")"
        if isinstance(value, dict):
            return "{" + ",".join(f"{k}={param(x)}" for k, x in sorted(value.items(), key=lambda kv: str(kv[0]))) + "}"
        if value is None or isinstance(value, (bool, int, float, str, np.generic, Enum)):
            return repr(value)
        if isinstance(value, np.dtype) or (isinstance(value, type) and issubclass(value, np.generic)):
            return str(np.dtype(value))
        return type(value).__name__  # functions, shardings, meshes: not plain data

    inner = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    consts = jaxpr.consts if isinstance(jaxpr, ClosedJaxpr) else []
    for v, c in zip(inner.constvars, consts):
        h = hashlib.sha256()
        hash_array(h, c)  # typed PRNG keys too
        lines.append(f"const {var(v)} {h.hexdigest()[:16]}")
    lines.append("in " + " ".join(var(v) for v in inner.invars))
    for eqn in inner.eqns:
        params = " ".join(f"{k}={param(eqn.params[k])}" for k in sorted(eqn.params))
        lines.append(
            f"{' '.join(var(v) for v in eqn.outvars)} = {eqn.primitive.name}[{params}] "
            f"{' '.join(var(v) for v in eqn.invars)}"
        )
    lines.append("out " + " ".join(var(v) for v in inner.outvars))
    return "\n".join(lines)


def check_same_model(cfg: Config, layout: RunLayout, now: dict[str, Any], flags: bool) -> None:
    """A run that would resume a checkpoint must train the model it was saved with: compared with
    run_dir/model.json and with its newest readable checkpoint's structure.
    `flags`: word the refusal for the command line (else for Python callers)."""
    if cfg.resume == "never" or not Checkpointer.has_checkpoint(layout.checkpoints):
        return
    check_model(layout, cfg.resume, now, read_model_record(layout), flags)
    # and the newest checkpoint's own structure (checkpoints copied in from another run, under an intact
    # model.json); an older one is checked by the restore before it is read (Checkpointer.restore_latest)
    check_model(layout, cfg.resume, now, saved_structure(layout.checkpoints), flags, source="its latest checkpoint")


def check_init_from(cfg: Config, now: dict[str, Any]) -> None:
    """--init_from must name a run whose params have this model's paths and shapes (dtypes are cast)."""
    if not cfg.init_from:
        return
    if hf_gpt2.is_hf_dir(cfg.init_from):  # a Hugging Face GPT-2: its tensors' shapes, from the file's header
        hf_gpt2.to_params(hf_gpt2.tensor_shapes(cfg.init_from), cfg.model, cfg.init_from)
        return
    source = saved_structure(RunLayout.of(cfg.init_from).checkpoints)
    if source is None:
        return  # no readable checkpoint: init_params_from says so
    params = lambda record: {"model": None, "leaves": [x for x in record["leaves"] if x[0].startswith("params/")]}  # noqa: E731
    differences = model_differences(params(source), params(now), dtypes=False)
    if differences:
        raise ConfigError(
            "init_from",
            cfg.init_from,
            "a run of this model's shapes; these params differ: "
            f"{first_differences(differences).replace(' in the run,', ' there,')}",
        )
