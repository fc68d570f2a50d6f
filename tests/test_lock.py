"""One run per run_dir (jaxloop.rundir.lock): a second launch is refused naming the holder, a stale lock is
taken over with a warning, the lock is freed at any exit. Real processes where the kernel's part matters."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from jaxloop.config.run import ConfigError
from jaxloop.rundir.lock import HOLDER_FILE, LOCK_FILE, RunDirInUse, RunLock, StaleLockWarning, read_holder
from jaxloop.rundir.records import read_records


def _write_holder(run_dir: Path, **fields) -> None:
    record = {
        "pid": 999_999_999,
        "host": socket.gethostname(),
        "started": time.time() - 60,
        "lease_until": time.time() + 60,
        "token": "t0",
    }
    record.update(fields)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / HOLDER_FILE).write_text(json.dumps(record))


# ----------------------------------------------------------------------------- in one process


def test_a_held_run_dir_refuses_another_holder_naming_pid_host_and_start(tmp_path):
    with RunLock(tmp_path) as lock:
        with pytest.raises(RunDirInUse) as refused:
            RunLock(tmp_path, settle_s=0).acquire()
        message = str(refused.value)
        assert f"held by pid {os.getpid()} on host {socket.gethostname()} (started " in message
        assert "wait for it, stop it, or choose another --run_dir" in message
        assert isinstance(refused.value, ConfigError) and refused.value.field_path == "run_dir"  # exit status 2
        assert read_holder(tmp_path) == lock.holder
    assert not (tmp_path / HOLDER_FILE).exists(), "the holder record goes with the lock"
    assert (tmp_path / LOCK_FILE).exists(), "the lock file stays: its inode is what contenders lock"
    RunLock(tmp_path).acquire().release()  # free again


def test_a_record_left_by_a_killed_process_on_this_host_is_taken_over_with_a_warning(tmp_path):
    _write_holder(tmp_path, pid=999_999_999)  # the flock is free: its holder is gone
    with pytest.warns(StaleLockWarning, match=r"locked by pid 999999999 on host .*that process no longer holds it"):
        lock = RunLock(tmp_path).acquire()
    assert lock.took_over.pid == 999_999_999 and read_holder(tmp_path).pid == os.getpid()
    lock.release()


def test_another_hosts_record_refuses_while_its_lease_runs_and_is_taken_over_once_it_expired(tmp_path):
    # A filesystem shared between hosts may not carry flock across them: the record's lease decides.
    _write_holder(tmp_path, host="elsewhere", pid=4242, lease_until=time.time() + 30)
    with pytest.raises(RunDirInUse, match=r"held by pid 4242 on host elsewhere .*whose lease runs until"):
        RunLock(tmp_path).acquire()
    assert read_holder(tmp_path).host == "elsewhere", "a refused launch leaves the record alone"
    _write_holder(tmp_path, host="elsewhere", pid=4242, lease_until=time.time() - 1)
    with pytest.warns(StaleLockWarning, match=r"pid 4242 on host elsewhere .*its host's lease expired"):
        lock = RunLock(tmp_path).acquire()
    assert read_holder(tmp_path).host == socket.gethostname()
    lock.release()


def test_the_heartbeat_renews_the_lease(tmp_path):
    with RunLock(tmp_path, lease_s=0.3) as lock:
        first = read_holder(tmp_path).lease_until
        time.sleep(0.5)
        renewed = read_holder(tmp_path)
        assert renewed.lease_until > first and renewed.token == lock.holder.token


def test_a_run_failing_in_process_releases_the_lock(tmp_path):
    # run() holds the lock from before config.json until it returns or raises (here: a bad record met
    # at batching); the next run starts without a stale-lock warning.
    import warnings

    import numpy as np

    import jaxloop
    from jaxloop.config.run import preset, replace
    from jaxloop.data.sources import RecordError

    records = [{"x": np.zeros(4, np.float32), "y": np.int32(i % 3)} for i in range(64)]
    bad = list(records)
    bad[40] = {"x": np.zeros(5, np.float32), "y": np.int32(0)}

    class Lazy:  # not a list: only its first records are checked up front
        def __init__(self, seq):
            self.seq = seq

        def __len__(self):
            return len(self.seq)

        def __getitem__(self, i):
            return self.seq[i]

    import flax.linen as nn

    task = jaxloop.Task(
        model=nn.Dense(3), loss=lambda model, b, train: (model(b["x"]).mean() * 0, {}), train=Lazy(bad), val=records
    )
    cfg = replace(
        preset("debug"),
        run_dir=str(tmp_path),
        steps=4,
        batch_size=16,
        compile_cache="",
        log=replace(preset("debug").log, progress="off"),
    )
    with pytest.raises(RecordError):
        jaxloop.run(cfg, task)
    assert not (tmp_path / HOLDER_FILE).exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaleLockWarning)
        RunLock(tmp_path).acquire().release()


# ----------------------------------------------------------------------------- real processes


def _cmd(run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "jaxloop.train",
        "--preset",
        "debug",
        "--run_dir",
        str(run_dir),
        "--log.progress",
        "off",
        "--log.no-tensorboard",
        *extra,
    ]


def _wait_for_update(run_dir: Path, proc: subprocess.Popen, beyond: int = 0, timeout: float = 600) -> None:
    """Until the run logs an update beyond `beyond`; `timeout` only guards against a hang (a loaded machine may
    need minutes: it is no claim on speed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before training"
        if any(r["kind"] == "train" and r["step"] > beyond for r in read_records(run_dir)):
            return
        time.sleep(0.02)
    raise TimeoutError(f"no update in {run_dir}")


def _wait_for_checkpoint(run_dir: Path, proc: subprocess.Popen, timeout: float = 600) -> None:
    """Until a checkpoint is committed (Orbax renames `N.orbax-checkpoint-tmp*` to `N` at its commit)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before a checkpoint was committed"
        if (run_dir / "checkpoints").is_dir() and any(p.name.isdigit() for p in (run_dir / "checkpoints").iterdir()):
            return
        time.sleep(0.02)
    raise TimeoutError(f"no committed checkpoint in {run_dir}")


def test_a_second_launch_is_refused_naming_the_running_holder_and_writes_nothing(tmp_path):
    first = subprocess.Popen(_cmd(tmp_path, "--steps", "100000", "--log_every", "1"), stderr=subprocess.PIPE, text=True)
    try:
        # beyond the pace's measurements (its first two calls, of at most 50 updates each), which record the
        # calls' cap in metadata.json (a cap lowered on a loaded machine rewrites it after the second)
        _wait_for_update(tmp_path, first, beyond=100)
        written = {
            p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p.name in ("config.json", "metadata.json")
        }
        second = subprocess.run(_cmd(tmp_path, "--steps", "100000"), capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1, second.stderr
        assert lines[0].startswith(
            f"jaxloop.train: error: run_dir='{tmp_path}' is not allowed: a run_dir no other run "
            f"is using: it is held by pid {first.pid} on host {socket.gethostname()} (started "
        )
        assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir() if p.name in written} == written
        assert not (tmp_path / "resumes.jsonl").exists()
        assert first.poll() is None, "the holder trains on"
    finally:
        first.send_signal(signal.SIGTERM)
        rest = first.communicate(timeout=120)[1]
    assert first.returncode == 143, rest
    assert not (tmp_path / HOLDER_FILE).exists(), "SIGTERM: saved, stopped, and the lock released"
    RunLock(tmp_path, settle_s=0).acquire().release()  # no stale-lock warning either (the record is gone)


BARRIER = textwrap.dedent("""
    import os, sys, time
    from jaxloop.train import main  # imported before the barrier: the two start training code at once
    ready, barrier = sys.argv[1], sys.argv[2]
    open(f"{ready}.{os.getpid()}", "w").close()
    while not os.path.exists(barrier):
        time.sleep(0.0005)
    sys.exit(main(sys.argv[3:]))
""")


@pytest.mark.parametrize("round_", [0, 1])
def test_two_launches_at_the_same_instant_exactly_one_runs(tmp_path, round_):
    run_dir, ready, barrier = tmp_path / "run", tmp_path / "ready", tmp_path / "go"
    args = _cmd(run_dir, "--steps", "30")[3:]  # the flags after "-m jaxloop.train"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BARRIER, str(ready), str(barrier), *args], stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("ready.*"))) < 2:  # both imported jaxloop and wait on the barrier
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.01)
    barrier.touch()
    errs = [p.communicate(timeout=300)[1] for p in procs]
    codes = [p.returncode for p in procs]
    assert sorted(codes) == [0, 2], errs
    winner, loser = (0, 1) if codes[0] == 0 else (1, 0)
    assert f"held by pid {procs[winner].pid} on host" in errs[loser], errs[loser]
    steps = [r["step"] for r in read_records(run_dir) if r["kind"] == "train"]
    assert steps == list(range(1, 31)), "one run's records, each update once"


def test_a_sigkilled_holder_is_taken_over_at_once_and_the_run_resumes(tmp_path):
    # 100 updates: the kill lands a little past update 12, most of the run ahead of it (a run of 300 gave the
    # second run 200 updates and 40 saves more, of the same checks)
    flags = ("--steps", "100", "--log_every", "1", "--checkpoint.every", "5")
    first = subprocess.Popen(_cmd(tmp_path, *flags), stderr=subprocess.DEVNULL)
    _wait_for_update(tmp_path, first, beyond=12)
    _wait_for_checkpoint(tmp_path, first)  # a record alone may precede every async save's commit
    first.kill()
    first.wait()
    holder = read_holder(tmp_path)
    assert holder is not None and holder.pid == first.pid, "SIGKILL leaves the record behind"
    t0 = time.monotonic()
    second = subprocess.run(
        _cmd(tmp_path, *flags),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert second.returncode == 0, second.stderr
    assert "StaleLockWarning" in second.stderr and f"locked by pid {first.pid} on host" in second.stderr
    assert time.monotonic() - t0 < 120, "no lease to wait out on this host: the kernel freed the flock"
    resumes = [json.loads(line) for line in (tmp_path / "resumes.jsonl").read_text().splitlines()]
    assert resumes and resumes[0]["step"] >= 5, "it resumed from the killed run's checkpoint"
    steps = [r["step"] for r in read_records(tmp_path) if r["kind"] == "train"]
    assert steps == list(range(1, 101))
    assert not (tmp_path / HOLDER_FILE).exists()
