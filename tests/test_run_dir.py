"""The run directory's start and resume rules (jaxloop/rundir/rules.py): a refused resume says how to go on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxloop.config.cli import parse_config
from jaxloop.config.run import ConfigError, resume_conflicts, to_dict
from jaxloop.rundir.layout import CHECKPOINT_CONFIG, CONFIG_FILE
from jaxloop.rundir.rules import RunDir


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
    # (check_paths=False: this saved run holds no checkpoint for --init_from to read; the rule here is run_dir's)
    new = parse_config(
        ["--preset", "debug", "--seed", "3", "--run_dir", str(tmp_path / "new"), "--init_from", str(run_dir)],
        check_paths=False,
    )
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


OLD_CONFIG = Path(__file__).parent / "data" / "old_config" / "sgd_one_cycle.json"
"""A config.json as an earlier jaxloop wrote it (tests/data/old_config): the flat optim form."""


def _earlier_run(run_dir: Path, checkpoint_config: bytes) -> None:
    """A run directory as a jaxloop from before the marker left it: config.json, metrics.jsonl and a committed
    checkpoint (checkpoints/10/) whose config item holds `checkpoint_config`."""
    (run_dir / "checkpoints" / "10" / "config").mkdir(parents=True)
    (run_dir / "checkpoints" / "10" / CHECKPOINT_CONFIG).write_bytes(checkpoint_config)
    (run_dir / CONFIG_FILE).write_bytes(OLD_CONFIG.read_bytes())
    (run_dir / "metrics.jsonl").write_text("")


def test_a_run_directory_of_an_earlier_version_without_a_marker_still_resumes(tmp_path):
    # made before the marker existed: known by its checkpoint's copy of the config, which jaxloop reads
    run_dir = tmp_path / "run"
    _earlier_run(run_dir, OLD_CONFIG.read_bytes())
    again = RunDir(parse_config(["--run_dir", str(run_dir)], check_paths=False))  # resumed by name
    assert again.foreign_files() == []
    assert again.check(has_checkpoint=True) == json.loads(OLD_CONFIG.read_text())
    again.start()
    assert again.layout.marker.is_file()  # marked from now on


@pytest.mark.parametrize("config_item", [b'{"epoch": 1, "acc": 0.5}', b"not json", b"[]"])
def test_a_checkpoint_whose_config_jaxloop_cannot_read_is_no_evidence(tmp_path, config_item):
    # mutant: any digit-named checkpoint counted as evidence (no read of its config): foreign_files() == []
    run_dir = tmp_path / "run"
    _earlier_run(run_dir, config_item)
    assert RunDir(_cfg(run_dir)).foreign_files() == ["checkpoints", "config.json", "metrics.jsonl"]


USERS_FOLDERS = {
    # a folder of the user's own files that happens to hold names a run writes (issue 43's outside pass)
    "metrics.jsonl beside config.json": {
        "config.json": b'{"lr": 0.1}\n',
        "metrics.jsonl": b'{"epoch": 1, "acc": 0.5}\n',
    },
    "an empty checkpoints/ beside config.json, summary.json, report.md": {
        "config.json": b'{"lr": 0.1}\n',
        "summary.json": b'{"acc": 0.5}\n',
        "report.md": b"# my notes\n",
        "checkpoints/": b"",
    },
}


@pytest.mark.parametrize("files", USERS_FOLDERS.values(), ids=USERS_FOLDERS.keys())
def test_a_folder_that_only_looks_like_a_run_is_refused_in_one_line_and_left_byte_identical(tmp_path, files):
    # a real launch of the CLI (mutant: the old layout rule, config.json beside metrics.jsonl or checkpoints/,
    # accepted as an earlier version's run: exit 0, metrics.jsonl appended to and config.json replaced)
    folder = tmp_path / "mine"
    folder.mkdir()
    for name, data in files.items():
        (folder / name).mkdir() if name.endswith("/") else (folder / name).write_bytes(data)
    before = {p.relative_to(folder): (p.read_bytes() if p.is_file() else None) for p in folder.rglob("*")}
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run(
        [sys.executable, "-m", "jaxloop.train", "--preset", "debug", "--run_dir", str(folder)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"jaxloop.train: error: run_dir='{folder}' is not allowed")
    named = ", ".join(sorted(n.rstrip("/") for n in files if not n.endswith("/")))
    assert f"holds other files: {named}" in lines[0]
    assert {p.relative_to(folder): (p.read_bytes() if p.is_file() else None) for p in folder.rglob("*")} == before


def test_an_empty_checkpoints_directory_made_beforehand_is_no_foreign_file(tmp_path):
    # e.g. a mount point for a bucket, made before the first run
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert RunDir(_cfg(tmp_path / "run")).foreign_files() == []
    (tmp_path / "run" / "checkpoints" / "x").write_text("")
    assert RunDir(_cfg(tmp_path / "run")).foreign_files() == ["checkpoints"]
