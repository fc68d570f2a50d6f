"""Data parallelism and sharded state (FSDP) over every device of every process: a 2-D mesh.

The mesh has axes ("data", "fsdp"): `distributed.fsdp` devices hold one copy of the state between them,
each leaf split along one dimension (see `partition_spec`); the rest of the devices form the data axis,
each row of the mesh a replica of that sharded state. fsdp = 1 is plain data parallelism (the state
replicated on every device). Every global micro-batch is split along its first axis over *all*
devices, P(("data", "fsdp")); each process loads only its own rows (jaxloop.data.pipeline).

jit partitions train_step (GSPMD): it all-gathers each sharded weight where the forward and backward
passes use it, reduce-scatters the gradients onto the state's shards (all-reduces them over "data"),
and the optimizer, EMA and loss-scale updates run shard by shard. `pin_shardings` makes the jitted
step return the state with the shardings it came in with, so donation reuses the buffers and the state
stays sharded from update to update. The loop and the step are the same code for 1 or N devices, for
1 or N processes (jax.distributed; CPU processes talk through gloo), and for any fsdp.

Everything here is a pure function of a pytree and a mesh: it works for the built-in TrainState and for
any state pytree (a user's own model, Linen or NNX state).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from jaxloop.config.run import Config, ConfigError, DistributedConfig

DATA_AXIS = "data"
FSDP_AXIS = "fsdp"
BATCH_AXES = (DATA_AXIS, FSDP_AXIS)
"""The batch's first axis is split over both mesh axes: every device gets its own rows."""
MIN_SHARD_SIZE = 2**12
"""Leaves with fewer elements (biases, norm scales, scalars, counters, rng) stay replicated: sharding them
saves almost nothing and costs one collective each."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def cpu_devices_hint(wanted: int) -> str:
    """On a CPU backend of one device, how to get `wanted` devices from one machine (XLA's host-platform
    device count, set before jax starts); empty elsewhere (the user has set it, or has accelerators)."""
    if jax.default_backend() != "cpu" or jax.device_count() != 1:
        return ""
    return (
        f" (on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count={wanted} before the command gives "
        f"{wanted} CPU devices)"
    )


def check_divisible(cfg: Config) -> None:
    """distributed.fsdp must divide the device count; micro-batches (and validation batches) must split
    evenly over all devices (data x fsdp)."""
    n = jax.device_count()
    f = cfg.distributed.fsdp
    if n % f:
        raise ConfigError(
            "distributed.fsdp",
            f,
            f"a divisor of the device count ({n}): one of {', '.join(map(str, _divisors(n)))}{cpu_devices_hint(f)}",
        )
    for field, size in (("batch_size", cfg.batch_size), ("data.eval_batch_size", cfg.data.eval_batch_size)):
        if size % n:
            raise ConfigError(field, size, f"a multiple of the device count ({n})")


def make_mesh(dist: DistributedConfig | None = None, devices: Any = None) -> Mesh:
    """The (data, fsdp) mesh over `devices` (default: all devices of all processes), fsdp = dist.fsdp.

    jax.devices() lists each process's devices together, so with fsdp <= devices per process the fsdp
    groups stay within a host (the state's all-gathers and reduce-scatters on the fast links) and the
    data axis spans hosts (one gradient all-reduce per update over the slower network); each process's
    devices are a contiguous run of the batch's rows, as jax.make_array_from_process_local_data wants.
    """
    devices = np.asarray(jax.devices() if devices is None else devices).ravel()
    f = 1 if dist is None else dist.fsdp
    if f < 1 or devices.size % f:
        raise ConfigError(
            "distributed.fsdp",
            f,
            f"a divisor of the device count ({devices.size}): one of {', '.join(map(str, _divisors(devices.size)))}",
        )
    return Mesh(devices.reshape(devices.size // f, f), BATCH_AXES)


def partition_spec(shape: tuple[int, ...], fsdp: int, min_size: int = MIN_SHARD_SIZE) -> PartitionSpec:
    """How a leaf of this shape is laid out: its largest dimension divisible by fsdp is split over the
    "fsdp" axis (the first such one on a tie); leaves under min_size elements, scalars, and leaves with no
    dimension divisible by fsdp are replicated."""
    if fsdp <= 1 or len(shape) == 0 or math.prod(shape) < min_size:
        return PartitionSpec()
    candidates = [i for i, d in enumerate(shape) if d % fsdp == 0]
    if not candidates:
        return PartitionSpec()
    axis = max(candidates, key=lambda i: (shape[i], -i))
    return PartitionSpec(*([None] * axis), FSDP_AXIS)


def state_shardings(state: Any, mesh: Mesh, min_size: int = MIN_SHARD_SIZE) -> Any:
    """A pytree like `state` (arrays or jax.ShapeDtypeStructs) with a NamedSharding per leaf."""
    fsdp = mesh.shape[FSDP_AXIS] if FSDP_AXIS in mesh.shape else 1
    return jax.tree.map(lambda x: NamedSharding(mesh, partition_spec(tuple(np.shape(x)), fsdp, min_size)), state)


def shard_state(state: Any, mesh: Mesh, min_size: int = MIN_SHARD_SIZE) -> Any:
    """Place a built state (every process holding the same values) on the mesh, sharded by the rule."""
    return jax.device_put(state, state_shardings(state, mesh, min_size))


def abstract_sharded(init: Callable[[], Any], mesh: Mesh, min_size: int = MIN_SHARD_SIZE) -> Any:
    """init()'s tree as jax.ShapeDtypeStructs carrying the rule's shardings, computing nothing: a restore
    target (Orbax reads each shard straight into place, and no fresh state is built only to be replaced)."""
    abstract = jax.eval_shape(init)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        abstract,
        state_shardings(abstract, mesh, min_size),
    )


def create_sharded(init: Callable[[], Any], mesh: Mesh, min_size: int = MIN_SHARD_SIZE) -> Any:
    """init() (e.g. `lambda: create_train_state(cfg, model, x)`), computed straight into its shards.

    The state is jitted with out_shardings, so no device ever holds the whole of it: the way to build a
    model bigger than one device. The values are those of init() run on its own (the same PRNG draws).
    """
    abstract = jax.eval_shape(init)
    leaves, treedef = jax.tree.flatten(abstract)
    shardings = jax.tree.leaves(state_shardings(leaves, mesh, min_size))
    # Flat leaves out: the state's static fields (an optimizer, a schedule) are new objects on every
    # call of init, so a second trace's tree would not equal the first's; the first's is kept.
    flat = jax.jit(lambda: jax.tree.leaves(init()), out_shardings=shardings)()
    return jax.tree.unflatten(treedef, flat)


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Place every leaf of tree whole on every device (fsdp = 1's layout)."""
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


def pin_shardings(
    step: Callable[..., Any], state: Any, donate: bool = True, gather_params: bool = True
) -> jax.stages.Wrapped:
    """step(state, *args) -> (state, rest...), jitted to return the state in the shardings it has now
    (and everything else replicated), with the state donated.

    gather_params: a state with `.params` (and `.replace`, a flax struct) enters the step with its params
    constrained to be whole on every device, so XLA all-gathers the weights once per call and reduce-
    scatters their gradients, and the activations stay split over the batch. Left to itself, GSPMD
    followed the weights' feature split into the activations, and had to replicate some of them
    ("Involuntary full rematerialization"): measured on the shakespeare GPT, 1.3x the temporaries of
    fsdp = 1, against ~1.0x with the gather.

    Without it, GSPMD's propagation picks the output layout: usually the input's, but nothing says so,
    and a state that came back in another layout would not be donated into (new buffers every update)
    and would drift from the layout the checkpoint's restore target expects. `step` may itself be jitted.
    """
    shardings = jax.tree.map(lambda x: x.sharding, state)
    named = [s for s in jax.tree.leaves(shardings) if isinstance(s, NamedSharding)]
    if not named:
        raise ValueError("pin_shardings needs a state placed on a mesh (shard_state or create_sharded)")
    replicated = NamedSharding(named[0].mesh, PartitionSpec())

    def pinned(s: Any, *args: Any) -> Any:
        return step(whole_params(s, replicated.mesh) if gather_params else s, *args)

    return jax.jit(pinned, donate_argnums=0 if donate else (), out_shardings=(shardings, replicated))


def whole_params(state: Any, mesh: Mesh | AbstractMesh) -> Any:
    """Inside a jitted step: a state with `.params` (a flax struct) gets them whole on every device.

    FSDP's schedule: XLA all-gathers each sharded weight where the model uses it (once per call) and
    reduce-scatters its gradient back, so the activations stay split over the batch (and the sums over
    the batch come out the same for every layout). Any other pytree is returned as it is.
    """
    if hasattr(state, "params") and hasattr(state, "replace"):
        return state.replace(
            params=jax.lax.with_sharding_constraint(state.params, NamedSharding(mesh, PartitionSpec()))
        )
    return state


def shard_batch(local_batch: dict[str, np.ndarray], mesh: Mesh, stacked: bool = False) -> dict[str, jax.Array]:
    """A global batch array from this process's rows, split along the batch axis over all devices of the
    mesh: axis 0, or axis 1 of `stacked` micro-batches [n, batch, ...] (what the loop dispatches)."""
    axes = tuple(a for a in BATCH_AXES if a in mesh.shape)
    sharding = NamedSharding(mesh, PartitionSpec(None, axes) if stacked else PartitionSpec(axes))
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local_batch.items()}


def to_host(tree: Any) -> Any:
    """The tree's full values as numpy arrays on every process (leaves split across processes are
    gathered one at a time); for digests and inspection, not for the training path."""
    from jax.experimental import multihost_utils

    def get(x: Any) -> Any:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return multihost_utils.process_allgather(x, tiled=True)
        return np.asarray(jax.device_get(x))

    return jax.tree.map(get, tree)


def state_bytes_per_device(state: Any) -> dict[Any, int]:
    """Bytes of the state each (addressable) device holds: the sum of its shards' nbytes."""
    out: dict[Any, int] = {}
    for leaf in jax.tree.leaves(state):
        for shard in leaf.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out
