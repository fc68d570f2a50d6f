"""One run per run_dir: an exclusive lock on the run directory, with a record naming its holder.

    with RunLock(cfg.run_dir):       # RunDirInUse (a ConfigError: exit status 2) if another run holds it
        ...                          # check run_dir, write, train

The exclusion is filelock's FileLock on run_dir/.lock: flock(2), which the kernel releases when the
holder exits in any way (SIGKILL included), so a killed run's successor takes over at once. Beside it,
run_dir/.lock.holder.json names the holder (pid, host, start time) for the refusal message, and
carries a lease (`lease_until`, renewed by a heartbeat thread every lease_s / 3) for other hosts: a
filesystem shared between hosts may not carry flock across them, so a record of another host whose
lease has not expired refuses the launch even when flock was granted, and one whose lease expired is
a stale lock taken over with a warning. A record left behind on this host (the holder was killed) is
stale by definition once flock is granted, and taken over with a warning too. The lock file itself
stays in place (its inode is what contenders lock); the holder record is deleted on release.
Leases compare wall clocks: hosts must agree on the time to within the lease (LEASE_S).

Imports no jax and no torch: both loops use it; a multi-process run locks in process 0 only.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import filelock

from jaxloop.config.run import ConfigError
from jaxloop.rundir.atomic import atomic_write_text
from jaxloop.rundir.layout import HOLDER_FILE, LOCK_FILE, RunLayout

LOCK_FILES = (LOCK_FILE, HOLDER_FILE)
"""What the lock keeps in a run_dir (an otherwise empty run_dir still counts as empty)."""
LEASE_S = 60.0
"""Seconds a holder's record stays valid for other hosts without renewal (renewed every LEASE_S / 3)."""
SETTLE_S = 5.0
"""A refused launch waits up to this long for the winner of a simultaneous start to write its record."""


def is_lock_file(name: str) -> bool:
    """Whether a file of run_dir is the lock's (the lock file, the holder record or its temporary)."""
    return name in LOCK_FILES or name.startswith((HOLDER_FILE + ".", f".{HOLDER_FILE}."))


class RunDirInUse(ConfigError):
    """Another run holds the run_dir: the launch is refused before it writes anything (exit status 2)."""

    def __init__(self, run_dir: str, holder: Holder | None, reason: str = "", who: str | None = None):
        self.holder = holder
        if who is None:
            who = holder.describe() if holder is not None else "another process (it has not named itself yet)"
        super().__init__(
            "run_dir",
            run_dir,
            f"a run_dir no other run is using: it is held by {who}{reason}; "
            "wait for it, stop it, or choose another --run_dir",
        )


class StaleLockWarning(UserWarning):
    """The run_dir's lock was left by a run that is gone (killed, or its host's lease expired): taken over."""


@dataclass(frozen=True)
class Holder:
    """Who holds a run_dir: the process, its host, when it started and until when its lease runs."""

    pid: int
    host: str
    started: float
    lease_until: float
    token: str

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host} (started {_when(self.started)})"

    def alive_here(self) -> bool:
        """On this host: whether the process still exists (a recycled pid would read as alive)."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(t))


def read_holder(run_dir: str | Path) -> Holder | None:
    """The holder record of run_dir, or None (absent, or half-written by a crash)."""
    try:
        data = json.loads(RunLayout(Path(run_dir)).holder.read_text())
        return Holder(
            int(data["pid"]), str(data["host"]), float(data["started"]), float(data["lease_until"]), str(data["token"])
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


class RunLock:
    """The exclusive hold of one run_dir (see the module doc). Use as a context manager, or acquire()
    and release() in a finally; the kernel releases the flock at any exit anyway."""

    def __init__(self, run_dir: str | Path, lease_s: float = LEASE_S, settle_s: float = SETTLE_S):
        self.run_dir, self.lease_s, self.settle_s = Path(run_dir), float(lease_s), float(settle_s)
        self.layout = RunLayout(self.run_dir)
        self.host = socket.gethostname()
        self.holder: Holder | None = None
        self.took_over: Holder | None = None  # the stale holder this lock replaced, if any
        self._lock: Any = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def acquire(self) -> RunLock:
        """Hold run_dir (creating it), or raise RunDirInUse naming the holder. Warns (StaleLockWarning)
        when it takes over a stale lock."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(str(self.layout.lock), timeout=0, thread_local=False)
        try:
            lock.acquire()
        except filelock.Timeout:
            raise RunDirInUse(str(self.run_dir), self._named_holder()) from None
        try:
            previous = read_holder(self.run_dir)
            now = time.time()
            if previous is not None and previous.host != self.host:
                if previous.lease_until > now:  # flock may not reach across hosts: the record decides
                    raise RunDirInUse(
                        str(self.run_dir), previous, f", whose lease runs until {_when(previous.lease_until)}"
                    )
                reason = f"its host's lease expired at {_when(previous.lease_until)}"
            else:
                reason = "that process no longer holds it"
            if previous is not None:
                self.took_over = previous
                warnings.warn(
                    f"run_dir {self.run_dir} was locked by {previous.describe()}, and {reason}: taking the lock over",
                    StaleLockWarning,
                    stacklevel=2,
                )
            self.holder = Holder(os.getpid(), self.host, now, now + self.lease_s, secrets.token_hex(8))
            self._write(self.holder)
        except BaseException:
            lock.release()
            raise
        self._lock = lock
        self._stop.clear()
        self._heartbeat = threading.Thread(target=self._renew, name="jaxloop-run-lock", daemon=True)
        self._heartbeat.start()
        return self

    def _named_holder(self) -> Holder | None:
        """The holder's record; a contender that lost a simultaneous start waits (up to settle_s) for the
        winner to write it, rather than naming a stale record left by an earlier, killed run."""
        deadline = time.monotonic() + self.settle_s
        while True:
            holder = read_holder(self.run_dir)
            live = holder is not None and (
                holder.alive_here() if holder.host == self.host else holder.lease_until > time.time()
            )
            if live or time.monotonic() >= deadline:
                return holder if live else None
            time.sleep(0.02)

    def _write(self, holder: Holder) -> None:
        """Replace the holder record atomically (a reader never sees half of it)."""
        atomic_write_text(self.layout.holder, json.dumps(asdict(holder)) + "\n")  # a failed write leaves no temporary

    def _renew(self) -> None:
        """Heartbeat: extend the lease every lease_s / 3 until released."""
        while not self._stop.wait(self.lease_s / 3):
            holder = self.holder
            if holder is None:
                return
            try:
                self.holder = Holder(holder.pid, holder.host, holder.started, time.time() + self.lease_s, holder.token)
                self._write(self.holder)
            except OSError:
                pass  # a full disk, say: the next beat tries again; the lease only matters to other hosts

    def release(self) -> None:
        """Stop the heartbeat, delete this holder's record and release the flock (idempotent)."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
        lock, self._lock = self._lock, None
        if lock is None:
            return
        try:
            current = read_holder(self.run_dir)
            if current is not None and self.holder is not None and current.token == self.holder.token:
                self.layout.holder.unlink(missing_ok=True)
        finally:
            self.holder = None
            lock.release()

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
