"""A torch state_dict mapped onto a Flax model's variables, and back.

Each torch module that owns tensors is a *slot* whose tensors, by the module's type, become Flax leaves
with a known layout change:

| torch module                       | torch tensor -> Flax leaf                      | layout                         |
|------------------------------------|------------------------------------------------|--------------------------------|
| Linear (and subclasses)            | weight (out, in) -> kernel (in, out); bias     | transpose                      |
| transformers' Conv1D (GPT-2)       | weight (in, out) -> kernel (in, out); bias     | as is (a Dense port), or       |
|                                    |                                                | transpose (HF's FlaxConv1D)    |
| Conv1d/2d/3d                       | weight (O, I, *k) -> kernel (*k, I, O); bias   | OIHW -> HWIO                   |
| ConvTranspose1d/2d/3d              | weight (I, O, *k) -> kernel                    | (*k, I, O) flipped for Flax's   |
|                                    |                                                | transpose_kernel=False;        |
|                                    |                                                | (*k, O, I) for True            |
| LayerNorm, GroupNorm, RMSNorm      | weight -> scale; bias                          | as is                          |
| BatchNorm*, InstanceNorm*          | weight -> scale; bias; running_mean -> mean,   | as is; num_batches_tracked     |
|                                    | running_var -> var (batch_stats / BatchStat)   | dropped                        |
| Embedding                          | weight -> embedding                            | as is                          |
| MultiheadAttention                 | in_proj_weight/bias -> in_proj kernel/bias;    | transpose                      |
|                                    | out_proj is a Linear                           |                                |
| any other module's own tensors     | weight -> kernel/scale/embedding/weight by     | as is, or transposed where the |
|                                    | name and shape; other names as they are        | shape says so                  |

The Flax leaves are grouped by their module path into slots too. A torch slot and a Flax slot match
when every tensor of one becomes a leaf of the other with the right shape. Matching, in order:
(1) the user's overrides ({flax leaf: torch key, (torch key, layout), or (function of the state_dict, the
torch keys it reads)})
and rename rules ([(regex on torch keys, replacement giving the flax leaf)]); (2) by name: the module
paths agree once separators, case and a leading wrapper (e.g. `transformer.`) are set aside;
(3) by structure: the remaining slots of the same signature pair up in execution order (the forward
hooks' and interceptors' first-call order; a module never called takes its nearest called
ancestor's place). Where a square weight fits a Flax leaf both as is and transposed (a Conv1D, a module of
the user's own) and the Flax module's type does not say (a Flax Dense is (in, out); Hugging Face's
FlaxConv1D is not one), the layout is decided by evidence: the one under which the Flax module, applied alone
to the torch module's captured input, reproduces its captured output; when none or both do, a
MappingError names the tensor and the override that settles it. Tensors sharing storage in torch (tied
weights) map once; a Flax model with a separate leaf for the tied copy gets it too, and the mapping notes
that the port is untied. An unmatched or ambiguous tensor is a MappingError naming it and its candidates.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# ----------------------------------------------------------------------------- layouts


def _conv(w: np.ndarray) -> np.ndarray:  # (O, I, *k) -> (*k, I, O)
    return np.transpose(w, tuple(range(2, w.ndim)) + (1, 0))


def _conv_back(k: np.ndarray) -> np.ndarray:
    n = k.ndim
    return np.transpose(k, (n - 1, n - 2) + tuple(range(n - 2)))


def _flip(k: np.ndarray) -> np.ndarray:
    return k[tuple(slice(None, None, -1) for _ in range(k.ndim - 2)) + (slice(None), slice(None))]


def _conv_t(w: np.ndarray) -> np.ndarray:  # (I, O, *k) -> (*k, I, O), spatially flipped
    return _flip(np.transpose(w, tuple(range(2, w.ndim)) + (0, 1)))


def _conv_t_back(k: np.ndarray) -> np.ndarray:
    n = k.ndim
    return np.transpose(_flip(k), (n - 2, n - 1) + tuple(range(n - 2)))


LAYOUTS: dict[str, tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray]]] = {
    "as is": (lambda w: w, lambda k: k),
    "transpose": (lambda w: w.T, lambda k: k.T),
    "OIHW->HWIO": (_conv, _conv_back),
    "IOHW->HWIO flipped": (_conv_t, _conv_t_back),
}
"""layout name -> (torch -> Flax, Flax -> torch); every pair is an exact permutation (round trip bit for bit)."""


def _shape_after(layout: str, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    if layout == "as is":
        return shape
    if layout == "transpose":
        return shape[::-1] if len(shape) == 2 else None
    if len(shape) < 3:
        return None
    if layout == "OIHW->HWIO":
        return shape[2:] + (shape[1], shape[0])
    return shape[2:] + (shape[0], shape[1])  # IOHW->HWIO flipped


# ----------------------------------------------------------------------------- slots


@dataclass
class TorchTensor:
    key: str  # state_dict key
    shape: tuple[int, ...]
    leaves: tuple[str, ...]  # Flax leaf names it may become, by preference
    layouts: tuple[str, ...]  # layouts it may take, by preference
    kind: str  # "param" | "buffer"


@dataclass
class TorchSlot:
    module: str  # module name ("" the root; "x.in_proj" for a MultiheadAttention's own projection)
    type: str
    tensors: list[TorchTensor]
    order: tuple[int, int] = (0, 0)
    called: bool = False
    alias: bool = False  # every tensor is a tied copy of one in another slot


@dataclass
class FlaxSlot:
    module: str  # module path ("h_0/attn/c_attn"; "" the root)
    leaves: dict[str, tuple[str, tuple[int, ...], str]]  # leaf -> (full name, shape, kind)
    order: tuple[int, int] = (0, 0)
    type: str = ""
    obj: Any = None  # the module (for attributes such as ConvTranspose's transpose_kernel), when seen


@dataclass(frozen=True)
class Entry:
    """One Flax leaf and the torch tensor it comes from."""

    flax: str
    torch: str
    layout: str
    kind: str  # "param" | "buffer"
    how: str  # "name", "order", "override", "rename", "tied"
    torch_module: str = ""
    torch_type: str = ""
    flax_module: str = ""


class MappingError(ValueError):
    """A torch tensor or Flax leaf that does not map (or maps more than one way): names it and the candidates."""


_NORMS = (
    "LayerNorm",
    "GroupNorm",
    "RMSNorm",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "SyncBatchNorm",
    "InstanceNorm1d",
    "InstanceNorm2d",
    "InstanceNorm3d",
    "LocalResponseNorm",
)


def _is(module: Any, *names: str) -> bool:
    return any(c.__name__ in names for c in type(module).__mro__)


def torch_slots(module: Any) -> tuple[list[TorchSlot], dict[str, str], list[str]]:
    """(slots, tied: {alias key: canonical key}, dropped keys) of a torch module's state_dict."""
    from jaxloop.parity.torchside import require_torch

    torch = require_torch()

    torch_sd = module.state_dict(keep_vars=True)
    canonical: dict[Any, str] = {}
    tied: dict[str, str] = {}
    for key, t in torch_sd.items():  # tensors sharing storage: the first key is canonical
        ident = (t.data_ptr(), tuple(t.shape), tuple(t.stride())) if t.numel() else id(t)
        if ident in canonical:
            tied[key] = canonical[ident]
        else:
            canonical[ident] = key
    dropped: list[str] = []
    slots: list[TorchSlot] = []
    for d, (name, mod) in enumerate(module.named_modules(remove_duplicate=False)):
        prefix = name + "." if name else ""
        own = [
            (n, t)
            for n, t in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False))
            if prefix + n in torch_sd
        ]
        by_module: dict[str, list[TorchTensor]] = {}
        for n, t in own:
            key, shape = prefix + n, tuple(t.shape)
            if n == "num_batches_tracked":
                dropped.append(key)
                continue
            sub, leaves, layouts = _rule(mod, n, shape)
            kind = "param" if isinstance(t, torch.nn.Parameter) else "buffer"
            by_module.setdefault(sub, []).append(TorchTensor(key, shape, leaves, layouts, kind))
        for sub, tensors in by_module.items():
            mname = f"{name}.{sub}" if sub and name else (sub or name)
            slots.append(
                TorchSlot(
                    mname,
                    type(mod).__name__ + (f".{sub}" if sub else ""),
                    tensors,
                    (0, d),
                    alias=all(t.key in tied for t in tensors),
                )
            )
    return slots, tied, dropped


def _rule(mod: Any, n: str, shape: tuple[int, ...]) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """(sub-slot name, Flax leaf names, layouts) of the module's own tensor `n` (the table above)."""
    if _is(mod, "MultiheadAttention"):
        m = re.fullmatch(r"(in_proj|q_proj|k_proj|v_proj)_(weight|bias)", n)
        if m:
            weight = m.group(2) == "weight"
            return m.group(1), ("kernel" if weight else "bias",), ("transpose" if weight else "as is",)
        return "", (n,), ("as is",)
    if n == "bias":
        return "", ("bias",), ("as is",)
    if _is(mod, "Linear") and n == "weight":
        return "", ("kernel",), ("transpose",)
    if type(mod).__name__ == "Conv1D" and n == "weight" and hasattr(mod, "nf"):  # transformers' Conv1D: (in, out)
        # a Flax Dense kernel is (in, out) too; Hugging Face's FlaxConv1D keeps (out, in): shape or evidence decides
        return "", ("kernel",), ("as is", "transpose")
    if _is(mod, "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d") and n == "weight":
        return "", ("kernel",), ("IOHW->HWIO flipped", "OIHW->HWIO")
    if _is(mod, "Conv1d", "Conv2d", "Conv3d") and n == "weight":
        return "", ("kernel",), ("OIHW->HWIO",)
    if _is(mod, *_NORMS):
        names = {"weight": ("scale",), "running_mean": ("mean",), "running_var": ("var",)}
        return "", names.get(n, (n,)), ("as is",)
    if _is(mod, "Embedding", "EmbeddingBag") and n == "weight":
        return "", ("embedding",), ("as is",)
    # a module of the user's own: decided by the Flax leaf's name and shape (a square matrix stays ambiguous)
    if n == "weight":
        return "", ("kernel", "scale", "embedding", "weight", "w"), ("as is", "transpose")
    return "", (n, n.lstrip("_")), ("as is", "transpose")


def flax_slots(kinds: dict[str, str], shapes: dict[str, tuple[int, ...]], kind: str) -> list[FlaxSlot]:
    """Flax leaves grouped by module path (Linen names drop their collection)."""
    slots: dict[str, FlaxSlot] = {}
    for name, k in kinds.items():
        parts = name.split("/")
        if kind == "linen":
            parts = parts[1:]
        module, leaf = "/".join(parts[:-1]), parts[-1]
        slot = slots.setdefault(module, FlaxSlot(module, {}))
        slot.leaves[leaf] = (name, shapes[name], k)
    return list(slots.values())


# ----------------------------------------------------------------------------- matching


def _tokens(name: str) -> list[str]:
    return [t for t in re.split(r"[./_\-]+", name.lower()) if t]


Decide = Callable[[TorchSlot, FlaxSlot, list[dict[str, tuple[str, str]]]], int | str]
"""decide(torch slot, Flax slot, candidates [{flax leaf: (torch key, layout)}]) -> the index of the one
candidate under which the Flax module reproduces the torch module's captured output, or why none can be
chosen."""


def _assign(
    t: TorchSlot, f: FlaxSlot, partial: bool = False, decide: Decide | None = None
) -> list[tuple[TorchTensor, str, str]] | None | str:
    """[(tensor, leaf, layout)] when every tensor of t becomes exactly the leaves of f; None when they do
    not fit; a message when they fit more than one way and `decide` cannot choose by evidence. `partial`:
    every leaf of f taken by some tensor of t, tensors of t left over allowed (a module that lost its
    bias in the port)."""
    if len(t.tensors) < len(f.leaves) or (len(t.tensors) != len(f.leaves) and not partial):
        return None
    out = []
    used = set()
    for tt in t.tensors:
        options = []
        for leaf in tt.leaves:
            if leaf not in f.leaves or leaf in used:
                continue
            _, shape, kind = f.leaves[leaf]
            if kind != tt.kind:
                continue
            fits = [lay for lay in tt.layouts if _shape_after(lay, tt.shape) == shape]
            if len(fits) > 1 and "IOHW->HWIO flipped" in fits and f.obj is not None:  # ConvTranspose, I == O
                fits = ["OIHW->HWIO" if getattr(f.obj, "transpose_kernel", False) else "IOHW->HWIO flipped"]
            if fits:
                options.append((leaf, fits))
        if not options:
            if partial:
                continue
            return None
        leaf, fits = options[0]
        used.add(leaf)
        out.append((tt, leaf, fits))
    if len(used) != len(f.leaves) or not out:
        return None
    if _flax_dense(f.obj) and t.type == "Conv1D":  # both (in, out) by definition: nothing to decide
        out = [(tt, leaf, ["as is"] if "as is" in fits else fits) for tt, leaf, fits in out]
    ambiguous = [(tt, leaf, fits) for tt, leaf, fits in out if len(fits) > 1]
    if not ambiguous:
        return [(tt, leaf, fits[0]) for tt, leaf, fits in out]
    import itertools

    combos = list(itertools.product(*[fits for _, _, fits in out]))
    why = "no evidence (the mapping was asked for without a forward pass)"
    if decide is not None:
        got = decide(t, f, [{f.leaves[leaf][0]: (tt.key, lay) for (tt, leaf, _), lay in zip(out, c)} for c in combos])
        if isinstance(got, int):
            return [(tt, leaf, lay) for (tt, leaf, _), lay in zip(out, combos[got])]
        why = got
    tt, leaf, fits = ambiguous[0]
    return (
        f"torch {tt.key} {tt.shape} ({t.type}) fits Flax {f.leaves[leaf][0]} {f.leaves[leaf][1]} in more than one "
        f"layout {fits} and the mapper will not guess: {why}; give the layout in overrides, e.g. "
        f"{{'{f.leaves[leaf][0]}': ('{tt.key}', '{fits[1]}')}}"
    )


def _flax_dense(obj: Any) -> bool:
    """A Flax Dense (Linen nn.Dense, NNX nnx.Linear, or a subclass): its kernel is (in, out) by definition."""
    if obj is None:
        return False
    from flax import linen as nn
    from flax import nnx

    return isinstance(obj, (nn.Dense, nnx.Linear))


@dataclass
class Mapping:
    """Flax leaf <- torch tensor, for every Flax leaf; `to_flax` and `to_torch` apply it both ways."""

    entries: list[Entry]
    tied: dict[str, str]  # torch alias key -> canonical key
    dropped: list[str]  # torch keys nothing maps to by design (num_batches_tracked)
    notes: list[str] = field(default_factory=list)
    custom: dict[str, Callable[[dict[str, np.ndarray]], np.ndarray]] = field(default_factory=dict)
    """Flax leaves filled by a function of the state_dict (overrides); they have no way back."""

    def to_flax(self, state_dict: dict[str, Any]) -> dict[str, np.ndarray]:
        """{flax leaf: array} from a torch state_dict (numpy or torch values)."""
        sd = {k: _np(v) for k, v in state_dict.items()}
        out = {e.flax: LAYOUTS[e.layout][0](sd[e.torch]) for e in self.entries}
        for name, fn in self.custom.items():
            out[name] = np.asarray(fn(sd))
        return out

    def to_torch(self, leaves: dict[str, Any], base: dict[str, Any] | None = None) -> dict[str, np.ndarray]:
        """A torch state_dict from {flax leaf: array}: every mapped tensor and its tied copies; keys nothing
        maps (num_batches_tracked) taken from `base` (the module's own state_dict) when given."""
        if self.custom:
            raise MappingError(f"no way back for Flax leaves filled by a function: {sorted(self.custom)}")
        out = {k: _np(v) for k, v in (base or {}).items()}
        written: set[str] = set()
        for e in self.entries:
            canonical = self.tied.get(e.torch, e.torch)
            if canonical in written:
                continue  # an untied Flax copy of a tied torch tensor: the first leaf is written
            out[canonical] = np.ascontiguousarray(LAYOUTS[e.layout][1](np.asarray(leaves[e.flax])))
            written.add(canonical)
        for alias, canonical in self.tied.items():
            out[alias] = out[canonical]
        return out

    def torch_modules(self) -> dict[str, str]:
        """{flax module path: torch module name} of the mapped slots."""
        return {e.flax_module: e.torch_module for e in self.entries}

    def table(self) -> str:
        """The mapping as a table: one line per Flax leaf, then tied copies and dropped tensors."""
        rows = [("torch", "Flax", "layout", "by")]
        for e in self.entries:
            rows.append((e.torch, e.flax, e.layout, e.how))
        for name in sorted(self.custom):
            rows.append(("(function of the state_dict)", name, "-", "override"))
        for alias, canonical in self.tied.items():
            if not any(e.torch == alias for e in self.entries):
                rows.append((alias, f"= {canonical} (tied)", "-", "tied"))
        for key in self.dropped:
            rows.append((key, "(dropped)", "-", "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines + self.notes)


def _np(v: Any) -> np.ndarray:
    if hasattr(v, "detach"):
        return v.detach().cpu().numpy()
    return np.asarray(v)


Override = str | tuple[str, str] | Callable[[dict[str, np.ndarray]], np.ndarray] | tuple[Callable, str | list[str]]
"""A Flax leaf's source: a torch key (layout from the module's type and the shapes), (key, layout), or a
function of the state_dict (numpy arrays) with the torch keys it consumes: (fn, key or [keys])."""


def map_slots(
    tslots: list[TorchSlot],
    fslots: list[FlaxSlot],
    tied: dict[str, str],
    dropped: list[str],
    overrides: dict[str, Override] | None = None,
    rename: list[tuple[str, str]] | None = None,
    decide: Decide | None = None,
) -> Mapping:
    """The Mapping of torch slots onto Flax slots (module doc); MappingError when incomplete or ambiguous."""
    flax_by_name = {name: (slot, leaf) for slot in fslots for leaf, (name, _, _) in slot.leaves.items()}
    tensor_by_key = {tt.key: (slot, tt) for slot in tslots for tt in slot.tensors}
    entries: dict[str, Entry] = {}
    custom: dict[str, Callable] = {}
    done: set[str] = set()  # canonical keys of the torch tensors mapped (a tied group counts once)
    done_keys: set[str] = set()  # the keys themselves (a tied copy may still map to a leaf of its own)

    def group(key: str) -> str:
        return tied.get(key, key)

    def add(slot: TorchSlot, tt: TorchTensor, fname: str, layout: str, how: str) -> None:
        entries[fname] = Entry(
            fname, tt.key, layout, tt.kind, how, slot.module, slot.type, flax_by_name[fname][0].module
        )
        done.add(group(tt.key))
        done_keys.add(tt.key)

    # (1) overrides and rename rules
    for fname, spec in (overrides or {}).items():
        fname = _flax_name(fname, flax_by_name)
        if callable(spec) or (isinstance(spec, tuple) and callable(spec[0])):
            fn, sources = (
                (spec, []) if callable(spec) else (spec[0], [spec[1]] if isinstance(spec[1], str) else list(spec[1]))
            )
            assert callable(fn), "the branch's condition: spec or spec[0] is callable"
            for key in sources:
                if key not in tensor_by_key:
                    raise MappingError(
                        f"override {fname!r}: torch has no tensor {key!r}; candidates: "
                        f"{_near(key, list(tensor_by_key))}"
                    )
                done.add(group(key))
                done_keys.add(key)
            custom[fname] = fn
            continue
        key, layout = (spec, None) if isinstance(spec, str) else spec
        if not isinstance(key, str):
            raise MappingError(f"override {fname!r}: {spec!r} is none of a torch key, (key, layout), (function, keys)")
        if key not in tensor_by_key:
            raise MappingError(
                f"override {fname!r}: torch has no tensor {key!r}; candidates: {_near(key, list(tensor_by_key))}"
            )
        slot, tt = tensor_by_key[key]
        shape = _flax_shape(fname, flax_by_name)
        layout = layout or _fitting_layout(tt, shape, fname)
        if layout not in LAYOUTS:
            raise MappingError(f"override {fname!r}: layout {layout!r} is not one of {list(LAYOUTS)}")
        if _shape_after(layout, tt.shape) != shape:
            raise MappingError(
                f"override {fname!r} {shape}: {key} {tt.shape} in layout {layout!r} is {_shape_after(layout, tt.shape)}"
            )
        add(slot, tt, fname, layout, "override")
    for pattern, repl in rename or []:
        for key, (slot, tt) in tensor_by_key.items():
            if group(key) in done or not re.fullmatch(pattern, key):
                continue
            fname = _flax_name(re.sub(pattern, repl, key), flax_by_name)
            if fname not in entries:
                add(slot, tt, fname, _fitting_layout(tt, _flax_shape(fname, flax_by_name), fname), "rename")

    # what overrides and rename rules left of each slot is matched as a slot of its own
    import dataclasses

    full_t = {s.module: s for s in tslots}
    order = {f.module: f.order for f in fslots}
    tslots = [dataclasses.replace(s, tensors=[tt for tt in s.tensors if tt.key not in done_keys]) for s in tslots]
    tslots = [s for s in tslots if s.tensors and (s.alias or not all(group(tt.key) in done for tt in s.tensors))]
    fslots = [
        dataclasses.replace(f, leaves={k: v for k, v in f.leaves.items() if v[0] not in entries and v[0] not in custom})
        for f in fslots
    ]
    fslots = [f for f in fslots if f.leaves]

    def open_t(s: TorchSlot) -> bool:
        if s.alias:  # a tied copy: open until it maps to a leaf of its own (an untied port) or is left tied
            return not any(tt.key in done_keys for tt in s.tensors)
        return not any(group(tt.key) in done for tt in s.tensors)

    def open_f(s: FlaxSlot) -> bool:
        return not any(name in entries or name in custom for name, _, _ in s.leaves.values())

    def take(t: TorchSlot, f: FlaxSlot, got: list[tuple[TorchTensor, str, str]], how: str) -> None:
        for tt, leaf, layout in got:
            add(t, tt, f.leaves[leaf][0], layout, how)

    ambiguous: list[str] = []
    # (2) by name; a module's tied copy (e.g. a tied output head) after the others
    for t in sorted(tslots, key=lambda s: s.alias):
        if not open_t(t):
            continue
        named = [f for f in fslots if open_f(f) and _name_match(_tokens(t.module), _tokens(f.module))]
        named = [f for f in named if _tokens(f.module) == _tokens(t.module)] or named
        fits = [(f, a) for f in named if (a := _assign(t, f, decide=decide)) is not None]
        if not fits and len(named) == 1 and isinstance(a := _assign(t, named[0], partial=True, decide=decide), list):
            fits = [
                (named[0], a)
            ]  # a port that dropped a tensor (e.g. the bias): the rest maps, the loss is named below
        if len(fits) == 1:
            f, a = fits[0]
            if isinstance(a, str):
                ambiguous.append(a)
            else:
                take(t, f, a, "name")
    # (3) by structure: the same signature, in execution order
    for t in sorted(tslots, key=lambda s: (s.alias, s.order)):
        if not open_t(t):
            continue
        fits = [
            (f, a)
            for f in sorted(fslots, key=lambda s: s.order)
            if open_f(f) and (a := _assign(t, f, decide=decide)) is not None
        ]
        if not fits:
            continue
        f, a = fits[0]
        if isinstance(a, str):
            ambiguous.append(a)
        elif len(fits) > 1 and not t.alias and not (t.called and f.obj is not None):
            ambiguous.append(
                f"torch {t.module} ({t.type}) fits {len(fits)} Flax modules {[g.module for g, _ in fits]} "
                "and the example batch did not run it, so the execution order cannot choose: map it "
                "in overrides"
            )
        else:
            take(t, f, a, "order")

    # what is left
    problems = list(ambiguous)
    left_t = [tt for s in tslots for tt in s.tensors if group(tt.key) not in done and tt.key not in tied]
    for tt in left_t:
        slot = full_t.get(tensor_by_key[tt.key][0].module, tensor_by_key[tt.key][0])
        problems.append(
            f"torch {tt.key} {tt.shape} ({slot.type}) has no Flax counterpart" + _explain(slot, tt, fslots, entries)
        )
    for f in fslots:
        for name, shape, _ in f.leaves.values():
            if name not in entries and name not in custom:
                problems.append(
                    f"Flax {name} {shape} has no torch counterpart" + _explain_flax(f, name, shape, entries, left_t)
                )
    if problems:
        raise MappingError(
            "the weights do not map:\n  "
            + "\n  ".join(problems)
            + "\n(map them in overrides={flax leaf: torch key} or rename=[(regex on torch keys, flax leaf)])"
        )
    mapping = Mapping(
        sorted(entries.values(), key=lambda e: (order.get(e.flax_module, (0, 0)), e.flax)), tied, dropped, custom=custom
    )
    groups: dict[str, list[str]] = {}
    for e in entries.values():
        groups.setdefault(group(e.torch), []).append(e.flax)
    for canonical, leaves in groups.items():
        if len(leaves) > 1:
            mapping.notes.append(
                f"note: torch ties {sorted(k for k, c in tied.items() if c == canonical)} to {canonical}; "
                f"the Flax model keeps separate leaves {leaves}: their gradients and training differ "
                "from torch's unless the port ties them"
            )
    return mapping


def _flax_shape(fname: str, flax_by_name: dict[str, Any]) -> tuple[int, ...]:
    slot, leaf = flax_by_name[fname]
    return slot.leaves[leaf][1]


def _name_match(t: list[str], f: list[str]) -> bool:
    """The module paths agree, or one ends with the other (a wrapper such as `transformer.` left out) in at
    least two tokens or one word of three letters or more."""
    if not t or not f:
        return t == f
    n = min(len(t), len(f))
    return t[-n:] == f[-n:] and (len(t) == len(f) or n >= 2 or (t[-1].isalpha() and len(t[-1]) >= 3))


def _flax_name(name: str, flax_by_name: dict[str, Any]) -> str:
    if name in flax_by_name:
        return name
    if "params/" + name in flax_by_name:
        return "params/" + name
    raise MappingError(f"the Flax model has no leaf {name!r}; candidates: {_near(name, list(flax_by_name))}")


def _fitting_layout(tt: TorchTensor, shape: tuple[int, ...], fname: str) -> str:
    fits = [lay for lay in tt.layouts if _shape_after(lay, tt.shape) == shape]
    if not fits:
        fits = [lay for lay in LAYOUTS if _shape_after(lay, tt.shape) == shape]
    if not fits:
        raise MappingError(f"{tt.key} {tt.shape} does not fit Flax {fname} {shape} in any layout")
    return fits[0]


def _near(name: str, names: list[str], n: int = 5) -> list[str]:
    import difflib

    return difflib.get_close_matches(name, names, n=n, cutoff=0.3) or names[:n]


def _explain(slot: TorchSlot, tt: TorchTensor, fslots: list[FlaxSlot], entries: dict[str, Entry]) -> str:
    """Why a torch tensor found no Flax leaf: what the Flax module mapped to (or named like) its module
    lacks (e.g. a dropped bias: use_bias=False), or the unmapped Flax leaves of a fitting shape."""
    mapped = {e.flax_module for e in entries.values() if e.torch_module == slot.module}
    same = [f for f in fslots if f.module in mapped] or [
        f for f in fslots if _name_match(_tokens(slot.module), _tokens(f.module))
    ]
    if len(same) == 1:
        f = same[0]
        leaves = {leaf: shape for leaf, (_, shape, _) in f.leaves.items()}
        wanted = next((leaf for leaf in tt.leaves if leaf in leaves), tt.leaves[0])
        where = f"; the Flax module {f.module or '(root)'} it maps to"
        if wanted not in leaves:
            hint = " (built with use_bias=False? the torch module has a bias)" if wanted == "bias" else ""
            return f"{where} has {leaves}, no {wanted}{hint}"
        full, shape = f.leaves[wanted][0], leaves[wanted]
        taken = [e.torch for e in entries.values() if e.flax == full]
        if taken:
            return f"{where} holds {wanted} {shape}, already mapped from torch {taken[0]}"
        given = {lay: _shape_after(lay, tt.shape) for lay in tt.layouts}
        if shape in given.values():
            return (
                f"{where} holds {wanted} {shape}, which it fits, but the module's other tensors do not map "
                "(see the lines above for them)"
            )
        other = [lay for lay in LAYOUTS if _shape_after(lay, tt.shape) == shape]
        fix = (
            f"it becomes {shape} in layout {other[0]!r}: map it with overrides={{'{full}': ('{tt.key}', '{other[0]}')}}"
            if other
            else "no layout gives that shape: the port's module has other sizes"
        )
        return (
            f"{where} holds {wanted} {shape}, which {tt.key} {tt.shape} does not become in the layouts a "
            f"{slot.type} takes ({', '.join(f'{k}: {v}' for k, v in given.items())}); {fix}"
        )
    shapes = {_shape_after(lay, tt.shape) for lay in LAYOUTS} - {None}
    left = [
        (name, shape)
        for f in fslots
        for name, shape, kind in f.leaves.values()
        if name not in entries and kind == tt.kind
    ]
    cands = [name for name, shape in left if shape in shapes]
    if cands:
        return f"; candidates (unmapped Flax leaves of this shape in some layout): {cands[:8]}"
    unmapped = [f"{n} {s}" for n, s in left][:8] or "none"
    return f"; no unmapped Flax leaf has its shape in any layout; unmapped Flax leaves: {unmapped}"


def _explain_flax(
    f: FlaxSlot, name: str, shape: tuple[int, ...], entries: dict[str, Entry], left_t: list[TorchTensor]
) -> str:
    mapped = {e.torch_module for e in entries.values() if e.flax_module == f.module}
    if len(mapped) == 1:
        hint = " (built with bias=False? set use_bias=False in the port)" if name.endswith("bias") else ""
        return f"; the torch module {next(iter(mapped)) or '(root)'} it maps to has no such tensor{hint}"
    cands = [f"{tt.key} {tt.shape}" for tt in left_t if shape in {_shape_after(lay, tt.shape) for lay in LAYOUTS}]
    if cands:
        return f"; candidates (unmapped torch tensors of this shape in some layout): {cands[:8]}"
    return (
        f"; no unmapped torch tensor has its shape in any layout; unmapped torch tensors: "
        f"{[f'{tt.key} {tt.shape}' for tt in left_t][:8] or 'none'}"
    )


# ----------------------------------------------------------------------------- execution order


def _nearest(name: str, seen: dict[str, Any], sep: str) -> str | None:
    """name itself or its nearest ancestor among `seen` ("" the root)."""
    parts = name.split(sep) if name else []
    for n in range(len(parts), -1, -1):
        candidate = sep.join(parts[:n])
        if candidate in seen:
            return candidate
    return None


def set_orders(
    tslots: list[TorchSlot],
    fslots: list[FlaxSlot],
    torch_starts: dict[str, int],
    flax_calls: dict[str, tuple[int, str, Any]],
) -> None:
    """Each slot's place in execution order: its module's first call, or (never called itself) its nearest
    called ancestor's, then definition order. A slot counts as run when it or a non-root ancestor ran.
    flax_calls: module path (or "path:method") -> (start, type name, module object)."""
    for s in tslots:
        anc = _nearest(s.module, torch_starts, ".")
        s.order = ((torch_starts[anc] if anc is not None else 1 << 30), s.order[1])
        s.called = anc is not None and (anc == s.module or anc != "")
    starts: dict[str, int] = {}
    for key, (start, _type_name, _obj) in flax_calls.items():
        name = key.split(":")[0]
        starts[name] = min(start, starts.get(name, start))
    for i, f in enumerate(sorted(fslots, key=lambda s: s.module)):
        anc = _nearest(f.module, starts, "/")
        f.order = ((starts[anc] if anc is not None else 1 << 30), i)
        if f.module in flax_calls:
            f.type, f.obj = flax_calls[f.module][1], flax_calls[f.module][2]
        elif f.module in starts:
            call = next(v for k, v in flax_calls.items() if k.split(":")[0] == f.module)
            f.type, f.obj = call[1], call[2]
