"""Faults the CLI used to answer with a traceback (issue 43), each now one line on stderr with exit status 2
(docs/faults.md), found before anything is written: a run directory whose own files are of the wrong kind or
an edited model.json, a size beyond int32, --init_from a folder with no checkpoint, --compile_cache at a file.
Every case is a real launch of `python -m jaxloop.train`, and the files are compared byte for byte."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxloop.data.shards import write_shard

DEBUG = ["--preset", "debug", "--log.progress", "off"]


def _cli(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run(
        [sys.executable, "-m", "jaxloop.train", *argv], cwd=cwd, capture_output=True, text=True, timeout=600, env=env
    )


def _snapshot(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def _one_line(out: subprocess.CompletedProcess, *parts: str) -> str:
    assert out.returncode == 2, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxloop.train: error: "), out.stderr[-3000:]
    assert all(part in lines[0] for part in parts), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished debug run (20 updates, checkpoints at 10 and 20); tests copy it."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    out = _cli(run_dir.parent, *DEBUG, "--run_dir", str(run_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir


def _leaf_of_two_fields(run: Path) -> None:
    record = json.loads((run / "model.json").read_text())
    record["leaves"][0] = record["leaves"][0][:2]
    (run / "model.json").write_text(json.dumps(record))


def _dir_for(name: str):
    def make(run: Path) -> None:
        (run / name).unlink(missing_ok=True)
        (run / name).mkdir()

    return make


def _file_for(name: str):
    def make(run: Path) -> None:
        shutil.rmtree(run / name, ignore_errors=True)
        (run / name).write_text("mine\n")

    return make


# (name, damage(run_dir), the parts the one line must hold); mutant seen failing for each: the code before
# issue 43 (a ValueError, IsADirectoryError or NotADirectoryError traceback, 27 to 59 lines, exit 1)
DAMAGED_RUNS = [
    (
        "model.json leaf of 2 fields",
        _leaf_of_two_fields,
        (
            "a run directory whose model.json can be read (leaf 0 of ",
            "is ['params/hidden_0/bias', [32]], not [path, shape, dtype]); restore it from a copy, or delete it",
        ),
    ),
    (
        "metrics.jsonl a directory",
        _dir_for("metrics.jsonl"),
        (
            "a run directory whose files are files and whose directories are directories (",
            "metrics.jsonl is a directory, not a file)",
        ),
    ),
    ("resumes.jsonl a directory", _dir_for("resumes.jsonl"), ("resumes.jsonl is a directory, not a file",)),
    ("tb a file", _file_for("tb"), ("tb is not a directory): move them aside, or choose another --run_dir",)),
]


@pytest.mark.parametrize("damage,parts", [d[1:] for d in DAMAGED_RUNS], ids=[d[0] for d in DAMAGED_RUNS])
def test_a_resume_into_a_damaged_run_directory_is_one_line_and_writes_nothing(finished, tmp_path, damage, parts):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    damage(run)
    before = _snapshot(run)
    out = _cli(tmp_path, *DEBUG, "--run_dir", str(run), "--steps", "30", "--allow_steps_change")
    _one_line(out, f"run_dir='{run}' is not allowed: ", *parts)
    assert _snapshot(run) == before


def test_a_model_size_beyond_int32_is_refused_in_one_line(tmp_path):
    # mutant seen failing: no upper bound (jax's OverflowError at the first trace, 71 lines, exit 1)
    text = Path(__file__).parent / "data" / "tinyshakespeare_60k.txt"
    out = _cli(
        tmp_path,
        "--preset",
        "shakespeare",
        "--data.path",
        str(text),
        "--optim.warmup_steps",
        "0",
        "--steps",
        "2",
        "--model.vocab_size",
        "3000000000",
        "--run_dir",
        "run",
    )
    _one_line(out, "model.vocab_size=3000000000 is not allowed: an integer <= 2147483647")
    assert list(tmp_path.iterdir()) == []


def test_a_meta_json_vocab_size_beyond_int32_is_refused_in_one_line(tmp_path):
    # mutant seen failing: read_meta's bound without its upper end (OverflowError traceback, exit 1)
    data = tmp_path / "data"
    data.mkdir()
    write_shard(str(data / "train.bin"), np.arange(400) % 50)
    write_shard(str(data / "val.bin"), np.arange(100) % 50)
    (data / "meta.json").write_text(json.dumps({"format": "llm.c", "vocab_size": 2**40}))
    before = _snapshot(tmp_path)
    out = _cli(
        tmp_path,
        "--preset",
        "shakespeare",
        "--data.source",
        "tokens",
        "--data.path",
        str(data),
        "--optim.warmup_steps",
        "0",
        "--steps",
        "2",
        "--run_dir",
        "run",
    )
    _one_line(
        out, "meta.json whose vocab_size is an integer in [1, 2147483647] (got 1099511627776; token ids are int32)"
    )
    assert _snapshot(tmp_path) == before


def test_init_from_a_folder_without_a_checkpoint_is_refused_before_the_run_folder_is_made(tmp_path):
    # mutant seen failing: only "an existing directory" checked (FileNotFoundError traceback after the run folder
    # was made: its marker, config.json, metadata.json, model.json and the lock left behind)
    (tmp_path / "empty").mkdir()
    out = _cli(tmp_path, *DEBUG, "--run_dir", "run", "--init_from", "empty")
    _one_line(
        out,
        "init_from='empty' is not allowed: a run_dir or checkpoints directory holding a checkpoint, "
        "or a Hugging Face GPT-2 directory (empty holds neither)",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_a_compile_cache_at_a_file_is_refused_in_one_line(tmp_path):
    # mutant seen failing: no check (mkdir's FileExistsError traceback, 37 lines, exit 1)
    (tmp_path / "cache").write_text("mine\n")
    out = _cli(tmp_path, *DEBUG, "--run_dir", "run", "--compile_cache", "cache")
    _one_line(
        out, "compile_cache='cache' is not allowed: a directory, or a path where one can be made (", "cache is a file)"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]
