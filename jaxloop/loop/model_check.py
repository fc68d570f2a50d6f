"""The model half of a run's identity, checked before a run writes anything (jaxloop.core.identity holds the
record and the rules): a resume whose model differs from the run's, or --init_from a run (or a Hugging Face GPT-2) whose params
have other shapes, is refused with a ConfigError (exit 2) naming the first differing leaves.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxloop.checkpoint import hf_gpt2
from jaxloop.checkpoint.manager import Checkpointer, saved_structure
from jaxloop.update.state import model_record
from jaxloop.loop.task import Task, run_state
from jaxloop.core.config import Config, ConfigError
from jaxloop.core.identity import check_model, first_differences, model_differences, read_model_record
from jaxloop.core.layout import RunLayout
from jaxloop.core.sources import Splits


def this_model(cfg: Config, task: Task, splits: Splits) -> dict[str, Any]:
    """The model record of the state this run trains (shapes only: nothing is computed)."""
    return model_record(jax.eval_shape(lambda: run_state(cfg, task, splits)), task.model)


def check_same_model(cfg: Config, layout: RunLayout, now: dict[str, Any], flags: bool) -> None:
    """A run that would resume a checkpoint must train the model it was saved with: compared with
    run_dir/model.json, or for a run from before that record, with its newest checkpoint's structure.
    `flags`: word the refusal for the command line (else for Python callers)."""
    if cfg.resume == "never" or not Checkpointer.has_checkpoint(layout.checkpoints):
        return
    run = read_model_record(layout) or saved_structure(layout.checkpoints)
    check_model(layout, cfg.resume, now, run, flags)


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
        raise ConfigError("init_from", cfg.init_from, "a run of this model's shapes; these params differ: "
                          f"{first_differences(differences).replace(' in the run,', ' there,')}")
