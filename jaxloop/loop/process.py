"""Process-wide configuration of a run, in one place and once: at the start of `jaxloop.run()` (which the
CLI calls), never at import.

What a training process needs set before jax starts or before its first compile, and why each is
process-wide: XLA reads XLA_FLAGS once, when jax starts a backend (deterministic GPU kernels); float64
is a global jax switch (precision fp64); the persistent compilation cache and glibc's malloc policy
serve every compile and every call of the process; jax.distributed joins the job's processes before
any device is used. Importing jaxloop changes none of these. (Orbax's logging is quieted by each
Checkpointer for its own life: jaxloop.checkpoint.orbax_quiet.)
"""

from __future__ import annotations

import jax

from jaxloop.core.config import Config


def configure_process(cfg: Config) -> None:
    """Apply cfg's process-wide settings, in the order they must come (see the module doc)."""
    from jaxloop.loop.compilation import enable_compilation_cache
    from jaxloop.loop.determinism import request_deterministic_ops
    from jaxloop.update.distributed import initialize
    from jaxloop.loop.host_memory import retain_freed_memory

    if cfg.deterministic:
        request_deterministic_ops()  # before jax starts a backend: XLA reads XLA_FLAGS once
    if cfg.precision == "fp64":
        jax.config.update("jax_enable_x64", True)
    if cfg.compile_cache:
        enable_compilation_cache(cfg.compile_cache)  # before the first compile of the run
    if cfg.retain_host_memory:
        retain_freed_memory()  # before the first call's buffers are allocated
    initialize(cfg)  # join the other processes, if any, before any device is used
