"""Data order: the same training records in every micro-batch, in both loaders, for any worker count.

The records are labelled by their own index (x = [index]), so every batch names its records. 103
records in batches of 10: 10 batches per epoch with 3 records dropped per epoch, and 35 micro-batches
cross three epoch boundaries. jaxloop: grain TrainLoader over jaxloop.data.sources.record_order; torch_ref:
DataLoader over ReplayBatchSampler, whose order (torch_ref.data.replay_order) is its own implementation
of the documented definition: two implementations compared. Exact: indices are integers.

Mutants caught (run, seen to fail, reverted): torch_ref seeding an epoch with SeedSequence([epoch, seed])
instead of [seed, epoch] (every batch differs); torch_ref keeping an epoch's remainder (drop-last off:
every batch after the first epoch boundary differs).
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxloop.config.run import Config, DataConfig
from jaxloop.data.pipeline import TrainLoader
from jaxloop.data.sources import ArrayRecords, Splits, record_order
from parity_tests.harness import QUIET
from torch_ref.data import make_train_loader, replay_order

# torch's DataLoader forks its workers; this process has jax's threads, which the workers never touch
# (torch_ref alone never imports jax), so python's warning about forking a multithreaded process is moot.
pytestmark = pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")

N, BATCH, COUNT, RESUME = 103, 10, 35, 13
"""Records, batch size, micro-batches read, and the mid-epoch position a loader resumes from (epoch 1, batch 3)."""


def _cfg(workers: int) -> Config:
    return Config(seed=3, batch_size=BATCH, log=QUIET, data=DataConfig(workers=workers, prefetch=2))


def _splits() -> Splits:
    index = np.arange(N, dtype=np.float32)[:, None]
    records = ArrayRecords(index, (np.arange(N) % 2).astype(np.int32))
    return Splits(source="npz", train=records, val=records, num_classes=2, example_x=np.zeros((1, 1), np.float32))


def _jax_indices(workers: int, start: int, count: int, splits: Splits, state: dict | None = None) -> np.ndarray:
    cfg = _cfg(workers)
    loader = (
        TrainLoader.from_state(splits, state, seed=cfg.seed, batch_size=cfg.batch_size, workers=cfg.data.workers)
        if state is not None
        else TrainLoader(splits, seed=cfg.seed, batch_size=cfg.batch_size, position=start, workers=cfg.data.workers)
    )
    with loader:
        return np.stack([next(loader)["x"][:, 0].astype(np.int64) for _ in range(count)])


def _torch_indices(workers: int, start: int, count: int, splits: Splits) -> np.ndarray:
    loader = make_train_loader(_cfg(workers), splits, position=start, stop=start + count)
    return np.stack([x[:, 0].numpy().astype(np.int64) for x, _ in loader])


@pytest.fixture(scope="module")
def order():
    splits = _splits()
    expected = record_order(_cfg(0), N, 0, COUNT)
    got = {}
    for workers in (0, 2):
        got[("jax", workers, 0)] = _jax_indices(workers, 0, COUNT, splits)
        got[("torch", workers, 0)] = _torch_indices(workers, 0, COUNT, splits)
        got[("torch", workers, RESUME)] = _torch_indices(workers, RESUME, COUNT - RESUME, splits)
    # jaxloop resumes from a loader's checkpointed state: saved with 2 workers, resumed with 0 and 2.
    cfg2 = _cfg(2)
    with TrainLoader(splits, seed=cfg2.seed, batch_size=cfg2.batch_size, workers=cfg2.data.workers) as loader:
        for _ in range(RESUME):
            next(loader)
        saved = loader.state()
    for workers in (0, 2):
        got[("jax", workers, RESUME)] = _jax_indices(workers, RESUME, COUNT - RESUME, splits, saved)
    return expected, got


def _mismatches(a: np.ndarray, b: np.ndarray) -> int:
    assert a.shape == b.shape, (a.shape, b.shape)
    return int(np.sum(np.any(a != b, axis=1)))


def test_record_order_crosses_epochs_reshuffled_with_the_remainder_dropped(order):
    expected, _ = order
    assert expected.shape == (COUNT, BATCH)
    for epoch in range(3):
        rows = expected[epoch * 10 : (epoch + 1) * 10]
        assert len(set(rows.ravel())) == 100, "no record repeats within an epoch; 3 are dropped"
    assert not np.array_equal(expected[:10], expected[10:20]), "each epoch is reshuffled"


def test_same_records_in_every_batch_for_0_and_2_workers(order, parity):
    expected, got = order
    bad = sum(_mismatches(got[(fw, w, 0)], expected) for fw in ("jax", "torch") for w in (0, 2))
    parity.check(
        "data order: micro-batches (of 35, 3 epoch boundaries) whose records differ, both loaders, 0 and 2 workers",
        bad,
        0,
        "both replay record_order; workers only decide who gathers a batch",
    )


def test_same_records_after_a_mid_epoch_resume(order, parity):
    expected, got = order
    bad = sum(_mismatches(got[(fw, w, RESUME)], expected[RESUME:]) for fw in ("jax", "torch") for w in (0, 2))
    parity.check(
        f"data order: batches differing after resuming at micro-batch {RESUME} (mid-epoch), both loaders, 0/2 workers",
        bad,
        0,
        "the position is the loader's whole state",
    )


def test_torch_refs_own_record_order_equals_the_cores_over_many_shapes(parity):
    """torch_ref.data.replay_order (epoch by epoch) against jaxloop.data.sources.record_order (per-batch
    divmod), for 40 seeded (seed, num_train, batch_size, start, count): 2..5 epochs each."""
    rng = np.random.default_rng(7)
    bad = 0
    for _ in range(40):
        n = int(rng.integers(1, 300))
        batch = int(rng.integers(1, n + 1))
        per_epoch = n // batch
        start = int(rng.integers(0, 3 * per_epoch + 1))
        count = int(rng.integers(1, 2 * per_epoch + 2))
        cfg = Config(seed=int(rng.integers(0, 2**31)), batch_size=batch, log=QUIET)
        mine = np.stack(list(replay_order(cfg, n, start, start + count)))
        bad += _mismatches(mine, record_order(cfg, n, start, count))
    parity.check(
        "data order: micro-batches differing, torch_ref's own order vs jaxloop.data.sources' (40 shapes)",
        bad,
        0,
        "the same documented definition, implemented twice",
    )
