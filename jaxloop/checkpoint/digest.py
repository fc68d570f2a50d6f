"""What a checkpoint records of itself and how a restore checks it: a sha256 of each state leaf's dtype,
shape and bytes (jaxloop.update.state.leaf_digests) and of the data position's JSON, and the update it was saved
at, saved as the item `digest` and compared with what every restore read (and with the step directory's name),
beside a check that the state is finite. A digest record that is not one of these (an unknown algorithm, a
missing or malformed field) is damage, never a reason to skip the check."""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxloop.update.state import leaf_digests

finite = jax.jit(
    lambda tree: jnp.all(
        jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)])
    )
)
"""Whether every inexact leaf of a tree is finite (one jitted reduction)."""


class DamagedCheckpointError(ValueError):
    """A restored checkpoint whose arrays or data position fail its digest, or whose state is not finite."""


class UnverifiedCheckpointWarning(UserWarning):
    """A checkpoint written before jaxloop recorded digests was restored without a check of its bytes."""


DIGEST_ALGORITHM = "sha256"


def data_digest(data: dict[str, Any]) -> str:
    """sha256 of a data position as its canonical JSON (what the `data` item holds, restored or not)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def checkpoint_digest(state: Any, data: dict[str, Any], step: int) -> dict[str, Any]:
    """What a checkpoint records of itself: the update it is saved at, each state leaf's digest and the data
    position's."""
    return {"algorithm": DIGEST_ALGORITHM, "step": int(step), "state": leaf_digests(state), "data": data_digest(data)}


UNRECORDED = None
"""The `algorithm` of a record that says why no digest was computed (several processes: each held only its
shards); such a checkpoint is checked as one without a digest."""


def _malformed(recorded: Any) -> str | None:
    """What is wrong with a digest record's form (None: a sha256 record or a documented unrecorded one)."""
    if not isinstance(recorded, dict):
        return f"a {type(recorded).__name__}, not a record"
    algorithm = recorded.get("algorithm", "(missing)")
    if algorithm is UNRECORDED and isinstance(recorded.get("why"), str):
        return None
    if algorithm != DIGEST_ALGORITHM:
        return f"an unknown algorithm {algorithm!r} (this jaxloop checks {DIGEST_ALGORITHM!r})"
    state = recorded.get("state")
    if not isinstance(state, dict) or not all(isinstance(v, str) for v in state.values()):
        return "no leaf digests"
    if not isinstance(recorded.get("data"), str):
        return "no data position digest"
    if "step" in recorded and (not isinstance(recorded["step"], int) or isinstance(recorded["step"], bool)):
        return f"the step {recorded['step']!r}, not an update number"
    return None


def verify(
    restored: dict[str, Any],
    recorded: Any,
    directory: Path,
    cast: frozenset[str] = frozenset(),
    step: int | None = None,
) -> bool:
    """Raise DamagedCheckpointError when what was restored of a step (its `state`, and `data` if read) differs
    from the digest recorded with it, the digest names another update than `step` (the directory's name), the
    record is malformed or names an unknown algorithm, or the state is not finite. `cast`: leaves the reader
    converted to another dtype on purpose (not comparable). No digest recorded: one warning, and only the
    finite check (which is all a checkpoint of several processes gets: each held only its shards).
    Returns whether the bytes were checked against a digest."""
    state = restored["state"]
    if recorded is None:
        warnings.warn(
            f"the checkpoints in {directory} carry no digest (written by an older jaxloop): "
            "restored without checking their bytes",
            UnverifiedCheckpointWarning,
            stacklevel=3,
        )
    elif (wrong := _malformed(recorded)) is not None:
        raise DamagedCheckpointError(f"its digest record holds {wrong}")
    elif recorded["algorithm"] == DIGEST_ALGORITHM:
        if step is not None and "step" in recorded and recorded["step"] != step:
            raise DamagedCheckpointError(
                f"its digest records update {recorded['step']}, not {step} (the directory was renamed or copied)"
            )
        now = leaf_digests(state)
        saved = recorded.get("state") or {}
        bad = [p for p in sorted(set(now) | set(saved)) if p not in cast and now.get(p) != saved.get(p)]
        if bad:
            more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
            raise DamagedCheckpointError(f"the state leaf {bad[0]}{more} does not match the checkpoint's digest")
        if "data" in restored and data_digest(dict(restored["data"])) != recorded.get("data"):
            raise DamagedCheckpointError("the data position does not match the checkpoint's digest")
    floats = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.inexact)]
    if floats and not bool(finite(floats)):
        raise DamagedCheckpointError("the restored state holds NaN or Inf")
    return recorded is not None and recorded["algorithm"] == DIGEST_ALGORITHM
