"""A full disk during an async checkpoint save: one clear line, exit status 3, nothing half-written counted,
and a rerun after space is freed resumes bit-identically. A real process on a real 6 MB tmpfs (tests run as
root here and in CI: mount needs it)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxloop.checkpoint.write_errors import committed_steps, is_disk_full, write_error
from jaxloop.loop.runner import is_compile_line
from jaxloop.rundir.layout import MARKER_FILE
from jaxloop.rundir.records import read_records

# ~0.95 MB a checkpoint (a 64-256-256-10 MLP: params, Adam's moments, the accumulator), one every 10 updates,
# all kept: the sixth or seventh save fills 6 MB. Asynchronous saves (the default).
ARGS = (
    "--preset",
    "debug",
    "--log.progress",
    "off",
    "--log.no-tensorboard",
    "--model.hidden",
    "256",
    "256",
    "--steps",
    "100",
    "--checkpoint.every",
    "10",
    "--checkpoint.keep_last",
    "10",
)
LINE = re.compile(
    r"jaxloop\.train: error: the checkpoint of update (\d+) could not be written to (\S+): the disk is "
    r"full \(No space left on device\); [\d.]+ (?:B|KiB|MiB) free there; the last good checkpoint is "
    r"update (\d+), which a rerun resumes from"
)


def _train(run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxloop.train", "--run_dir", str(run_dir), *ARGS],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def tmpfs(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_disk_filling_during_an_async_save_stops_with_one_line_and_a_rerun_resumes_bit_identically(tmp_path, tmpfs):
    reference = _train(tmp_path / "ref")
    assert reference.returncode == 0, reference.stderr
    ref = json.loads((tmp_path / "ref" / "summary.json").read_text())

    run_dir = tmpfs / "run"
    full = _train(run_dir)
    assert full.returncode == 3, full.stderr
    lines = [line for line in full.stderr.strip().splitlines() if not is_compile_line(line)]
    assert "Traceback" not in full.stderr, full.stderr
    match = LINE.fullmatch(lines[-1])
    assert match, lines[-1]
    failed, path, last_good = int(match.group(1)), match.group(2), int(match.group(3))
    assert path == str(run_dir / "checkpoints")
    # warned once, before: the free space held at most one more checkpoint of the last one's size
    assert full.stderr.count("the next saves will not fit") == 1
    assert len(lines) <= 3, full.stderr  # the warning (2 lines: message and source) and the error

    committed = committed_steps(run_dir / "checkpoints")
    assert committed == list(range(10, last_good + 1, 10)), "the last good checkpoint named is the newest whole one"
    assert failed > last_good
    leftovers = [p.name for p in (run_dir / "checkpoints").iterdir() if not p.name.isdigit()]
    assert all(
        re.fullmatch(r"(\d+)\.orbax-checkpoint-tmp.*", name) and int(name.split(".")[0]) > last_good
        for name in leftovers
    ), f"only unfinished saves are left, as Orbax's tmp directories: {leftovers}"

    # space freed: the same command resumes from the last good checkpoint, ends bit-identical
    subprocess.run(["mount", "-o", "remount,size=64m", str(tmpfs)], check=True)
    rerun = _train(run_dir)
    assert rerun.returncode == 0, rerun.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["state_digest"] == ref["state_digest"]
    resumed = json.loads((run_dir / "resumes.jsonl").read_text().splitlines()[-1])
    assert resumed["step"] == last_good
    assert [r["step"] for r in read_records(run_dir) if r["kind"] == "train"] == [
        r["step"] for r in read_records(tmp_path / "ref") if r["kind"] == "train"
    ]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if not p.name.isdigit()], "leftovers cleaned up"
    assert "damaged" not in rerun.stderr and not (run_dir / "checkpoints_damaged").exists(), (
        "the unfinished save was never taken for a checkpoint"
    )


def test_a_write_error_names_the_failed_step_the_cause_and_the_last_good_one(tmp_path):
    (tmp_path / "10").mkdir()
    (tmp_path / "20").mkdir()
    (tmp_path / "30.orbax-checkpoint-tmp").mkdir()
    # the failed step: the one Orbax's error names, else the first handed over and not committed
    assert "of update 30 could not" in str(
        write_error(OSError(28, "No space left on device"), tmp_path, [10, 20, 30, 40])
    )
    named = ValueError(
        f'RESOURCE_EXHAUSTED: Error writing "x" at "{tmp_path}/40.orbax-checkpoint-tmp/state": '
        "No space left on device [os_error_code='28']"
    )
    assert "of update 40 could not" in str(write_error(named, tmp_path, [10, 20, 30, 40]))
    # a write failure other than a full disk: the cause as the OS gave it, found down the chain
    denied = PermissionError(13, "Permission denied", str(tmp_path / "30.orbax-checkpoint-tmp" / "state"))
    try:
        raise RuntimeError("save failed") from denied
    except RuntimeError as e:
        line = str(write_error(e, tmp_path, [10, 20, 30]))
    assert not is_disk_full(denied)
    assert line.startswith(
        f"the checkpoint of update 30 could not be written to {tmp_path}: PermissionError: [Errno 13] Permission denied"
    )
    assert re.search(
        r"; [\d.]+ (B|KiB|MiB|GiB) free there; the last good checkpoint is update 20, which a rerun "
        r"resumes from$",
        line,
    ), line
    assert is_disk_full(OSError(28, "No space left on device")) and is_disk_full(named)


def test_a_checkpointer_drops_the_closed_loop_callbacks_of_abandoned_writes_and_nothing_else(tmp_path, monkeypatch):
    # When one write of a save fails, Orbax's gather stops and the other writes finish into its closed event
    # loop: tensorstore reports each as an unraisable RuntimeError("Event loop is closed"), or its own
    # failure nobody retrieved (dozens of tracebacks, or none, depending on timing). Mutant seen failing:
    # the hook not installed.
    from types import SimpleNamespace

    from jaxloop.checkpoint.manager import Checkpointer
    from jaxloop.config.run import Config

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    ckpt = Checkpointer(Config().checkpoint, tmp_path)
    try:
        closed = SimpleNamespace(
            exc_type=RuntimeError,
            exc_value=RuntimeError("Event loop is closed"),
            exc_traceback=None,
            err_msg=None,
            object=None,
        )
        other = SimpleNamespace(
            exc_type=ValueError, exc_value=ValueError("something else"), exc_traceback=None, err_msg=None, object=None
        )
        failed_write = SimpleNamespace(
            exc_type=ValueError,
            exc_traceback=None,
            err_msg=None,
            object=None,
            exc_value=ValueError(
                f'RESOURCE_EXHAUSTED: Error writing "x" in "{tmp_path}/60.orbax-checkpoint-tmp/state": '
                "No space left on device"
            ),
        )
        for unraisable in (closed, failed_write, other):
            sys.unraisablehook(unraisable)
    finally:
        ckpt.close()
    assert seen == [other]


def test_a_full_disk_met_outside_a_checkpoint_save_is_one_line_and_exit_status_3(tmp_path, monkeypatch, capsys):
    # metrics.jsonl or config.json may be the write that meets the full disk first
    import errno

    from jaxloop import train
    from jaxloop.loop import runner

    (tmp_path / "checkpoints" / "40").mkdir(parents=True)
    (tmp_path / MARKER_FILE).write_text("{}\n")  # a run's directory (jaxloop.rundir.rules)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "metrics.jsonl"))

    monkeypatch.setattr(runner, "_run_held", full)
    assert train.main(["--preset", "debug", "--run_dir", str(tmp_path)]) == 3
    line = capsys.readouterr().err.strip()
    assert re.fullmatch(
        rf"jaxloop\.train: error: {tmp_path}/metrics\.jsonl could not be written: the disk is full "
        r"\(No space left on device\); [\d.]+ (B|KiB|MiB|GiB) free there; the last good checkpoint "
        r"is update 40, which a rerun resumes from",
        line,
    ), line


def _fill(mount: Path) -> None:
    """Write until not one more byte fits (tmpfs allocates whole pages: smaller and smaller chunks)."""
    with open(mount / "filler", "wb", buffering=0) as f:
        for chunk in (1 << 20, 1 << 16, 1 << 12, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError:
                pass


def test_a_disk_full_at_the_start_is_one_line_exit_3_and_leaves_no_temporary(tmpfs, capsys):
    # the first write of a run is the lock's holder record: it used to leave .lock.holder.json.PID.tmp behind
    from jaxloop import train

    _fill(tmpfs)
    run_dir = tmpfs / "run"
    assert train.main(["--preset", "debug", "--run_dir", str(run_dir), "--log.progress", "off"]) == 3
    line = capsys.readouterr().err.strip()
    assert re.fullmatch(
        rf"jaxloop\.train: error: {run_dir} could not be written: the disk is full \(No space left on "
        r"device\); 0 B free there; no checkpoint was completed; a rerun starts afresh",
        line,
    ), line
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]  # the lock file itself: empty, and kept by design
