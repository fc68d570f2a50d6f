"""Sharded state (FSDP, issue 14) over two real processes (jax.distributed, one device each, gloo on
CPU): with fsdp=2 every sharded leaf has one half in each process, and the run is the same, bit for bit,
as one process with two devices, through a SIGTERM and a resume.

Subprocesses as in tests/test_fsdp.py (forced host devices, XLA CPU optimization level 0).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_fsdp import MLP, ROOT
from test_fsdp import _env as env
from test_fsdp import _main_runs as main_runs
from test_fsdp import _summary as summary

from jaxloop.rundir.records import read_records


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(run_dir: Path, processes: int, *args: str) -> list[subprocess.Popen]:
    """The same command in `processes` processes of one device each, joined by jax.distributed."""
    coordinator = f"127.0.0.1:{_free_port()}"
    return [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jaxloop.train",
                *args,
                "--run_dir",
                str(run_dir),
                "--distributed.num_processes",
                str(processes),
                "--distributed.process_id",
                str(p),
                "--distributed.coordinator",
                coordinator,
            ],
            cwd=ROOT,
            env=env(1),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for p in range(processes)
    ]


def _wait(procs: list[subprocess.Popen], timeout: int = 300) -> list[tuple[int, str]]:
    done = []
    for p in procs:
        _, err = p.communicate(timeout=timeout)
        done.append((p.returncode, err))
    return done


@pytest.mark.slow  # five processes start and compile one after another
def test_two_processes_match_one_process_bit_for_bit_through_a_sigterm_to_one_and_a_resume(tmp_path):
    # fsdp=2 over two processes: gloo carries the all-gathers and reduce-scatters of one global
    # computation, the same as one process with two devices runs. SIGTERM reaches process 1 only; at the
    # next sync point (every update: log_every 1) both agree to stop, save that update and exit 143.
    # Resumed, the run ends bit-identical to the uninterrupted one-process run, every logged number too.
    flags = (
        *MLP,
        "--optim.accum_steps",
        "2",
        "--distributed.fsdp",
        "2",
        "--steps",
        "120",
        "--log_every",
        "1",
        "--checkpoint.every",
        "40",
    )
    main_runs(2, [*flags, "--run_dir", str(tmp_path / "ref")])
    procs = _launch(tmp_path / "run", 2, *flags)
    deadline = time.monotonic() + 240
    while len([r for r in read_records(tmp_path / "run") if r["kind"] == "train"]) < 5:
        assert time.monotonic() < deadline and procs[0].poll() is None, "the run did not get to update 5"
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)
    done = _wait(procs)
    assert [status for status, _ in done] == [143, 143], [err[-2000:] for _, err in done]
    stopped = [r["step"] for r in read_records(tmp_path / "run") if r["kind"] == "train"][-1]
    assert stopped < 120
    assert (tmp_path / "run" / "checkpoints" / str(stopped)).is_dir(), "the update it stopped at was saved"

    for status, err in _wait(_launch(tmp_path / "run", 2, *flags)):
        assert status == 0, err[-3000:]
    assert summary(tmp_path / "run")["state_digest"] == summary(tmp_path / "ref")["state_digest"]
    keys = ("kind", "step", "lr", "loss", "grad_norm", "val_loss", "val_acc", "ema_val_loss")
    strip = lambda d: [{k: r[k] for k in keys if k in r} for r in read_records(d)]
    assert strip(tmp_path / "run") == strip(tmp_path / "ref")
