"""Token shards (data.source=tokens): llm.c's header and nanoGPT's .bin read back, corrupt headers refused in one
line, the windows a run trains and validates on, the index shuffle, the evaluation subset, constant anonymous
memory over shards far larger than RAM, and exact resume on shards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxloop.config.run import (
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    preset,
    replace,
    validate,
)
from jaxloop.data.shards import HEADER_BYTES, read_shard, write_shard
from jaxloop.data.sources import (
    RecordError,
    eval_records,
    index_shuffle,
    load_splits,
    record_order,
)

CTX = 8


def _cfg(path, **model) -> Config:
    base = preset("shakespeare")
    return replace(
        base,
        batch_size=4,
        data=DataConfig(source="tokens", path=str(path), val_fraction=0.25),
        model=replace(base.model, context=CTX, **model),
    )


def _meta(directory: Path, vocab: int, **more) -> None:
    (directory / "meta.json").write_text(json.dumps({"format": "llm.c", "vocab_size": vocab, **more}))


# ----------------------------------------------------------------------------- formats


@pytest.mark.parametrize("dtype, magic, version", [("uint16", 20240520, 1), ("uint32", 20240801, 7)])
def test_an_llmc_header_written_is_read_back(tmp_path, dtype, magic, version):
    tokens = np.array([0, 1, 65535, 7, 300], np.int64) * (60000 if dtype == "uint32" else 1)
    path = tmp_path / "s.bin"
    write_shard(str(path), tokens, dtype)
    header = np.fromfile(path, "<i4", count=256)
    assert list(header[:3]) == [magic, version, 5] and not header[3:].any()
    assert path.stat().st_size == HEADER_BYTES + 5 * np.dtype(dtype).itemsize
    shard = read_shard(str(path))
    assert (shard.format, shard.dtype, shard.count, shard.offset) == ("llm.c", dtype, 5, HEADER_BYTES)
    assert shard.tokens().tolist() == tokens.tolist()


def test_a_headerless_nanogpt_bin_is_uint16_tokens(tmp_path):
    tokens = np.arange(3, 1003, dtype=np.uint16)
    tokens.tofile(tmp_path / "train.bin")
    shard = read_shard(str(tmp_path / "train.bin"))
    assert (shard.format, shard.dtype, shard.count, shard.offset) == ("nanogpt", "uint16", 1000, 0)
    assert shard.tokens().tolist() == tokens.tolist()


def _corrupt(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / "fineweb_train_000001.bin"
    write_shard(str(path), np.arange(100), "uint16")
    header = np.fromfile(path, "<i4", count=256)
    body = path.read_bytes()[HEADER_BYTES:]
    if kind == "version":
        header[1] = 7  # magic 20240520's version is 1
    elif kind == "count":
        header[2] = 101  # one more token than the file holds
    elif kind == "magic":  # prepare's meta.json says llm.c: the magic must be there
        header[0] = 20240521
        _meta(tmp_path, 256)
    path.write_bytes(header.tobytes() + body)
    return path


@pytest.mark.parametrize(
    "kind, says", [("version", "version 7"), ("count", "says 101 uint16 tokens"), ("magic", "bad magic 20240521")]
)
def test_a_corrupt_header_is_refused_naming_the_file(tmp_path, kind, says):
    path = _corrupt(tmp_path, kind)
    with pytest.raises(ConfigError, match="data.path") as caught:
        load_splits(_cfg(tmp_path, vocab_size=256))
    message = str(caught.value)
    assert str(path) in message and says in message and "\n" not in message


def test_a_corrupt_header_on_the_command_line_is_one_line_and_exit_2_with_nothing_written(tmp_path):
    _corrupt(tmp_path, "count")
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxloop.train",
            "--preset",
            "shakespeare",
            "--data.source",
            "tokens",
            "--data.path",
            str(tmp_path),
            "--model.vocab_size",
            "256",
            "--run_dir",
            str(run_dir),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "fineweb_train_000001.bin" in lines[0] and "header says 101" in lines[0], lines
    assert not run_dir.exists()


def test_shards_without_meta_json_need_model_vocab_size(tmp_path):
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "data.bin")
    with pytest.raises(ConfigError, match="model.vocab_size=0 .*no meta.json"):
        load_splits(_cfg(tmp_path / "data.bin"))
    assert load_splits(_cfg(tmp_path / "data.bin", vocab_size=100)).num_classes == 100


def test_a_token_outside_the_vocabulary_stops_naming_the_record(tmp_path):
    tokens = np.zeros(200, np.uint16)
    tokens[150] = 300
    write_shard(str(tmp_path / "t_train.bin"), tokens)
    write_shard(str(tmp_path / "t_val.bin"), np.zeros(50, np.uint16))
    _meta(tmp_path, 256)
    splits = load_splits(_cfg(tmp_path))
    assert splits.train.get([100])["x"].max() == 0
    with pytest.raises(RecordError, match=r"record 145 of the train split holds token 300 .*vocabulary of 256"):
        splits.train.get([3, 145])


# ----------------------------------------------------------------------------- windows and splits


def test_windows_follow_the_shards_in_order_and_never_cross_one(tmp_path):
    lengths = [30, 5, 21]  # the 5-token shard holds no window of CTX + 1 = 9
    start = 0
    for i, n in enumerate(lengths):
        write_shard(str(tmp_path / f"c_train_{i:06d}.bin"), np.arange(start, start + n))
        start += n
    write_shard(str(tmp_path / "c_val_000000.bin"), np.arange(1000, 1035))
    _meta(tmp_path, 2000)
    splits = load_splits(_cfg(tmp_path))
    assert splits.num_train == (30 - CTX) + (21 - CTX) and splits.num_val == (35 - 1) // CTX
    train = splits.train.get(np.arange(splits.num_train))
    window = np.concatenate([train["x"], train["y"][:, -1:]], axis=1)
    expected = [np.arange(s, s + CTX + 1) for s in list(range(22)) + list(range(35, 48))]
    assert window.tolist() == np.stack(expected).tolist()
    assert (train["y"][:, :-1] == train["x"][:, 1:]).all()
    val = splits.val.get(np.arange(splits.num_val))
    assert val["x"][:, 0].tolist() == [1000 + j * CTX for j in range(splits.num_val)]


@pytest.mark.parametrize("form", ["directory", "glob", "file"])
def test_data_path_is_a_directory_a_glob_or_one_file(tmp_path, form):
    np.arange(0, 400, dtype=np.uint16).tofile(tmp_path / "train.bin")  # nanoGPT's pair
    np.arange(500, 600, dtype=np.uint16).tofile(tmp_path / "val.bin")
    (tmp_path / "notes.txt").write_text("not a shard")
    path = {"directory": tmp_path, "glob": tmp_path / "*.bin", "file": tmp_path / "train.bin"}[form]
    splits = load_splits(_cfg(path, vocab_size=1024))
    first_val = int(splits.val.get([0])["x"][0, 0])
    if form == "file":  # one file: its last val_fraction (0.25) validates
        assert (splits.num_train, first_val) == (300 - CTX, 300)
    else:
        assert (splits.num_train, first_val) == (400 - CTX, 500)


def _names(record: dict, split: str) -> list[str]:
    return [os.path.basename(f) for f in record["splits"][split]["files"]]


@pytest.mark.parametrize(
    "train, val",
    [
        ("tiny_shakespeare_train.bin", "tiny_shakespeare_val.bin"),
        ("fineweb_train_000001.bin", "fineweb_val_000000.bin"),
        ("x_train_000000.bin", "x_validation_000000.bin"),
        ("train.bin", "valid.bin"),
        ("TRAIN.bin", "eval.bin"),
    ],
)
def test_llmc_nanogpt_and_hugging_face_split_names_assign_the_files(tmp_path, train, val):
    """val, valid, validation and eval as a word of a file's name (any case) make it validation data: its windows
    validate whole, none is trained on (before, x_validation_000000.bin was split 90/10 like a nameless file)."""
    write_shard(str(tmp_path / train), np.arange(0, 400))
    write_shard(str(tmp_path / val), np.arange(500, 600))
    _meta(tmp_path, 1024)
    splits = load_splits(_cfg(tmp_path))
    assert (_names(splits.record, "train"), _names(splits.record, "val")) == ([train], [val])
    assert (splits.num_train, int(splits.val.get([0])["x"][0, 0])) == (400 - CTX, 500)
    assert splits.record["splits"]["assigned_by"] == "file names"


def test_a_test_split_is_listed_and_never_trained_or_validated_on(tmp_path):
    """nanoGPT-style train.bin / val.bin beside a test.bin: the test file is listed (record and console), not read."""
    for name, first in (("train.bin", 0), ("val.bin", 500), ("test.bin", 900)):
        np.arange(first, first + 100, dtype=np.uint16).tofile(tmp_path / name)
    splits = load_splits(_cfg(tmp_path, vocab_size=1024))
    assert splits.num_train == 100 - CTX  # train.bin's windows only
    assert int(splits.val.get([0])["x"][0, 0]) == 500 and splits.num_val == (100 - 1) // CTX
    assert splits.record["splits"]["test"] == {"files": [str(tmp_path / "test.bin")], "tokens": 100}
    assert str(tmp_path / "test.bin") not in splits.record["files"]  # never read, so not fingerprinted
    from jaxloop.data.identity import data_lines

    assert data_lines(splits.record)[-1] == "data test (listed, never read): 1 file, 100 tokens: test.bin"


def test_files_naming_no_split_beside_files_that_do_are_refused_naming_them(tmp_path):
    for name in ("train.bin", "val.bin", "extra.bin", "more.bin"):
        np.arange(100, dtype=np.uint16).tofile(tmp_path / name)
    with pytest.raises(ConfigError, match=r"extra\.bin, more\.bin name no split, train\.bin, val\.bin do") as caught:
        load_splits(_cfg(tmp_path, vocab_size=1024))
    assert "--data.train and --data.val" in caught.value.cli_message


def test_a_file_naming_two_splits_is_refused_naming_it(tmp_path):
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "train_val.bin")
    with pytest.raises(ConfigError, match=r"train_val\.bin names train and val"):
        load_splits(_cfg(tmp_path, vocab_size=1024))


def test_a_directory_where_no_file_names_a_split_splits_each_file_and_says_so(tmp_path):
    """docs/data.md's promise kept (each file's last val_fraction validates), and now said on the console."""
    for name in ("a.bin", "b.bin"):
        np.arange(100, dtype=np.uint16).tofile(tmp_path / name)
    splits = load_splits(_cfg(tmp_path, vocab_size=1024))
    assert splits.num_train == 2 * (75 - CTX)  # val_fraction 0.25
    from jaxloop.data.identity import data_lines

    assert data_lines(splits.record) == [
        "data train (no file names a split): 2 files, 150 tokens: a.bin, b.bin",
        "data val (the last 0.25 of each training file: data.val_fraction): 2 files, 50 tokens: a.bin, b.bin",
    ]


def test_data_train_and_data_val_name_the_splits_when_the_names_do_not(tmp_path):
    for name, first in (("part_0.bin", 0), ("part_1.bin", 200), ("holdout.bin", 500)):
        np.arange(first, first + 100, dtype=np.uint16).tofile(tmp_path / name)
    base = _cfg(tmp_path, vocab_size=1024)
    cfg = replace(
        base, data=replace(base.data, path="", train=str(tmp_path / "part_*.bin"), val=str(tmp_path / "holdout.bin"))
    )
    splits = load_splits(validate(cfg))
    assert (_names(splits.record, "train"), _names(splits.record, "val")) == (
        ["part_0.bin", "part_1.bin"],
        ["holdout.bin"],
    )
    assert splits.num_train == 2 * (100 - CTX) and int(splits.val.get([0])["x"][0, 0]) == 500


@pytest.mark.parametrize(
    "given, refused",
    [
        (dict(val="v.bin"), "data.val='v.bin' is not allowed: empty unless data.train names the training shards too"),
        (
            dict(path="d", train="t_*.bin"),
            "data.path='d' is not allowed: empty when data.train names the training shards",
        ),
        (
            dict(source="text", path="t.txt", train="t.bin"),
            "data.train='t.bin' is not allowed: empty unless data.source is tokens",
        ),
    ],
)
def test_data_train_and_data_val_are_refused_where_they_cannot_name_the_splits(given, refused):
    with pytest.raises(ConfigError) as caught:
        DataConfig(**{"source": "tokens", **given}).validate()
    assert str(caught.value).startswith(refused), str(caught.value)


# ----------------------------------------------------------------------------- order and evaluation subset


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 65, 1000, 4097])
def test_the_index_shuffle_is_a_permutation_drawn_from_its_key(n):
    order = index_shuffle((3, 0), n, np.arange(n))
    assert sorted(order.tolist()) == list(range(n))
    if n >= 64:  # another key (epoch), another order; the same key, the same order
        assert (index_shuffle((3, 1), n, np.arange(n)) != order).any()
        assert (index_shuffle((4, 0), n, np.arange(n)) != order).any()
        assert (index_shuffle((3, 0), n, np.arange(n)) == order).all()


def test_token_windows_are_ordered_by_the_index_shuffle_epoch_by_epoch(tmp_path):
    write_shard(str(tmp_path / "a_train.bin"), np.arange(60))
    write_shard(str(tmp_path / "a_val.bin"), np.arange(20))
    _meta(tmp_path, 64)
    cfg = _cfg(tmp_path)
    splits = load_splits(cfg)  # 52 windows: 13 micro-batches of 4 per epoch
    assert splits.train.order == "index_shuffle"
    got = record_order(cfg, splits.num_train, 10, 6, order="index_shuffle")  # crosses into epoch 1 at 13
    for row, b in zip(got, range(10, 16)):
        epoch, k = divmod(b, 13)
        assert row.tolist() == index_shuffle((cfg.seed, epoch), 52, np.arange(4 * k, 4 * k + 4)).tolist()


def test_the_evaluation_subset_is_fixed_seeded_sorted_and_the_whole_split_by_default():
    subset = eval_records(seed=0, num_val=1000, batches=3, batch_size=7)
    assert len(subset) == 21 and len(set(subset.tolist())) == 21 and (np.diff(subset) > 0).all()
    assert subset.min() >= 0 and subset.max() < 1000
    assert (eval_records(0, 1000, 3, 7) == subset).all(), "the same records at every evaluation"
    assert set(eval_records(1, 1000, 3, 7).tolist()) != set(subset.tolist()), "another seed, another subset"
    assert eval_records(0, 1000, 0, 7) is None and eval_records(0, 21, 3, 7) is None  # the whole split


def test_a_run_evaluates_the_subset_it_names(tmp_path):
    from jaxloop.data.pipeline import run_val_batches

    write_shard(str(tmp_path / "a_train.bin"), np.arange(60))
    write_shard(str(tmp_path / "a_val.bin"), np.arange(0, 4000) % 64)
    _meta(tmp_path, 64)
    cfg = replace(_cfg(tmp_path), eval_batches=3, data=replace(_cfg(tmp_path).data, eval_batch_size=5))
    splits = load_splits(cfg)
    batches = list(run_val_batches(cfg, splits))
    assert len(batches) == 3 and all(b["weight"].sum() == 5 for b in batches)
    expected = splits.val.get(eval_records(cfg.seed, splits.num_val, 3, 5))["x"]
    assert np.concatenate([b["x"] for b in batches]).tolist() == expected.tolist()
    whole = list(run_val_batches(replace(cfg, eval_batches=0), splits))
    assert sum(b["weight"].sum() for b in whole) == splits.num_val


# ----------------------------------------------------------------------------- memory


def _rss_anon() -> int:
    """The process's anonymous resident memory (RssAnon of /proc/self/status), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_anonymous_memory_does_not_grow_with_shards_far_larger_than_ram(tmp_path):
    # 8 training shards of 2e9 uint16 tokens and one validation shard (36 GB, sparse files: no disk used)
    # against this machine's RAM (psutil's total, asserted smaller). A permutation of the 16e9 training
    # windows would take 128 GB; the run reads 200 micro-batches and an evaluation subset of 40 windows.
    import psutil

    from jaxloop.data.pipeline import TrainLoader, run_val_batches

    count = 2_000_000_000
    for name in [f"big_train_{i:06d}.bin" for i in range(8)] + ["big_val_000000.bin"]:
        write_shard(str(tmp_path / name), np.zeros(0, np.uint16))
        header = np.fromfile(tmp_path / name, "<i4", count=256)
        header[2] = count
        with open(tmp_path / name, "r+b") as f:
            f.write(header.tobytes())
            f.truncate(HEADER_BYTES + 2 * count)
    _meta(tmp_path, 50257)
    total = sum(p.stat().st_size for p in tmp_path.glob("*.bin"))
    assert total > psutil.virtual_memory().total, "the shards must be larger than RAM"
    cfg = replace(_cfg(tmp_path), batch_size=8, eval_batches=5, data=replace(_cfg(tmp_path).data, eval_batch_size=8))
    splits = load_splits(cfg)
    assert splits.num_train == 8 * (count - CTX)
    with TrainLoader(splits, seed=0, batch_size=8, workers=0) as loader:
        next(loader)  # the iterator's own set-up
        before = _rss_anon()
        for _ in range(200):
            batch = next(loader)
        assert batch["x"].shape == (8, CTX)
        assert sum(b["weight"].sum() for b in run_val_batches(cfg, splits)) == 40
        grown = _rss_anon() - before
    # margin: 32 MiB, for allocator noise; the data are 36 GB, their order alone would be 128 GB
    assert grown < 32 * 2**20, f"anonymous memory grew by {grown / 2**20:.1f} MiB"


# ----------------------------------------------------------------------------- exact resume


def _tiny_run(tmp_path: Path, run_dir: Path) -> Config:
    tokens = (np.arange(3000) * 7919 % 97).astype(np.uint16)
    shards = tmp_path / "shards"
    if not shards.exists():
        shards.mkdir()
        write_shard(str(shards / "x_train_000000.bin"), tokens[:1400])
        write_shard(str(shards / "x_train_000001.bin"), tokens[1400:2600])
        write_shard(str(shards / "x_val_000000.bin"), tokens[2600:])
        _meta(shards, 97)
    base = preset("shakespeare")
    # every update logged, one per call (the signal below stops the run where chosen); the runs share one
    # compile cache (the second and third load their compiled calls from it)
    return replace(
        base,
        run_dir=str(run_dir),
        steps=12,
        batch_size=4,
        eval_every=6,
        eval_batches=2,
        log_every=1,
        updates_per_call=1,
        compile_cache=str(tmp_path / "cache"),
        optim=replace(base.optim, lr_schedule=replace(base.optim.lr_schedule, warmup_steps=2)),
        model=ModelConfig(kind="gpt", context=16, d_model=32, n_layers=1, n_heads=2),
        data=DataConfig(source="tokens", path=str(shards), eval_batch_size=4),
        checkpoint=replace(base.checkpoint, every=6),
        log=replace(base.log, progress="off", report=False, tensorboard=False),
    )


def test_a_run_on_shards_interrupted_and_resumed_ends_bit_identical(tmp_path, monkeypatch):
    from jaxloop.config.cli import Interrupted
    from jaxloop.loop.runner import run
    from jaxloop.observe.logger import RunLogger
    from jaxloop.rundir.records import read_records

    reference = run(_tiny_run(tmp_path, tmp_path / "whole"))
    cfg = _tiny_run(tmp_path, tmp_path / "resumed")
    original = RunLogger.train

    def train(self, record):  # SIGTERM while update 8 is logged: the loop finishes update 9, saves, stops
        original(self, record)
        if record["step"] == 8:
            signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(RunLogger, "train", train)
    with pytest.raises(Interrupted):
        run(cfg)
    monkeypatch.setattr(RunLogger, "train", original)
    assert max(int(p.name) for p in (tmp_path / "resumed" / "checkpoints").iterdir() if p.name.isdigit()) == 9
    resumed = run(cfg)

    def losses(d):
        return [
            (r["step"], r.get("loss"), r.get("val_loss")) for r in read_records(d) if r["kind"] in ("train", "eval")
        ]

    assert resumed["state_digest"] == reference["state_digest"]
    assert losses(tmp_path / "resumed")[-6:] == losses(tmp_path / "whole")[-6:]
    assert os.path.exists(tmp_path / "resumed" / "summary.json")


# ----------------------------------------------------------------------------- data changed under a run

_TRUNCATE_AT_UPDATE_2 = """
import os, sys
from jaxloop.observe.logger import RunLogger
import jaxloop.train

shard, original = sys.argv[1], RunLogger.train

def train(self, record):  # update 2 logged: the training shard is cut to its header, in place (its pages
    # past the first are then past the file's end: reading one is SIGBUS)
    original(self, record)
    if record["step"] == 2:
        os.truncate(shard, 1024)

RunLogger.train = train
sys.exit(jaxloop.train.main(sys.argv[2:]))
"""


def test_a_shard_truncated_during_a_run_is_one_line_and_exit_2_not_sigbus(tmp_path):
    """A memory-mapped read past a file's new end is SIGBUS (exit 135, no word); the loader checks the file's size
    (an fstat of the map) before each read. Data are read in the main thread here (workers 0, prefetch 0), so the
    truncation falls between two reads, never inside one."""
    tokens = (np.arange(22000) * 7919 % 97).astype(np.uint16)  # 40 KB of training tokens: pages past the cut
    (tmp_path / "shards").mkdir()
    shard = tmp_path / "shards" / "x_train_000000.bin"
    write_shard(str(shard), tokens[:20000])
    write_shard(str(tmp_path / "shards" / "x_val_000000.bin"), tokens[20000:])
    _meta(tmp_path / "shards", 97)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _TRUNCATE_AT_UPDATE_2,
            str(shard),
            "--preset",
            "shakespeare",
            "--data.source",
            "tokens",
            "--data.path",
            str(tmp_path / "shards"),
            "--model.context",
            "16",
            "--model.d_model",
            "32",
            "--model.n_layers",
            "1",
            "--model.n_heads",
            "2",
            "--batch_size",
            "4",
            "--steps",
            "50",
            "--optim.warmup_steps",
            "2",
            "--log_every",
            "1",
            "--updates_per_call",
            "1",
            "--eval_every",
            "0",
            "--data.prefetch",
            "0",
            "--log.progress",
            "off",
            "--log.no-report",
            "--compile_cache",
            str(tmp_path / "cache"),
            "--run_dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()  # the compile lines, then the error
    assert "Traceback" not in proc.stderr and [line for line in lines if "error" in line] == lines[-1:], lines
    assert lines[-1].startswith(
        f"jaxloop.train: error: token shard {shard} shrank during the run: it holds 1024 bytes now"
    ), lines[-1]


_TRUNCATED_DURING_A_READ = """
import os, sys, time
import numpy as np
from jaxloop.data.shards import ShardShrank, read_shard
from jaxloop.data.sources import TokenWindows

shard = read_shard(sys.argv[1])
windows = TokenWindows([shard], context=512, stride=1, vocab_size=97, split="train")
windows.get(np.arange(1))  # opened, as a worker's first batch opens it
every = np.linspace(0, len(windows) - 1, 40_000).astype(np.int64)  # a read of 40 MB spread over the file
if os.fork() == 0:  # the truncation lands during the read: 10 ms into it
    time.sleep(0.01)
    os.truncate(sys.argv[1], 1024)
    os._exit(0)
try:
    windows.get(every)
except ShardShrank as e:
    print(e.allowed, file=sys.stderr)
    sys.exit(2)
os.wait()
"""


def test_a_shard_truncated_during_a_read_is_shard_shrank_not_sigbus(tmp_path):
    # a worker's read racing the truncation: a size check before it cannot cover the read itself (mutant seen
    # failing: TokenWindows reading its memory map after check_size, as before: SIGBUS, exit -7, no line). The
    # windows are read with pread: a short read is ShardShrank wherever the truncation falls.
    shard = tmp_path / "x_train_000000.bin"
    write_shard(str(shard), (np.arange(8_000_000) * 7919 % 97).astype(np.uint16))
    proc = subprocess.run(
        [sys.executable, "-c", _TRUNCATED_DURING_A_READ, str(shard)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.startswith(f"token shard {shard} shrank during the run: it holds 1024 bytes now"), proc.stderr
