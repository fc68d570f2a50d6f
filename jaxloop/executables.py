"""Compiled calls kept on disk under a key computed before tracing: a restart skips trace and lowering too.

JAX's persistent compilation cache (jaxloop.compilation) keys an executable by its HLO, so every run
still traces and lowers its steps in Python before the cache can answer: for the shakespeare GPT's
update that is about 1 s of the 1.4 s a second run spends on it. For the built-in tasks, whose whole
computation follows from the config and jaxloop's own sources, the loop can key the executable by
those instead, and load it without tracing (jax.experimental.serialize_executable, what MaxText does
with an ahead-of-time compiled train step):

    compiled = compile_cached(jax.jit(step, donate_argnums=0), (state, batch), directory, context)

The key covers everything the compiled code depends on: jaxloop's and loopcore's source files, the
context (the config's fields that enter the computation), each argument's path, type (shape, dtype,
weak type) and sharding with its devices, the jax, jaxlib, flax, optax and numpy versions, the
backend and devices, XLA_FLAGS and jax's configuration. A user's own model or loss is code outside
those sources, so the loop only uses this for the built-in tasks (a user task goes through JAX's cache).
An entry that cannot be read is compiled afresh and replaced; one that cannot be written (outputs
whose structure does not pickle, say) is simply not stored. A miss compiles with JAX's persistent
cache off (see _persistent_cache_off): the executables stored here are always fresh compiles.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

import jax
from jax.experimental import serialize_executable

log = logging.getLogger(__name__)

FORMAT = "jaxloop-executable-1"
SOURCE_PACKAGES = ("jaxloop", "loopcore")
VERSIONED = ("jax", "jaxlib", "flax", "optax", "numpy")
STATE = "<args[0]>"  # stands for the first argument's tree in a stored output structure


def _source_digest() -> str:
    """sha256 over the source files of jaxloop and loopcore (the code every built-in step is traced from)."""
    h = hashlib.sha256()
    for package in SOURCE_PACKAGES:
        root = Path(sys.modules[package].__file__).parent
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _leaf_key(path: Any, leaf: Any) -> list[str]:
    sharding = getattr(leaf, "sharding", None)
    devices = getattr(sharding, "_device_assignment", None)
    return [jax.tree_util.keystr(path), str(jax.typeof(leaf)), repr(sharding),
            repr([d.id for d in devices] if devices is not None else None)]


def fingerprint(context: Any, args: tuple) -> str:
    """The key of a call compiled for `args` (arrays or ShapeDtypeStructs) under `context` (JSON-able)."""
    devices = jax.devices()
    parts = {
        "format": FORMAT,
        "versions": {name: metadata.version(name) for name in VERSIONED},
        "python": sys.version,
        "backend": [jax.default_backend(), devices[0].client.platform_version, devices[0].device_kind,
                    len(devices), jax.process_count(), jax.process_index()],
        "env": [os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", "")],
        "jax_config": sorted((k, repr(v)) for k, v in jax.config.values.items()
                             if not any(word in k for word in ("cache", "log_compiles", "explain"))),
        "sources": _source_digest(),
        "context": context,
        "args": [_leaf_key(p, x) for p, x in jax.tree_util.tree_flatten_with_path(args)[0]],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()


def _stored_outputs(out_tree: Any, args: tuple) -> Any:
    """The output structure in a picklable form: plain containers with 0 leaves, and STATE where the
    output holds the first argument's tree (a TrainState carries its optimizer's functions, which do
    not pickle); None where that does not describe it."""
    placeholder = jax.tree.unflatten(out_tree, [0] * out_tree.num_leaves)
    state = jax.tree.structure(args[0])
    if isinstance(placeholder, tuple) and not hasattr(placeholder, "_fields"):
        stored = tuple(STATE if jax.tree.structure(p) == state else p for p in placeholder)
    else:
        stored = placeholder
    try:
        if _output_tree(pickle.loads(pickle.dumps(stored)), args) == out_tree:
            return stored
    except (pickle.PicklingError, AttributeError, TypeError):
        pass
    return None


def _output_tree(stored: Any, args: tuple) -> Any:
    if isinstance(stored, tuple) and not hasattr(stored, "_fields"):
        stored = tuple(args[0] if p == STATE else p for p in stored)
    return jax.tree.structure(stored)


def _load(path: Path, args: tuple) -> jax.stages.Compiled:
    blob, stored = pickle.loads(path.read_bytes())
    return serialize_executable.deserialize_and_load(blob, jax.tree.structure((args, {})), _output_tree(stored, args))


def _store(path: Path, compiled: jax.stages.Compiled, args: tuple) -> bool:
    """Write compiled under path (atomically); False where it cannot be serialized."""
    try:
        blob, in_tree, out_tree = serialize_executable.serialize(compiled)
    except (ValueError, NotImplementedError, TypeError) as e:
        log.info("jaxloop: %s not cached: %s", path.name, e)
        return False
    stored = _stored_outputs(out_tree, args)
    if stored is None or in_tree != jax.tree.structure((args, {})):
        log.info("jaxloop: %s not cached: its argument or output structure cannot be stored", path.name)
        return False
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as f:
            f.write(pickle.dumps((blob, stored)))
        os.replace(f.name, path)  # readers see the whole entry or none
    except OSError as e:  # a cache that cannot be written costs the next run a compile, not this run
        log.warning("jaxloop: compiled call not stored in %s: %s", path.parent, e)
        return False
    return True


def compile_cached(jitted: Any, args: tuple, directory: str | os.PathLike[str] | None, context: Any
                   ) -> jax.stages.Compiled:
    """jitted.lower(*args).compile(), or the executable a former run stored under the same key in
    `directory` (None: always compile). The compiled call is stored for the next run."""
    if directory is None:
        return jitted.lower(*args).compile()
    path = Path(directory).expanduser() / f"{fingerprint(context, args)}.exe"
    if path.exists():
        try:
            return _load(path, args)
        except Exception as e:  # noqa: BLE001  (a stale or damaged entry is compiled again and replaced)
            log.warning("jaxloop: compiled call %s unreadable (%s: %s); compiling it again", path, type(e).__name__, e)
    with _persistent_cache_off() as fresh:
        compiled = jitted.lower(*args).compile()
    if fresh:
        _store(path, compiled, args)
    return compiled


@contextmanager
def _persistent_cache_off() -> Iterator[bool]:
    """JAX's persistent cache switched off for the compiles inside; yields whether it could be.

    An executable JAX loaded from its persistent cache serializes without its code (XLA:CPU, jax 0.10: the
    call loaded back from those bytes fails with "Function ... not found"), so only a fresh compile is
    stored. jax has no public switch for one compile: its cache latches whether it is in use, and
    reset_cache (private, as in jaxloop.compilation) makes it read the configuration again.
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
