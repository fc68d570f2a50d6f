"""The input pipeline in PyTorch: a Dataset over jaxloop.data.sources' splits and DataLoaders.

Training batches come from a batch sampler that implements the documented record order on its own
(the definition in jaxloop/data/sources.py's docstring, written here from that text with numpy's
generator and no code of jaxloop.data.sources): micro-batch b holds exactly the records jaxloop's
micro-batch b holds, for every worker count; parity_tests/test_data_order.py compares the two
implementations. The sampler starts at any micro-batch position, so a resumed run continues
mid-epoch where it stopped; the position (micro-batches consumed) is the loader's whole checkpointable
state, as in jaxloop.data.pipeline.TrainLoader.

Token windows (data.source=tokens) are shuffled by the documented index shuffle (a Feistel network
over the record index, jaxloop/data/sources.py's docstring), written here on its own too.

Validation batches are the validation split in file order, data.eval_batch_size (0 = batch_size)
records each, the last one short (jaxloop pads it with weight-0 records instead; both average exactly
over the records); with eval_batches > 0 only the documented seeded subset of it, in file order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from jaxloop.config.run import Config
from jaxloop.data.sources import Records, Splits


def epoch_batches(seed: int, epoch: int, num_train: int, batch_size: int) -> np.ndarray:
    """The micro-batches of one epoch, int64 [num_train // batch_size, batch_size]: the epoch's
    permutation Generator(PCG64(SeedSequence([seed, epoch]))).permutation(num_train), cut into
    consecutive batches of batch_size, its tail (num_train % batch_size records) dropped."""
    if not 1 <= batch_size <= num_train:
        raise ValueError(f"batch_size {batch_size} must be in [1, {num_train}]")
    perm = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch]))).permutation(num_train)
    per_epoch = num_train // batch_size
    return perm[: per_epoch * batch_size].reshape(per_epoch, batch_size).astype(np.int64)


def feistel_shuffle(key: list[int], n: int, positions: np.ndarray) -> np.ndarray:
    """Records at `positions` of the permutation of range(n) the key draws: a 4-round Feistel network on
    halves of h bits, splitmix64's finalizer as round function, cycle-walked back into range(n)."""
    h = max(1, (int(n - 1).bit_length() + 1) // 2)
    low = (1 << h) - 1
    keys = [
        int(k)
        for k in np.random.Generator(np.random.PCG64(np.random.SeedSequence(key))).integers(
            0, 2**32, size=4, dtype=np.uint64
        )
    ]

    def mix(z: int) -> int:
        z ^= z >> 30
        z = (z * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z ^= z >> 27
        z = (z * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        return z ^ (z >> 31)

    def encrypt(x: int) -> int:
        left, right = x >> h, x & low
        for k in keys:
            left, right = right, left ^ (mix(right ^ k) & low)
        return (left << h) | right

    out = []
    for p in positions:
        y = encrypt(int(p))
        while y >= n:
            y = encrypt(y)
        out.append(y)
    return np.asarray(out, np.int64)


def shuffled_batch(seed: int, epoch: int, k: int, num_train: int, batch_size: int) -> np.ndarray:
    """Batch k of epoch `epoch` of token windows: positions k*batch_size .. of the epoch's index shuffle."""
    return feistel_shuffle([seed, epoch], num_train, np.arange(k * batch_size, (k + 1) * batch_size))


def replay_order(
    cfg: Config, num_train: int, start: int, stop: int | None = None, order: str = "permutation"
) -> Iterator[np.ndarray]:
    """Micro-batches start, start + 1, ... (up to stop, or endless): epoch by epoch, batch by batch;
    global micro-batch b is batch b mod batches-per-epoch of epoch b div batches-per-epoch. `order`
    "index_shuffle" (token windows): each batch from the index shuffle, never a whole permutation."""
    per_epoch = num_train // cfg.batch_size
    epoch, first = divmod(start, per_epoch) if per_epoch else (0, 0)
    b = start
    while stop is None or b < stop:
        if order == "index_shuffle":
            rows: Any = (shuffled_batch(cfg.seed, epoch, k, num_train, cfg.batch_size) for k in range(first, per_epoch))
        else:
            rows = epoch_batches(cfg.seed, epoch, num_train, cfg.batch_size)[first:]
        for row in rows:
            if stop is not None and b >= stop:
                return
            yield row
            b += 1
        epoch, first = epoch + 1, 0


class SplitDataset(Dataset):
    """One split's records as (x, y) tensor pairs: features or token windows, labels or next tokens."""

    def __init__(self, records: Records):
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        record = self.records.get([index])
        return torch.as_tensor(record["x"][0]), torch.as_tensor(record["y"][0])


class ReplayBatchSampler(Sampler[list[int]]):
    """Micro-batches start, start + 1, ... (up to stop, or endless) of the record order (replay_order).

    Each item is the list of training-record indices of one micro-batch: epoch e is the permutation
    drawn from (cfg.seed, e), cut into num_train // batch_size batches, remainder dropped.
    """

    def __init__(
        self, cfg: Config, num_train: int, start: int = 0, stop: int | None = None, order: str = "permutation"
    ):
        if start < 0 or (stop is not None and stop < start):
            raise ValueError(f"need 0 <= start <= stop, got start={start}, stop={stop}")
        self.cfg, self.num_train, self.start, self.stop, self.order = cfg, num_train, start, stop, order

    def __iter__(self) -> Iterator[list[int]]:
        for row in replay_order(self.cfg, self.num_train, self.start, self.stop, self.order):
            yield row.tolist()

    def __len__(self) -> int:
        if self.stop is None:
            raise TypeError("an endless ReplayBatchSampler has no length")
        return self.stop - self.start


def _loader_kwargs(cfg: Config, device: torch.device) -> dict:
    workers = cfg.data.workers
    kwargs = dict(
        num_workers=workers,
        pin_memory=device.type == "cuda",
        persistent_workers=workers > 0,
        # The loader's own generator: creating an iterator draws a base seed from it, which would
        # otherwise advance torch's global RNG (the one dropout uses) and break bit-exact resume.
        generator=torch.Generator().manual_seed(cfg.seed),
    )
    if workers > 0 and cfg.data.prefetch > 0:
        kwargs["prefetch_factor"] = cfg.data.prefetch
    return kwargs


def make_train_loader(
    cfg: Config, splits: Splits, position: int = 0, device: torch.device | str = "cpu", stop: int | None = None
) -> DataLoader:
    """Endless (or up to micro-batch `stop`) loader of training micro-batches from `position` on."""
    sampler = ReplayBatchSampler(
        cfg, splits.num_train, start=position, stop=stop, order=getattr(splits.train, "order", "permutation")
    )
    return DataLoader(SplitDataset(splits.train), batch_sampler=sampler, **_loader_kwargs(cfg, torch.device(device)))


EVAL_SUBSET_KEY = 0x6576616C  # "eval": the second word of the evaluation subset's shuffle key


def eval_subset(cfg: Config, num_val: int) -> list[int] | None:
    """The validation records evaluated with cfg.eval_batches > 0: the first eval_batches x eval batch size
    positions of the index shuffle keyed [seed, EVAL_SUBSET_KEY], in file order; None for the whole split."""
    size = cfg.data.eval_batch_size or cfg.batch_size
    count = cfg.eval_batches * size
    if cfg.eval_batches <= 0 or count >= num_val:
        return None
    return sorted(feistel_shuffle([cfg.seed, EVAL_SUBSET_KEY], num_val, np.arange(count)).tolist())


def make_val_loader(cfg: Config, splits: Splits, device: torch.device | str = "cpu") -> DataLoader:
    """The validation split (or cfg.eval_batches' subset of it) in order, eval_batch_size (0 = batch_size)
    records per batch."""
    size = cfg.data.eval_batch_size or cfg.batch_size
    dataset: Dataset = SplitDataset(splits.val)
    subset = eval_subset(cfg, len(splits.val))
    if subset is not None:
        dataset = Subset(dataset, subset)
    return DataLoader(
        dataset, batch_size=size, shuffle=False, drop_last=False, **_loader_kwargs(cfg, torch.device(device))
    )


def micro_batch(cfg: Config, splits: Splits, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch b as one (x, y) pair without a DataLoader (for tests and single-update helpers)."""
    record = splits.train.get(
        next(replay_order(cfg, splits.num_train, b, b + 1, getattr(splits.train, "order", "permutation")))
    )
    return torch.from_numpy(np.array(record["x"])), torch.from_numpy(np.array(record["y"]))
