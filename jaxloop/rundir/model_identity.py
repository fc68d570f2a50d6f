"""The model half of a run's identity: the structure of its trained state and what its loss computes, recorded
in run_dir/model.json.

A record is plain JSON: {"model": the model's class name (None when unknown), "leaves": [[path, shape,
dtype], ...]} for every leaf of the TrainState, in its order (jaxloop.update.state.model_record builds one),
and "computation": {"sha256": a fingerprint of the loss's traced operations on the example record's shapes,
"traced_with": the jax and flax versions} (jaxloop.loop.model_check). A run resumed with a model whose record
differs (its leaves, or, every shape the same, its computation) is refused before anything is written or
moved, like a changed config: a different model is not a damaged checkpoint. A record without a computation
(an older jaxloop's), or one traced by other jax or flax versions (whose operations may be spelled
otherwise), is not compared on it, and is rewritten with this run's. Jax-free: records are compared as data.
"""

from __future__ import annotations

import json
from typing import Any

from jaxloop.config.errors import short_repr
from jaxloop.config.run import ConfigError
from jaxloop.rundir.atomic import atomic_write_text
from jaxloop.rundir.layout import RunLayout

SHOWN = 3
"""How many differing leaves a refusal names."""


def read_model_record(layout: RunLayout) -> dict[str, Any] | None:
    """The run's model record, or None when it has none (a run from before records were kept); a ConfigError
    naming the first leaf that is not [path, shape, dtype] (an edited model.json), before anything is written."""
    record = layout.read_json(layout.model)
    if not (isinstance(record, dict) and isinstance(record.get("leaves"), list)):
        return None
    for i, leaf in enumerate(record["leaves"]):
        if not (
            isinstance(leaf, list)
            and len(leaf) == 3
            and isinstance(leaf[0], str)
            and isinstance(leaf[1], list)
            and all(isinstance(n, int) for n in leaf[1])
            and isinstance(leaf[2], str)
        ):
            raise ConfigError(
                "run_dir",
                str(layout.root),
                f"a run directory whose {layout.model.name} can be read "
                f"(leaf {i} of {layout.model} is {short_repr(leaf)}, not [path, shape, dtype]); restore "
                "it from a copy, or delete it (the checkpoints' own metadata stands in for it)",
            )
    return record


def write_model_record(layout: RunLayout, record: dict[str, Any]) -> None:
    """Write run_dir/model.json atomically (a crash leaves the old record or the new one)."""
    leaves = ",\n  ".join(json.dumps(leaf) for leaf in record["leaves"])  # one leaf a line
    computation = f',\n "computation": {json.dumps(record["computation"])}' if "computation" in record else ""
    atomic_write_text(
        layout.model, f'{{"model": {json.dumps(record["model"])}{computation},\n "leaves": [\n  {leaves}\n ]}}\n'
    )


def computation_changed(run: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether both records fingerprint their computation with the same jax and flax and the fingerprints
    differ (a record without one, or traced by other versions, is not compared)."""
    was, is_ = run.get("computation"), now.get("computation")
    return (
        isinstance(was, dict)
        and isinstance(is_, dict)
        and was.get("traced_with") == is_.get("traced_with")
        and was.get("sha256") != is_.get("sha256")
    )


def _shape(shape: Any) -> str:
    return str(tuple(shape))


def model_differences(run: dict[str, Any], now: dict[str, Any], dtypes: bool = True) -> list[str]:
    """What differs between the run's record and the model now, one phrase each, in the order of the model
    now (then the run's leaves it lacks): `params/Dense_0/kernel: (4, 32) in the run, (4, 64) now`.
    `dtypes`: compare dtypes too (False for --init_from, which casts)."""
    out = []
    if run.get("model") and now.get("model") and run["model"] != now["model"]:
        out.append(f"the model's class: {run['model']} in the run, {now['model']} now")
    before = {path: (shape, dtype) for path, shape, dtype in run["leaves"]}
    after = {path: (shape, dtype) for path, shape, dtype in now["leaves"]}
    for path, shape, dtype in now["leaves"]:
        if path not in before:
            out.append(f"{path}: absent in the run, {_shape(shape)} now")
            continue
        was, was_dtype = before[path]
        if list(was) != list(shape):
            out.append(f"{path}: {_shape(was)} in the run, {_shape(shape)} now")
        elif dtypes and was_dtype != dtype:
            out.append(f"{path}: {_shape(was)} {was_dtype} in the run, {_shape(shape)} {dtype} now")
    out += [f"{path}: {_shape(shape)} in the run, absent now" for path, shape, _ in run["leaves"] if path not in after]
    return out


def first_differences(differences: list[str]) -> str:
    """The first SHOWN differences joined, and how many more there are."""
    more = len(differences) - SHOWN
    return "; ".join(differences[:SHOWN]) + (f" (and {more} more)" if more > 0 else "")


def check_model(
    layout: RunLayout,
    resume: str,
    now: dict[str, Any],
    run: dict[str, Any] | None,
    flags: bool,
    source: str | None = None,
) -> None:
    """Refuse (ConfigError, exit 2) to resume the run in `layout` with a model whose record `now` differs
    from the run's (`run`: its model.json, or the structure of one of its checkpoints, named by `source`;
    None: nothing to compare). `flags`: word the ways forward as command-line flags, else as Python
    arguments."""
    if run is None:
        return
    differences = model_differences(run, now)
    root = layout.root
    if not differences and computation_changed(run, now):
        if flags:
            forward = (
                f"To train the new model, start a new run: --run_dir NEW_DIR (add --init_from {root} to "
                f"start from this run's weights); to continue this run with it on purpose, delete "
                f'"computation" from {layout.model}; to continue this run as it was, run it with the model '
                "it was saved with"
            )
        else:
            forward = (
                f"To train the new model, start a new run: Config(run_dir=NEW_DIR) (add "
                f"init_from={str(root)!r} to start from this run's weights); to continue this run with it on "
                f'purpose, delete "computation" from {layout.model}; to continue this run as it was, give '
                "jaxloop.run the model it was saved with"
            )
        raise ConfigError(
            "resume",
            resume,
            f"a model that computes what the checkpointed run's did "
            f"({layout.model.name}); the model's computation changed (its loss traces to other "
            f"operations), though every leaf's shape and dtype match. {forward}",
        )
    if not differences:
        return
    if flags:
        forward = (
            f"To train the new model, start a new run: --run_dir NEW_DIR; to start over in place, empty "
            f"{root} and pass --resume never; to continue this run, run it with the model it was saved with"
        )
    else:
        forward = (
            f"To train the new model, start a new run: Config(run_dir=NEW_DIR); to start over in place, "
            f'empty {root} and pass Config(resume="never"); to continue this run, give '
            "jaxloop.run the model it was saved with"
        )
    source = source or (layout.model.name if layout.model.exists() else "its latest checkpoint")
    raise ConfigError(
        "resume",
        resume,
        f"a model that matches the checkpointed run's ({source}); these differ: "
        f"{first_differences(differences)}. {forward}",
    )
