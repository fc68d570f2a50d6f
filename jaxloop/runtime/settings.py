"""Process-wide configuration of a run, in one place: for the length of `jaxloop.run()` (which the CLI
calls), never at import; what jax lets go back is put back when the run ends.

What a training process needs set before jax starts or before its first compile, and why each is
process-wide: XLA reads XLA_FLAGS once, when jax starts a backend (deterministic GPU kernels); float64
is a global jax switch (precision fp64); the persistent compilation cache and glibc's malloc policy
serve every compile and every call of the process; jax.distributed joins the job's processes before
any device is used. Importing jaxloop changes none of these. (Orbax's logging is quieted by each
Checkpointer for its own life: jaxloop.checkpoint.orbax_quiet.)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import jax

from jaxloop.config.run import Config


@contextmanager
def process_settings(cfg: Config) -> Iterator[None]:
    """Apply cfg's process-wide settings for the block, in the order they must come (see the module doc).

    What jax lets go back is put back when the block ends, as it was: float64 (fp64) and the persistent
    compilation cache's settings, so that `jaxloop.run` called from research code leaves jax as it found it
    (the arrays of an fp64 run's result stay float64; compute with them inside `jax.enable_x64(True)`). The
    rest is made once for the process and stays: XLA_FLAGS (read when jax starts a backend), glibc's malloc
    policy, and joining the job's processes."""
    from jaxloop.runtime.compilation import compilation_cache
    from jaxloop.runtime.determinism import request_deterministic_ops
    from jaxloop.runtime.host_memory import retain_freed_memory
    from jaxloop.runtime.processes import initialize

    x64 = jax.config.jax_enable_x64  # pyright: ignore[reportAttributeAccessIssue]  # jax adds config options at run time
    with ExitStack() as scope:
        if cfg.deterministic:
            request_deterministic_ops()  # before jax starts a backend: XLA reads XLA_FLAGS once
        if cfg.precision == "fp64":
            jax.config.update("jax_enable_x64", True)
            scope.callback(jax.config.update, "jax_enable_x64", x64)
        if cfg.compile_cache:
            scope.enter_context(compilation_cache(cfg.compile_cache))  # before the first compile of the run
        if cfg.retain_host_memory:
            retain_freed_memory()  # before the first call's buffers are allocated
        initialize(cfg)  # join the other processes, if any, before any device is used
        yield
