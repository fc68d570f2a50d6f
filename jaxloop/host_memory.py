"""Host memory: glibc malloc keeps what it frees for reuse, so XLA:CPU's per-call buffers do not page-fault.

XLA:CPU allocates a call's temporaries (activations, gradients: tens of MB for a small GPT) afresh on
every call and frees them after it. With glibc's default policy, large blocks are mmapped and unmapped,
and a heap's freed top is given back to the kernel, so every call touches fresh pages and pays a page
fault for each: the 4-block GPT's update (ctx 64, batch 12) took 84 ms that way and 49-59 ms with
freed memory kept (`python -m benchmarks --only step.gpt64`). What none of
jax, numpy or the Python allocator sets; mallopt is glibc's own switch (what MALLOC_*_ variables set at
process start), applied here at run time.
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc <malloc.h>
SETTINGS = (
    (M_MMAP_THRESHOLD, 32 << 20),  # blocks up to 32 MiB come from the heap, not fresh mmaps (glibc's maximum)
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
