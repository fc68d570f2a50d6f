"""jaxloop.runtime.compilation: --compile_cache is JAX's persistent compilation cache; a second process loads the
compiled calls a first one wrote, and can tell that it did (loaded_from_cache)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax

from jaxloop.runtime.compilation import enable_compilation_cache

ONE_RUN = """
import sys, jax, jax.numpy as jnp
from jaxloop.runtime.compilation import enable_compilation_cache, loaded_from_cache
enable_compilation_cache(sys.argv[1])
with loaded_from_cache() as cache:
    jax.jit(lambda x: jnp.tanh(x)[:, None] * jnp.ones((3, 5)) + x.sum()).lower(jnp.arange(3.0)).compile()
    if sys.argv[2:]:  # and a function no run compiled before
        jax.jit(lambda x: jnp.cos(x) * 3).lower(jnp.arange(3.0)).compile()
print(cache["loaded"])
"""


def one_run(cache: Path, *new: str) -> str:
    """A fresh process, as one run: compiles one function (and another, new, if `new`) with JAX's cache in `cache`;
    prints whether it loaded them."""
    return run_process(cache, *new).stdout.strip()


def run_process(cache: Path, *new: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-c", ONE_RUN, str(cache), *new], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out


def test_a_second_process_loads_the_call_the_first_compiled_into_the_cache(tmp_path: Path) -> None:
    assert one_run(tmp_path / "cache") == "False"  # compiled, and written
    entries = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert entries
    assert one_run(tmp_path / "cache") == "True"  # loaded: no compile, no new entry
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == entries


def test_a_call_of_which_one_compile_missed_the_cache_is_not_loaded(tmp_path: Path) -> None:
    one_run(tmp_path / "cache")
    assert one_run(tmp_path / "cache", "new") == "False"  # one hit, one miss: it compiled


def test_a_damaged_entry_is_warned_of_and_the_call_compiled_afresh(tmp_path: Path) -> None:
    # docs/faults.md: JAX reads the entry, fails to decompress it, warns, and compiles; the run goes on
    one_run(tmp_path / "cache")
    for entry in (tmp_path / "cache").iterdir():
        entry.write_bytes(b"garbage")
    out = run_process(tmp_path / "cache")
    assert out.stdout.strip() == "False"
    assert "Error reading persistent compilation cache entry" in out.stderr


def test_the_cache_keeps_xla_s_autotuning_results_but_not_its_gpu_kernel_cache(tmp_path: Path) -> None:
    # "all" adds XLA's GPU kernel cache: with it, on an H100 (jax 0.11.2), the fp32 eval step compiled
    # after the train step in one process died with CUDA_ERROR_ILLEGAL_INSTRUCTION. CPU runs never show
    # it, so the setting itself is what this checks.
    from jax.experimental.compilation_cache.compilation_cache import reset_cache

    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_enable_xla_caches)
    try:
        for asked, kept in [
            ("all", "xla_gpu_per_fusion_autotune_cache_dir"),
            ("xla_gpu_kernel_cache_file", "xla_gpu_per_fusion_autotune_cache_dir"),
            ("none", "none"),
        ]:  # a user's choice without the kernel cache stands
            jax.config.update("jax_persistent_cache_enable_xla_caches", asked)
            enable_compilation_cache(tmp_path / "jax")
            assert jax.config.jax_persistent_cache_enable_xla_caches == kept, asked
    finally:
        jax.config.update("jax_compilation_cache_dir", before[0])
        jax.config.update("jax_persistent_cache_enable_xla_caches", before[1])
        reset_cache()


def test_the_cache_is_bounded_so_that_processes_sharing_it_lock_each_entry(tmp_path: Path) -> None:
    # jax locks an entry's read and write only when the cache has a bound (jax_compilation_cache_max_size):
    # without it, two processes on one host (a run's processes, the suite's workers) can read a half-written
    # entry. The lock's file in the directory is the sign that the writes went through the lock.
    one_run(tmp_path / "cache")
    assert (tmp_path / "cache" / ".lockfile").exists()
