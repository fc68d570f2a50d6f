"""Compiled calls kept on disk under a key computed before tracing: a restart skips trace and lowering too.

JAX's persistent compilation cache (jaxloop.loop.compilation) keys an executable by its HLO, so every run
still traces and lowers its steps in Python before the cache can answer: for the shakespeare GPT's
update that is about 1 s of the 1.4 s a second run spends on it. For the built-in tasks, whose whole
computation follows from the config and jaxloop's own sources, the loop can key the executable by
those instead, and load it without tracing (jax.experimental.serialize_executable, what MaxText does
with an ahead-of-time compiled train step):

    compiled = compile_cached(jax.jit(step, donate_argnums=0), (state, batch), directory, context)

The key covers what a built-in task's compiled code depends on: jaxloop's and jaxloop.core's source files
as the process loaded them, the function's module and name, the context (the config's fields that
enter the computation, and which call it is), each argument's path, type (shape, dtype, weak type)
and sharding with its devices, the jax, jaxlib, flax, optax and numpy versions, the backend, devices
and host CPU, XLA flags and jax's configuration. A user's own model or loss is code outside those
sources, so the loop only uses this for the built-in tasks (a user task goes through JAX's cache).
An entry is data: a format line, the output structure as JSON, and jax's serialized executable, read
through an unpickler that may name only jax's classes and dtypes (_DataOnlyUnpickler), so a planted
pickle payload is refused, not run. The compiled code itself is machine code: the directory is trusted
like the code a run imports (docs/speed.md). An entry that cannot be read is compiled afresh and replaced;
one that loads but fails on its first run is deleted, with the error (LoadedCall); one that cannot be
written (outputs whose structure plain containers do not describe, say) is simply not stored. Only fresh
compiles are stored: where JAX's persistent cache answers a miss, the call is compiled once more without
it (see _persistent_cache_off).
The directory is kept under MAX_BYTES: each store deletes the least recently used entries beyond it
(a load marks its entry used), as JAX's cache does with jax_compilation_cache_max_size.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import json
import logging
import os
import pickle
import platform
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
from jax.experimental import serialize_executable

log = logging.getLogger(__name__)

FORMAT = "jaxloop-executable-3"  # 3: no pickle around the entry (2 pickled it whole)
SOURCE_PACKAGES = ("jaxloop",)  # jaxloop.core included
STATE = "<args[0]>"  # stands for the first argument's tree in a stored output structure
# An option set to its default value: the same code, but another key for jit's in-process compile cache,
# which would otherwise hand back the executable JAX loaded from its persistent cache.
RECOMPILE = {"xla_embed_ir_in_executable": False}
COMPILING = threading.Lock()  # one miss at a time: the switch of JAX's cache is process-wide
MAX_BYTES = 1 << 30
"""Default bound of a directory's entries: 0.2-2 MB a compiled call here, so hundreds of configs or
source versions, before the least recently used are deleted."""


def _source_digest(packages: tuple[str, ...]) -> str | None:
    """sha256 over the .py files of `packages` (the code every built-in step is traced from); None where a
    package has none to read (a zip or .pyc-only install), which the key could not then see."""
    h = hashlib.sha256()
    for package in packages:
        root = Path(importlib.import_module(package).__file__).parent
        files = sorted(root.rglob("*.py"))
        if not files:
            return None
        for path in files:
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _cpu() -> str:
    """The host CPU's model and instruction-set flags: XLA:CPU compiles for the CPU it runs on."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features"))]
        return "".join(dict.fromkeys(lines))
    except OSError:
        return platform.processor()


# The sources as this process loaded them (read when jaxloop is imported): a file edited while a run
# goes on must not key the code traced from its former text. The host's CPU, read once too.
LOADED_SOURCES = _source_digest(SOURCE_PACKAGES)
HOST = [platform.machine(), _cpu()]


def _leaf_key(path: Any, leaf: Any) -> list[str]:
    sharding = getattr(leaf, "sharding", None)
    devices = getattr(sharding, "_device_assignment", None)
    return [jax.tree_util.keystr(path), str(jax.typeof(leaf)), repr(sharding),
            repr([d.id for d in devices] if devices is not None else None)]


def fingerprint(context: Any, args: tuple, function: Any = None) -> str:
    """The key of `function` (a jitted callable; its module and name) compiled for `args` (arrays or
    ShapeDtypeStructs) under `context` (JSON-able: what else the traced code depends on, its jit options
    included). Raises where the sources could not be read (LOADED_SOURCES is None)."""
    if LOADED_SOURCES is None:
        raise RuntimeError("jaxloop's sources could not be read, so no key can cover them")
    import flax
    import jaxlib
    import numpy
    import optax

    devices = jax.devices()
    wrapped = getattr(function, "__wrapped__", function)
    parts = {
        "format": FORMAT,
        "versions": [m.__version__ for m in (jax, jaxlib, flax, optax, numpy)],
        "python": sys.version,
        "backend": [jax.default_backend(), devices[0].client.platform_version, devices[0].device_kind,
                    len(devices), jax.process_count(), jax.process_index(), *HOST],
        "env": [os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", ""),
                [a for a in sys.argv if a.startswith("--xla")]],
        "jax_config": sorted((k, repr(v)) for k, v in jax.config.values.items()
                             if not any(word in k for word in ("cache", "log_compiles", "explain"))),
        "sources": LOADED_SOURCES,
        "function": [getattr(wrapped, "__module__", None), getattr(wrapped, "__qualname__", None)],
        "context": context,
        "args": [_leaf_key(p, x) for p, x in jax.tree_util.tree_flatten_with_path(args)[0]],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()


def _stored_outputs(out_tree: Any, args: tuple) -> Any:
    """The output structure as JSON-able data (_encode): STATE where the output holds the first argument's tree (a
    TrainState carries its optimizer's functions, which no data format holds); None where plain containers
    (tuple, list, dict with string keys, None) and leaves do not describe it."""
    placeholder = jax.tree.unflatten(out_tree, [0] * out_tree.num_leaves)
    state = jax.tree.structure(args[0])
    try:
        if isinstance(placeholder, tuple) and not hasattr(placeholder, "_fields"):
            stored = {"tuple": [STATE if jax.tree.structure(p) == state else _encode(p) for p in placeholder]}
        else:
            stored = _encode(placeholder)
        if _output_tree(json.loads(json.dumps(stored)), args) == out_tree:
            return stored
    except (TypeError, ValueError, KeyError):
        pass
    return None


def _encode(tree: Any) -> Any:
    """A pytree of plain containers as JSON data: {"tuple": [...]}, {"list": [...]}, {"dict": [[key, ...], ...]},
    {"none": 0}, and 0 for a leaf; raises TypeError for anything else (a namedtuple, a dataclass, a non-string key)."""
    if tree is None:
        return {"none": 0}
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return {"tuple": [_encode(t) for t in tree]}
    if type(tree) is list:
        return {"list": [_encode(t) for t in tree]}
    if type(tree) is dict and all(isinstance(k, str) for k in tree):
        return {"dict": [[k, _encode(v)] for k, v in tree.items()]}
    if jax.tree.structure(tree).num_nodes == 1 and jax.tree.structure(tree).num_leaves == 1:
        return 0
    raise TypeError(f"{type(tree).__name__} is not a plain container")


def _decode(data: Any) -> Any:
    """The placeholder tree _encode described (the inverse; ValueError for anything it does not write)."""
    if data == 0:
        return 0
    if isinstance(data, dict) and len(data) == 1:
        (kind, value), = data.items()
        if kind == "none":
            return None
        if kind == "tuple" and isinstance(value, list):
            return tuple(_decode(v) for v in value)
        if kind == "list" and isinstance(value, list):
            return [_decode(v) for v in value]
        if kind == "dict" and isinstance(value, list):
            return {str(k): _decode(v) for k, v in value}
    raise ValueError(f"not an output structure: {str(data)[:80]}")


def _output_tree(stored: Any, args: tuple) -> Any:
    if isinstance(stored, dict) and list(stored) == ["tuple"]:
        tree = tuple(args[0] if p == STATE else _decode(p) for p in stored["tuple"])
    else:
        tree = _decode(stored)
    return jax.tree.structure(tree)


# What a stored executable's bytes may name (jax serializes an executable with pickle, its devices and the
# compiled code by reference): jax's and jaxlib's classes and their _unpickle_* helpers, NumPy arrays and dtypes. Anything
# else (os.system, builtins.eval, ...) is refused before it is called: a planted entry is not executed that way.
_ALLOWED_MODULES = ("jax", "jaxlib")
_ALLOWED = {("numpy", "dtype"), ("numpy", "ndarray"), ("jax", "P"), ("numpy._core.multiarray", "_reconstruct"),
            ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "scalar"),
            ("numpy.core.multiarray", "scalar")}


class _DataOnlyUnpickler(serialize_executable._JaxPjrtUnpickler):
    """jax's unpickler of executables, restricted to _ALLOWED_MODULES' classes (see above)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or module.startswith(("numpy.dtypes", "ml_dtypes")):
            return super().find_class(module, name)
        if module.split(".")[0] in _ALLOWED_MODULES:
            found = super().find_class(module, name)
            if isinstance(found, type) or name.startswith("_unpickle"):
                return found
        raise pickle.UnpicklingError(f"a stored executable may not name {module}.{name}")


def _deserialize(blob: bytes, in_tree: Any, out_tree: Any) -> jax.stages.Compiled:
    """serialize_executable.deserialize_and_load through _DataOnlyUnpickler (its body, jax 0.10-0.12)."""
    backend = jax.devices()[0].client
    unloaded, args_info_flat, no_kwargs = _DataOnlyUnpickler(io.BytesIO(blob), backend).load()
    return jax.stages.Compiled(unloaded.load(), [], in_tree.unflatten(args_info_flat), out_tree, no_kwargs=no_kwargs)


def _entry_bytes(blob: bytes, stored: Any) -> bytes:
    """An entry: the format line, the output structure as one line of JSON, then jax's serialized executable."""
    return FORMAT.encode() + b"\n" + json.dumps({"outputs": stored}).encode() + b"\n" + blob


def _read_entry(data: bytes) -> tuple[bytes, Any]:
    """(executable bytes, output structure) of an entry; ValueError for any other file (no pickle is read here)."""
    parts = data.split(b"\n", 2)
    if len(parts) != 3 or parts[0] != FORMAT.encode():
        raise ValueError(f"not a {FORMAT} entry")
    return parts[2], json.loads(parts[1])["outputs"]


class LoadedCall:
    """A call loaded from the entry at `path`, called as the compiled call. If its first run fails in
    XLA, the entry is deleted and the error raised, naming it: an entry that loads but cannot run (one
    serialized without its code, see the module doc) would otherwise fail every run. This run cannot
    retry: the failed call consumed its donated arguments."""

    def __init__(self, compiled: jax.stages.Compiled, path: Path) -> None:
        self.compiled, self.path, self.ran = compiled, path, False

    def __call__(self, *args: Any) -> Any:
        if self.ran:
            return self.compiled(*args)
        try:
            out = self.compiled(*args)
        except jax.errors.JaxRuntimeError as e:
            self.path.unlink(missing_ok=True)
            raise RuntimeError(f"jaxloop: the compiled call loaded from {self.path} failed on its first run "
                               f"({e}); the entry is deleted, so the next run compiles the call afresh") from e
        self.ran = True
        return out

    def __getattr__(self, name: str) -> Any:  # the compiled call's own attributes (cost_analysis, ...)
        if name == "compiled":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.compiled, name)


def _load(path: Path, args: tuple) -> LoadedCall:
    blob, stored = _read_entry(path.read_bytes())
    compiled = _deserialize(blob, jax.tree.structure((args, {})), _output_tree(stored, args))
    try:
        os.utime(path)  # used now: eviction goes by modification time, least recent first
    except OSError:
        pass
    return LoadedCall(compiled, path)


def _evict(directory: Path, max_bytes: int, keep: Path) -> None:
    """Delete the least recently used entries (oldest modification time) until the directory's entries
    total at most max_bytes; never `keep`, the entry just stored. Never raises: another process may be
    evicting the same directory, and an entry it deletes under a reader is compiled again there."""
    try:
        entries = []
        for path in directory.glob("*.exe"):
            try:
                st = path.stat()
            except OSError:
                continue  # deleted meanwhile
            entries.append((st.st_mtime_ns, st.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries, key=lambda e: (e[0], e[2].name)):
            if total <= max_bytes:
                break
            if path == keep:
                continue
            path.unlink(missing_ok=True)
            total -= size
    except OSError as e:
        log.warning("jaxloop: compiled calls in %s not evicted: %s", directory, e)


def _store(path: Path, compiled: jax.stages.Compiled, args: tuple) -> bool:
    """Write compiled under path (atomically); False where it cannot be serialized or written. Never raises:
    a call that is not stored costs the next run a compile, not this run."""
    try:
        blob, in_tree, out_tree = serialize_executable.serialize(compiled)
        stored = _stored_outputs(out_tree, args)
        if stored is None or in_tree != jax.tree.structure((args, {})):
            log.info("jaxloop: %s not stored: its argument or output structure cannot be", path.name)
            return False
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as f:
            f.write(_entry_bytes(blob, stored))
        os.replace(f.name, path)  # readers see the whole entry or none
    except Exception as e:  # noqa: BLE001
        log.warning("jaxloop: compiled call not stored in %s: %s: %s", path.parent, type(e).__name__, e)
        return False
    return True


def compile_cached(jitted: Any, args: tuple, directory: str | os.PathLike[str] | None, context: Any,
                   max_bytes: int = MAX_BYTES) -> jax.stages.Compiled | LoadedCall:
    """jitted.lower(*args).compile(), or the executable a former run stored under the same key in
    `directory` (None: always compile). A call freshly compiled here is stored for the next run, and the
    least recently used entries beyond max_bytes are deleted.

    The caller vouches that `context` names everything the traced code depends on beyond jaxloop's
    sources, the function's module and name, and the arguments' types and shardings."""
    if directory is None:
        return jitted.lower(*args).compile()
    try:
        path = Path(directory).expanduser() / f"{fingerprint(context, args, jitted)}.exe"
    except Exception as e:  # noqa: BLE001  (no key, no cache: the run compiles as without one)
        log.warning("jaxloop: no key for a compiled call (%s: %s); compiling it", type(e).__name__, e)
        return jitted.lower(*args).compile()
    if path.exists():
        try:
            return _load(path, args)
        except Exception as e:  # noqa: BLE001  (a stale or damaged entry is compiled again and replaced)
            log.warning("jaxloop: compiled call %s unreadable (%s: %s); compiling it again", path, type(e).__name__, e)
    with COMPILING:
        with _compile_events() as events:
            compiled = jitted.lower(*args).compile()
        # Stored only if XLA compiled it just now: not one jit had compiled earlier in this process (it
        # may have come from JAX's persistent cache), nor one JAX loaded from that cache (see
        # _persistent_cache_off), which is compiled once more without the cache to be stored whole.
        stored = False
        if _fresh(events):
            stored = _store(path, compiled, args)
        elif events.get("cache_hit"):
            with _persistent_cache_off() as off, _compile_events() as again:
                whole = jitted.lower(*args).compile(compiler_options=RECOMPILE)
            stored = bool(off and _fresh(again)) and _store(path, whole, args)
        if stored:
            _evict(path.parent, max_bytes, keep=path)
    return compiled


def _fresh(events: dict[str, bool]) -> bool:
    return bool(events.get("backend_compile")) and not events.get("cache_hit")


@contextmanager
def _compile_events() -> Iterator[dict[str, bool]]:
    """Which of JAX's compile events fired inside (jax.monitoring): an XLA compile, a persistent-cache hit."""
    seen: dict[str, bool] = {}

    def on_event(event: str, **kwargs: Any) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            seen["cache_hit"] = True

    def on_duration(event: str, duration: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            seen["backend_compile"] = True

    jax.monitoring.register_event_listener(on_event)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_listener(on_event)
        jax.monitoring.unregister_event_duration_listener(on_duration)


@contextmanager
def _persistent_cache_off() -> Iterator[bool]:
    """JAX's persistent cache switched off for the compiles inside (hold COMPILING); yields whether it could be.

    An executable JAX loaded from its persistent cache serializes without its code (XLA:CPU, jax 0.10: the
    call loaded back from those bytes fails with "Function ... not found"), so only a fresh compile is
    stored. jax has no public switch for one compile: its cache latches whether it is in use, and
    reset_cache (private, as in jaxloop.loop.compilation) makes it read the configuration again.
    """
    try:
        from jax._src.compilation_cache import reset_cache
    except ImportError:
        yield False
        return
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    reset_cache()
    try:
        yield True
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        reset_cache()
