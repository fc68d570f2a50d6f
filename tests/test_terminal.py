"""`python -m jaxloop.train` driven in a pseudo-terminal, as a person at a terminal uses it (issue 39): the
lines before and after the first compile, Ctrl-C (the terminal's ^C, sent to the foreground process group)
during the compile and during training, the resume line and the next run resuming, and the progress bar's
ETA. Time bounds are generous ("within N seconds" for a hang, as the issue asks), never measurements."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "tests" / "data" / "tinyshakespeare_60k.txt"
# pty.fork, as a terminal emulator starts a shell: the child gets the terminal as its controlling one (so
# ^C reaches it). The child only changes directory and execs, so JAX's threads in this test process (the
# reason for Python's fork warning) hold nothing it needs.
pytestmark = pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")

ACK_S = 5.0
"""A Ctrl-C is acknowledged within this (the issue asks for a second; margin for a loaded 2-core CI)."""


class Terminal:
    """A command run in a pseudo-terminal: its output as the terminal shows it, ^C typed into it."""

    def __init__(self, *argv: str, cwd: Path):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: its own session, the pty as its controlling terminal
            os.chdir(cwd)
            os.execv(sys.executable, [sys.executable, *argv])
        self.out = b""
        self.status: int | None = None

    def read_until(self, pattern: str, timeout: float) -> re.Match:
        """Read until `pattern` (a regex) appears in the output (CR LF read as LF); AssertionError when it
        does not within `timeout` or before the command ends."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.text())
            if found:
                return found
            if not self._read(min(0.2, max(deadline - time.monotonic(), 0))):
                break  # the command ended
        found = re.search(pattern, self.text())
        if found is None:
            raise AssertionError(f"no {pattern!r} within {timeout}s; output:\n{self.text()[-3000:]}")
        return found

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if ready:
            try:
                data = os.read(self.fd, 65536)
            except OSError:  # EIO: the child closed the terminal
                return False
            if not data:
                return False
            self.out += data
        return True

    def text(self) -> str:
        return self.out.decode(errors="replace").replace("\r\n", "\n")

    def ctrl_c(self) -> float:
        os.write(self.fd, b"\x03")  # the terminal turns it into SIGINT for the foreground process group
        return time.monotonic()

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._read(0.2)
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                while self._read(0.05):
                    pass
                os.close(self.fd)
                self.status = os.waitstatus_to_exitcode(status)
                return self.status
        os.kill(self.pid, 9)
        raise AssertionError(f"still running after {timeout}s; output:\n{self.text()[-3000:]}")


def _train(run_dir: Path, *flags: str) -> Terminal:
    return Terminal("-m", "jaxloop.train", *flags, "--run_dir", str(run_dir), cwd=run_dir.parent)


def _last_line(term: Terminal) -> str:
    return [ln for ln in re.split(r"[\r\n]+", term.text()) if ln.strip()][-1].strip()


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def test_ctrl_c_while_compiling_stops_at_once_in_one_line(tmp_path):
    # A GPT (one layer) compiled afresh (compile_cache off) takes seconds: ^C lands in the compile.
    # Mutant (SignalStop without the watcher thread): nothing is printed until the compile and the
    # first call end, and the run trains on to its first save: fails on the ACK_S bound.
    run_dir = tmp_path / "r"
    flags = (
        "--preset",
        "shakespeare",
        "--data.path",
        str(TEXT),
        "--model.n_layers",
        "1",
        "--steps",
        "4",
        "--optim.warmup_steps",
        "0",
        "--eval_every",
        "0",
        "--compile_cache",
        "",
    )
    term = _train(run_dir, *flags)
    term.read_until(
        r"compiling the training call \(\d+ update\(s\) of batch 32 per device call\); compile_cache "
        r"is off: every run compiles it\.\.\.",
        300,
    )
    sent = term.ctrl_c()
    term.read_until(r"SIGINT received while compiling \(nothing trained in this run yet\): stopped at once", ACK_S)
    assert time.monotonic() - sent < ACK_S
    assert term.wait(30) == 130
    assert "Traceback" not in term.text() and "compiled in" not in term.text()
    assert _last_line(term).endswith(f"resume with: python -m jaxloop.train --run_dir {run_dir}")
    assert not (run_dir / ".lock.holder.json").exists()  # released: the next run takes no stale lock over


def test_ctrl_c_while_training_is_acknowledged_saves_and_the_next_run_resumes(tmp_path):
    # Mutant (no acknowledgement from the watcher): the "stopping after" line is missing.
    run_dir = tmp_path / "r"
    term = _train(
        run_dir,
        "--preset",
        "debug",
        "--steps",
        "100000",
        "--updates_per_call",
        "20",
        "--checkpoint.every",
        "0",
        "--eval_every",
        "0",
        "--log.no_tensorboard",
        "--log.report",
        "--compile_cache",
        str(tmp_path / "cache"),
    )
    term.read_until(r"compiled in [\d.]+s", 300)
    # the bar's ETA, after two calls: not 00:00 with 99.9% of the run to go (the former ETA, taken
    # between the records of one call, read 0:00:00); mutant (eta_s from record to record): fails
    eta = term.read_until(r"update (\d+)/100000 \[[\d:]+<(\d+):(\d+)(?::(\d+))?,", 120)
    assert int(eta.group(1)) >= 40
    assert int(eta.group(2)) * 60 + int(eta.group(3)) > 0 or eta.group(4)
    sent = term.ctrl_c()
    ack = term.read_until(
        r"SIGINT received: (?:finishing updates? [\d-]+, then )?stopping after update (\d+): "
        r"saving\.\.\.",
        ACK_S,
    )
    assert time.monotonic() - sent < ACK_S
    assert term.wait(120) == 130
    saved = int(ack.group(1))
    assert _last_line(term) == (
        f"jaxloop.train: SIGINT received: saved and stopped at update {saved}; "
        f"resume with: python -m jaxloop.train --run_dir {run_dir}"
    )
    assert "Traceback" not in term.text()
    summary = json.loads((run_dir / "summary.json").read_text())  # a stopped run gets its summary and report
    assert summary["final_step"] == saved and summary["stop_reason"] == "signal SIGINT"
    assert (run_dir / "report.md").is_file()
    # the command it names resumes the run (stopped again once it says so)
    again = _train(run_dir, "--compile_cache", str(tmp_path / "cache"))
    again.read_until(rf"resuming from update {saved} ", 120)
    again.ctrl_c()
    assert again.wait(120) == 130


ACK = r"SIGINT received: finishing (?:update (\d+)|updates (\d+)-(\d+)), then stopping after update (\d+): saving\.\.\."
"""The acknowledgement of a Ctrl-C while calls run: the updates on the device it finishes, then the save."""


@pytest.fixture(scope="module")
def shakespeare_cache(tmp_path_factory) -> Path:
    """One compile cache for the module's SHAKESPEARE runs: the first compiles the call of 50 updates (its test
    reads "compiled in"), the next loads it (a run of its own cache compiled the same program again)."""
    return tmp_path_factory.mktemp("shakespeare_cache")


def test_ctrl_c_after_the_compile_finishes_the_first_call_and_keeps_it(tmp_path, shakespeare_cache):
    # issue 45: a Ctrl-C just after "compiled in" was taken for one while compiling, and the call's work
    # thrown away. Now the compile's end is heard: the first call (of the grid's 50 updates) is finished
    # and saved. Mutant (trained only once a call finished, as before): "while compiling", exit
    # without a save, seen failing.
    run_dir = tmp_path / "r"
    term = _train(run_dir, *SHAKESPEARE, "--compile_cache", str(shakespeare_cache))
    term.read_until(r"compiled in [\d.]+s", 300)
    term.ctrl_c()
    ack = term.read_until(ACK, ACK_S)
    assert term.wait(120) == 130
    assert "while compiling" not in term.text() and "Traceback" not in term.text()
    saved = int(ack.group(4))
    assert saved >= 1 and json.loads((run_dir / "summary.json").read_text())["final_step"] == saved


def test_a_stop_finishes_the_paced_call_on_the_device_and_names_its_updates(tmp_path, shakespeare_cache):
    # issue 45: the shakespeare preset's calls of 50 updates made a stop wait a whole call (50 s on a loaded
    # machine). The pace times the first calls and, past 2 s, caps them to about a second (metadata.json's calls):
    # the acknowledgement names the updates of the call on the device, at most that cap, and the run
    # saves at its end. Mutant (the acknowledgement of before, naming only the update it stops after):
    # no "finishing updates", seen failing.
    run_dir = tmp_path / "r"
    term = _train(run_dir, *SHAKESPEARE, "--compile_cache", str(shakespeare_cache))
    term.read_until(r"update (?:[6-9]\d|\d{3,})/2000", 600)
    term.ctrl_c()
    ack = term.read_until(ACK, ACK_S)
    assert term.wait(120) == 130
    first, last = (int(ack.group(1)),) * 2 if ack.group(1) else (int(ack.group(2)), int(ack.group(3)))
    calls = json.loads((run_dir / "metadata.json").read_text())["calls"]
    assert calls["max_updates_per_call"] == 50 and calls["measured_s_per_update"] > 0
    assert 1 <= last - first + 1 <= calls["updates_per_call"], (ack.group(0), calls)
    assert last == int(ack.group(4)) == json.loads((run_dir / "summary.json").read_text())["final_step"]


SHAKESPEARE = (
    "--preset",
    "shakespeare",
    "--data.path",
    str(TEXT),
    "--model.n_layers",
    "1",
    "--steps",
    "2000",
    "--optim.warmup_steps",
    "0",
    "--eval_every",
    "0",
    "--checkpoint.every",
    "0",
    "--log.no_tensorboard",
)
"""A run whose uncapped calls (50 updates of a GPT) would take seconds each on a CPU."""
