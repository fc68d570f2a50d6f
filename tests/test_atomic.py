"""Every file a run rewrites is replaced atomically (jaxloop.rundir.atomic): a SIGKILL at any instant leaves the old
file or the new one, whole. The window that matters most: a resume rewrites metrics.jsonl to the records up to
its checkpoint, and that file holds the run's whole history."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxloop.rundir.atomic import atomic_write_text, is_temporary
from jaxloop.rundir.records import kept_on_resume

RESUME = """
import sys
from jaxloop.observe.logger import RunLogger
from jaxloop.config.run import LogConfig
print("rewriting", flush=True)
RunLogger(sys.argv[1], LogConfig(progress="off", tensorboard=False), start_step=int(sys.argv[2]), total_steps=10).close()
print("done", flush=True)
"""
RECORDS = 30_000
"""A long run's history: metrics.jsonl of ~2.5 MB, whose rewrite takes a few tenths of a second here."""


def _history(path: Path) -> bytes:
    """RECORDS train records over updates 1..10, a skipped update's record at 9 (updated false), evals."""
    lines = []
    for i in range(RECORDS):
        step = 1 + i * 10 // RECORDS
        record = {"kind": "train", "step": step, "loss": 1.0 / (i + 1), "lr": 3e-3, "i": i}
        if i == RECORDS - 1000:
            record.update(step=9, updated=False)
        lines.append(json.dumps(record) + "\n")
    data = "".join(lines).encode()
    path.write_bytes(data)
    return data


def _resume(run_dir: Path) -> subprocess.Popen:
    """The logger of a resume at update 9 in a process of its own, once it has printed that it starts."""
    resume = subprocess.Popen([sys.executable, "-c", RESUME, str(run_dir), "9"], stdout=subprocess.PIPE, text=True)
    assert resume.stdout.readline() == "rewriting\n"
    return resume


def test_a_resume_killed_inside_the_metrics_rewrite_loses_no_record(tmp_path):
    # The logger of a resume at update 9 keeps every record up to it (all but those after the checkpoint) and
    # rewrites the file. Killed at several instants across the rewrite (fractions of its duration, measured
    # first): the file is always the old history or the new one, whole; never truncated or partial.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics = run_dir / "metrics.jsonl"
    old = _history(metrics)
    new = b"".join(line + b"\n" for line in old.splitlines() if kept_on_resume(json.loads(line), 9))
    assert len(new.splitlines()) > RECORDS * 8 // 10
    killed_inside = 0
    for _ in range(3):  # a loaded machine may move the rewrite past the kills: measure again and retry
        metrics.write_bytes(old)
        resume = _resume(run_dir)
        t0 = time.monotonic()  # the rewrite's own duration, from its start (not the interpreter's)
        assert resume.wait() == 0
        duration_s = time.monotonic() - t0
        assert metrics.read_bytes() == new
        for fraction in (0.2, 0.4, 0.55, 0.7, 0.85):
            metrics.write_bytes(old)
            resume = _resume(run_dir)
            time.sleep(fraction * duration_s)
            resume.send_signal(signal.SIGKILL)
            resume.wait()
            after = metrics.read_bytes()
            assert after in (old, new), (
                f"killed at {fraction:.0%} of the rewrite: {len(after.splitlines())} of "
                f"{len(old.splitlines())} records left"
            )
            killed_inside += resume.returncode == -signal.SIGKILL and after == old
        if killed_inside >= 2:
            break
    assert killed_inside >= 2, "the kills must land inside the rewrite (before its rename) to show anything"
    # the temporaries killed rewrites left are deleted by the next one, which completes
    assert _resume(run_dir).wait() == 0
    assert metrics.read_bytes() == new
    assert [p.name for p in run_dir.iterdir()] == ["metrics.jsonl"]


def test_the_resume_rule_keeps_records_up_to_the_checkpoint_but_a_skipped_update_at_it():
    # one rule for both loops: a skipped update's record carries the count of updates before it
    assert kept_on_resume({"kind": "train", "step": 5}, 5)
    assert kept_on_resume({"kind": "eval", "step": 5}, 5)
    assert not kept_on_resume({"kind": "train", "step": 5, "updated": False}, 5)
    assert not kept_on_resume({"kind": "train", "step": 6}, 5)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    path.write_text("old")

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError):
        atomic_write_text(path, "new")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_a_replaced_file_keeps_its_permissions_and_a_new_one_gets_the_umasks(tmp_path):
    kept = tmp_path / "config.json"
    kept.write_text("{}")
    kept.chmod(0o640)
    atomic_write_text(kept, "{}\n")
    assert stat.S_IMODE(kept.stat().st_mode) == 0o640
    fresh = tmp_path / "summary.json"
    atomic_write_text(fresh, "{}\n")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o666 & ~umask  # as open() would make it, not mkstemp's 0o600


def test_temporaries_are_recognised_by_name():
    assert is_temporary(".metrics.jsonl.k2j3h4.tmp")
    assert not is_temporary("metrics.jsonl") and not is_temporary("notes.tmp")
