"""The input pipeline: sources -> grain (order, shard, gather, worker processes) -> device prefetch.

    splits = load_splits(cfg)                        # jaxloop.data.sources, numpy only
    with TrainLoader(splits, seed=0, batch_size=64, position=p) as loader, DevicePrefetcher(loader, 2) as it:
        batch = next(it)                             # this process's shard of micro-batch `position`
        ...
        checkpoint["data"] = it.state()              # micro-batches consumed, not merely prefetched

Worker invariance: every grain element is one whole (sharded) micro-batch (with `chunks()`, one
call's micro-batches stacked), gathered from the deterministic `record_order`; workers only decide *who* computes a
batch, never *what* is in it, so
data.workers = 0, 1, 2, ... give the same batches in the same order. The checkpointable state is the
micro-batch position alone, so a run saved with one worker count resumes with any other.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import grain
import jax
import numpy as np
from absl import flags as absl_flags

from jaxloop.config.run import Config, ConfigError
from jaxloop.data.sources import (
    Batch,
    ChunkGather,
    MicroBatchGather,
    Splits,
    batches_in_epoch,
    eval_records,
    shard_slice,
    stack_batches,
)
from jaxloop.data.workers import loader_worker_init

STATE_VERSION = 1
WORKER_BUFFER = 2
"""Elements each worker process keeps ready (as torch's DataLoader prefetch_factor=2): micro-batches,
or with TrainLoader.chunks() whole chunks."""
_END = 2**62
"""Exclusive upper bound of micro-batch indices: the loader is, in practice, endless."""


def _process(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    p = jax.process_index() if process_index is None else int(process_index)
    n = jax.process_count() if process_count is None else int(process_count)
    if n < 1 or not 0 <= p < n:
        raise ValueError(f"process_index {p} not in [0, {n})")
    return p, n


def _ensure_absl_flags_parsed() -> None:
    """grain reads absl flags when it starts workers; unparsed flags raise there (grain #1355)."""
    if not absl_flags.FLAGS.is_parsed():
        absl_flags.FLAGS.mark_as_parsed()


def _plain(batch: Batch) -> Batch:
    # Worker outputs arrive in shared-memory segments; copy them out (a memcpy) so each segment is
    # unlinked as soon as it is read, not whenever the caller drops the batch.
    return {k: np.array(v, copy=True) for k, v in batch.items()}


def _weak_close(obj: Any) -> Callable[[], None]:
    """An atexit callback that closes `obj` if it is still alive, without keeping it alive."""
    ref = weakref.ref(obj)

    def close() -> None:
        live = ref()
        if live is not None:
            live.close()

    return close


class TrainLoader(Iterator[Batch]):
    """This process's shard of micro-batches position, position + 1, ... as numpy dicts {x, y}.

    Endless (epochs follow one another, each reshuffled from (seed, epoch)). `position` counts
    the micro-batches yielded so far plus the start, and is the whole checkpointable state:
    `state()` / `TrainLoader.from_state(splits, state, ...)`. `workers` processes start on the first
    `next()`; `close()` (or leaving a `with` block) stops them, and they are stopped at interpreter exit
    otherwise. `transform(batch) -> batch` runs in the workers after the gather; it must be picklable
    and deterministic. `train_loader(cfg, splits)` builds one from a run's config.
    """

    def __init__(
        self,
        splits: Splits,
        *,
        seed: int,
        batch_size: int,
        position: int = 0,
        workers: int = 0,
        process_index: int | None = None,
        process_count: int | None = None,
        transform: Callable[[Batch], Batch] | None = None,
    ):
        if isinstance(position, bool) or not isinstance(position, (int, np.integer)) or position < 0:
            raise ValueError(f"position must be an integer >= 0, got {position!r}")
        position = int(position)
        self.process_index, self.process_count = _process(process_index, process_count)
        self.workers = int(workers)
        if self.workers < 0:
            raise ValueError(f"workers must be an integer >= 0, got {workers!r}")
        self.seed, self.batch_size, self.num_train = int(seed), int(batch_size), splits.num_train
        self.batches_per_epoch = batches_in_epoch(self.batch_size, self.num_train)
        shard_slice(self.batch_size, self.process_index, self.process_count)  # ConfigError if not divisible
        self.local_batch_size = self.batch_size // self.process_count
        self._gather = MicroBatchGather(
            splits.train, self.seed, self.batch_size, self.process_index, self.process_count, transform
        )
        self._start = position
        self._position = position
        self._it: Any = None
        self._chunked = False
        self._closed = False
        # Close before interpreter teardown (atexit runs last-registered first, so a DevicePrefetcher
        # made afterwards stops its thread before this runs, and this runs before grain's own
        # multiprocessing finalizers): workers stop and shared-memory buffers are released in order.
        self._atexit = _weak_close(self)
        atexit.register(self._atexit)

    # -- state

    @property
    def position(self) -> int:
        """Global index of the next micro-batch this loader yields (= micro-batches consumed)."""
        return self._position

    @property
    def epoch(self) -> int:
        """Epoch of the next micro-batch."""
        return self._position // self.batches_per_epoch

    def state(self, position: int | None = None) -> dict[str, int]:
        """JSON-able checkpoint of the loader (at `position`, default the current one)."""
        return {
            "version": STATE_VERSION,
            "position": self._position if position is None else int(position),
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_train": self.num_train,
        }

    def record_indices(self, b: int) -> np.ndarray:
        """This process's global training-record indices of micro-batch b (int64 [local_batch_size])."""
        return self._gather.indices(b)

    @classmethod
    def from_state(cls, splits: Splits, state: dict[str, Any], **kwargs: Any) -> TrainLoader:
        """A loader resuming where `state` left off (seed and batch_size taken from it unless given; any
        worker or process count). ValueError if a given seed or batch_size, or the training split's size,
        differ from the saved run's: the same position would then name other records."""
        kwargs.setdefault("seed", int(state["seed"]))
        kwargs.setdefault("batch_size", int(state["batch_size"]))
        mismatch = order_changes(state, kwargs["seed"], kwargs["batch_size"], splits.num_train)
        if mismatch:
            raise ValueError(f"the saved data order differs: {mismatch[0][0]}={mismatch[0][1]}, now {mismatch[0][2]}")
        return cls(splits, position=int(state["position"]), **kwargs)

    # -- iteration

    @property
    def started(self) -> bool:
        """Whether next() or chunks() has begun this loader's one pass."""
        return self._it is not None

    def chunks(self, size: int, first: int = 0) -> Iterator[Batch]:
        """The micro-batches from `position` on, stacked `size` at a time along a new leading axis (the
        first chunk `first`, if > 0): one grain element and one gather per chunk. `position` advances
        by a chunk's size as it is yielded. Use either this or next(), not both."""
        if self._closed:
            raise ValueError("TrainLoader is closed")
        if self._it is not None:
            raise ValueError("TrainLoader.chunks() after next() or chunks(): a loader is iterated once")
        element = ChunkGather(self._gather, self._position, size, first or size)  # ValueError on sizes < 1
        self._it, self._chunked = self._make_iterator(element, -(-_END // size)), True
        return self._yield_chunks(element)

    def _yield_chunks(self, element: ChunkGather) -> Iterator[Batch]:
        it, n = self._it, element.first
        while not self._closed:
            chunk = next(it)
            self._position += n
            yield _plain(chunk) if self.workers > 0 else chunk
            n = element.size

    def _make_iterator(self, element: Callable[[int], Batch] | None = None, end: int | None = None) -> Any:
        """grain's iterator over element(i) for i = 0, 1, ... (default: micro-batch `position` + i)."""
        if element is None:
            ds = grain.MapDataset.range(self._position, _END).map(self._gather)
        else:
            ds = grain.MapDataset.range(0, end).map(element)
        ids = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
        if self.workers > 0:
            _ensure_absl_flags_parsed()
            ids = ids.mp_prefetch(
                grain.MultiprocessingOptions(num_workers=self.workers, per_worker_buffer_size=WORKER_BUFFER),
                worker_init_fn=loader_worker_init,
            )
        return iter(ids)

    def __iter__(self) -> TrainLoader:
        return self

    def __next__(self) -> Batch:
        if self._closed:
            raise ValueError("TrainLoader is closed")
        if self._chunked:
            raise ValueError("TrainLoader.__next__ after chunks(): a loader is iterated once")
        if self._it is None:
            self._it = self._make_iterator()
        batch = next(self._it)
        if self.workers > 0:
            batch = _plain(batch)
        self._position += 1
        return batch

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        if not self._closed:
            self._closed = True
            atexit.unregister(self._atexit)
        it, self._it = self._it, None
        if it is not None:
            it.close()

    def __enter__(self) -> TrainLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def order_changes(state: dict[str, Any], seed: int, batch_size: int, num_train: int) -> list[tuple[str, int, int]]:
    """(name, saved, now) of each of seed, batch_size and num_train that differs from a loader's saved
    state: any one makes the saved position name other records."""
    now = {"seed": seed, "batch_size": batch_size, "num_train": num_train}
    return [(k, int(state[k]), v) for k, v in now.items() if k in state and int(state[k]) != v]


def train_loader(cfg: Config, splits: Splits, saved: dict[str, Any] | None = None) -> TrainLoader:
    """The run's loader (data.workers processes), at the start or where a checkpoint's loader state
    `saved` left off. ConfigError naming the field when the config's data order differs from the saved
    run's (seed, batch_size, or a training split of another size: data.path, unless data.allow_changed)."""
    if saved is None:
        return TrainLoader(splits, seed=cfg.seed, batch_size=cfg.batch_size, workers=cfg.data.workers)
    if cfg.data.allow_changed:  # data changed on purpose: the position goes on over the new training split
        saved = {**saved, "num_train": splits.num_train}
    for key, before, now in order_changes(saved, cfg.seed, cfg.batch_size, splits.num_train):
        field = {"num_train": "data.path"}.get(key, key)
        shown = now if key != "num_train" else (cfg.data.path or cfg.data.source)
        raise ConfigError(
            field,
            shown,
            f"the checkpointed run's data order ({key}={before}, now {now}); start a new run_dir to change it",
        )
    return TrainLoader.from_state(splits, saved, seed=cfg.seed, batch_size=cfg.batch_size, workers=cfg.data.workers)


def eval_batch_size(cfg: Config) -> int:
    """The validation batch size: data.eval_batch_size, 0 meaning batch_size."""
    return cfg.data.eval_batch_size or cfg.batch_size


def val_batches(
    splits: Splits,
    batch_size: int,
    process_index: int | None = None,
    process_count: int | None = None,
    records: np.ndarray | None = None,
) -> Iterator[Batch]:
    """The whole validation split in order (or only `records`, in their order), in global batches of
    `batch_size` (eval_batch_size(cfg)).

    Every batch has the full (per-process) size: the last one is padded by repeating the first record with
    `weight` 0; real records have weight 1 (float32 [n]). Each record appears exactly once over all
    batches and processes; process p gets rows [p*n/P, (p+1)*n/P) of each global batch.
    """
    p, n = _process(process_index, process_count)
    size = int(batch_size)
    rows = shard_slice(size, p, n)  # ConfigError (batch_size) when size does not split over the processes
    total = splits.num_val if records is None else len(records)
    for start in range(0, total, size):
        pos = np.arange(start, start + size, dtype=np.int64)
        weight = (pos < total).astype(np.float32)
        pos = np.where(pos < total, pos, 0)[rows]
        batch = splits.val.get(pos if records is None else np.asarray(records, np.int64)[pos])
        batch["weight"] = weight[rows]
        yield batch


def run_val_batches(cfg: Config, splits: Splits) -> Iterator[Batch]:
    """The batches a run's evaluation reads: val_batches over the whole split, or over cfg.eval_batches'
    fixed, seeded subset (jaxloop.data.sources.eval_records)."""
    size = eval_batch_size(cfg)
    return val_batches(splits, size, records=eval_records(cfg.seed, splits.num_val, cfg.eval_batches, size))


def num_val_batches(splits: Splits, batch_size: int) -> int:
    """How many batches val_batches yields over the whole split."""
    return -(-splits.num_val // batch_size)


# ----------------------------------------------------------------------------- device prefetch


_STOP = object()


def _stacked(source: Iterator[Batch], size: int, first: int = 0) -> Iterator[Batch]:
    """Micro-batches of `source` stacked `size` at a time (the first group `first`, if > 0)."""
    n = first or size
    while True:
        yield stack_batches([next(source) for _ in range(n)])
        n = size


class _Raised:
    def __init__(self, exc: BaseException):
        self.exc = exc


class DevicePrefetcher(Iterator[Any]):
    """Keeps `size` batches already on the device while the step runs (a background thread).

    next() returns put(batch) in the source's order; `last_wait_s` is how long that next() waited
    for data, `total_wait_s` the sum over all calls (log it as data_wait_ms). With size 0 nothing
    runs ahead: next() fetches and puts in the caller's thread (the wait then includes the fetch).
    `position` and `state()` count the batches handed out, not those prefetched, so checkpoint the
    prefetcher's state rather than its source's. close() (or a `with` block) stops the thread; it
    is also stopped at interpreter exit.
    """

    def __init__(
        self,
        iterator: Iterator[Any],
        size: int = 2,
        put: Callable[[Any], Any] | None = None,
        chunk: int = 0,
        first_chunk: int = 0,
    ):
        if size < 0:
            raise ValueError(f"prefetch size must be an integer >= 0, got {size!r}")
        self.chunk, self._first_chunk = int(chunk), int(first_chunk)
        self._source = iterator
        if chunk:  # a fresh TrainLoader gathers whole chunks itself; any other source is stacked here
            self._source = (
                iterator.chunks(self.chunk, self._first_chunk)
                if isinstance(iterator, TrainLoader) and not iterator.started
                else _stacked(iterator, self.chunk, self._first_chunk)
            )
        self._position_source: Any = iterator  # state() needs one with state(position), e.g. a TrainLoader
        self._head: Any = None  # the chunk take() last cut, and where what is left of it starts
        self._offset = 0
        self._put = put if put is not None else jax.device_put
        self.size = int(size)
        self._start = int(getattr(iterator, "position", 0))
        self.taken = 0
        self.consumed = 0
        self.last_wait_s = 0.0
        self.total_wait_s = 0.0
        self._done = False
        self._stop = threading.Event()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(self.size, 1))
        self._thread: threading.Thread | None = None
        if self.size > 0:
            self._thread = threading.Thread(target=self._produce, name="jaxloop-device-prefetch", daemon=True)
            self._thread.start()
            self._atexit = _weak_close(self)
            atexit.register(self._atexit)

    def _produce(self) -> None:
        try:
            for batch in self._source:
                item = self._put(batch)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._offer(_STOP)
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            self._offer(_Raised(e))

    def _offer(self, item: Any) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    @property
    def position(self) -> int:
        """The source's position after the batches handed out so far (micro-batches, with `chunk`)."""
        return self._start + (self.taken if self.chunk else self.consumed)

    def state(self) -> dict[str, Any]:
        """The source's state at `position` (needs a source with state(position), e.g. TrainLoader)."""
        return self._position_source.state(self.position)

    def take(self, n: int) -> Any:
        """The next n micro-batches stacked along a new leading axis, on the device (needs `chunk`).

        A whole prefetched chunk of n is handed over as it is; otherwise chunks are cut and joined on
        the device (after a skipped update moved the loop off the chunk grid).
        """
        parts, have = [], 0
        while have < n:
            if self._head is None:
                self._head, self._offset = next(self), 0
            size = jax.tree.leaves(self._head)[0].shape[0]
            cut = min(n - have, size - self._offset)
            if cut == size:
                parts.append(self._head)
            else:  # a slice at a traced offset: compiled once per size cut, not once per place in the chunk
                parts.append(
                    jax.tree.map(
                        lambda a, at=self._offset, cut=cut: jax.lax.dynamic_slice_in_dim(a, at, cut), self._head
                    )
                )
            self._offset += cut
            if self._offset == size:
                self._head = None
            have += cut
        self.taken += n
        return parts[0] if len(parts) == 1 else jax.tree.map(lambda *a: jax.numpy.concatenate(a), *parts)

    def __iter__(self) -> DevicePrefetcher:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        t0 = time.perf_counter()
        if self._thread is None:
            try:
                item = self._put(next(self._source))
            except StopIteration:
                self._done = True
                raise
        else:
            item = self._queue.get()
        self.last_wait_s = time.perf_counter() - t0
        self.total_wait_s += self.last_wait_s
        if item is _STOP:
            self._done = True
            raise StopIteration
        if isinstance(item, _Raised):
            self._done = True
            raise item.exc
        self.consumed += 1
        return item

    def close(self, timeout: float = 10.0) -> None:
        """Stop the background thread (idempotent); the source is left open."""
        self._done = True
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            while True:  # unblock a producer waiting on a full queue
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
            thread.join(timeout)
            atexit.unregister(self._atexit)

    def __enter__(self) -> DevicePrefetcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
