"""The data layer: sources, the deterministic record order, the grain loader, validation, prefetch.

Grain worker processes are spawned (about 1.5 s each on 2 cores), so every run with workers shares
the module-scoped `runs` fixture. All comparisons are exact (np.array_equal): the loader moves
records, it never computes on them.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxloop.config.run import Config, ConfigError, DataConfig, ModelConfig, preset
from jaxloop.data.pipeline import (
    DevicePrefetcher,
    TrainLoader,
    eval_batch_size,
    num_val_batches,
    train_loader,
    val_batches,
)
from jaxloop.data.sources import (
    SPLIT_SEED,
    UNK,
    MicroBatchGather,
    batches_per_epoch,
    decode,
    epoch_permutation,
    load_splits,
    read_vocab,
    record_order,
    write_vocab,
)

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO / "tests" / "data" / "tinyshakespeare_60k.txt"  # its first 60k characters (tests/data/README.md)

DIGITS = preset("digits")  # batch_size 64; 1437 training records -> 22 batches/epoch, 29 dropped
SPLITS = load_splits(DIGITS)


def make_loader(position: int = 0, p: int = 0, count: int = 1, cfg=DIGITS, **kw) -> TrainLoader:
    """The digits preset's loader at micro-batch `position`, as process p of `count`."""
    return TrainLoader(
        SPLITS, seed=cfg.seed, batch_size=cfg.batch_size, position=position, process_index=p, process_count=count, **kw
    )


BPE = batches_per_epoch(DIGITS, SPLITS.num_train)
SAVE_AT = 2 * BPE + 8  # saved after batch 7 (0-based) of epoch 2: the next is batch 8 of epoch 2
STOP = 3 * BPE + 4  # runs cross two epoch boundaries
CHUNKS_FROM = BPE - 12  # chunked reads from here cross the epoch boundaries at BPE and 2 BPE


def take(loader, n: int) -> list[dict[str, np.ndarray]]:
    return [next(loader) for _ in range(n)]


def same_batches(a, b) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
    )


def worker_probe(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Runs inside a worker: reports whether it could touch an accelerator."""
    jax_mod = sys.modules.get("jax")
    bridge = sys.modules.get("jax._src.xla_bridge")
    batch["probe"] = np.array(
        [
            os.environ.get("JAX_PLATFORMS") == "cpu",
            jax_mod is None or jax_mod.config.jax_platforms == "cpu",
            bridge is not None and bridge.backends_are_initialized(),
            os.getpid(),
        ],
        np.int64,
    )
    return batch


@pytest.fixture(scope="module")
def runs():
    """Every loader run that needs worker processes, done once."""
    out = {}
    with make_loader() as loader:
        out["w0"] = take(loader, STOP)
    with make_loader(workers=2) as loader:
        out["w2"] = take(loader, SAVE_AT)
        out["state"] = json.loads(json.dumps(loader.state()))  # through JSON, as a checkpoint would
        out["w2"] += take(loader, STOP - SAVE_AT)
    with make_loader(workers=1) as loader:
        out["w1"] = take(loader, STOP)
    with TrainLoader.from_state(SPLITS, out["state"], workers=1) as loader:
        out["restored_w1"] = take(loader, STOP - SAVE_AT)
    with TrainLoader.from_state(SPLITS, out["state"], workers=0) as loader:
        out["restored_w0"] = take(loader, STOP - SAVE_AT)
    with make_loader(workers=1, transform=worker_probe) as loader:
        out["probe"] = next(loader)["probe"]
    with make_loader(position=CHUNKS_FROM, workers=1) as loader:
        out["chunks_w1"] = list(itertools.islice(loader.chunks(7, 3), 6))  # 3 + 5 x 7 micro-batches
        out["chunks_w1_position"] = loader.position
    return out


def text_cfg(path, context: int = 4, val_fraction: float = 0.1, batch_size: int = 8) -> Config:
    return dataclasses.replace(
        preset("shakespeare"),
        batch_size=batch_size,
        model=ModelConfig(kind="gpt", context=context),
        data=DataConfig(source="text", path=str(path), val_fraction=val_fraction),
    )


def npz_cfg(path, val_fraction: float = 0.2, batch_size: int = 4, seed: int = 0) -> Config:
    return dataclasses.replace(
        preset("digits"),
        batch_size=batch_size,
        seed=seed,
        data=DataConfig(source="npz", path=str(path), val_fraction=val_fraction),
    )


# ----------------------------------------------------------------------------- worker invariance


def test_batches_identical_for_workers_0_1_2(runs):
    assert len(runs["w0"]) == STOP
    assert same_batches(runs["w2"], runs["w0"])
    assert same_batches(runs["w1"], runs["w0"])


def test_mid_epoch_save_restores_with_another_worker_count(runs):
    state = runs["state"]
    assert state["position"] == SAVE_AT and SAVE_AT // BPE == 2 and SAVE_AT % BPE == 8
    # saved from 2 workers; resumed with 1 and with 0: batch 8 of epoch 2 onward, exactly
    assert same_batches(runs["restored_w1"], runs["w0"][SAVE_AT:])
    assert same_batches(runs["restored_w0"], runs["w0"][SAVE_AT:])


def test_record_order_matches_loader(runs):
    order = record_order(DIGITS, SPLITS.num_train, 0, STOP)
    expected = [SPLITS.train.get(rows) for rows in order]
    assert same_batches(runs["w0"], expected)
    with make_loader() as loader:
        assert all(np.array_equal(loader.record_indices(b), order[b]) for b in range(STOP))
    # any window of record_order is the same slice of the whole
    assert np.array_equal(record_order(DIGITS, SPLITS.num_train, 17, 9), order[17:26])


def test_loader_position_and_state_track_consumed_batches():
    with make_loader(position=5) as loader:
        take(loader, 3)
        assert loader.position == 8 and loader.state()["position"] == 8
        assert loader.epoch == 8 // BPE
        assert json.loads(json.dumps(loader.state())) == loader.state()


def test_workers_never_initialise_an_accelerator(runs):
    env_cpu, jax_cpu, backends_initialised, pid = runs["probe"].tolist()
    assert pid != os.getpid()  # the probe really ran in a worker process
    assert env_cpu and jax_cpu
    assert not backends_initialised


# ----------------------------------------------------------------------------- order


def test_each_epoch_is_a_permutation_with_documented_remainder_dropped():
    n, bs = SPLITS.num_train, DIGITS.batch_size
    order = record_order(DIGITS, n, 0, 3 * BPE)
    assert order.shape == (3 * BPE, bs) and BPE == n // bs
    epochs = [order[e * BPE : (e + 1) * BPE].ravel() for e in range(3)]
    for e, records in enumerate(epochs):
        assert len(np.unique(records)) == BPE * bs  # no record twice within an epoch
        perm = epoch_permutation(DIGITS.seed, e, n)
        assert np.array_equal(records, perm[: BPE * bs])  # epoch e = permutation from (seed, e)
        dropped = np.setdiff1d(np.arange(n), records)
        assert len(dropped) == n % bs == 29  # the remainder, the permutation's tail, is dropped
        assert np.array_equal(np.sort(perm[BPE * bs :]), dropped)
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])


def test_same_seed_same_order_other_seed_other_order():
    n = SPLITS.num_train
    a = record_order(DIGITS, n, 0, 2 * BPE)
    assert np.array_equal(a, record_order(dataclasses.replace(DIGITS), n, 0, 2 * BPE))
    assert not np.array_equal(a, record_order(dataclasses.replace(DIGITS, seed=1), n, 0, 2 * BPE))
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([DIGITS.seed, 1])))
    assert np.array_equal(a[BPE], rng.permutation(n)[:64])  # the documented draw, by hand


# ----------------------------------------------------------------------------- sharding


@pytest.mark.parametrize("count", [2, 4])
def test_process_shards_are_disjoint_and_union_is_the_global_batch(count):
    single = make_loader(position=3)
    shards = [make_loader(position=3, p=p, count=count) for p in range(count)]
    for b in range(3, 3 + BPE + 2):  # across an epoch boundary
        whole = next(single)
        parts = [next(s) for s in shards]
        assert all(len(part["x"]) == DIGITS.batch_size // count for part in parts)
        idx = [s.record_indices(b) for s in shards]
        assert len(np.unique(np.concatenate(idx))) == DIGITS.batch_size  # disjoint
        assert np.array_equal(np.concatenate(idx), single.record_indices(b))
        for k in ("x", "y"):
            assert np.array_equal(np.concatenate([part[k] for part in parts]), whole[k])


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("count", [1, 2])
def test_val_batches_cover_split_once_with_weight_padding(count):
    cfg = dataclasses.replace(DIGITS, data=dataclasses.replace(DIGITS.data, eval_batch_size=64))
    n = SPLITS.num_val  # 360 = 5 * 64 + 40: the last batch holds 24 padding records
    per_process = [list(val_batches(SPLITS, eval_batch_size(cfg), p, count)) for p in range(count)]
    assert all(
        len(batches) == num_val_batches(SPLITS, eval_batch_size(cfg)) == math.ceil(n / 64) for batches in per_process
    )
    xs, ws = [], []
    for step in zip(*per_process):
        assert all(b["x"].shape == (64 // count, 64) and b["weight"].dtype == np.float32 for b in step)
        xs.append(np.concatenate([b["x"] for b in step]))
        ws.append(np.concatenate([b["weight"] for b in step]))
    x, w = np.concatenate(xs), np.concatenate(ws)
    assert set(np.unique(w)) == {0.0, 1.0} and w.sum() == n and np.all(w[:n] == 1) and np.all(w[n:] == 0)
    assert np.array_equal(x[w == 1], SPLITS.val.get(np.arange(n))["x"])  # every record once, in order


# ----------------------------------------------------------------------------- sources


def test_digits_split_is_fixed_and_independent_of_seed():
    a, b = load_splits(DIGITS), load_splits(dataclasses.replace(DIGITS, seed=7))
    assert a.num_train + a.num_val == 1797 and a.num_train == math.floor(1797 * 0.8)
    assert np.array_equal(a.train.x, b.train.x) and np.array_equal(a.val.y, b.val.y)
    from sklearn.datasets import load_digits

    d = load_digits()
    perm = np.random.Generator(np.random.PCG64(np.random.SeedSequence(SPLIT_SEED))).permutation(1797)
    val_idx = np.sort(perm[: 1797 - a.num_train])
    # read from sklearn's bundled file without importing sklearn: the same records as load_digits()
    assert np.array_equal(a.val.x, (d.data[val_idx] / 16).astype(np.float32))
    assert np.array_equal(a.val.y, d.target[val_idx]) and np.array_equal(a.train.y, np.delete(d.target, val_idx))
    assert np.array_equal(a.train.x, (np.delete(d.data, val_idx, axis=0) / 16).astype(np.float32))
    assert a.train.x.dtype == np.float32 and a.train.y.dtype == np.int32
    assert a.example_x.shape == (1, 64) and a.num_classes == 10 and a.vocab is None


def test_text_source_vocab_windows_and_split(tmp_path):
    train_part, val_part = "abracadabra " * 9, "abraQ dabra "  # 108 + 12 characters
    path = tmp_path / "t.txt"
    path.write_text(train_part + val_part, encoding="utf-8")
    s = load_splits(text_cfg(path, context=4, val_fraction=0.1))  # train = first floor(120 * 0.9) = 108
    assert s.vocab == (" ", "a", "b", "c", "d", "r", UNK)  # sorted training characters, then <unk>
    assert s.num_classes == 7 and s.example_x.shape == (1, 4) and s.example_x.dtype == np.int32
    assert s.num_train == 108 - 4  # a window of context + 1 = 5 at every offset
    assert s.num_val == (12 - 5) // 4 + 1 == 2  # non-overlapping windows, stride context
    for i in (0, 7, 103):
        r = s.train.get([i])
        assert decode(r["x"][0], s.vocab) == train_part[i : i + 4]
        assert decode(r["y"][0], s.vocab) == train_part[i + 1 : i + 5]  # y = x shifted by one
        assert r["x"].dtype == r["y"].dtype == np.int32
    v = s.val.get([0, 1])
    assert decode(v["x"][0], s.vocab) == "abra" and decode(v["y"][0], s.vocab) == "bra\ufffd"  # Q -> <unk>
    assert decode(v["x"][1], s.vocab) == "\ufffd da" and decode(v["y"][1], s.vocab) == " dab"
    assert write_vocab(str(tmp_path / "run"), s) and read_vocab(str(tmp_path / "run")) == s.vocab
    assert write_vocab(str(tmp_path / "digits_run"), SPLITS) is None
    assert read_vocab(str(tmp_path / "digits_run")) is None


def test_text_source_tiny_shakespeare():
    s = load_splits(text_cfg(SHAKESPEARE, context=128, val_fraction=0.1, batch_size=32))
    n = 60_000
    n_train = math.floor(n * 0.9)
    assert s.num_train == n_train - 128 and s.num_val == (n - n_train - 129) // 128 + 1 == 46
    text = SHAKESPEARE.read_text(encoding="utf-8")
    # the slice's training part has 59 of the whole text's 65 characters, and its validation part no other
    assert s.vocab == tuple(sorted(set(text[:n_train]))) and len(s.vocab) == s.num_classes == 59
    assert UNK not in s.vocab
    assert decode(s.val.get([3])["x"][0], s.vocab) == text[n_train + 3 * 128 : n_train + 4 * 128]
    assert decode(s.train.get([n_train - 129])["y"][0], s.vocab) == text[n_train - 128 : n_train]


def test_npz_without_x_val_splits_by_fixed_permutation(tmp_path):
    x = np.arange(50 * 3, dtype=np.float64).reshape(50, 3)
    y = np.arange(50) % 3
    np.savez(tmp_path / "d.npz", x=x, y=y)
    s = load_splits(npz_cfg(tmp_path / "d.npz", val_fraction=0.2))
    assert s.num_train == 40 and s.num_val == 10 and s.num_classes == 3
    assert s.train.x.dtype == np.float32 and s.train.y.dtype == np.int32 and s.example_x.shape == (1, 3)
    rows = np.concatenate([s.train.x[:, 0], s.val.x[:, 0]]) // 3
    assert sorted(rows.tolist()) == list(range(50))  # disjoint, complete
    assert np.all(np.diff(s.val.x[:, 0]) > 0)  # kept in file order
    other = load_splits(npz_cfg(tmp_path / "d.npz", val_fraction=0.2, seed=9))
    assert np.array_equal(other.val.x, s.val.x)  # independent of cfg.seed


def test_npz_with_x_val_uses_it(tmp_path):
    # (a validation label must be a class the training split has, and x is (records, features): docs/data.md)
    x, y = np.ones((12, 4), np.float32), np.arange(12) % 4
    xv, yv = np.zeros((5, 4), np.float32), np.array([0, 1, 2, 3, 3])
    np.savez(tmp_path / "d.npz", x=x, y=y, x_val=xv, y_val=yv)
    s = load_splits(npz_cfg(tmp_path / "d.npz"))
    assert s.num_train == 12 and s.num_val == 5 and s.num_classes == 4
    assert np.array_equal(s.val.get(np.arange(5))["y"], yv) and s.example_x.shape == (1, 4)


# ----------------------------------------------------------------------------- bad input


def _bad_cases():
    def short_train(tmp):
        (tmp / "t.txt").write_text("abcdefghij", encoding="utf-8")
        return lambda: load_splits(text_cfg(tmp / "t.txt", context=16))

    def short_val(tmp):
        (tmp / "t.txt").write_text("abcdefghij" * 10, encoding="utf-8")  # val: 10 chars < 17
        return lambda: load_splits(text_cfg(tmp / "t.txt", context=16, val_fraction=0.1))

    def not_utf8(tmp):
        (tmp / "t.txt").write_bytes(b"hello \xff\xfe world" * 20)
        return lambda: load_splits(text_cfg(tmp / "t.txt"))

    def npz_missing_y(tmp):
        np.savez(tmp / "d.npz", x=np.zeros((10, 2)))
        return lambda: load_splits(npz_cfg(tmp / "d.npz"))

    def npz_length_mismatch(tmp):
        np.savez(tmp / "d.npz", x=np.zeros((10, 2)), y=np.zeros(9, np.int64))
        return lambda: load_splits(npz_cfg(tmp / "d.npz"))

    def npz_float_labels(tmp):
        np.savez(tmp / "d.npz", x=np.zeros((10, 2)), y=np.linspace(0, 1, 10))
        return lambda: load_splits(npz_cfg(tmp / "d.npz"))

    def npz_x_val_without_y_val(tmp):
        np.savez(tmp / "d.npz", x=np.zeros((10, 2)), y=np.zeros(10, np.int64), x_val=np.zeros((3, 2)))
        return lambda: load_splits(npz_cfg(tmp / "d.npz"))

    def npz_garbage(tmp):
        (tmp / "d.npz").write_bytes(os.urandom(256))
        return lambda: load_splits(npz_cfg(tmp / "d.npz"))

    def npz_truncated(tmp):
        np.savez(tmp / "full.npz", x=np.zeros((100, 8)), y=np.zeros(100, np.int64))
        (tmp / "d.npz").write_bytes((tmp / "full.npz").read_bytes()[:300])
        return lambda: load_splits(npz_cfg(tmp / "d.npz"))

    def batch_larger_than_train(tmp):
        return lambda: load_splits(dataclasses.replace(DIGITS, batch_size=SPLITS.num_train + 1))

    def batch_not_divisible_by_processes(tmp):
        return lambda: make_loader(p=0, count=4, cfg=dataclasses.replace(DIGITS, batch_size=30))

    def vocab_size_too_small(tmp):
        cfg = dataclasses.replace(DIGITS, model=dataclasses.replace(DIGITS.model, vocab_size=5))
        return lambda: load_splits(cfg)

    def restore_with_other_seed(tmp):
        state = make_loader(position=9).state()
        return lambda: train_loader(dataclasses.replace(DIGITS, seed=3), SPLITS, state)

    return [
        (short_train, "data.path"),
        (short_val, "data.val_fraction"),
        (not_utf8, "data.path"),
        (npz_missing_y, "data.path"),
        (npz_length_mismatch, "data.path"),
        (npz_float_labels, "data.path"),
        (npz_x_val_without_y_val, "data.path"),
        (npz_garbage, "data.path"),
        (npz_truncated, "data.path"),
        (batch_larger_than_train, "batch_size"),
        (batch_not_divisible_by_processes, "batch_size"),
        (vocab_size_too_small, "model.vocab_size"),
        (restore_with_other_seed, "seed"),
    ]


@pytest.mark.parametrize("make, field", _bad_cases(), ids=[f.__name__ for f, _ in _bad_cases()])
def test_bad_input_raises_config_error_naming_the_field(tmp_path, make, field):
    with pytest.raises(ConfigError) as info:
        make(tmp_path)()
    assert info.value.field_path == field
    assert str(info.value).startswith(f"{field}=") and "not allowed" in str(info.value)


# ----------------------------------------------------------------------------- robustness


def test_no_hang_at_exit_with_workers_left_open():
    # A plain script (absl flags never parsed: grain issue #1355) that starts 2 workers and a device
    # prefetch thread, takes a few batches and exits without close(). Must exit cleanly; a hang is
    # caught by subprocess.run's timeout (TimeoutExpired fails the test).
    script = textwrap.dedent("""
        from absl import flags
        assert not flags.FLAGS.is_parsed()
        from jaxloop.config.run import preset
        from jaxloop.data.sources import load_splits
        from jaxloop.data.pipeline import DevicePrefetcher, TrainLoader
        cfg = preset("digits")
        it = DevicePrefetcher(TrainLoader(load_splits(cfg), seed=cfg.seed, batch_size=cfg.batch_size, workers=2), size=2)
        print([int(next(it)["y"][0]) for _ in range(4)], flush=True)
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().startswith("[")
    assert "Traceback" not in proc.stderr and "leaked" not in proc.stderr, proc.stderr[-3000:]


def test_sources_imports_neither_jax_nor_grain():
    # torch_ref imports jaxloop.data.sources; it must not pull in jax or grain.
    script = textwrap.dedent("""
        import importlib.abc, sys
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("jax", "jaxlib", "grain", "flax", "optax"):
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        from jaxloop.data import sources
        from jaxloop.config.run import preset
        s = sources.load_splits(preset("digits"))
        assert sources.record_order(preset("digits"), s.num_train, 0, 3).shape == (3, 64)
        assert not [m for m in sys.modules if m.split(".")[0] in ("jax", "grain")]
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_micro_batch_gather_is_the_loader_element():
    gather = MicroBatchGather(SPLITS.train, DIGITS.seed, DIGITS.batch_size, 1, 2)
    with make_loader(position=40, p=1, count=2) as loader:
        assert same_batches([next(loader)], [gather(40)])


def stacked(batches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.stack([b[k] for b in batches]) for k in batches[0]}


def test_loader_chunks_are_its_micro_batches_stacked_first_chunk_apart(runs):
    # chunk 0 holds 3 micro-batches, every later one 7; one grain element (read by a worker) each
    ends = [CHUNKS_FROM + 3 + 7 * i for i in range(6)]
    expected = [stacked(runs["w0"][a:b]) for a, b in zip([CHUNKS_FROM] + ends, ends)]
    assert same_batches(runs["chunks_w1"], expected)
    assert runs["chunks_w1_position"] == ends[-1]  # micro-batches handed out, chunk by chunk


def test_a_chunk_of_a_process_shard_is_that_shards_micro_batches():
    gather = MicroBatchGather(SPLITS.train, DIGITS.seed, DIGITS.batch_size, 1, 2)
    assert same_batches([gather.chunk(40, 5)], [stacked([gather(b) for b in range(40, 45)])])


def count_records(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {**batch, "n": np.array(len(batch["y"]))}


def test_a_transform_sees_one_micro_batch_at_a_time_in_a_chunk():
    gather = MicroBatchGather(SPLITS.train, DIGITS.seed, DIGITS.batch_size, transform=count_records)
    chunk = gather.chunk(3, 4)
    assert chunk["n"].tolist() == [DIGITS.batch_size] * 4  # not 4 x batch_size
    assert same_batches([chunk], [stacked([gather(b) for b in range(3, 7)])])


def test_loader_chunks_refuses_a_second_iteration():
    with make_loader() as loader:
        next(loader)
        with pytest.raises(ValueError, match="iterated once"):
            loader.chunks(4)
    with make_loader() as loader:
        loader.chunks(4)
        with pytest.raises(ValueError, match="iterated once"):
            next(loader)


def test_a_prefetcher_over_a_loader_already_read_stacks_its_micro_batches(runs):
    loader = make_loader()
    next(loader)
    with DevicePrefetcher(loader, size=0, chunk=3) as it:
        assert same_batches([{k: np.asarray(v) for k, v in it.take(3).items()}], [stacked(runs["w0"][1:4])])


# ----------------------------------------------------------------------------- device prefetch


@pytest.mark.parametrize("size", [0, 2])
def test_device_prefetcher_yields_the_same_batches_and_reports_waits(runs, size):
    loader = make_loader()
    with DevicePrefetcher(loader, size=size) as it:
        got, waits = [], []
        for _ in range(30):
            batch = next(it)
            assert isinstance(batch["x"], jax.Array)
            got.append({k: np.asarray(v) for k, v in batch.items()})
            waits.append(it.last_wait_s)
        assert same_batches(got, runs["w0"][:30])
        assert all(w >= 0 for w in waits) and it.total_wait_s == pytest.approx(sum(waits))
        # checkpoint what was consumed, even though the thread has run ahead of it
        assert it.position == 30 and it.state()["position"] == 30 and loader.position >= 30
    assert it._thread is None


def test_device_prefetcher_takes_whole_chunks_from_the_loader_and_cuts_them(runs):
    loader = make_loader()
    with DevicePrefetcher(loader, size=2, chunk=4, first_chunk=2) as it:
        assert it._source.gi_code.co_name == "_yield_chunks"  # the loader's own chunks, not stacked here
        got = [it.take(n) for n in (2, 4, 1, 3, 4)]  # 1 + 3 cut one chunk; 4 is whole again
        ends = list(itertools.accumulate((2, 4, 1, 3, 4)))
        expected = [stacked(runs["w0"][a:b]) for a, b in zip([0] + ends, ends)]
        assert same_batches([{k: np.asarray(v) for k, v in g.items()} for g in got], expected)
        assert it.position == 14 and it.state()["position"] == 14


def test_device_prefetcher_passes_on_errors_and_end():
    def source():
        yield {"x": np.zeros(2)}
        raise RuntimeError("broken record")

    with DevicePrefetcher(source(), size=2, put=lambda b: b) as it:
        next(it)
        with pytest.raises(RuntimeError, match="broken record"):
            next(it)
    with DevicePrefetcher(iter([{"x": np.ones(1)}]), size=1, put=lambda b: b) as it:
        assert list(it)[0]["x"][0] == 1
