"""What every benchmark row shares: the result row, the machine, timing and child processes."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxloop.rundir.atomic import atomic_write_text

ROOT = Path(__file__).resolve().parent.parent
TEXT_ENV = "JAXLOOP_BENCH_TEXT"
DEFAULT_TEXT = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
"""Where the development machines keep the whole Tiny Shakespeare, beside the repository (a clone has none:
the tests use the 60k-character slice in tests/data, the benchmarks want the whole text by path)."""


def text_path() -> Path:
    """The text the GPT rows train on: $JAXLOOP_BENCH_TEXT (which `--data.path FILE` sets, so that child
    processes inherit it), else DEFAULT_TEXT; a clear error naming both when the file is not there."""
    path = Path(os.environ.get(TEXT_ENV) or DEFAULT_TEXT)
    if not path.is_file():
        raise FileNotFoundError(
            f"the GPT benchmarks train on Tiny Shakespeare's whole text, and {path} is not a file: pass "
            f"--data.path FILE (or set {TEXT_ENV}=FILE); the default is {DEFAULT_TEXT}"
        )
    return path


def add_text_option(parser: Any) -> None:
    """`--data.path FILE` on a benchmark's argparse parser; call use_text(args) after parsing."""
    parser.add_argument(
        "--data.path",
        dest="text",
        default=None,
        metavar="FILE",
        help=f"the text the GPT rows train on (default: ${TEXT_ENV}, else {DEFAULT_TEXT})",
    )


def use_text(args: Any) -> None:
    """Make --data.path the text of this process and of its children (through the environment)."""
    if getattr(args, "text", None):
        os.environ[TEXT_ENV] = str(Path(args.text).resolve())


@dataclass
class Row:
    """One line of the table: jaxloop's figure against a reference's, their ratio and the goal."""

    name: str
    what: str
    jax: float | None = None
    ref: float | None = None
    unit: str = ""
    ratio: float | None = None
    goal: str = ""
    met: bool | None = None
    status: str = "ok"  # ok | failed | unmeasured | skipped
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def check(self, op: str, bound: float) -> Row:
        """Set goal and met from ratio `op` bound (op: '<=' or '>=')."""
        self.goal = f"{op} {bound:g}"
        if self.ratio is not None:
            self.met = self.ratio <= bound if op == "<=" else self.ratio >= bound
        return self


@dataclass
class Options:
    quick: bool = False
    smoke: bool = False  # tests only: one round of tiny blocks (checks the harness, measures nothing)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="jaxloop-bench-")))
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    cache: dict[str, Any] = field(default_factory=dict)  # figures one row measured and another reuses
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def interleaved(contenders: dict[str, Callable[[], float]], rounds: int, gap_s: float = 0.05) -> dict[str, list[float]]:
    """Round-robin A B C A B C ...: each callable runs one timed block and returns seconds per unit.

    On a shared machine a burst of load then hits one block of each contender, not all blocks of one.
    """
    out: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            out[name].append(fn())
            time.sleep(gap_s)  # let the other runtime's spinning worker threads settle
    return out


def sized_interleaved(
    contenders: dict[str, Callable[[int], float]],
    rounds: int,
    block_s: float,
    warm: tuple[int, int] = (1, 2),
    min_units: int = 1,
) -> dict[str, list[float]]:
    """Warm each contender up (warm[0] units, then warm[1] to size it), give it blocks of about block_s,
    and run those interleaved: seconds per unit, per round. A contender is called with a unit count."""
    per = {}
    for name, fn in contenders.items():
        fn(warm[0])
        per[name] = fn(warm[1])
    # the defaults bind each contender's own block size as the comprehension runs
    sized = {
        name: (lambda fn=fn, n=max(min_units, math.ceil(block_s / max(per[name], 1e-6))): fn(n))  # noqa: B008
        for name, fn in contenders.items()
    }
    return interleaved(sized, rounds)


# ----------------------------------------------------------------------------- machine


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """CPU model, cores, load, python and the versions of the libraries compared."""
    import importlib.metadata as md

    versions = {}
    for pkg in ("jax", "jaxlib", "flax", "optax", "torch", "grain", "orbax-checkpoint", "numpy"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "accelerator": accelerator(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "versions": versions,
        "load_avg_at_start": load,
        "time_utc": time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime()),
    }


def accelerator() -> str | None:
    """The first JAX device's kind when it is no CPU (e.g. "NVIDIA H100 80GB HBM3"), else None."""
    try:
        import jax

        device = jax.devices()[0]
    except RuntimeError:
        return None
    return None if device.platform == "cpu" else device.device_kind


def gpu_present() -> bool:
    try:
        import jax

        return any(d.platform in ("gpu", "cuda", "rocm", "tpu") for d in jax.devices())
    except RuntimeError:
        return False


# ----------------------------------------------------------------------------- child processes


@dataclass
class Child:
    rc: int
    wall_s: float
    maxrss_bytes: int
    cpu_s: float
    stdout: str
    stderr: str

    def json(self) -> Any:
        """The last stdout line that parses as JSON (drivers print one)."""
        for line in reversed(self.stdout.strip().splitlines()):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
        raise RuntimeError(f"child printed no JSON (rc {self.rc}); stderr tail:\n{self.stderr[-2000:]}")


def child_env(threads: int | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if threads:  # torch (torch_ref children) reads OMP_NUM_THREADS; XLA:CPU uses every core regardless
        env["JAXLOOP_BENCH_THREADS"] = env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_child(
    args: Sequence[str],
    *,
    timeout: float = 1800,
    cwd: Path | None = None,
    poll: Callable[[], bool] | None = None,
    threads: int | None = None,
) -> Child:
    """Run `python args...` in the repository's environment; wall time, peak RSS, CPU seconds.

    Peak RSS is the child's VmHWM (/proc/PID/status), read every 10 ms while it runs: wait4's ru_maxrss
    is no good here, Linux carries the high-water mark over fork + exec, so every child of this (large)
    process would report at least this process's own peak.

    poll: called every 10 ms while the child runs (e.g. to timestamp a file appearing); True stops polling.
    """
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(
            [sys.executable, *args], stdout=out, stderr=err, cwd=str(cwd or ROOT), env=child_env(threads)
        )
        deadline = t0 + timeout
        status, usage = 0, None
        hwm = 0
        while True:
            hwm = max(hwm, _vm_hwm(p.pid))
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                p.kill()
                pid, status, usage = os.wait4(p.pid, 0)
                break
            if poll is not None and poll():
                poll = None
            time.sleep(0.01)
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return Child(
            rc=p.returncode,
            wall_s=wall,
            maxrss_bytes=hwm or usage.ru_maxrss * 1024,
            cpu_s=usage.ru_utime + usage.ru_stime,
            stdout=out.read(),
            stderr=err.read(),
        )


def _vm_hwm(pid: int) -> int:
    """The process's resident-set high-water mark in bytes (0 if unreadable)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def failed(row: Row, err: BaseException | str) -> Row:
    row.status = "failed"
    msg = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
    row.notes = (row.notes + "; " if row.notes else "") + " ".join(str(msg).split())[:300]
    return row


def save_record(path: str | os.PathLike[str], record: dict[str, Any]) -> None:
    """A run's record as JSON, replaced atomically (jaxloop.rundir.atomic): the harness and the GPU script
    rewrite it after every row or part, so that a run killed or cut by its budget keeps what it measured,
    and one killed inside a rewrite keeps the record of the rewrite before."""
    atomic_write_text(path, json.dumps(record, indent=1, default=str) + "\n")


def as_dict(row: Row) -> dict[str, Any]:
    return dataclasses.asdict(row)
