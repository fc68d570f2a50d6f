"""The run's processes: joining them (jax.distributed) before anything touches a device, which one writes
the run's files, and waiting for all of them. Process control, apart from the mesh and shardings
(jaxloop.update.distributed)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading

import jax

from jaxloop.config.errors import EXIT_BAD_INPUT
from jaxloop.config.run import Config, ConfigError, DistributedConfig

JAX_TIMEOUT_MARGIN_S = 60
"""jax's own wait is longer than distributed.peer_timeout_s by this much, so that the timer's line comes first."""


def missing_peer_line(d: DistributedConfig) -> str:
    """What a process that waited in vain for its peers says: who is missing and what to do."""
    others = [p for p in range(d.num_processes) if p != d.process_id]
    named = ", ".join(map(str, others[:8])) + (", ..." if len(others) > 8 else "")
    return (
        f"distributed: process {d.process_id} waited {d.peer_timeout_s} s at the coordinator {d.coordinator} for "
        f"all {d.num_processes} processes; missing among process_id {named}: start each with the same "
        "--distributed.* flags and its own --distributed.process_id (or raise --distributed.peer_timeout_s)"
    )


def initialize(cfg: Config) -> None:
    """Join the run's processes (distributed.*) before anything touches a device; one process: nothing.

    A peer that never comes ends this process with one line (`missing_peer_line`) and EXIT_BAD_INPUT after
    distributed.peer_timeout_s: jax's own timeout aborts the process from C++ (a fatal log and a stack trace),
    so a timer ends it first; nothing is written before this wait."""
    d = cfg.distributed
    if d.num_processes == 1:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU all-reduce across processes
    # at once, before the wait: a missing peer would otherwise be minutes of silence
    print(
        f"distributed: process {d.process_id} waiting for all {d.num_processes} processes at the coordinator "
        f"{d.coordinator} (up to {d.peer_timeout_s} s)",
        file=sys.stderr,
        flush=True,
    )

    def give_up() -> None:  # a thread of its own: jax's wait releases the GIL
        print(f"jaxloop.train: error: {missing_peer_line(d)}", file=sys.stderr, flush=True)
        os._exit(EXIT_BAD_INPUT)

    timer = threading.Timer(d.peer_timeout_s, give_up)
    timer.daemon = True
    timer.start()
    try:
        jax.distributed.initialize(
            coordinator_address=d.coordinator,
            num_processes=d.num_processes,
            process_id=d.process_id,
            initialization_timeout=d.peer_timeout_s + JAX_TIMEOUT_MARGIN_S,
        )
    except Exception as e:  # noqa: BLE001 - jax's error for a peer that never came (its text varies by version)
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise ConfigError(
            "distributed.coordinator",
            d.coordinator,
            f"a coordinator that all {d.num_processes} processes reach within {d.peer_timeout_s} s (this is "
            f"process {d.process_id}; {type(e).__name__}: {why}): start the others with the same "
            "--distributed.* flags and their own --distributed.process_id",
        ) from None
    finally:
        timer.cancel()


def leave() -> None:
    """Wait for the run's other processes at jax's shutdown barrier before this one ends (up to jax's
    shutdown timeout). Process 0 hosts the coordinator: a peer still finishing its last save when process 0's
    process ends is aborted from C++ (SIGABRT, exit -6, seen when a SIGTERM'd run stopped under load). One
    process, or a distributed runtime never started: nothing."""
    if jax.distributed.is_initialized():
        with contextlib.suppress(Exception):  # a peer already gone: this process ends anyway
            jax.distributed.shutdown()


def is_primary() -> bool:
    """Process 0 writes the run's files (the checkpoints are written by Orbax on every process)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process got here (no-op for one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
