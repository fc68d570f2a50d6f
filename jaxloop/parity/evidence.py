"""A square weight's layout decided by evidence, never guessed: the Flax module, applied alone to the
torch module's captured input with the weight in each candidate layout, must reproduce the torch
module's captured output under exactly one of them (weights.Decide)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxloop.parity.diagnose import CLOSE
from jaxloop.parity.layers import Capture, align, difference
from jaxloop.parity.precision import np_dtype
from jaxloop.parity.weights import LAYOUTS, Decide, FlaxSlot, TorchSlot


def layout_by_output(tcap: Capture, state_dict: dict[str, np.ndarray], kind: str, precision: str) -> Decide:
    """weights.Decide from one captured torch forward pass (tcap) and the torch weights (numpy)."""
    dtype = np_dtype(precision)

    def decide(t: TorchSlot, f: FlaxSlot, candidates: list[dict[str, tuple[str, str]]]) -> int | str:
        call = tcap.calls.get(t.module)
        if call is None or call.input is None or call.output is None:
            return f"the example batch did not run torch {t.module}, so its output cannot decide"
        if f.obj is None:
            return f"the Flax module {f.module} was not called on the example batch, so its output cannot decide"
        diffs = []
        for candidate in candidates:
            values = {
                name: np.asarray(LAYOUTS[layout][0](state_dict[key]), dtype)
                for name, (key, layout) in candidate.items()
            }
            try:
                out = _apply_alone(f.obj, values, np.asarray(call.input, dtype), kind)
            except Exception as e:  # the module needs more than its input: no evidence
                return f"the Flax module {f.module} cannot be applied alone to the captured input ({type(e).__name__}: {e})"
            both = align(call.output, out)
            diffs.append(np.inf if both is None else difference(*both))
        close = [i for i, d in enumerate(diffs) if d <= CLOSE[precision]]
        if len(close) == 1:
            return close[0]
        tried = ", ".join(f"{'/'.join(lay for _, lay in c.values())}: {d:.1e}" for c, d in zip(candidates, diffs))
        return (
            f"applied alone to torch {t.module}'s captured input, the Flax module {f.module} reproduces its output "
            f"under {'every' if close else 'no'} layout (relative differences {tried})"
        )

    return decide


def _apply_alone(obj: Any, values: dict[str, np.ndarray], x: np.ndarray, kind: str) -> np.ndarray:
    """The Flax module's output on x with its own variables set to `values` (full leaf names)."""
    if kind == "linen":
        variables: dict[str, dict[str, Any]] = {}
        for name, v in values.items():
            collection, leaf = name.split("/")[0], name.split("/")[-1]
            variables.setdefault(collection, {})[leaf] = jnp.asarray(v)
        out = obj.clone(parent=None).apply(variables, jnp.asarray(x))
    else:
        from flax import nnx

        module = nnx.clone(obj)
        for name, v in values.items():
            getattr(module, name.split("/")[-1]).value = jnp.asarray(v)
        out = module(jnp.asarray(x))
    floats = [a for a in jax.tree.leaves(out) if jnp.issubdtype(a.dtype, jnp.floating)]
    return np.asarray(floats[0])
