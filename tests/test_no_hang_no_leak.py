"""No hang, no leak: a SIGKILLed run leaves no data worker, resource tracker or shared-memory segment behind,
and a checkpoints directory that cannot be written ends the run with one line and exit status 3 within
seconds (not Orbax's 300 s coordination timeout). Real processes; the read-only directory is a read-only
bind mount (tests run as root here and in CI, where permission bits do not stop root)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from jaxloop.loop.runner import is_compile_line

SMALL = ("--preset", "debug", "--log.progress", "off", "--log.no-tensorboard")
SHM = Path("/dev/shm")


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.1)


def test_data_workers_their_resource_tracker_and_shared_memory_die_with_a_sigkilled_run(tmp_path):
    shm_before = set(os.listdir(SHM))
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxloop.train",
            "--run_dir",
            str(tmp_path / "run"),
            *SMALL,
            "--steps",
            "1000000",
            "--data.workers",
            "2",
        ],
        stderr=subprocess.DEVNULL,
    )
    try:
        main = psutil.Process(run.pid)

        def workers() -> list[psutil.Process]:
            return [p for p in main.children() if "spawn_main" in _cmdline(p)]

        _wait_for(
            lambda: (
                len(workers()) == 2
                and (tmp_path / "run" / "metrics.jsonl").exists()
                and os.path.getsize(tmp_path / "run" / "metrics.jsonl") > 0
            ),
            120,
            "two workers feeding the run",
        )
        children = main.children(recursive=True)  # the workers and multiprocessing's resource tracker
        segments = set(os.listdir(SHM)) - shm_before
        assert any("resource_tracker" in _cmdline(p) for p in children)
        assert segments, "the workers pass batches through shared memory"
    finally:
        run.send_signal(signal.SIGKILL)
        run.wait()
    try:
        # a worker notices within PARENT_WATCH_S (0.5 s); 10 s: a generous margin on a loaded 2-core machine
        _wait_for(lambda: not any(_alive(p) for p in children), 10, f"the children {[p.pid for p in children]} ending")
        _wait_for(lambda: not segments & set(os.listdir(SHM)), 10, "the workers' shared-memory segments being removed")
    finally:
        for p in children:  # what a failure leaves: not for the next tests
            if _alive(p):
                p.kill()


def _cmdline(p: psutil.Process) -> str:
    """A process's command line, or "" for one that has ended (a short-lived child may be a zombie already)."""
    try:
        return " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return ""


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def read_only_checkpoints(tmp_path):
    """run/checkpoints/ as a read-only bind mount of an empty directory (unmounted after the test)."""
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(checkpoints), str(checkpoints)], check=True)
    subprocess.run(["mount", "-o", "remount,bind,ro", str(checkpoints)], check=True)
    try:
        yield checkpoints
    finally:
        subprocess.run(["umount", "-l", str(checkpoints)], check=False)


def test_a_read_only_checkpoints_directory_is_one_line_and_exit_3_within_seconds(tmp_path, read_only_checkpoints):
    t0 = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxloop.train",
            "--run_dir",
            str(tmp_path / "run"),
            *SMALL,
            "--steps",
            "20",
            "--checkpoint.every",
            "10",
        ],
        capture_output=True,
        text=True,
        timeout=290,
    )
    took = time.monotonic() - t0
    assert out.returncode == 3, out.stderr[-2000:]
    lines = [line for line in out.stderr.strip().splitlines() if not is_compile_line(line)]
    assert len(lines) == 1, out.stderr
    (line,) = lines
    assert line.startswith(
        f"jaxloop.train: error: the checkpoint of update 10 could not be written to "
        f"{read_only_checkpoints}: OSError: [Errno 30] Read-only file system"
    ), line
    assert line.endswith("free there; no checkpoint was completed; a rerun starts afresh"), line
    # the run itself takes ~5 s here; Orbax's commit threads used to hold the exit for 300 s
    assert took < 120, f"{took:.0f} s"
