"""The PyTorch side of the port check: torch imported on demand, the module copied per precision with
dropout off, batches and outputs converted. Nothing here runs at `import jaxloop.parity`.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import numpy as np

INSTALL = (
    "the port check needs PyTorch, which jaxloop itself never imports: pip install torch "
    "(or the project's test extra: pip install -e '.[test]')"
)


class TorchMissing(ImportError):
    """torch is not installed; the message says how to install it."""


def require_torch() -> Any:
    """The torch module, or TorchMissing saying how to install it."""
    try:
        import torch
    except ImportError as e:
        raise TorchMissing(INSTALL) from e
    return torch


def dtype_of(precision: str) -> Any:
    torch = require_torch()
    return torch.float64 if precision == "fp64" else torch.float32


def zero_dropout(module: Any) -> None:
    """Dropout off in train mode too: every torch Dropout module's p, nn.MultiheadAttention's attention
    dropout and a DropPath's (stochastic depth) drop_prob set to 0 (masks cannot match across frameworks)."""
    torch = require_torch()
    for m in module.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):  # noqa: SLF001 (the base of every Dropout*)
            m.p = 0.0
        if isinstance(m, torch.nn.MultiheadAttention):
            m.dropout = 0.0
        if type(m).__name__.endswith("DropPath") and isinstance(getattr(m, "drop_prob", None), float):
            m.drop_prob = 0.0  # stochastic depth (timm's and transformers' DropPath)


_DROPOUTS = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout")


@contextlib.contextmanager
def functional_dropout_off() -> Iterator[None]:
    """While checking: torch.nn.functional's dropouts are identities and scaled_dot_product_attention runs
    with dropout_p=0, whatever probability a module passes (transformers' attentions keep theirs as plain
    numbers and call these functions, no Dropout module to zero). Restored on exit."""
    torch = require_torch()
    F = torch.nn.functional
    saved = {name: getattr(F, name) for name in (*_DROPOUTS, "scaled_dot_product_attention")}

    def identity(input: Any, *args: Any, **kwargs: Any) -> Any:
        return input

    def sdpa(*args: Any, **kwargs: Any) -> Any:
        if len(args) > 4:
            args = (*args[:4], 0.0, *args[5:])
        else:
            kwargs["dropout_p"] = 0.0
        return saved["scaled_dot_product_attention"](*args, **kwargs)

    try:
        for name in _DROPOUTS:
            setattr(F, name, identity)
        F.scaled_dot_product_attention = sdpa
        yield
    finally:
        for name, fn in saved.items():
            setattr(F, name, fn)


def prepared(module: Any, precision: str) -> Any:
    """A copy of the user's module in the precision's dtype with dropout off (the original is untouched)."""
    m = copy.deepcopy(module)
    m.to(dtype_of(precision))
    zero_dropout(m)
    return m


def batch_to_torch(batch: dict[str, Any], precision: str) -> dict[str, Any]:
    """numpy batch -> torch tensors; floating arrays in the precision's dtype, others as they are."""
    torch = require_torch()
    out = {}
    for k, v in batch.items():
        a = np.asarray(v)
        t = torch.from_numpy(np.array(a))
        out[k] = t.to(dtype_of(precision)) if t.is_floating_point() else t
    return out


def tensors_in(obj: Any) -> list[Any]:
    """The tensors in a module's arguments or outputs, in order (tuples, lists, dicts such as Hugging
    Face's ModelOutput, and dataclasses are looked into)."""
    torch = require_torch()
    out: list[Any] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (tuple, list)):
            for v in x:
                walk(v)

    walk(obj)
    return out


def to_numpy(t: Any) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == require_torch().bfloat16:  # numpy has no bfloat16: float32 holds it exactly
        t = t.float()
    return t.numpy().copy()


def state_dict(module: Any) -> dict[str, np.ndarray]:
    """The module's state_dict as numpy copies."""
    return {k: to_numpy(v) for k, v in module.state_dict().items()}


def load_state_dict(module: Any, values: dict[str, np.ndarray]) -> None:
    """Copy values into the module's tensors (in their dtype); every state_dict key must be given."""
    torch = require_torch()
    current = module.state_dict()
    missing = sorted(set(current) - set(values))
    if missing:
        raise KeyError(f"no values for {missing}")
    with torch.no_grad():
        for k, t in current.items():
            t.copy_(torch.from_numpy(np.array(values[k])).to(t.dtype))
