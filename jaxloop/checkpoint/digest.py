"""What a checkpoint records of itself and how a restore checks it: a sha256 of each state leaf's dtype,
shape and bytes (jaxloop.update.state.leaf_digests) and of the data position's JSON, saved as the item `digest`
and compared with what every restore read, beside a check that the state is finite."""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxloop.update.state import leaf_digests

finite = jax.jit(lambda tree: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
                                                   if jnp.issubdtype(x.dtype, jnp.inexact)])))
"""Whether every inexact leaf of a tree is finite (one jitted reduction)."""


class DamagedCheckpointError(ValueError):
    """A restored checkpoint whose arrays or data position fail its digest, or whose state is not finite."""


class UnverifiedCheckpointWarning(UserWarning):
    """A checkpoint written before jaxloop recorded digests was restored without a check of its bytes."""


DIGEST_ALGORITHM = "sha256"


def data_digest(data: dict[str, Any]) -> str:
    """sha256 of a data position as its canonical JSON (what the `data` item holds, restored or not)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def checkpoint_digest(state: Any, data: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint records of itself: each state leaf's digest and the data position's."""
    return {"algorithm": DIGEST_ALGORITHM, "state": leaf_digests(state), "data": data_digest(data)}


def verify(restored: dict[str, Any], recorded: dict[str, Any] | None, directory: Path,
           cast: frozenset[str] = frozenset()) -> None:
    """Raise DamagedCheckpointError when what was restored of a step (its `state`, and `data` if read) differs
    from the digest recorded with it, or the state is not finite. `cast`: leaves the reader converted to
    another dtype on purpose (not comparable). No digest recorded: one warning, and only the finite check
    (which is all a checkpoint of several processes gets: each held only its shards)."""
    state = restored["state"]
    if recorded is None:
        warnings.warn(f"the checkpoints in {directory} carry no digest (written by an older jaxloop): "
                      "restored without checking their bytes", UnverifiedCheckpointWarning, stacklevel=3)
    elif recorded.get("algorithm") == DIGEST_ALGORITHM:
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
