"""Data parallelism over every device of every process: a 1-D mesh with axis "data".

The state is replicated; each global micro-batch is split along its first axis over all devices
(each process loads only its own rows, see jaxloop.data). jit then partitions train_step (GSPMD) and
all-reduces the gradients, so the loop and the step are the same code for 1 or N devices, and for 1
or N processes (jax.distributed; CPU processes all-reduce through gloo).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from loopcore.config import Config, ConfigError

DATA_AXIS = "data"


def initialize(cfg: Config) -> None:
    """Join the run's processes (distributed.*) before anything touches a device; one process: nothing."""
    d = cfg.distributed
    if d.num_processes == 1:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU all-reduce across processes
    jax.distributed.initialize(coordinator_address=d.coordinator, num_processes=d.num_processes,
                               process_id=d.process_id)


def is_primary() -> bool:
    """Process 0 writes the run's files (the checkpoints are written by Orbax on every process)."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Wait until every process got here (no-op for one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def make_mesh() -> Mesh:
    return Mesh(np.asarray(jax.devices()), (DATA_AXIS,))


def check_divisible(cfg: Config) -> None:
    """Micro-batches (and validation batches) must split evenly over all devices."""
    n = jax.device_count()
    for field, size in (("batch_size", cfg.batch_size), ("data.eval_batch_size", cfg.data.eval_batch_size)):
        if size % n:
            raise ConfigError(field, size, f"a multiple of the device count ({n})")


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Place every leaf of tree (the TrainState) whole on every device."""
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


def shard_batch(local_batch: dict[str, np.ndarray], mesh: Mesh, stacked: bool = False) -> dict[str, jax.Array]:
    """A global batch array from this process's rows, split along the batch axis over the mesh (axis 0,
    or axis 1 of `stacked` micro-batches [n, batch, ...])."""
    sharding = NamedSharding(mesh, PartitionSpec(None, DATA_AXIS) if stacked else PartitionSpec(DATA_AXIS))
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local_batch.items()}
