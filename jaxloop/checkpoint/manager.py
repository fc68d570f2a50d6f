"""Orbax rotating checkpoints: TrainState + data position + config + run metadata per saved update.

Retention is Orbax's AnyPreservationPolicy of LatestN(keep_last), BestN(keep_best by best_metric) and
EveryNSteps(keep_every): the newest checkpoint is never deleted (unlike max_to_keep + best_fn, orbax
#526). Restores go against the fresh state as target, so optimizer states come back as their own types.
A damaged step (a file missing or truncated, an array or data position that fails its digest, a digest of
another update or of an unknown form, a non-finite state) is moved aside with a warning and the previous one
is used. Damage needs that proof from the step's own bytes: a step whose structure (leaf paths, shapes,
dtypes, read from Orbax's metadata) differs from the state being resumed holds another model, and the
restore is refused (CheckpointMismatch, a ConfigError: exit 2) with nothing moved.

Every checkpoint carries a digest of what it holds (item `digest`, jaxloop.checkpoint.digest: the update it is
saved at, sha256 of each state leaf's dtype, shape and bytes, jaxloop.update.state.leaf_digests, and of the
data position's JSON), computed
from the arrays as handed to Orbax (the hand-over thread of an async save: off the loop's path) and
committed with the step. Every
restore (resume, load_model, --init_from, sampling) checks it; a checkpoint written before digests is
restored with a one-time warning that it is unverified.

An async save blocks the loop only while the state is protected from the next train_step, which
donates its buffers: on CPU, zero-copy NumPy views hold them (JAX does not donate a buffer that has
external references, so that step allocates fresh ones); on accelerators, a device-side copy. A
background thread then hands the state to Orbax, whose own async save copies it to the host and
writes it, so Orbax's per-leaf bookkeeping (tens of ms for a few hundred leaves) stays off the loop.
One process on the CPU hands Orbax the NumPy views themselves (the same zarr arrays on disk, restored
as jax.Arrays against the loop's targets): Orbax's NumPy handler copies and writes them without the
jax.Array handler's per-array bookkeeping, about half its CPU per save.
At most one hand-over is pending: a save first waits for the previous one. With several processes
Orbax's save is called on the loop's thread (its barriers are collectives that every process must
issue in the same order), so only Orbax's own async write is in the background.

A save that fails (a full disk: ENOSPC, tensorstore's RESOURCE_EXHAUSTED) raises CheckpointWriteError,
one line naming the path, the error, the free space and the last good (committed) checkpoint
(jaxloop.checkpoint.write_errors); Orbax's own reports of it (absl errors, and the "Event loop is closed"
tracebacks of the writes its failed gather abandoned) are kept off the console while the Checkpointer is
open, and only then (jaxloop.checkpoint.orbax_quiet). Orbax writes a step into N.orbax-checkpoint-tmp and renames
it to N once complete, so only whole steps are ever listed or restored; the next start deletes the
leftover (cleanup_tmp_directories) and resumes from the last good one. Before each save, the free space
is compared with the last checkpoint's size: a warning (once) when at most one more save fits.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import shutil
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as cm

from jaxloop.checkpoint.digest import checkpoint_digest, finite, verify
from jaxloop.checkpoint.orbax_quiet import MessageFilter, close_abandoned_reads, quiet_absl, quiet_checkpointing
from jaxloop.checkpoint.write_errors import committed_steps, free_bytes, root_cause, size_text, write_error
from jaxloop.config.errors import CheckpointWriteError, ConfigError
from jaxloop.config.run import CheckpointConfig, Config
from jaxloop.rundir.layout import DAMAGED_DIR, RunLayout
from jaxloop.rundir.model_identity import first_differences, model_differences
from jaxloop.runtime.processes import barrier, is_primary
from jaxloop.update.state import TrainState, leaf_path, model_record

ITEMS = ("state", "data", "config", "metadata", "digest")
SPACE_MARGIN = 2
"""Warn when the free space holds fewer than this many checkpoints of the last one's size (one more save)."""


class NonFiniteStateError(RuntimeError):
    """Raised instead of saving a state that holds NaN or Inf."""


class CheckpointMismatch(ConfigError):
    """A checkpoint whose structure is not the state's being resumed: another model's, refused, not damaged."""


@dataclass
class Restored:
    step: int
    state: TrainState
    data: dict[str, Any]
    metadata: dict[str, Any]
    path: Path | None = None
    """The checkpoint's directory."""
    verified: bool = True
    """Whether its bytes were checked against a digest (False: a checkpoint of an older jaxloop, or of
    several processes, checked only for being finite)."""


def preservation_policy(c: CheckpointConfig) -> cm.PreservationPolicy:
    """Keep the last N, the best N by the validation metric, and every M-th update, together."""
    policies: list[cm.PreservationPolicy] = [cm.LatestN(n=c.keep_last)]
    if c.keep_best:
        # BestN sorts ascending (reverse=False) and keeps the tail, so `min` needs reverse=True.
        policies.append(
            cm.BestN(
                get_metric_fn=_metric_fn(c.best_metric),
                reverse=c.best_mode == "min",
                n=c.keep_best,
                keep_checkpoints_without_metrics=False,
            )
        )
    if c.keep_every:
        policies.append(cm.EveryNSteps(interval_steps=c.keep_every))
    return cm.AnyPreservationPolicy(policies)


def _metric_fn(name: str):
    return lambda metrics: float(metrics[name])


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


_device_copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))  # new buffers, same shardings


def _host_views(state: TrainState) -> list[np.ndarray] | None:
    """Zero-copy NumPy views of every addressable shard of the state's buffers, which keep them from
    being donated; None where views cannot hold them (accelerators, extended dtypes such as PRNG keys)
    or must not stand for them (several processes: Orbax must see global arrays)."""
    leaves = jax.tree.leaves(state)
    if (
        jax.process_count() > 1
        or any(d.platform != "cpu" for leaf in leaves for d in leaf.devices())
        or any(jnp.issubdtype(leaf.dtype, jax.dtypes.extended) for leaf in leaves)
    ):
        return None
    return [np.asarray(shard.data) for leaf in leaves for shard in leaf.addressable_shards]


def _for_orbax(state: TrainState, views: list[np.ndarray] | None) -> TrainState:
    """What Orbax is given: the views themselves where each is a whole leaf (one shard a leaf), else
    the state.

    Orbax copies and writes NumPy arrays without its jax.Array handler's per-array bookkeeping (the same
    zarr arrays on disk; a restore against jax.Array targets gives jax.Arrays, one without a target
    NumPy arrays): about half its CPU per save (`python benchmarks/bench_checkpoint.py --cpu`).
    """
    if views is not None and len(views) == len(jax.tree.leaves(state)):
        return jax.tree.unflatten(jax.tree.structure(state), views)
    return state


def _protect(state: TrainState) -> tuple[TrainState, list[Any]]:
    """The state to hand over and what keeps its buffers from being donated until Orbax holds them."""
    views = _host_views(state)
    if views is not None:
        return _for_orbax(state, views), views
    return jax.block_until_ready(_device_copy(state)), []


class Checkpointer:
    """One run's CheckpointManager. Always close() it (in a finally): that awaits the last save.

    options: retention and async (the run's checkpoint.* config); config: the run's config as a dict,
    saved with every checkpoint beside `metadata`."""

    def __init__(
        self,
        options: CheckpointConfig,
        run_dir: str | Path,
        *,
        config: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
    ):
        self.options = options
        self.layout = RunLayout(Path(run_dir).absolute())
        self.directory = self.layout.checkpoints
        self.config, self.metadata = config or {}, metadata or {}
        # Orbax's console reports of what this Checkpointer reports itself, off until close() (orbax_quiet)
        self._quiet = contextlib.ExitStack()
        self._quiet.enter_context(quiet_checkpointing())
        try:
            self._open(options)
        except BaseException:
            self._quiet.close()
            raise

    def _open(self, options: CheckpointConfig) -> None:
        manager_options = ocp.CheckpointManagerOptions(
            best_fn=_metric_fn(options.best_metric),
            best_mode=options.best_mode,
            preservation_policy=preservation_policy(options),
            enable_async_checkpointing=options.async_save,
            cleanup_tmp_directories=True,  # leftovers of a save interrupted by SIGKILL
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=manager_options, item_names=ITEMS)
        # Orbax's save runs barriers made of device collectives, which must come in the same order on
        # every process: with several processes it stays on the loop's thread (Orbax's own async save).
        self._stager = (
            ThreadPoolExecutor(1, thread_name_prefix="jaxloop-checkpoint")
            if options.async_save and jax.process_count() == 1
            else None
        )
        self._handover: Future | None = None
        self._handed: list[int] = []  # the steps handed to Orbax, in order
        self._failed: CheckpointWriteError | None = None  # the first failed save, raised again on every call
        self._space_warned = False
        self._sizes: dict[int, int] = {}  # bytes on disk of committed steps, measured once each

    @staticmethod
    def has_checkpoint(directory: Path) -> bool:
        """Whether a run's checkpoint directory holds anything (a checkpoint, valid or not)."""
        return directory.is_dir() and any(directory.iterdir())

    def save(
        self,
        step: int,
        state: TrainState,
        data: dict[str, Any],
        metrics: dict[str, float] | None = None,
        check_finite: bool = True,
    ) -> float:
        """Save at an update boundary; returns the seconds the caller was blocked.

        check_finite reads the whole state once (tens of ms for 100M floats on a CPU); the loop skips it
        because train_step never returns a non-finite state (it skips such updates).
        """
        t0 = time.perf_counter()
        if check_finite and not bool(finite((state.params, state.opt_state))):
            raise NonFiniteStateError(f"refusing to save update {step}: the state holds NaN or Inf")
        self._raise_failed()
        self._check_space()
        if self._stager is None:
            with self._writing():
                self._save(step, _for_orbax(state, _host_views(state)), data, metrics)
        else:
            self._finish_handover()  # at most one snapshot waits; raises a failed hand-over's error
            snapshot, pins = _protect(state)
            self._handover = self._stager.submit(self._save, step, snapshot, copy.deepcopy(data), metrics, pins)
        return time.perf_counter() - t0

    def _raise_failed(self) -> None:
        if self._failed is not None:
            raise self._failed

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """A failed write inside becomes CheckpointWriteError: the first one is kept (the manager is not used
        again) and every later call raises the same line."""
        try:
            yield
        except CheckpointWriteError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of a save is a failed write
            if self._failed is None:
                self._failed = write_error(e, self.directory, self._handed)
            raise self._failed from e

    def _check_space(self) -> None:
        """Warn once when the free space holds fewer than SPACE_MARGIN checkpoints of the last one's size."""
        good = committed_steps(self.directory)
        if self._space_warned or not good:
            return
        last = good[-1]
        if last not in self._sizes:
            self._sizes[last] = _tree_bytes(self.directory / str(last))
        free = free_bytes(self.directory)
        if free is not None and free < SPACE_MARGIN * self._sizes[last]:
            self._space_warned = True
            warnings.warn(
                f"the next saves will not fit in {self.directory}: {size_text(free)} free, each save "
                f"~{size_text(self._sizes[last])} (update {last}); free some space or lower "
                "checkpoint.keep_last",
                DiskSpaceWarning,
                stacklevel=3,
            )

    def _save(
        self,
        step: int,
        state: TrainState,
        data: dict[str, Any],
        metrics: dict[str, float] | None,
        pins: list[Any] | None = None,
    ) -> None:
        """Orbax's save (async or not); `pins` are released when it returns, Orbax then holds the buffers."""
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(data),
            config=ocp.args.JsonSave(self.config),
            metadata=ocp.args.JsonSave(self.metadata),
            # read from the arrays handed to Orbax (host views, or a device copy), before it holds them;
            # several processes hold only their shards of the state: no digest there
            digest=ocp.args.JsonSave(
                checkpoint_digest(state, data, step)
                if jax.process_count() == 1
                else {"algorithm": None, "why": "several processes: each holds part of the state"}
            ),
        )
        self._handed.append(step)
        self.manager.save(step, args=args, metrics=metrics, force=True)

    def _finish_handover(self) -> None:
        """Wait until the background thread has handed the last snapshot to Orbax; re-raise its error."""
        if self._handover is not None:
            handover, self._handover = self._handover, None
            with self._writing():
                handover.result()

    def restore_latest(self, target: TrainState) -> Restored | None:
        """The newest checkpoint that restores; damaged newer ones are warned about and moved aside. A step of
        another structure than `target` is not damaged: CheckpointMismatch, nothing moved (nor the damaged
        newer steps: they are moved once a step restores, or none does)."""
        expected = model_record(target)
        damaged: list[tuple[int, str]] = []
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                check_structure(self.directory, step, expected)
                out = restore(self.manager, step, target, data=True)
                for bad, why in damaged:
                    self.set_aside(bad, why)
                return Restored(
                    step=step,
                    state=out["state"],
                    data=dict(out["data"]),
                    metadata=dict(out["metadata"] or {}),
                    path=self.directory / str(step),
                    verified=out["verified"],
                )
            except CheckpointMismatch:
                raise
            except Exception as e:  # noqa: BLE001 - any other failure to read a step means it is damaged
                damaged.append((step, root_cause(e)))
        for bad, why in damaged:
            self.set_aside(bad, why)
        return None

    def set_aside(self, step: int, why: str) -> None:
        """Warn that the checkpoint of `step` is damaged (`why`) and move it to checkpoints_damaged/."""
        warnings.warn(
            f"checkpoint at update {step} is damaged ({why}); moving it to {DAMAGED_DIR}/ and trying the previous one",
            stacklevel=3,
        )
        self._quarantine(step)

    def _quarantine(self, step: int) -> None:
        self._finish_handover()
        if is_primary():  # every process found the step damaged; one moves it
            damaged = self.layout.damaged
            damaged.mkdir(exist_ok=True)
            src = self.directory / str(step)
            if src.exists():
                shutil.move(str(src), str(damaged / f"{step}-{int(time.time())}"))
        barrier(f"jaxloop: checkpoint {step} moved aside")
        self.manager.reload()

    def all_steps(self) -> list[int]:
        self._finish_handover()
        return sorted(self.manager.all_steps())

    def best_step(self) -> int | None:
        """The kept step with the best best_metric (None before any evaluated save)."""
        self._finish_handover()
        return self.manager.best_step() if self.options.keep_best else None

    def wait(self) -> None:
        """Block until pending async saves are committed; raises their errors (CheckpointWriteError)."""
        self._raise_failed()
        self._finish_handover()
        with self._writing():
            self.manager.wait_until_finished()
            self.manager.check_for_errors()

    def close(self) -> None:
        """Await the last save (its errors surface here), then close the manager and the thread. After a
        failed save the failure is raised again, with the last good checkpoint as it is now, without
        waiting for the failed save's writes: Orbax's commit threads may wait for it until Orbax's
        coordination timeout (300 s), and the process they keep alive is ended by the command line's edge
        once its one line is out (jaxloop.runtime.signals.end_process)."""
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.shutdown(wait=True)
            failed = self._failed
            try:
                if failed is None:
                    self.manager.close()
            finally:
                self._quiet.close()
            if failed is not None:
                raise write_error(failed.__cause__ or failed, self.directory, self._handed) from failed.__cause__


class DiskSpaceWarning(UserWarning):
    """The free space beside the checkpoints holds at most one more save."""


def restore(
    manager: ocp.CheckpointManager, step: int, target: Any, data: bool = False, cast: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """The one Orbax restore of jaxloop: the state of `step` against `target` (a TrainState to resume,
    or an abstract tree to read), with the data position and metadata when `data`; checked against the
    step's digest (`verify`: DamagedCheckpointError; `cast`: leaves the target converts on purpose)."""
    items: dict[str, ocp.args.CheckpointArgs] = {"state": ocp.args.StandardRestore(target)}
    if data:
        items.update(data=ocp.args.JsonRestore(), metadata=ocp.args.JsonRestore())
    directory = Path(manager.directory).absolute()
    has_digest = (directory / str(step) / "digest").is_dir()
    if has_digest:
        items["digest"] = ocp.args.JsonRestore()
    try:
        out = manager.restore(step, args=ocp.args.Composite(**items))
    except Exception:
        close_abandoned_reads()
        raise
    verified = verify(dict(out), out["digest"] if has_digest else None, directory, cast, step=step)
    return {**dict(out), "verified": verified}


def read_checkpoint(
    run_dir: str | Path, which: str = "best", cfg: Config | None = None, follow_x64: bool = True
) -> tuple[int, str, dict]:
    """(step, "best" or "latest" (or the step asked for by its number), the saved TrainState as nested dicts)
    of a run, read-only.

    Nothing in run_dir is changed (a damaged step is skipped with a warning, not moved). The state is
    restored against an abstract tree built from the checkpoint's own metadata, on the first local
    device, so no model needs building. `best` (by checkpoint.best_metric) falls back to the latest
    checkpoint, with a warning, when no checkpoint holds validation metrics. FileNotFoundError when
    the run holds no readable checkpoint. `follow_x64`: an fp64 run's checkpoint is read in jax's x64
    mode, so its float64 leaves come back float64 (compute with them inside `jax.enable_x64(True)`);
    False reads them as the current mode's floats (a run taking another run's params to cast them to its
    own). jax's x64 mode and absl's log level are as before when it returns.
    """
    from jaxloop.rundir.rules import read_config

    layout = RunLayout.of(Path(run_dir).absolute())
    run_dir = layout.root
    if cfg is None:
        cfg = read_config(layout)
    directory = layout.checkpoints
    if not directory.is_dir() or not any(p.name.isdigit() for p in directory.iterdir()):
        raise FileNotFoundError(f"{run_dir} holds no checkpoint (nothing in {directory})")
    with contextlib.ExitStack() as scope:
        if cfg.precision == "fp64" and follow_x64:
            scope.enter_context(jax.enable_x64(True))
        scope.enter_context(quiet_absl(logging.ERROR))  # orbax warns at length about read-only managers
        return _read_steps(run_dir, directory, cfg, which)


def _read_steps(run_dir: Path, directory: Path, cfg: Config, which: str) -> tuple[int, str, dict]:
    """read_checkpoint's read: the chosen step, else the next newest that reads."""
    metric = cfg.checkpoint.best_metric
    options = ocp.CheckpointManagerOptions(
        read_only=True, create=False, best_mode=cfg.checkpoint.best_mode, best_fn=lambda metrics: float(metrics[metric])
    )
    with ocp.CheckpointManager(directory, options=options, item_names=ITEMS) as manager:
        steps = sorted(manager.all_steps(), reverse=True)
        if not steps:
            raise FileNotFoundError(f"{run_dir} holds no committed checkpoint (in {directory})")
        chosen, first = which, steps[0]
        if which.isdigit():  # one step by its number: that step or nothing
            if int(which) not in steps:
                raise FileNotFoundError(
                    f"{run_dir} holds no checkpoint of update {which} (it holds {', '.join(map(str, sorted(steps)))})"
                )
            first = int(which)
            steps = [first]
        if which == "best":
            try:
                best = manager.best_step()
            except Exception:  # noqa: BLE001 - metrics missing or unreadable
                best = None
            if best is None:
                warnings.warn(f"no checkpoint of {run_dir} holds {metric}; using the latest", stacklevel=3)
                chosen = "latest"
            else:
                first = best
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        for step in [first] + [s for s in steps if s != first]:
            try:
                meta = _state_metadata(directory / str(step))
                abstract = jax.tree.map(
                    lambda m: jax.ShapeDtypeStruct(m.shape, jax.dtypes.canonicalize_dtype(m.dtype), sharding=sharding),
                    meta,
                )
                # float64 leaves read as float32 (follow_x64=False, x64 off) are converted: their digest cannot match
                cast = frozenset(
                    leaf_path(p)
                    for p, m in jax.tree_util.tree_flatten_with_path(meta)[0]
                    if jax.dtypes.canonicalize_dtype(m.dtype) != m.dtype
                )
                return int(step), chosen, restore(manager, step, abstract, cast=cast)["state"]
            except Exception as e:  # noqa: BLE001 - any failure to read a step means it is damaged
                warnings.warn(
                    f"checkpoint at update {step} could not be read ({root_cause(e)}); trying the next newest",
                    stacklevel=3,
                )
                chosen = "latest"
    raise FileNotFoundError(f"no checkpoint of {run_dir} could be read")


def read_state(run_dir: str | Path, step: int, target: TrainState) -> TrainState | None:
    """The state a run saved at `step`, restored against `target` (the run's state, abstract) and checked
    against its digest, read-only: a finished run's final state. None, with a warning, where it does not
    read (its step deleted or damaged: nothing is moved)."""
    directory = RunLayout.of(Path(run_dir).absolute()).checkpoints
    with contextlib.ExitStack() as scope:
        scope.enter_context(quiet_absl(logging.ERROR))  # Orbax warns at length about read-only managers
        options = ocp.CheckpointManagerOptions(read_only=True, create=False)
        manager = scope.enter_context(ocp.CheckpointManager(directory, options=options, item_names=ITEMS))
        try:
            if step not in manager.all_steps():
                raise FileNotFoundError(f"no checkpoint of update {step} in {directory}")
            check_structure(directory, step, model_record(target))
            return restore(manager, step, target)["state"]
        except CheckpointMismatch:
            raise
        except Exception as e:  # noqa: BLE001 - the summary is still the run's; the state is not to be had
            warnings.warn(
                f"the final state of {directory.parent} could not be read ({root_cause(e)}); no state returned",
                stacklevel=3,
            )
            return None


def _state_metadata(step_dir: Path) -> Any:
    """Orbax's metadata tree of a step's state (shapes and dtypes, no arrays read); ValueError when there is
    none. The path is made absolute: Orbax reads no metadata from a relative one (and says so only in a log
    line). Orbax's warning that the item has no _CHECKPOINT_METADATA of its own (the step directory holds it)
    is kept off the console."""
    item = Path(step_dir).absolute() / "state"
    with (
        quiet_absl(
            logging.NOTSET, MessageFilter("Metadata file does not exist"), MessageFilter("Failed to get item metadata")
        ),
        ocp.StandardCheckpointer() as reader,
    ):
        meta = reader.metadata(item).item_metadata
    if meta is None or not jax.tree.leaves(meta):  # Orbax reads a missing state item as an empty tree
        raise ValueError(f"no readable state metadata in {item}")
    return meta


def saved_structure(directory: str | Path) -> dict[str, Any] | None:
    """The model record (jaxloop.update.state.model_record; the class unknown) of the newest committed checkpoint
    in `directory` whose metadata reads, from Orbax's metadata alone: what a resume would restore first,
    compared with the model before anything is written (and the identity of a run from before model.json).
    None when no checkpoint's metadata reads. A step whose metadata does not read is skipped: its restore
    calls it damaged (its own files are missing or broken)."""
    for step in reversed(committed_steps(Path(directory).absolute())):
        try:
            return model_record(_state_metadata(Path(directory) / str(step)))
        except Exception:  # noqa: BLE001 - unreadable metadata: the restore will call it damaged
            continue
    return None


def check_structure(directory: Path, step: int, expected: dict[str, Any]) -> None:
    """CheckpointMismatch when the checkpoint of `step` holds leaves of other paths, shapes or dtypes than
    `expected` (a model record). Metadata that does not read (ocdbt keeps it in the array files, so a
    truncated array breaks it too) is left to the restore, which reads the same files, reports what failed
    and calls the step damaged."""
    try:
        saved = model_record(_state_metadata(directory / str(step)))
    except Exception:  # noqa: BLE001 - the restore reads the same files and reports them damaged
        return
    differences = model_differences(saved, expected)
    if differences:
        raise CheckpointMismatch(
            "run_dir",
            str(directory.parent),
            f"checkpoints of the model trained now; the "
            f"checkpoint of update {step} holds another: {first_differences(differences)}; "
            "nothing was moved",
        )


def load_model(run_dir: str | Path, model: Any, which: str = "best") -> Any:
    """The trained weights of a run, given back in the user's form: an NNX module (updated in place
    with the checkpoint's params and state, in eval mode), or for a Linen module its variables
    {"params": ..., other collections}. `which`: the best (checkpoint.best_metric) or latest checkpoint.
    Changes no global state: an fp64 run's weights come back float64, to be used inside
    `jax.enable_x64(True)` (outside it jax computes with them in float32)."""
    from jaxloop.model.interface import NnxModel, is_nnx

    _, _, saved = read_checkpoint(run_dir, which)
    if not is_nnx(model):
        return {"params": saved["params"], **saved.get("model_state", {})}
    from flax import nnx

    adapter, params, model_state = NnxModel.split(model)
    params, model_state = _fill(params, saved["params"]), _fill(model_state, saved["model_state"])
    nnx.update(model, params, adapter._typed(model_state))
    model.eval()
    return model


def _fill(target: Any, saved: dict[str, Any]) -> Any:
    """target's tree with each leaf taken from the nested dict `saved` at the same names."""

    def name(key: Any) -> str:
        return str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key))))

    def leaf(path: Any, _: Any) -> Any:
        node = saved
        for key in path:
            node = node[name(key)] if isinstance(node, dict) else node[int(name(key))]
        return node

    return jax.tree_util.tree_map_with_path(leaf, target)
