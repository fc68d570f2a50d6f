"""The measures of every parity comparison, one implementation each: parity_tests (jaxloop against
torch_ref) and the port check (a researcher's PyTorch model against its Flax translation) both use these.

- `rel_diff(a, b)`: ||a - b||_2 / ||b||_2 of one tensor as a whole (an elementwise ratio is meaningless
  for entries that pass through zero); 0 when equal, inf when b is zero and a is not.
- `tree_rel_diff(a, b)`: the largest `rel_diff` over the tensors of two trees, and which tensor.
- `scaled_diffs(a, b)`: each tensor's ||a - b||_2 against a scale that cannot vanish, max(||b||_2, the
  tensor's share of the whole tree's norm); `whole_rel_diff(a, b)`: the trees as one vector. For
  gradients, params and updates, where a tensor's true value can be zero (an attention key bias's
  gradient: softmax ignores a constant added to every score of a query).
- `curve_rel_diff(a, b)`: max over u of |a_u - b_u| / |b_u| (losses, rates).
- `abs_diff`, `ulps_of_value`: absolute and float32-ulp differences.

Every measure refuses what would make a comparison vacuous: empty inputs, different shapes or lengths
(a truncated curve compared over its common prefix would pass), different sets of tensors.
jax and numpy only: no torch here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def same_length(a: Any, b: Any) -> tuple[np.ndarray, np.ndarray]:
    """Both as float64 arrays; refuses empty inputs and different shapes."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.size == 0 or b.size == 0:
        raise ValueError(f"nothing to compare: sizes {a.size} and {b.size}")
    if a.shape != b.shape:
        raise ValueError(f"different shapes: {a.shape} and {b.shape}")
    return a, b


def curve_rel_diff(a: Any, b: Any) -> float:
    """max_u |a_u - b_u| / |b_u| (0 where both are 0); refuses empty or different-length curves."""
    a, b = same_length(a, b)
    diff = np.abs(a - b)
    scale = np.abs(b)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(diff == 0, 0.0, diff / scale)
    return float(np.max(rel))


def ulps_of_value(got: Any, reference: Any) -> np.ndarray:
    """|got - reference| in float32 ulps of the reference value itself (np.spacing of its float32
    rounding); a zero reference must be matched exactly (infinitely many ulps otherwise)."""
    got, reference = same_length(got, reference)
    spacing = np.spacing(np.abs(reference).astype(np.float32)).astype(np.float64)
    diff = np.abs(got - reference)
    return np.where(diff == 0, 0.0, np.where(reference == 0, np.inf, diff / spacing))


def abs_diff(a: Any, b: Any) -> float:
    """max |a - b|; refuses empty or different-length inputs."""
    a, b = same_length(a, b)
    return float(np.max(np.abs(a - b)))


def rel_diff(a: Any, b: Any) -> float:
    """||a - b||_2 / ||b||_2 over the whole tensor (NaN anywhere gives NaN); refuses different shapes."""
    a, b = same_length(a, b)
    d = float(np.linalg.norm((a - b).ravel()))
    if d == 0.0:
        return 0.0
    norm = float(np.linalg.norm(b.ravel()))
    return d / norm if norm else (math.nan if math.isnan(d) else math.inf)


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def flat_params(tree: Any) -> dict[str, np.ndarray]:
    """{'block_0/attn/qkv/bias': array, ...} in float64 (dict keys, attribute names and sequence indices
    joined by '/')."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out["/".join(_key_name(k) for k in path)] = np.asarray(leaf, np.float64)
    return out


def tensor_rel_diffs(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """`rel_diff` of each tensor of two flat {name: array} dicts with the same names and shapes."""
    if not a or not b:
        raise ValueError(f"nothing to compare: {len(a)} and {len(b)} tensors")
    if a.keys() != b.keys():
        raise ValueError(f"different tensors: {sorted(set(a) ^ set(b))}")
    out = {}
    for key in a:
        if np.shape(a[key]) != np.shape(b[key]):
            raise ValueError(f"{key}: shapes {np.shape(a[key])} and {np.shape(b[key])}")
        out[key] = rel_diff(a[key], b[key])
    return out


def tensor_floor(b: dict[str, Any]) -> dict[str, float]:
    """{name: ||b||_tree sqrt(size / total size)}: the norm a tensor of this size would have if the tree's
    norm were spread evenly over its entries. Rounding in a tensor whose exact value is zero (or cancels)
    is set by the magnitudes of the terms that cancel, which are those of the rest of the tree, not by
    the tensor's own (vanishing) norm; a difference this size is as large, relative to the training it
    drives, as the same relative difference in a typical tensor."""
    sizes = {k: np.size(v) for k, v in b.items()}
    total = sum(sizes.values())
    norm = math.sqrt(sum(float(np.sum(np.square(np.asarray(v, np.float64)))) for v in b.values()))
    return {k: norm * math.sqrt(sizes[k] / total) if total else 0.0 for k in b}


def scaled_diffs(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """Each tensor's ||a - b||_2 / max(||b||_2, tensor_floor(b)): `rel_diff` for a tensor of typical size or
    larger; for a tensor whose true value vanishes (a key bias's gradient), its difference measured
    against the whole tree's scale (an exactly zero tree: 0 when equal, inf otherwise)."""
    tensor_rel_diffs(a, b)  # the same names and shapes
    floors = tensor_floor(b)
    out = {}
    for key in a:
        x, y = same_length(a[key], b[key])
        d = float(np.linalg.norm((x - y).ravel()))
        scale = max(float(np.linalg.norm(y.ravel())), floors[key])
        out[key] = 0.0 if d == 0.0 else (d / scale if scale else (math.nan if math.isnan(d) else math.inf))
    return out


def whole_rel_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """||a - b||_2 / ||b||_2 of all the tensors of two trees as one vector."""
    tensor_rel_diffs(a, b)
    d = math.sqrt(sum(float(np.sum(np.square(np.asarray(a[k], np.float64) - np.asarray(b[k], np.float64)))) for k in a))
    n = math.sqrt(sum(float(np.sum(np.square(np.asarray(b[k], np.float64)))) for k in b))
    if d == 0.0:
        return 0.0
    return d / n if n else (math.nan if math.isnan(d) else math.inf)


def worst(diffs: dict[str, float]) -> tuple[float, str]:
    """(the largest value, its name); NaN counts as the largest."""
    name = max(diffs, key=lambda k: math.inf if math.isnan(diffs[k]) else diffs[k])
    return diffs[name], name


def tree_rel_diff(
    a: Any, b: Any, prepare: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None
) -> tuple[float, str]:
    """(max over tensors of ||a - b||_2 / ||b||_2, the tensor attaining it; '' when all are equal).

    `prepare` maps each flattened tree before the comparison (parity_tests leaves attention key biases out).
    """
    fa, fb = flat_params(a), flat_params(b)
    if prepare is not None:
        fa, fb = prepare(fa), prepare(fb)
    value, name = worst(tensor_rel_diffs(fa, fb))
    return value, (name if value != 0 else "")
