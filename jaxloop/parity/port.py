"""What the port check compares: a PyTorch module, its Flax translation, an example batch and the two losses."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

Batch = dict[str, Any]


@dataclass
class Port:
    """A researcher's port: what `compare` takes and what a factory for `python -m jaxloop.parity` returns.

    torch_loss(module, batch) -> scalar tensor; flax_loss(model, batch, train) -> (scalar, aux dict), the
    jaxloop convention (the model a Linen or NNX loss receives: jaxloop.model.interface). The batch is a dict of
    numpy arrays given to both losses (floating arrays in the checked precision): a loss feeds its model
    in its own layout (e.g. NCHW -> NHWC for a Flax CNN). `batches(i)` (or a sequence) gives the
    trajectory's batch i; the example batch is used for every update when it is None.
    """

    torch_module: Any
    flax_module: Any
    batch: Batch
    torch_loss: Callable[[Any, Batch], Any]
    flax_loss: Callable[[Any, Batch, bool], Any]
    batches: Callable[[int], Batch] | Sequence[Batch] | None = None
    overrides: dict[str, Any] | None = None
    rename: list[tuple[str, str]] | None = None
    name: str = ""


def torch_output_loss(module: Any, batch: Batch) -> Any:
    """The default torch loss: 0.5 mean(module(batch["x"])^2) of its first floating output."""
    from jaxloop.parity.torchside import tensors_in

    out = [t for t in tensors_in(module(batch["x"])) if t.is_floating_point()][0]
    return 0.5 * (out**2).mean()


def flax_output_loss(model: Any, batch: Batch, train: bool) -> Any:
    """The default Flax loss, as torch_output_loss: 0.5 mean(model(batch["x"])^2) of its first floating output."""
    import jax
    import jax.numpy as jnp

    out = [x for x in jax.tree.leaves(model(batch["x"])) if jnp.issubdtype(x.dtype, jnp.floating)][0]
    return 0.5 * jnp.mean(out**2), {}
