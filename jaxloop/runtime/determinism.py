"""Deterministic GPU kernels: the same config and seed give the same bits in every process.

XLA:GPU picks a kernel for each matmul and fusion by timing candidates (autotuning) when it compiles, so
two processes that each compile afresh may run different kernels and round differently: on an H100, two
`--preset debug` runs with `--compile_cache ""` ended with different state digests, while runs with
`--xla_gpu_deterministic_ops=true` matched. torch_ref makes the same request of
torch (`torch.use_deterministic_algorithms`). The CPU backend is deterministic already; the flag does
nothing there.
"""

from __future__ import annotations

import os
import warnings

FLAG = "--xla_gpu_deterministic_ops"


def names_flag(flags: str, flag: str = FLAG) -> bool:
    """Whether the XLA_FLAGS string sets `flag` itself (whole name: `--xla_gpu_exclude_nondeterministic_ops`
    is another flag)."""
    return any(token.split("=", 1)[0] == flag for token in flags.split())


PROBE = "jax_num_cpu_devices"
"""A jax setting that may change only before jax starts a backend (jax raises RuntimeError after)."""


def backend_started() -> bool | None:
    """Whether jax has started a backend, which is when XLA reads XLA_FLAGS and jax its client settings
    (None where this jax cannot tell). jax has no public question for it; its own rule answers: PROBE may
    change only before a backend starts. The probe changes it and puts it back at once: asking starts
    nothing and leaves the setting as it was."""
    import jax

    before = getattr(jax.config, PROBE, None)
    if not isinstance(before, int):
        return None
    try:
        jax.config.update(PROBE, 2 if before == 1 else 1)
    except RuntimeError:
        return True
    jax.config.update(PROBE, before)
    return False


def request_deterministic_ops() -> bool:
    """Add `--xla_gpu_deterministic_ops=true` to XLA_FLAGS unless XLA_FLAGS already sets it (either way: the
    user's choice stands). Returns whether the request reached XLA, which reads XLA_FLAGS once, when jax
    first starts a backend: a process that already used jax keeps what it started with."""
    flags = os.environ.get("XLA_FLAGS", "")
    if names_flag(flags):
        return False
    started = backend_started()
    if started is None:
        return False  # cannot tell whether XLA read XLA_FLAGS already: claim nothing, and start nothing
    if started:
        import jax

        if jax.default_backend() == "gpu":
            warnings.warn(
                f"jax started its GPU backend before jaxloop could set XLA_FLAGS={FLAG}=true: this "
                "run's kernels are chosen by timing and may differ from another process's; set it "
                "in the environment before jax is first used",
                stacklevel=3,
            )
        return False
    os.environ["XLA_FLAGS"] = f"{flags} {FLAG}=true".strip()
    return True
