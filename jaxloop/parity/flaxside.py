"""The Flax side of the port check: a Linen or NNX module held as jaxloop holds it (jaxloop.model.interface), its
variables named leaf by leaf, and dropout off in train mode.

Leaf names: Linen variables by collection and path ("params/h_0/attn/c_attn/kernel",
"batch_stats/bn/mean"); NNX state by path ("blocks/0/attn/qkv/kernel", "bn/mean"). Params are what
the optimizer trains; buffers are the other floating variables (BatchNorm's running statistics:
Linen's batch_stats, NNX's BatchStat); NNX's random-number state is neither.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxloop.model.interface import LinenModel, LossFn, NnxModel, is_nnx
from jaxloop.model.precision import Policy, get_policy
from jaxloop.parity.errors import ModelError
from jaxloop.parity.precision import np_dtype


@dataclass(frozen=True)
class FlaxModel:
    """A Flax module with its variables: params and model_state as jaxloop's TrainState holds them."""

    kind: str  # "linen" or "nnx"
    adapter: LinenModel | NnxModel
    params: Any
    model_state: Any

    def leaves(self) -> dict[str, np.ndarray]:
        """{leaf name: array} of every param and buffer."""
        return {name: np.asarray(leaf) for name, (leaf, _) in _named(self).items()}

    def kinds(self) -> dict[str, str]:
        """{leaf name: "param" | "buffer"}."""
        return {name: kind for name, (_, kind) in _named(self).items()}

    def with_leaves(self, values: dict[str, Any], precision: str) -> FlaxModel:
        """These variables with the named leaves replaced; every floating leaf in the precision's dtype."""
        dtype = np_dtype(precision)

        def put(tree: Any, prefix: str) -> Any:
            def leaf(path: Any, x: Any) -> Any:
                name = _name(prefix, path)
                x = values[name] if name in values else x
                if np.issubdtype(np.asarray(x).dtype, np.floating):
                    return jax.device_put(np.asarray(x, dtype))  # a transfer: jnp.asarray compiles per shape
                return x

            return jax.tree_util.tree_map_with_path(leaf, tree)

        params_prefix = "params" if self.kind == "linen" else ""
        return replace(self, params=put(self.params, params_prefix), model_state=put(self.model_state, ""))

    def bind(self, train: bool, precision: str) -> tuple[Callable[..., Any], Callable[[], Any]]:
        """(the model a loss calls, the model_state after the call): jaxloop.model.interface's bind."""
        return self.adapter.bind(self.params, self.model_state, train, jax.random.PRNGKey(0), policy(precision))

    def user_model(self) -> Any:
        """What the user's loss expects (Linen variables or the NNX module), via jaxloop.model.interface's merge."""
        return self.adapter.merge(self.params, self.model_state)


def policy(precision: str) -> Policy:
    return get_policy(precision)


def pin_dtype(module: Any, precision: str) -> tuple[Any, str | None]:
    """(the module computing in the checked precision, a note) when its own `dtype` field computes below it
    (Hugging Face's Flax modules default to dtype=jnp.float32 and pass it to every submodule; a bf16
    choice is mixed precision, not the port): a Linen clone, or the attribute set on an NNX copy.
    Layers with a dtype of their own are left alone (the check names them at the first divergence)."""
    want = np.dtype(np_dtype(precision))
    dtype = getattr(module, "dtype", None)
    try:
        have = np.dtype(dtype) if dtype is not None else None
    except TypeError:
        return module, None
    if have is None or not np.issubdtype(have, np.floating) or have.itemsize >= want.itemsize:
        return module, None
    hf_default = " (Hugging Face default)" if have == np.float32 else ""
    note = (
        f"{type(module).__name__} computes in {have} (its dtype field{hf_default}); "
        f"pinned to dtype={want} for the {precision} check: the check compares the port, not a precision choice"
    )
    if is_nnx(module):
        from flax import nnx

        module = nnx.merge(*nnx.split(module))
        module.dtype = want.type
        return module, note
    return module.clone(dtype=want.type), note


def flax_model(module: Any, loss: LossFn, batch: dict[str, Any]) -> FlaxModel:
    """Linen: the variables' structure from one (abstract) call of the loss on the batch, as jaxloop's
    LinenModel.init makes them, filled with zeros; NNX: the module split as jaxloop splits it."""
    if is_nnx(module):
        from flax import nnx

        module = nnx.merge(*nnx.split(module))  # a copy: the user's module is left as it is
        for _, m in nnx.iter_modules(module):
            if isinstance(m, nnx.Dropout):
                m.rate = 0.0  # an identity in train mode too (module.train() resets `deterministic`, not the rate)
        adapter, params, model_state = NnxModel.split(module)
        return FlaxModel("nnx", adapter, params, model_state)
    from flax import linen as nn

    adapter = LinenModel(module=module)
    stack: list[Any] = []

    def track(next_fun: Callable, args: tuple, kwargs: dict, context: Any) -> Any:
        stack.append(context.module)
        out = next_fun(*args, **kwargs)
        stack.pop()
        return out

    # Shapes only (jax.eval_shape: nothing compiled): every leaf gets the torch module's values anyway.
    try:
        with nn.intercept_methods(track):
            shapes = jax.eval_shape(lambda key: adapter.init(key, no_dropout(loss), batch), jax.random.PRNGKey(0))
    except Exception as e:
        top = stack[-1] if stack else None
        raise ModelError(
            "Flax",
            "/".join(map(str, top.path)) if top is not None and top.scope else "",
            type(top).__name__ if top is not None else "",
            e,
        ) from e
    params, model_state = jax.tree.map(_zeros, shapes)
    return FlaxModel("linen", adapter, params, model_state)


def _zeros(s: jax.ShapeDtypeStruct) -> jax.Array:
    """Zeros of a leaf's shape and dtype, made on the host and transferred (jnp.zeros compiles one program per
    shape); an extended dtype (a PRNG key) has no numpy zeros and takes jnp.zeros."""
    if jnp.issubdtype(s.dtype, jax.dtypes.extended):
        return jnp.zeros(s.shape, s.dtype)
    return jax.device_put(np.zeros(s.shape, s.dtype))


def batch_to_jax(batch: dict[str, Any], precision: str) -> dict[str, jax.Array]:
    """numpy batch -> jax arrays; floating arrays in the precision's dtype, others as jax makes them."""
    dtype = np_dtype(precision)
    return {
        k: jax.device_put(np.asarray(v, dtype) if np.issubdtype(np.asarray(v).dtype, np.floating) else np.asarray(v))
        for k, v in batch.items()
    }


def is_dropout(module: Any) -> bool:
    """A Linen module that drops at random in training: nn.Dropout, or a stochastic-depth module (a class
    named *DropPath, as Hugging Face's BEiT's: its first argument is returned, the identity it is in eval
    mode)."""
    from flax import linen as nn

    return isinstance(module, nn.Dropout) or type(module).__name__.endswith("DropPath")


def no_dropout(loss: LossFn) -> LossFn:
    """The loss with every Linen nn.Dropout (and DropPath: `is_dropout`) an identity, in train mode too (its
    calls intercepted; this acts while tracing, so under jit too). NNX models get their nnx.Dropout rates set
    to 0 in flax_model."""
    from flax import linen as nn

    def identity_dropout(next_fun: Callable, args: tuple, kwargs: dict, context: Any) -> Any:
        if is_dropout(context.module) and context.method_name == "__call__":
            return args[0] if args else kwargs["inputs"]
        return next_fun(*args, **kwargs)

    def loss_without_dropout(model: Any, batch: dict[str, Any], train: bool) -> Any:
        with nn.intercept_methods(identity_dropout):
            return loss(model, batch, train)

    return loss_without_dropout


@contextlib.contextmanager
def attention_dropout_off() -> Iterator[None]:
    """While checking: Flax's functional attention dropout off. `dot_product_attention_weights` (Linen's and
    NNX's) draws its own dropout mask from `dropout_rate` and `deterministic` (Hugging Face's Flax
    attentions call it directly; no nn.Dropout module to intercept): every reference to it in a loaded
    module is replaced by one that forces dropout_rate=0 and deterministic=True. Restored on exit."""
    import flax.linen.attention as linen_attention

    originals: list[Callable[..., Any]] = [linen_attention.dot_product_attention_weights]
    try:
        import flax.nnx.nn.attention as nnx_attention

        originals.append(nnx_attention.dot_product_attention_weights)
    except ImportError:  # pragma: no cover - flax always has nnx from 0.8 on
        pass
    patched: list[tuple[Any, str, Any]] = []

    def without_dropout(original: Callable) -> Callable:
        signature = inspect.signature(original)

        def weights(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.arguments["dropout_rate"] = 0.0
            bound.arguments["deterministic"] = True
            return original(*bound.args, **bound.kwargs)

        return weights

    replacement = {id(f): without_dropout(f) for f in originals}
    try:
        for module in list(sys.modules.values()):
            try:
                items = list(vars(module).items())
            except TypeError:
                continue
            for name, value in items:
                if id(value) in replacement and any(value is f for f in originals):
                    patched.append((module, name, value))
                    setattr(module, name, replacement[id(value)])
        yield
    finally:
        for module, name, value in reversed(patched):
            setattr(module, name, value)


# ----------------------------------------------------------------------------- naming


def _key(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _name(prefix: str, path: Any) -> str:
    parts = [_key(k) for k in path]
    if parts and parts[-1] == "value" and type(path[-1]).__name__ == "GetAttrKey":  # an NNX Variable's value
        parts = parts[:-1]
    return "/".join([prefix, *parts] if prefix else parts)


def _named(fm: FlaxModel) -> dict[str, tuple[Any, str]]:
    out: dict[str, tuple[Any, str]] = {}
    params_prefix = "params" if fm.kind == "linen" else ""
    for path, leaf in jax.tree_util.tree_flatten_with_path(fm.params)[0]:
        out[_name(params_prefix, path)] = (leaf, "param")
    skip = _rng_paths(fm)
    for path, leaf in jax.tree_util.tree_flatten_with_path(fm.model_state)[0]:
        name = _name("", path)
        if name not in skip and np.issubdtype(np.asarray(leaf).dtype, np.floating):
            out[name] = (leaf, "buffer")
    return out


def _rng_paths(fm: FlaxModel) -> set[str]:
    """Names of an NNX model_state's random-number state (nnx.Rngs keys and counters)."""
    if fm.kind != "nnx":
        return set()
    from flax import nnx

    out = set()
    leaves = jax.tree_util.tree_flatten_with_path(fm.model_state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    for path, var in leaves:
        if isinstance(var, nnx.RngState):
            out.add(_name("", path))
    return out
