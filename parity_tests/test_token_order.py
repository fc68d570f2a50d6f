"""Token windows and the evaluation subset: the same records in the same order in both loops.

Token shards (data.source=tokens, three training shards so that record indices cross shard boundaries) are
read by jaxloop's grain TrainLoader over jaxloop.data.sources' index shuffle and by torch_ref's DataLoader over
its own implementation of the documented shuffle (torch_ref.data.feistel_shuffle, pure-Python integers):
every micro-batch's windows compared, with 0 and 2 workers, from the start and resumed mid-epoch (jaxloop
from a loader state saved with 2 workers). The evaluation subset (eval_batches > 0): jaxloop.data.pipeline.run_val_batches
against torch_ref.data.make_val_loader, for token windows and for a text file. Exact: token ids are integers.

Mutants caught (run, seen to fail, reverted): torch_ref's shuffle with h = bit_length // 2 (floor) halves
(every micro-batch differs); torch_ref's subset left unsorted (validation batches differ); torch_ref's subset
keyed [seed] alone (the subset differs).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jaxloop.config.run import Config, DataConfig, preset, replace
from jaxloop.data.pipeline import TrainLoader, run_val_batches
from jaxloop.data.shards import write_shard
from jaxloop.data.sources import load_splits
from torch_ref.data import make_train_loader, make_val_loader

pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")]

CTX, BATCH, COUNT, RESUME = 6, 5, 30, 11


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("shards")
    tokens = np.arange(200)  # each window starts with its own first token: windows are distinct
    write_shard(str(d / "t_train_000000.bin"), tokens[:40])
    write_shard(str(d / "t_train_000001.bin"), tokens[40:47])  # holds one window of 7
    write_shard(str(d / "t_train_000002.bin"), tokens[47:120])
    write_shard(str(d / "t_val_000000.bin"), tokens[120:])
    (d / "meta.json").write_text(json.dumps({"format": "llm.c", "vocab_size": 256}))
    return d


def _cfg(path: Path, workers: int = 0, source: str = "tokens") -> Config:
    base = preset("shakespeare")
    return replace(
        base,
        seed=5,
        batch_size=BATCH,
        model=replace(base.model, context=CTX),
        data=DataConfig(source=source, path=str(path), workers=workers, eval_batch_size=4, val_fraction=0.2),
    )


def _jax_windows(cfg: Config, splits, start: int, count: int, state: dict | None = None) -> np.ndarray:
    kwargs = {"seed": cfg.seed, "batch_size": cfg.batch_size, "workers": cfg.data.workers}
    loader = (
        TrainLoader.from_state(splits, state, **kwargs)
        if state is not None
        else TrainLoader(splits, position=start, **kwargs)
    )
    with loader:
        return np.stack([next(loader)["x"] for _ in range(count)])


def _torch_windows(cfg: Config, splits, start: int, count: int) -> np.ndarray:
    return np.stack([x.numpy() for x, _ in make_train_loader(cfg, splits, position=start, stop=start + count)])


def test_token_windows_come_in_the_same_order_in_both_loops_for_any_workers_and_after_a_resume(shards):
    splits = load_splits(_cfg(shards))
    assert splits.num_train == 34 + 1 + 67  # 20 micro-batches per epoch: COUNT crosses an epoch
    reference = _jax_windows(_cfg(shards), splits, 0, COUNT)
    assert len({tuple(w) for w in reference[:20].reshape(-1, CTX).tolist()}) == 100, "epoch 0: distinct windows"
    # grain's worker processes get the records pickled and map the shards afresh (one 2-worker loader: its
    # start-up is the slow part of this test); the state it saves resumes in-process
    with TrainLoader(splits, seed=5, batch_size=BATCH, workers=2) as loader:
        assert (np.stack([next(loader)["x"] for _ in range(RESUME)]) == reference[:RESUME]).all()
        saved = loader.state()
    assert (_jax_windows(_cfg(shards), splits, 0, COUNT - RESUME, saved) == reference[RESUME:]).all()
    for workers in (0, 2):
        cfg = _cfg(shards, workers)
        assert (_torch_windows(cfg, splits, 0, COUNT) == reference).all(), f"torch_ref, {workers} workers"
    assert (_torch_windows(_cfg(shards), splits, RESUME, COUNT - RESUME) == reference[RESUME:]).all()


@pytest.mark.parametrize("source", ["tokens", "text"])
def test_both_loops_evaluate_the_same_seeded_subset(shards, source):
    path = shards if source == "tokens" else Path(__file__).parents[1] / "tests" / "data" / "tinyshakespeare_60k.txt"
    cfg = replace(_cfg(path, source=source), eval_batches=3)
    splits = load_splits(cfg)
    jax_x = np.concatenate([b["x"][b["weight"] > 0] for b in run_val_batches(cfg, splits)])
    torch_x = np.concatenate([x.numpy() for x, _ in make_val_loader(cfg, splits)])
    assert jax_x.shape == (12, CTX) and (jax_x == torch_x).all()
    whole = np.concatenate([x.numpy() for x, _ in make_val_loader(replace(cfg, eval_batches=0), splits)])
    assert len(whole) == splits.num_val > 12
    rows = {tuple(r) for r in whole.tolist()}
    assert all(tuple(r) in rows for r in jax_x.tolist()), "the subset is of the validation split"
