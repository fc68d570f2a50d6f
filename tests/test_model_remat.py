"""model.remat is gone: memory.remat=blocks is the one field that rematerialises the model's blocks. The flag
--model.remat, a config file's `model.remat: true` and a saved config.json's model.remat keep their meaning
(jaxloop.config.run.upgrade, jaxloop.config.cli), or are refused naming what to write where they would need two plans.
Mutant (upgrade returns the dict unchanged, no translation): every test of a file or saved config fails, seen."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from jaxloop.config.cli import parse_config
from jaxloop.config.errors import UsageError
from jaxloop.config.run import Config, ConfigError, MemoryConfig, changed_fields, resume_conflicts, to_dict
from jaxloop.rundir.rules import RunDir, read_config, saved_config


def _parse(*flags: str) -> Config:
    return parse_config(["--preset", "debug", *flags], check_paths=False)


def _file(tmp_path: Path, fields: dict) -> str:
    path = tmp_path / "old.json"
    path.write_text(json.dumps(fields))
    return str(path)


def test_the_flag_model_remat_is_memory_remat_blocks() -> None:
    assert _parse("--model.remat").memory.remat == "blocks"
    assert _parse("--model.remat", "--memory.remat", "none").memory.remat == "blocks"
    assert _parse("--model.no-remat").memory.remat == "none"
    assert _parse().memory.remat == "none"


def test_the_flag_model_remat_beside_another_remat_is_refused_saying_what_to_write() -> None:
    with pytest.raises(UsageError, match=r"--model.remat is --memory.remat blocks now.*memory.remat=full: give one"):
        _parse("--model.remat", "--memory.remat", "full")


def test_a_config_file_with_model_remat_true_is_memory_remat_blocks(tmp_path: Path) -> None:
    assert _parse("--config", _file(tmp_path, {"model": {"remat": True}})).memory.remat == "blocks"
    assert _parse("--config", _file(tmp_path, {"model": {"remat": False}})).memory.remat == "none"


def test_a_config_file_with_model_remat_and_another_remat_is_refused_naming_both(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model.remat=True is not allowed: .*memory.remat=dots_saveable.*write one"):
        _parse("--config", _file(tmp_path, {"model": {"remat": True}, "memory": {"remat": "dots_saveable"}}))


def test_model_no_remat_over_a_file_that_asked_for_blocks_says_what_to_write(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="write --memory.remat none"):
        _parse("--config", _file(tmp_path, {"model": {"remat": True}}), "--model.no-remat")


def _saved_run(tmp_path: Path, model_remat: bool) -> tuple[Path, dict]:
    """A run_dir as an earlier version left it: its config.json, and its checkpoint's copy of it (the evidence
    that jaxloop wrote the directory, jaxloop.rundir.rules), hold model.remat."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    saved = to_dict(replace(Config(preset="debug"), run_dir=str(run_dir)))
    saved["model"]["remat"] = model_remat
    (run_dir / "config.json").write_text(json.dumps(saved))
    (run_dir / "metrics.jsonl").write_text("")
    (run_dir / "checkpoints" / "10" / "config").mkdir(parents=True)
    (run_dir / "checkpoints" / "10" / "config" / "metadata").write_text(json.dumps(saved))
    return run_dir, saved


@pytest.mark.parametrize("model_remat", [False, True])
def test_a_saved_config_with_model_remat_resumes_by_name_without_a_conflict(tmp_path: Path, model_remat) -> None:
    run_dir, saved = _saved_run(tmp_path, model_remat)
    cfg = saved_config(str(run_dir))
    assert cfg is not None and cfg.memory.remat == ("blocks" if model_remat else "none")
    assert RunDir(cfg).check(has_checkpoint=True) == saved
    assert resume_conflicts(saved, cfg) == [] and changed_fields(saved, cfg) == {}


def test_a_saved_config_with_model_remat_beside_another_remat_keeps_that_plan(tmp_path: Path) -> None:
    """The run trained under both; the plans compute the same math, so its resume keeps memory.remat."""
    run_dir, saved = _saved_run(tmp_path, True)
    saved["memory"]["remat"] = "full"
    (run_dir / "config.json").write_text(json.dumps(saved))
    cfg = saved_config(str(run_dir))
    assert cfg is not None and cfg.memory == MemoryConfig(remat="full") == read_config(run_dir).memory
    assert resume_conflicts(saved, cfg) == []
