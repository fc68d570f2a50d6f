"""The run directory's start and resume rules (jaxloop/core/run_dir.py): a refused resume says how to go on."""

from __future__ import annotations

import pytest

from jaxloop.core.cli import parse_config
from jaxloop.core.config import ConfigError, resume_conflicts, to_dict
from jaxloop.core.layout import CONFIG_FILE
from jaxloop.core.run_dir import RunDir


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
    message = refused.value.cli_message  # what the CLI prints
    assert "seed: 0 -> 3" in message
    assert "--run_dir NEW_DIR" in message and f"--init_from {run_dir}" in message
    assert f"--run_dir {run_dir} alone" in message
    assert "allow_steps_change" not in message  # steps did not change: no hint about it


def test_the_python_api_refusal_names_config_arguments_not_flags(tmp_path):
    # jaxloop.run's callers read str(error): Config arguments (mutant: the CLI wording as str: fails)
    run_dir = tmp_path / "run"
    _saved_run(tmp_path)
    changed = RunDir(parse_config(["--preset", "debug", "--run_dir", str(run_dir), "--seed", "3"]))
    with pytest.raises(ConfigError) as refused:
        changed.check(has_checkpoint=True)
    message = str(refused.value)
    assert "seed: 0 -> 3" in message and "--" not in message
    assert "Config(run_dir=NEW_DIR" in message and f"init_from={str(run_dir)!r}" in message
    assert f"Config(run_dir={str(run_dir)!r}) alone" in message


def test_the_steps_hint_comes_only_when_steps_changed(tmp_path):
    run_dir = tmp_path / "run"
    _saved_run(tmp_path)
    changed = RunDir(parse_config(["--preset", "debug", "--run_dir", str(run_dir), "--steps", "30"]))
    with pytest.raises(ConfigError) as refused:
        changed.check(has_checkpoint=True)
    assert "steps: 20 -> 30 (steps may change with --allow_steps_change)" in refused.value.cli_message
    assert "(steps may change with allow_steps_change=True)" in str(refused.value)


def test_resume_never_on_a_used_run_dir_is_worded_per_caller(tmp_path):
    _saved_run(tmp_path)
    refused_run = RunDir(parse_config(["--preset", "debug", "--run_dir", str(tmp_path / "run"), "--resume", "never"]))
    with pytest.raises(ConfigError) as refused:
        refused_run.check(has_checkpoint=True)
    assert "--resume auto" in refused.value.cli_message and "--run_dir" in refused.value.cli_message
    assert 'resume="auto"' in str(refused.value) and "Config(run_dir=...)" in str(refused.value)


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


def _cfg(run_dir, *argv: str):
    return parse_config(["--preset", "debug", "--run_dir", str(run_dir), *argv])


def test_a_new_run_marks_its_directory_and_may_start_again_in_it(tmp_path):
    run_dir = tmp_path / "run"
    rd = RunDir(_cfg(run_dir))
    rd.check(has_checkpoint=False)
    rd.start()
    assert rd.layout.marker.is_file()  # written first: a run killed before config.json still owns its directory
    (run_dir / "notes.txt").write_text("the user's notes in the run's own directory")
    assert RunDir(_cfg(run_dir)).check(has_checkpoint=False) is None


def test_a_folder_holding_other_files_is_refused_naming_a_few_of_them(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    for name in ("config.json", "summary.json", "a.txt", "b.txt", "c.txt"):
        (folder / name).write_text("{}")
    with pytest.raises(ConfigError) as refused:
        RunDir(_cfg(folder)).check(has_checkpoint=False)
    assert "holds other files: a.txt, b.txt, c.txt, config.json and 1 more" in str(refused.value)
    assert sorted(p.name for p in folder.iterdir()) == ["a.txt", "b.txt", "c.txt", "config.json", "summary.json"]


@pytest.mark.parametrize("beside", ["metrics.jsonl", "checkpoints/10"])
def test_a_run_directory_of_an_earlier_version_without_a_marker_still_resumes(tmp_path, beside):
    # made before the marker existed: recognised by its layout (config.json beside metrics.jsonl or checkpoints/)
    run_dir = tmp_path / "run"
    rd = RunDir(_cfg(run_dir))
    rd.start()
    rd.layout.marker.unlink()
    has_checkpoint = beside.startswith("checkpoints")
    if has_checkpoint:
        (run_dir / beside).mkdir(parents=True)
    else:
        (run_dir / beside).write_text("")
    again = RunDir(_cfg(run_dir))
    assert again.check(has_checkpoint=has_checkpoint) == (to_dict(again.cfg) if has_checkpoint else None)
    again.start()
    assert again.layout.marker.is_file()  # marked from now on


def test_an_empty_checkpoints_directory_made_beforehand_is_no_foreign_file(tmp_path):
    # e.g. a mount point for a bucket, made before the first run
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert RunDir(_cfg(tmp_path / "run")).foreign_files() == []
    (tmp_path / "run" / "checkpoints" / "x").write_text("")
    assert RunDir(_cfg(tmp_path / "run")).foreign_files() == ["checkpoints"]
