"""JAX's persistent compilation cache: a second run (or a resume) loads its compiled steps from disk.

    from jaxloop.runtime.compilation import enable_compilation_cache
    enable_compilation_cache("~/.cache/jaxloop/xla")   # before the first jit compiles

A second run still traces and lowers each step in Python (the key is the HLO), then reads the executable
instead of compiling it: `loaded_from_cache()` tells which a compile was.

Every executable is cached (no minimum compile time, no minimum size): the built-in steps compile in
seconds on a CPU, below JAX's default threshold of one second per executable for some of them (the
init and eval steps), and a cache hit costs a file read. The key covers the HLO, the jax/jaxlib
versions, the backend and the compile options, so a changed model, shape, precision or version
simply misses and compiles again.

The cache is bounded (MAX_BYTES, least recently used entries evicted), and the bound is also what makes it
safe to share: jax takes a file lock around each read and write only when a bound is set, so several
jaxloop processes on one host (a run's processes, two runs, the test suite's workers) never read an entry
another is still writing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import jax

XLA_CACHES = "xla_gpu_per_fusion_autotune_cache_dir"
"""The XLA caches JAX's cache directory holds (jax_persistent_cache_enable_xla_caches) where the setting
asked for XLA's GPU kernel cache; JAX's own default, and any other choice a user made, stand."""
KERNEL_CACHE = "xla_gpu_kernel_cache_file"
MAX_BYTES = 4 * 2**30
"""The cache directory's bound (jax_compilation_cache_max_size): a few hundred GPT-2-sized executables."""
REQUEST, HIT = "/jax/compilation_cache/compile_requests_use_cache", "/jax/compilation_cache/cache_hits"
"""jax.monitoring's events of a compile that asked the persistent cache, and of one it answered."""


def cache_settings(directory: Path) -> dict[str, object]:
    """JAX's settings of a persistent cache in `directory` that keeps every executable, by their jax.config
    names (a child process takes them as environment variables: the names upper-cased)."""
    return {
        "jax_compilation_cache_dir": str(directory),
        "jax_persistent_cache_min_compile_time_secs": 0.0,
        "jax_persistent_cache_min_entry_size_bytes": 0,  # 0: cache every entry (-1 would disable)
        # a bound turns on jax's file lock around each entry's read and write (module docstring)
        "jax_compilation_cache_max_size": MAX_BYTES,
    }


def enable_compilation_cache(path: str | os.PathLike[str]) -> Path:
    """Turn on JAX's persistent compilation cache in directory `path` (created); returns it.

    Call it before the first compilation of the run: executables compiled earlier in the process are
    not written. Calling it again with another path moves the cache there.
    """
    directory = Path(path).expanduser().resolve()
    directory.mkdir(parents=True, exist_ok=True)
    for key, value in cache_settings(directory).items():
        jax.config.update(key, value)
    try:
        # GPU only. Never XLA's GPU kernel cache ("all" includes it): with it, an fp32 eval step compiled
        # after the train step in one process died with CUDA_ERROR_ILLEGAL_INSTRUCTION on an H100.
        chosen = jax.config.jax_persistent_cache_enable_xla_caches  # pyright: ignore[reportAttributeAccessIssue]  # jax adds its options at run time
        if chosen == "all" or KERNEL_CACHE in str(chosen).split(","):
            jax.config.update("jax_persistent_cache_enable_xla_caches", XLA_CACHES)
    except (AttributeError, KeyError, ValueError):
        pass
    # jax initialises the cache once, at the first compilation; a process that already compiled something
    # would otherwise keep the cache off (or in its former directory)
    _reset_cache()
    return directory


SETTINGS = (
    "jax_compilation_cache_dir",
    "jax_persistent_cache_min_compile_time_secs",
    "jax_persistent_cache_min_entry_size_bytes",
    "jax_compilation_cache_max_size",
    "jax_persistent_cache_enable_xla_caches",
)
"""The jax settings enable_compilation_cache changes (the last only where jax has it)."""


@contextmanager
def compilation_cache(path: str | os.PathLike[str]) -> Iterator[Path]:
    """enable_compilation_cache(path) inside the block (yields the directory); JAX's settings as they were
    before it afterwards, so that a run from Python leaves the process's cache as it found it."""
    saved = {k: getattr(jax.config, k) for k in SETTINGS if hasattr(jax.config, k)}
    try:
        yield enable_compilation_cache(path)
    finally:
        for key, value in saved.items():
            jax.config.update(key, value)
        _reset_cache()


def _reset_cache() -> None:
    """jax initialises its persistent cache once, at the first compilation after a reset: make the next
    compile read the settings now in force."""
    from jax.experimental.compilation_cache import compilation_cache as cache

    cache.reset_cache()


@contextmanager
def loaded_from_cache() -> Iterator[dict[str, bool]]:
    """Yields {"loaded": ...}, set on exit: whether JAX's persistent cache answered every compile inside (at
    least one; a miss, or the cache off, is False). Listens to jax.monitoring's events only inside the block."""
    counts = {REQUEST: 0, HIT: 0}
    seen = {"loaded": False}

    def on_event(event: str, **kwargs: object) -> None:
        if event in counts:
            counts[event] += 1

    jax.monitoring.register_event_listener(on_event)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_listener(on_event)
        seen["loaded"] = counts[HIT] == counts[REQUEST] > 0
