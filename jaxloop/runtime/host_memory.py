"""Host memory: glibc malloc keeps what it frees for reuse, so XLA:CPU's per-call buffers do not page-fault.

XLA:CPU allocates a call's temporaries (activations, gradients: tens of MB for a small GPT) afresh on
every call and frees them after it. With glibc's default policy, large blocks are mmapped and unmapped,
and a heap's freed top is given back to the kernel, so every call touches fresh pages and pays a page
fault for each: the 4-block GPT's update (ctx 64, batch 12) took 84 ms that way and 49-59 ms with
freed memory kept (`python -m benchmarks --only step.gpt64`). What none of
jax, numpy or the Python allocator sets; mallopt is glibc's own switch (what MALLOC_*_ variables set at
process start), applied here at run time.

Larger blocks come from the heap too (M_MMAP_MAX 0): otherwise a block over 32 MiB that no freed chunk
fits, once some small allocation has split the freed ones, is mmapped afresh on every call.

That keeps only what the main heap can hold. jax runs a CPU call on a worker thread by default, whose
allocations come from one of glibc's secondary arenas, and their heaps hold at most 64 MiB: a call with
more temporaries than that (335 MB for the 4-block GPT at context 128, batch 32) gets a fresh mmap and
faults it all in on every call (90,000 page faults per update). `run_cpu_calls_inline` runs calls on the
dispatching thread instead, which allocates from the main heap; it costs the overlap of Python with the
call, so it pays for large calls made one update at a time (your own loop over train_step), not for the
loop's, which run many updates per call (`python benchmarks/bench_dispatch.py`). Starting the process
with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 instead leaves the mmaps but faults them 2 MiB at a time, at
no cost to small calls; glibc reads it only at process start, so nothing here can set it.
"""

from __future__ import annotations

import ctypes
import os

from jaxloop.runtime.determinism import backend_started

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -2, -3, -4  # glibc <malloc.h>
SETTINGS = (
    (M_MMAP_THRESHOLD, 32 << 20),  # blocks up to 32 MiB come from the heap, not fresh mmaps (glibc's maximum)
    (M_MMAP_MAX, 0),  # and larger ones too, where the heap can grow (the main heap; other arenas still mmap)
    (M_TRIM_THRESHOLD, 1 << 30),  # keep up to 1 GiB of freed heap top instead of returning it
    (M_TOP_PAD, 512 << 20),  # grow a heap in large steps (address space only, until touched)
)


def retain_freed_memory() -> bool:
    """Make this process's glibc malloc keep freed memory for reuse; False where there is no glibc
    (musl, macOS), which changes nothing."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return all(mallopt(param, value) == 1 for param, value in SETTINGS)


ASYNC_DISPATCH = "jax_cpu_enable_async_dispatch"


def run_cpu_calls_inline() -> bool:
    """Have jax's CPU backend run each call on the thread that dispatches it, so the call's temporaries
    come from the heap that retain_freed_memory keeps (call both before jax is first used). jax reads the
    setting when it starts the backend: returns False, changing nothing, once it has started, or where the
    environment chose (JAX_CPU_ENABLE_ASYNC_DISPATCH)."""
    if ASYNC_DISPATCH.upper() in os.environ or backend_started() is not False:
        return False
    import jax

    jax.config.update(ASYNC_DISPATCH, False)
    return True
