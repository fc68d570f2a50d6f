"""The input pipeline in PyTorch: a Dataset over loopcore.sources' splits and DataLoaders.

Training batches come from a batch sampler that implements the documented record order on its own
(the definition in loopcore/sources.py's docstring, written here from that text with numpy's
generator and no code of loopcore.sources): micro-batch b holds exactly the records jaxloop's
micro-batch b holds, for every worker count; parity_tests/test_data_order.py compares the two
implementations. The sampler starts at any micro-batch position, so a resumed run continues
mid-epoch where it stopped; the position (micro-batches consumed) is the loader's whole checkpointable
state, as in jaxloop.data.TrainLoader.

Validation batches are the validation split in file order, data.eval_batch_size (0 = batch_size)
records each, the last one short (jaxloop pads it with weight-0 records instead; both average exactly
over the records).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from loopcore.config import Config
from loopcore.sources import Records, Splits


def epoch_batches(seed: int, epoch: int, num_train: int, batch_size: int) -> np.ndarray:
    """The micro-batches of one epoch, int64 [num_train // batch_size, batch_size]: the epoch's
    permutation Generator(PCG64(SeedSequence([seed, epoch]))).permutation(num_train), cut into
    consecutive batches of batch_size, its tail (num_train % batch_size records) dropped."""
    if not 1 <= batch_size <= num_train:
        raise ValueError(f"batch_size {batch_size} must be in [1, {num_train}]")
    perm = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch]))).permutation(num_train)
    per_epoch = num_train // batch_size
    return perm[:per_epoch * batch_size].reshape(per_epoch, batch_size).astype(np.int64)


def replay_order(cfg: Config, num_train: int, start: int, stop: int | None = None) -> Iterator[np.ndarray]:
    """Micro-batches start, start + 1, ... (up to stop, or endless): epoch by epoch, batch by batch;
    global micro-batch b is batch b mod batches-per-epoch of epoch b div batches-per-epoch."""
    per_epoch = num_train // cfg.batch_size
    epoch, first = divmod(start, per_epoch) if per_epoch else (0, 0)
    b = start
    while stop is None or b < stop:
        batches = epoch_batches(cfg.seed, epoch, num_train, cfg.batch_size)
        for row in batches[first:]:
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

    def __init__(self, cfg: Config, num_train: int, start: int = 0, stop: int | None = None):
        if start < 0 or (stop is not None and stop < start):
            raise ValueError(f"need 0 <= start <= stop, got start={start}, stop={stop}")
        self.cfg, self.num_train, self.start, self.stop = cfg, num_train, start, stop

    def __iter__(self) -> Iterator[list[int]]:
        for row in replay_order(self.cfg, self.num_train, self.start, self.stop):
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


def make_train_loader(cfg: Config, splits: Splits, position: int = 0,
                      device: torch.device | str = "cpu", stop: int | None = None) -> DataLoader:
    """Endless (or up to micro-batch `stop`) loader of training micro-batches from `position` on."""
    sampler = ReplayBatchSampler(cfg, splits.num_train, start=position, stop=stop)
    return DataLoader(SplitDataset(splits.train), batch_sampler=sampler, **_loader_kwargs(cfg, torch.device(device)))


def make_val_loader(cfg: Config, splits: Splits, device: torch.device | str = "cpu") -> DataLoader:
    """The whole validation split in order, eval_batch_size (0 = batch_size) records per batch."""
    size = cfg.data.eval_batch_size or cfg.batch_size
    return DataLoader(SplitDataset(splits.val), batch_size=size, shuffle=False, drop_last=False,
                      **_loader_kwargs(cfg, torch.device(device)))


def micro_batch(cfg: Config, splits: Splits, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch b as one (x, y) pair without a DataLoader (for tests and single-update helpers)."""
    record = splits.train.get(next(replay_order(cfg, splits.num_train, b, b + 1)))
    return torch.from_numpy(np.array(record["x"])), torch.from_numpy(np.array(record["y"]))
