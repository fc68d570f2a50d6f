"""The data a run trains on is part of its identity (jaxloop.data.identity): each split's files listed on the
console and in metadata.json with a cheap fingerprint of every file read; a resume on data that changed since is
refused in one line (exit 2, nothing written) unless --data.allow_changed says it is meant."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxloop.config.run import Config, ConfigError, DataConfig, ModelConfig, preset, replace
from jaxloop.data.identity import BLOCK, BLOCKS, data_differences, data_record
from jaxloop.data.shards import write_shard
from jaxloop.rundir.rules import saved_config

VOCAB = 97


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One compile cache for the module's runs: the later ones load the tiny GPT's calls from it."""
    return tmp_path_factory.mktemp("cache")


def _tokens(n: int, salt: int = 0) -> np.ndarray:
    return ((np.arange(n) * 7919 + salt) % VOCAB).astype(np.uint16)


STEPS = 9
"""Every run of the module trains toward update 9 (one schedule: the calls compiled once serve all of them)."""


def _cfg(tmp_path: Path, cache: Path, steps: int = STEPS) -> Config:
    shards = tmp_path / "shards"
    if not shards.exists():
        shards.mkdir()
        write_shard(str(shards / "x_train_000000.bin"), _tokens(1400))
        write_shard(str(shards / "x_train_000001.bin"), _tokens(1200, 5))
        write_shard(str(shards / "x_val_000000.bin"), _tokens(400, 11))
        (shards / "meta.json").write_text(json.dumps({"format": "llm.c", "vocab_size": VOCAB}))
    base = preset("shakespeare")
    return replace(
        base,
        run_dir=str(tmp_path / "run"),
        steps=steps,
        batch_size=4,
        eval_every=0,
        eval_batches=2,
        log_every=3,
        updates_per_call=3,
        compile_cache=str(cache),
        allow_steps_change=steps != STEPS,
        optim=replace(base.optim, lr_schedule=replace(base.optim.lr_schedule, warmup_steps=2)),
        model=ModelConfig(kind="gpt", context=16, d_model=32, n_layers=1, n_heads=2),
        data=DataConfig(source="tokens", path=str(shards), eval_batch_size=4),
        checkpoint=replace(base.checkpoint, every=3),
        log=replace(base.log, progress="off", report=False, tensorboard=False),
    )


def _replace_content(path: Path) -> None:
    """Other tokens, the same size: what a re-run of a tokenizer over other text can leave behind."""
    write_shard(str(path), _tokens(1200, 42))


def _files(run_dir: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns) for p in run_dir.rglob("*") if p.is_file()
    }


def test_a_run_lists_each_splits_files_on_the_console_and_in_metadata(tmp_path, cache, capfd):
    from jaxloop.loop.runner import run

    cfg = _cfg(tmp_path, cache)
    run(cfg)
    shards = tmp_path / "shards"
    out = capfd.readouterr()
    console = (out.out + out.err).splitlines()
    assert "data train (by file names): 2 files, 2,600 tokens: x_train_000000.bin, x_train_000001.bin" in console
    assert "data val (by file names): 1 file, 400 tokens: x_val_000000.bin" in console
    data = json.loads((tmp_path / "run" / "metadata.json").read_text())["data"]
    assert data["splits"]["train"] == {
        "files": [str(shards / "x_train_000000.bin"), str(shards / "x_train_000001.bin")],
        "tokens": 2600,
    }
    assert data["splits"]["val"] == {"files": [str(shards / "x_val_000000.bin")], "tokens": 400}
    assert data["files"][str(shards / "x_val_000000.bin")]["bytes"] == 1024 + 2 * 400


def test_a_resume_on_a_shard_replaced_at_the_same_size_is_one_line_exit_2_with_nothing_written(tmp_path, cache):
    from jaxloop.loop.runner import run

    run(_cfg(tmp_path, cache))
    shard = tmp_path / "shards" / "x_train_000001.bin"
    _replace_content(shard)
    before = _files(tmp_path / "run")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxloop.train",
            "--run_dir",
            str(tmp_path / "run"),
            "--steps",
            "12",
            "--allow_steps_change",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert f"{shard}: other content at the same size (3424 bytes)" in lines[0], lines[0]
    assert "--data.allow_changed" in lines[0] and "--run_dir NEW_DIR" in lines[0], lines[0]
    assert _files(tmp_path / "run") == before


def test_data_allow_changed_resumes_on_the_new_data_and_records_what_changed(tmp_path, cache):
    """This launch only: the flag is recorded among the resume's changed fields and not inherited by the next."""
    from jaxloop import Hook
    from jaxloop.loop.runner import run

    # a first session stopped (and saved) at update 6 by a hook: the resume runs the same schedule's calls
    first = run(_cfg(tmp_path, cache), hooks=[Hook(lambda info: info.stop("planned"), every=6)])
    assert first["final_step"] == 6
    shard = tmp_path / "shards" / "x_train_000001.bin"
    _replace_content(shard)
    again = _cfg(tmp_path, cache)
    with pytest.raises(ConfigError, match=r"DataConfig\(allow_changed=True\)"):
        run(again)
    result = run(replace(again, data=replace(again.data, allow_changed=True)))
    assert result["final_step"] == 9
    data = json.loads((tmp_path / "run" / "metadata.json").read_text())["data"]
    assert data["changed_on_resume"] == [f"{shard}: other content at the same size (3424 bytes)"]
    resumes = [json.loads(line) for line in (tmp_path / "run" / "resumes.jsonl").read_text().splitlines()]
    assert resumes[-1]["changed"]["data.allow_changed"] == [False, True]
    assert saved_config(str(tmp_path / "run")).data.allow_changed is False


@pytest.mark.parametrize("source", ["text", "npz"])
def test_a_text_or_npz_file_changed_at_the_same_size_is_told_apart(tmp_path, source):
    """The fingerprint samples BLOCKS blocks of BLOCK bytes over the file: a change in its last bytes is seen."""
    path = tmp_path / f"data.{source}"
    if source == "text":
        path.write_text("abcdefgh" * (BLOCK * BLOCKS // 4))  # 2 x BLOCK x BLOCKS bytes: sampled, not read whole
    else:
        np.savez(path, x=np.zeros((BLOCK * BLOCKS // 16, 16), np.float32), y=np.zeros(BLOCK * BLOCKS // 16, np.int64))
    run = data_record(source, str(path), [str(path)])
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert os.path.getsize(path) == run["files"][str(path)]["bytes"]
    assert data_differences(run, data_record(source, str(path), [str(path)])) == [
        f"{path}: other content at the same size ({len(raw)} bytes)"
    ]


def test_with_data_allow_changed_the_data_position_goes_on_over_a_training_split_of_another_size():
    """Without it a saved position over another number of records is refused (it would name other records)."""
    from jaxloop.data.pipeline import train_loader
    from jaxloop.data.sources import load_splits

    cfg = preset("digits")
    splits = load_splits(cfg)
    saved = {
        "version": 1,
        "position": 9,
        "seed": cfg.seed,
        "batch_size": cfg.batch_size,
        "num_train": splits.num_train + 100,
    }
    with pytest.raises(ConfigError, match=r"data.path='digits' .*num_train=1537, now 1437"):
        train_loader(cfg, splits, saved)
    with train_loader(replace(cfg, data=replace(cfg.data, allow_changed=True)), splits, saved) as loader:
        assert (loader.position, loader.num_train) == (9, splits.num_train)
