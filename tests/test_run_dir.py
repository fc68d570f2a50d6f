"""The run directory's start and resume rules (loopcore/run_dir.py): a refused resume says how to go on."""

from __future__ import annotations

import pytest

from loopcore.cli import parse_config
from loopcore.config import ConfigError, resume_conflicts, to_dict
from loopcore.layout import CONFIG_FILE
from loopcore.run_dir import RunDir


def _saved_run(tmp_path, *argv: str) -> RunDir:
    """A run directory as a finished run leaves it (its config.json), for the config of argv."""
    rd = RunDir(parse_config(["--preset", "debug", "--run_dir", str(tmp_path / "run"), *argv]))
    rd.start()
    return rd


def test_a_changed_config_is_refused_naming_both_ways_forward(tmp_path):
    run_dir = tmp_path / "run"
    _saved_run(tmp_path)
    changed = RunDir(parse_config(["--preset", "debug", "--run_dir", str(run_dir), "--seed", "3"]))
    with pytest.raises(ConfigError) as refused:
        changed.check(has_checkpoint=True)
    message = str(refused.value)
    assert "seed: 0 -> 3" in message
    assert "--run_dir NEW_DIR" in message and f"--init_from {run_dir}" in message
    assert f"--config {run_dir / CONFIG_FILE}" in message


def test_both_ways_forward_are_accepted(tmp_path):
    run_dir = tmp_path / "run"
    saved = _saved_run(tmp_path)
    # a new run, from this run's weights, with the new settings: nothing in its run_dir to conflict with
    new = parse_config(["--preset", "debug", "--seed", "3", "--run_dir", str(tmp_path / "new"),
                        "--init_from", str(run_dir)])
    assert RunDir(new).check(has_checkpoint=False) is None
    # this run resumed with its own settings, read back from its config.json: no field differs
    again = parse_config(["--config", str(run_dir / CONFIG_FILE)])
    assert resume_conflicts(to_dict(saved.cfg), again) == []
    assert RunDir(again).check(has_checkpoint=True) == to_dict(saved.cfg)
