"""Every module's first call seen on both sides, the module pairs, and where the outputs first diverge.

Capture: torch forward pre-hooks and hooks on every submodule; Linen `nn.intercept_methods` (every
module method but setup and private ones); NNX by wrapping `__call__` of the module classes found in
the model's graph while the loss runs (restored after). Each module's first call keeps its first
tensor argument (the input), the first floating tensor of its output, the module object (for its
attributes), and its start and end in execution order. A module that raises is named (ModelError).
The Flax side is one jit-compiled call: the records are made while tracing, the tensors returned.

Pairs: modules that own weights pair as the weight mapping paired them; a container (a block, an
attention module, the root) pairs with the Flax module holding exactly the images of its weights;
where several nested modules hold the same weights (a stage of one layer), the inner ones pair first
and the output shapes must agree. Activations are compared in torch's layout; a Flax output in
channels-last layout (NHWC for NCHW) is moved back first.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxloop.parity.errors import ModelError
from jaxloop.parity.flaxside import FlaxModel, batch_to_jax
from jaxloop.parity.measures import rel_diff
from jaxloop.parity.torchside import batch_to_torch, require_torch, tensors_in, to_numpy
from jaxloop.parity.weights import Mapping


@dataclass
class ModuleCall:
    """What a module's first call took and gave (its input, output, order), for the layer-by-layer diff."""

    name: str  # torch: "transformer.h.0.attn"; Flax: "h_0/attn"; "" the root
    type: str
    start: int
    end: int = -1  # completion order (-1: did not complete)
    input: np.ndarray | None = None
    output: np.ndarray | None = None
    output_dtype: str = ""
    module: Any = None
    calls: int = 1


@dataclass
class Capture:
    side: str
    calls: dict[str, ModuleCall]
    loss: float
    state: Any = None  # torch: the module's state_dict after the call; Flax: the model_state after it

    def order(self) -> dict[str, int]:
        return {name: c.start for name, c in self.calls.items()}


def _first_float(tensors: list[Any]) -> Any:
    return next((t for t in tensors if t.is_floating_point()), None)


# ----------------------------------------------------------------------------- torch


def capture_torch(
    module: Any, loss: Callable[[Any, dict], Any], batch: dict[str, Any], train: bool, precision: str
) -> Capture:
    """Run the torch loss once (no gradients), recording every module's first call."""
    torch = require_torch()
    names = {id(m): n for n, m in module.named_modules()}
    calls: dict[str, ModuleCall] = {}
    stack: list[str] = []
    counter = {"start": 0, "end": 0}

    def pre(mod: Any, args: tuple, kwargs: dict) -> None:
        name = names.get(id(mod))
        if name is None:
            return
        stack.append(name)
        if name in calls:
            calls[name].calls += 1
            return
        first = tensors_in((args, kwargs))
        calls[name] = ModuleCall(
            name, type(mod).__name__, counter["start"], input=to_numpy(first[0]) if first else None, module=mod
        )
        counter["start"] += 1

    def post(mod: Any, args: tuple, kwargs: dict, out: Any) -> None:
        name = names.get(id(mod))
        if name is None:
            return
        stack.pop()
        c = calls[name]
        if c.end < 0:
            c.end = counter["end"]
            counter["end"] += 1
            t = _first_float(tensors_in(out))
            if t is not None:
                c.output, c.output_dtype = to_numpy(t), str(t.dtype).replace("torch.", "")

    handles = []
    for m in module.modules():
        handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(m.register_forward_hook(post, with_kwargs=True))
    module.train(train)
    try:
        with torch.no_grad():
            value = loss(module, batch_to_torch(batch, precision))
    except Exception as e:
        raise ModelError("torch", stack[-1] if stack else "", calls[stack[-1]].type if stack else "", e) from e
    finally:
        for h in handles:
            h.remove()
    return Capture("torch", calls, float(value), {k: to_numpy(v) for k, v in module.state_dict().items()})


# ----------------------------------------------------------------------------- flax


def capture_flax(
    fm: FlaxModel,
    loss: Callable[..., Any],
    batch: dict[str, Any],
    train: bool,
    precision: str,
    trace_only: bool = False,
) -> Capture:
    """Run the Flax loss once (one jit-compiled call), recording every module's first call; dropout is an
    identity. The records are taken while tracing and the tensors come back as the call's outputs.
    trace_only: only trace (jax.eval_shape: nothing compiled or run): the calls, their order and
    modules, no tensors."""
    calls: dict[str, ModuleCall] = {}
    stack: list[str] = []
    counter = {"start": 0, "end": 0}
    values: dict[str, tuple[Any, Any]] = {}

    def enter(name: str, type_name: str, obj: Any, args: tuple, kwargs: dict) -> None:
        stack.append(name)
        if name in calls:
            calls[name].calls += 1
            return
        first = [x for x in jax.tree.leaves((args, kwargs)) if hasattr(x, "dtype") and hasattr(x, "shape")]
        calls[name] = ModuleCall(name, type_name, counter["start"], module=obj)
        values[name] = (first[0] if first else None, None)
        counter["start"] += 1

    def leave(name: str, out: Any) -> None:
        stack.pop()
        c = calls[name]
        if c.end < 0:
            c.end = counter["end"]
            counter["end"] += 1
            floats = [x for x in jax.tree.leaves(out) if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)]
            if floats:
                values[name] = (values[name][0], floats[0])
                c.output_dtype = str(floats[0].dtype)

    def run(params: Any, model_state: Any, jbatch: dict) -> tuple[Any, Any, dict]:
        if fm.kind == "linen":
            value, state = _run_linen(fm, params, model_state, loss, jbatch, train, precision, enter, leave)
        else:
            value, state = _run_nnx(fm, params, model_state, loss, jbatch, train, enter, leave)
        return value, state, values

    jbatch = batch_to_jax(batch, precision)
    try:
        if trace_only:
            jax.eval_shape(run, fm.params, fm.model_state, jbatch)
            value, state, got = math.nan, None, {}
        else:
            value, state, got = jax.jit(run)(fm.params, fm.model_state, jbatch)
    except Exception as e:
        top = calls.get(stack[-1]) if stack else None
        raise ModelError("Flax", top.name if top else "", top.type if top else "", e) from e
    for name, (x, y) in got.items():
        calls[name].input = None if x is None else np.asarray(x)
        calls[name].output = None if y is None else np.asarray(y)
    return Capture("flax", calls, float(value), state)


def _run_linen(
    fm: FlaxModel,
    params: Any,
    model_state: Any,
    loss: Callable,
    batch: dict,
    train: bool,
    precision: str,
    enter: Callable,
    leave: Callable,
) -> tuple[Any, Any]:
    from flax import linen as nn

    from jaxloop.parity.flaxside import is_dropout, policy

    def interceptor(next_fun: Callable, args: tuple, kwargs: dict, context: Any) -> Any:
        method = context.method_name
        if method == "setup" or (method.startswith("_") and method != "__call__"):
            return next_fun(*args, **kwargs)
        mod = context.module
        name = "/".join(str(p) for p in mod.path)
        key = name if method == "__call__" else f"{name}:{method}"
        enter(key, type(mod).__name__, mod, args, kwargs)
        if is_dropout(mod) and method == "__call__":
            out = args[0] if args else kwargs["inputs"]
        else:
            out = next_fun(*args, **kwargs)
        leave(key, out)
        return out

    model, new_state = fm.adapter.bind(params, model_state, train, jax.random.PRNGKey(0), policy(precision))
    with nn.intercept_methods(interceptor):
        value, _ = loss(model, batch, train)
    return value, new_state()


def _run_nnx(
    fm: FlaxModel,
    params: Any,
    model_state: Any,
    loss: Callable,
    batch: dict,
    train: bool,
    enter: Callable,
    leave: Callable,
) -> tuple[Any, Any]:
    from flax import nnx

    from jaxloop.model.interface import NnxModel

    module = fm.adapter.merge(params, model_state)
    module.train() if train else module.eval()
    names: dict[int, str] = {}
    classes: set[type] = set()
    for path, m in nnx.iter_modules(module):
        names.setdefault(id(m), "/".join(str(p) for p in path))
        classes.add(type(m))
    active: list[int] = []
    patched: list[tuple[type, Any]] = []

    def wrap(original: Callable) -> Callable:
        def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
            ident = id(self)
            if ident not in names or (active and active[-1] == ident):  # super().__call__ of the same object
                return original(self, *args, **kwargs)
            active.append(ident)
            enter(names[ident], type(self).__name__, self, args, kwargs)
            try:
                out = original(self, *args, **kwargs)
            finally:
                active.pop()
            leave(names[ident], out)
            return out

        return __call__

    for cls in classes:
        if any("__call__" in k.__dict__ for k in cls.__mro__[:-1]):
            patched.append((cls, cls.__dict__.get("__call__")))
            cls.__call__ = wrap(cls.__call__)
    try:
        value, _ = loss(module, batch, train)
    finally:
        for cls, original in reversed(patched):
            if original is None:
                delattr(cls, "__call__")
            else:
                cls.__call__ = original
    return value, NnxModel.split(module)[2]


# ----------------------------------------------------------------------------- pairs


def align(t: np.ndarray | None, f: np.ndarray | None) -> tuple[np.ndarray, np.ndarray] | None:
    """(torch array, Flax array in torch's layout), or None when the shapes cannot correspond. A Flax
    channels-last array is moved back to channels-first; where both readings fit (equal sizes) the one
    closer to torch's is taken."""
    if t is None or f is None:
        return None
    options = []
    if t.shape == f.shape:
        options.append(f)
    if f.ndim >= 3:
        moved = np.moveaxis(f, -1, 1)
        if moved.shape == t.shape:
            options.append(moved)
    if not options:
        return None
    if len(options) == 1:
        return t, options[0]
    return t, min(options, key=lambda o: difference(t, o))


def difference(a: np.ndarray, b: np.ndarray) -> float:
    """How far the Flax value b is from the torch value a: rel_diff(b, a) (inf for NaN; exact equality for
    integer tensors)."""

    def numeric(x: np.ndarray) -> bool:
        return np.issubdtype(x.dtype, np.number) or jnp.issubdtype(x.dtype, jnp.floating)  # bfloat16 too

    if not (numeric(a) and numeric(b)):
        return 0.0 if np.array_equal(a, b) else math.inf
    r = rel_diff(b, a)
    return math.inf if math.isnan(r) else r


@dataclass
class LayerDiff:
    """One module pair: the relative difference of its output and of its input (Flax against torch)."""

    torch: str
    flax: str
    torch_type: str
    flax_type: str
    end: int  # torch completion order
    start: int
    out_diff: float
    in_diff: float | None  # None: no input tensor to compare
    note: str = ""


def pair_modules(mapping: Mapping, tcap: Capture, fcap: Capture) -> list[tuple[str, str]]:
    """(torch module, Flax module) pairs of modules seen on both sides (module doc)."""
    slot_pairs = sorted({(e.torch_module, e.flax_module) for e in mapping.entries})

    def under_t(name: str, module: str) -> bool:
        return name == "" or module == name or module.startswith(name + ".")

    def under_f(name: str, module: str) -> bool:
        return name == "" or module == name or module.startswith(name + "/")

    groups: dict[frozenset, tuple[list[str], list[str]]] = {}
    for name in tcap.calls:
        s = frozenset(i for i, (t, _) in enumerate(slot_pairs) if under_t(name, t))
        if s:
            groups.setdefault(s, ([], []))[0].append(name)
    for name in fcap.calls:
        if ":" in name:
            continue
        s = frozenset(i for i, (_, f) in enumerate(slot_pairs) if under_f(name, f))
        if s and s in groups:
            groups[s][1].append(name)
    pairs = []
    for tnames, fnames in groups.values():
        # nested modules holding the same weights: those whose names agree pair; then a last one on each side
        fits = lambda t, f: (
            align(tcap.calls[t].output, fcap.calls[f].output) is not None  # noqa: E731
            or tcap.calls[t].output is None
        )
        tleft, fleft = list(tnames), list(fnames)
        if len(tleft) > 1 or len(fleft) > 1:
            for t in list(tleft):
                named = [f for f in fleft if _same_name(t, f) and fits(t, f)]
                if len(named) == 1:
                    pairs.append((t, named[0]))
                    tleft.remove(t)
                    fleft.remove(named[0])
        if len(tleft) == 1 and len(fleft) == 1 and fits(tleft[0], fleft[0]):
            pairs.append((tleft[0], fleft[0]))
    return sorted(pairs, key=lambda p: tcap.calls[p[0]].end)


def _same_name(t: str, f: str) -> bool:
    from jaxloop.parity.weights import _name_match, _tokens

    return _name_match(_tokens(t), _tokens(f))


def compare_layers(pairs: list[tuple[str, str]], tcap: Capture, fcap: Capture) -> list[LayerDiff]:
    """The relative difference of every pair's output and input, in torch's completion order."""
    out = []
    for t, f in pairs:
        tc, fc = tcap.calls[t], fcap.calls[f]
        note = ""
        both = align(tc.output, fc.output)
        if both is None:
            out_diff = math.inf
            note = (
                f"output shapes differ: torch {None if tc.output is None else tc.output.shape}, "
                f"Flax {None if fc.output is None else fc.output.shape}"
            )
        else:
            out_diff = difference(*both)
        ins = align(tc.input, fc.input)
        in_diff = None if ins is None else difference(*ins)
        out.append(LayerDiff(t, f, tc.type, fc.type, tc.end, tc.start, out_diff, in_diff, note))
    return out


@dataclass
class Divergence:
    """The first pair whose output differs beyond tolerance, and whether its input was already off."""

    layer: LayerDiff
    tolerance: float
    clean_input: bool
    previous: LayerDiff | None  # the last pair with a clean output that completed before this one started
    region: str  # torch module enclosing both (the code between them is where it diverged)
    diagnoses: list[str] = field(default_factory=list)

    def describe(self) -> str:
        L = self.layer
        head = (
            f"first divergence: torch {L.torch or '(root)'} ({L.torch_type}) / Flax {L.flax or '(root)'} "
            f"({L.flax_type}): output differs by {L.out_diff:.2e} (tolerance {self.tolerance:.0e})"
        )
        if L.note:
            head += f"; {L.note}"
        if self.clean_input:
            where = (
                "its input agrees"
                + (f" ({L.in_diff:.1e})" if L.in_diff is not None else "")
                + ": this layer computes differently"
            )
        else:
            prev = (
                f"the output of {self.previous.torch} / {self.previous.flax} agrees ({self.previous.out_diff:.1e})"
                if self.previous
                else "the model's input agrees"
            )
            where = (
                f"its input already differs ({L.in_diff:.1e}) while {prev}: the difference arises in the "
                f"code between them, inside {self.region or '(root)'} (not a module of its own)"
            )
        return "\n".join([head, "  " + where] + [f"  diagnosis: {d}" for d in self.diagnoses])


def first_divergence(diffs: list[LayerDiff], tolerance: float) -> Divergence | None:
    """The first pair (in completion order) whose output differs beyond tolerance (NaN counts), or None."""

    def bad(x: float | None) -> bool:
        return x is not None and not (x <= tolerance)

    for i, d in enumerate(diffs):
        if not bad(d.out_diff):
            continue
        clean = not bad(d.in_diff)
        previous = None
        for p in diffs[:i]:
            if not bad(p.out_diff) and _completed_before_start(p, d):
                previous = p
        region = _common(previous.torch, d.torch) if previous else ""
        return Divergence(d, tolerance, clean, previous, region)
    return None


def _completed_before_start(p: LayerDiff, d: LayerDiff) -> bool:
    """p finished before d began: p is not d's ancestor (d's ancestors complete after it) and p started first."""
    is_ancestor = p.torch == "" or d.torch.startswith(p.torch + ".")
    return p.start < d.start and not is_ancestor


def _common(a: str, b: str) -> str:
    pa, pb = a.split("."), b.split(".")
    n = 0
    while n < min(len(pa), len(pb)) and pa[n] == pb[n]:
        n += 1
    return ".".join(pa[:n])
