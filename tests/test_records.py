"""Bad records in a Task: the structure and dtypes are checked before anything is written, and a bad record
met later, at batching (grain's worker processes included), stops the run with one line naming the split,
the record index, the key, what was found and what was expected. Empty splits name the split."""

from __future__ import annotations

import numpy as np
import pytest

import jaxloop
from jaxloop.config.run import ConfigError, ModelConfig, preset, replace
from jaxloop.data.sources import FIRST_RECORDS_CHECKED, RecordError, SequenceRecords
from jaxloop.model.builtin import make_model
from jaxloop.update.step import cross_entropy_loss


def _records(n: int, width: int = 4) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=width).astype(np.float32), "y": np.int32(i % 3)} for i in range(n)]


class Lazy:
    """A random-access source that is not a list (read on demand, as a grain MapDataset or a file reader):
    only its first FIRST_RECORDS_CHECKED records are checked up front. Picklable: grain's workers get it."""

    def __init__(self, seq):
        self.seq = seq

    def __len__(self):
        return len(self.seq)

    def __getitem__(self, i):
        return self.seq[i]


def _cfg(run_dir, **fields):
    base = preset("debug")
    return replace(
        base,
        run_dir=str(run_dir),
        steps=6,
        batch_size=16,
        eval_every=3,
        compile_cache="",
        checkpoint=replace(base.checkpoint, every=3),
        log=replace(base.log, progress="off"),
        **fields,
    )


def _task(train, val):
    return jaxloop.Task(model=make_model(ModelConfig(hidden=(8,)), 3), loss=cross_entropy_loss, train=train, val=val)


def _with(records: list[dict], index: int, **record) -> list[dict]:
    out = list(records)
    out[index] = record
    return out


WIDE = dict(x=np.zeros(5, np.float32), y=np.int32(0))


@pytest.mark.parametrize(
    "split,index,bad,expected",
    [
        (
            "train",
            0,
            WIDE,
            ": key 'x' has shape (5,) float32, expected shape (4,) float32 (as 99 of the 100 records checked have)",
        ),
        (
            "train",
            57,
            WIDE,
            ": key 'x' has shape (5,) float32, expected shape (4,) float32 (as 99 of the 100 records checked have)",
        ),
        (
            "train",
            99,
            dict(x=np.zeros(4, np.float64), y=np.int32(0)),
            ": key 'x' has shape (4,) float64, expected shape (4,) float32 (as 99 of the 100 records checked have)",
        ),
        (
            "train",
            31,
            dict(x=np.zeros(4, np.float32)),
            " has keys ['x'], expected ['x', 'y'] (as 99 of the 100 records checked have)",
        ),
        (
            "val",
            12,
            WIDE,
            ": key 'x' has shape (5,) float32, expected shape (4,) float32 (as 39 of the 40 records checked have)",
        ),
    ],
    ids=["train-first", "train-middle", "train-last-dtype", "train-missing-key", "val-middle"],
)
def test_a_bad_record_of_an_in_memory_split_is_named_before_anything_is_written(tmp_path, split, index, bad, expected):
    train, val = _records(100), _records(40)
    if split == "train":
        train = _with(train, index, **bad)
    else:
        val = _with(val, index, **bad)
    with pytest.raises(RecordError) as error:
        jaxloop.run(_cfg(tmp_path / "run"), _task(train, val))
    assert str(error.value) == f"record {index} of the {split} split{expected}"
    assert isinstance(error.value, ConfigError), "exit status 2 from the CLI"
    assert not (tmp_path / "run").exists(), "nothing written"


@pytest.mark.parametrize("workers", [0, 2])
def test_a_bad_record_beyond_the_checked_ones_stops_the_run_at_batching(tmp_path, workers):
    # record 70 of a lazy source: not among the first 16 checked up front; micro-batch 4 or 5 of the first
    # epoch's order holds it (100 records, batches of 16); gathered in grain's worker processes with workers=2
    index = 70
    assert index >= FIRST_RECORDS_CHECKED
    train = Lazy(_with(_records(100), index, **WIDE))
    cfg = _cfg(tmp_path, data=replace(preset("debug").data, workers=workers))
    with pytest.raises(RecordError) as error:
        jaxloop.run(cfg, _task(train, _records(40)))
    assert str(error.value) == (
        f"record {index} of the train split: key 'x' has shape (5,) float32, expected shape "
        f"(4,) float32 (as 16 of the 16 records checked have)"
    )


def test_a_bad_validation_record_met_at_evaluation_names_the_val_split(tmp_path):
    val = Lazy(_with(_records(40), 33, x=np.zeros(4, np.int32), y=np.int32(0)))
    with pytest.raises(
        RecordError,
        match=r"^record 33 of the val split: key 'x' has shape \(4,\) int32, expected "
        r"shape \(4,\) float32 \(as 16 of the 16 records checked have\)$",
    ):
        jaxloop.run(_cfg(tmp_path), _task(_records(100), val))


@pytest.mark.parametrize("empty", ["train", "val"])
def test_an_empty_split_is_named(tmp_path, empty):
    splits = {"train": _records(100), "val": _records(40), empty: []}
    with pytest.raises(RecordError, match=rf"^the {empty} split holds no records: give it at least one$"):
        jaxloop.run(_cfg(tmp_path / "run"), _task(splits["train"], splits["val"]))
    assert not (tmp_path / "run").exists()


def test_validation_records_need_the_training_records_keys(tmp_path):
    val = [{"x": r["x"], "label": r["y"]} for r in _records(40)]
    with pytest.raises(
        RecordError, match=r"record 0 of the val split has keys \['label', 'x'\], expected \['x', 'y'\]"
    ):
        jaxloop.run(_cfg(tmp_path / "run"), _task(_records(100), val))
    assert not (tmp_path / "run").exists()


def test_a_record_that_is_not_a_dict_is_named():
    with pytest.raises(RecordError, match=r"^record 2 of the train split is list \[1, 2\], expected a non-empty dict"):
        SequenceRecords(_records(2) + [[1, 2]], "train")
