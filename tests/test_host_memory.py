"""The host allocator policy the loop sets (memory freed is reused without page faults), and CPU calls run
inline for temporaries larger than a secondary arena can keep."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROUNDS = r"""
import ctypes, resource, sys
if sys.argv[1] == "retain":
    from jaxloop.runtime.host_memory import retain_freed_memory
    assert retain_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def faults(mib):
    # glibc's malloc itself (numpy would ask the kernel for huge pages, which fault 512 pages at a time)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(mib << 20)
    ctypes.memset(block, 1, mib << 20)  # touch every page
    libc.free(block)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

print(*(faults(int(mib)) for mib in sys.argv[2:]))
"""


def _faults(mode: str, *mib: int) -> tuple[int, ...]:
    out = subprocess.run(
        [sys.executable, "-c", ROUNDS, mode, *map(str, mib)], capture_output=True, text=True, check=True
    )
    return tuple(map(int, out.stdout.split()))


# (24, 20) MiB: under glibc's mmap threshold's maximum (32 MiB); (96, 80): over it, as the temporaries of
# a larger model's call are (the 4-block GPT at context 128, batch 32: 335 MB)
SIZES = pytest.mark.parametrize("mib", [(24, 20), (96, 80)], ids=["under-32MiB", "over-32MiB"])


@SIZES
def test_retained_memory_is_reused_without_page_faults(mib: tuple[int, int]):
    """A block freed, then a smaller one: with glibc's default policy the first is an mmap given back on
    free and the second faults in fresh pages (one per 4 KiB page: 6144 and 24576 for the first blocks);
    with the loop's policy the second reuses the first's pages (0 measured). Bound: a tenth of the first's."""
    first, second = _faults("retain", *mib)
    assert first > (mib[0] << 20) // 4096 // 2, "the first block is touched page by page"
    assert second < first / 10, (first, second)


@SIZES
def test_without_it_the_same_blocks_fault_afresh(mib: tuple[int, int]):
    """The control: the same rounds under glibc's default policy fault again (a test that cannot tell
    the policies apart would pass without retain_freed_memory)."""
    first, second = _faults("default", *mib)
    assert second > first / 2, (first, second)


def test_a_run_sets_the_policy_unless_told_not_to(tmp_path, monkeypatch):
    """jaxloop.run applies it (retain_host_memory, default on) and leaves it with the flag off."""
    from dataclasses import replace

    import jaxloop.loop.runner
    import jaxloop.runtime.host_memory
    from jaxloop.config.run import preset

    calls = []
    monkeypatch.setattr(jaxloop.runtime.host_memory, "retain_freed_memory", lambda: calls.append(True) or True)
    base = replace(preset("debug"), steps=10, log=replace(preset("debug").log, progress="off", tensorboard=False))
    jaxloop.loop.runner.run(replace(base, run_dir=str(tmp_path / "default")))
    jaxloop.loop.runner.run(replace(base, run_dir=str(tmp_path / "off"), retain_host_memory=False))
    assert calls == [True], "once, for the run with the default"


CALLS = r"""
import resource, statistics, sys
from jaxloop.runtime.host_memory import retain_freed_memory, run_cpu_calls_inline
assert retain_freed_memory()
if sys.argv[1] == "inline":
    assert run_cpu_calls_inline()
import jax, jax.numpy as jnp
x = jnp.ones(1 << 25)  # 128 MiB; the barrier makes sin(x) a temporary of the same size
f = jax.jit(lambda x: (jax.lax.optimization_barrier(jnp.sin(x)) * 2).sum()).lower(x).compile()
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(f.memory_analysis().temp_size_in_bytes, statistics.median(faults[1:]))
"""


def _call_faults(mode: str) -> tuple[float, float]:
    env = {k: v for k, v in os.environ.items() if k != "JAX_CPU_ENABLE_ASYNC_DISPATCH"}
    out = subprocess.run([sys.executable, "-c", CALLS, mode], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    temp, faults = map(float, out.stdout.split())
    assert temp > 64 << 20, "the call's temporaries outgrow a secondary arena's heap (64 MiB)"
    return temp, faults


def test_a_call_run_inline_reuses_temporaries_larger_than_an_arena_heap():
    """Run on the dispatching thread, the calls after the first of a jitted function with 128 MiB of
    temporaries find them in the main heap's retained memory. The median over calls 2-8, because now and
    then a call still runs on a worker thread (15 processes measured: medians 0-1 faults, at most one call
    of 7 faulting; once in a whole-suite run on Python 3.12, every call of one process faulted). Bound: a
    tenth of the temporaries' pages, in the best of up to three processes (the worker-thread control below
    faults on every call of every process, so a mutant that never runs inline still fails all three)."""
    measured = []
    for _ in range(3):
        temp, faults = _call_faults("inline")
        measured.append((temp, faults))
        if faults < temp // 4096 // 10:
            return
    raise AssertionError(f"every process faulted its temporaries in again: (temporaries, faults) {measured}")


def test_on_jax_s_worker_thread_the_same_call_faults_them_in_again():
    """The control: on jax's default worker thread the same calls' temporaries are mmapped afresh and
    fault in page by page (32770 per call measured), whatever retain_freed_memory keeps (so the test
    above can tell the two apart)."""
    temp, faults = _call_faults("worker")
    assert faults > temp // 4096 // 2, (temp, faults)


def test_inline_is_not_claimed_after_jax_started_or_where_the_environment_chose(monkeypatch):
    """jax reads the setting when it starts its backend: afterwards nothing changes; and a choice made in
    the environment (JAX_CPU_ENABLE_ASYNC_DISPATCH) stands even before."""
    import jax

    from jaxloop.runtime.host_memory import ASYNC_DISPATCH, run_cpu_calls_inline

    jax.devices()  # this process's backend is started
    assert run_cpu_calls_inline() is False
    monkeypatch.setattr("jaxloop.runtime.host_memory.backend_started", lambda: False)  # as if not started
    monkeypatch.setenv("JAX_CPU_ENABLE_ASYNC_DISPATCH", "1")
    assert run_cpu_calls_inline() is False
    assert jax.config.read(ASYNC_DISPATCH) is True
