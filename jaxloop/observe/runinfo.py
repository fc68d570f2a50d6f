"""Run information: metadata (commit, config, packages, hardware), memory, the wall-time breakdown
and the profiler."""

from __future__ import annotations

import math
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from jaxloop.config.run import Config
from jaxloop.rundir.layout import PROFILE_DIR  # noqa: F401  (re-exported: the report names it)

# ----------------------------------------------------------------------------- memory


def _device_memory_stats() -> dict[str, Any] | None:
    import jax

    try:
        return jax.local_devices()[0].memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory statistics
        return None


def memory_source() -> str:
    """What memory_bytes() measures on this machine."""
    stats = _device_memory_stats()
    if stats and ("peak_bytes_in_use" in stats or "bytes_in_use" in stats):
        key = "peak_bytes_in_use" if "peak_bytes_in_use" in stats else "bytes_in_use"
        return f"accelerator {key} (jax memory_stats of the first local device)"
    return (
        "process resident set size, its peak so far (VmHWM of /proc/self/status, plus each live worker process's; "
        "the CPU backend reports no device statistics)"
    )


def memory_bytes() -> int | None:
    """Accelerator: the first local device's peak bytes in use; CPU: this process's peak resident set so far, with
    its live children's peaks (peak_rss_bytes)."""
    stats = _device_memory_stats()
    if stats:
        for key in ("peak_bytes_in_use", "bytes_in_use"):
            if key in stats:
                return int(stats[key])
    return peak_rss_bytes()


def peak_rss_bytes() -> int | None:
    """The high-water mark of this process's resident set (Linux VmHWM: the true peak between samples, where the
    current RSS misses what a compile or an evaluation took and gave back), plus each live multiprocessing child's
    (grain's data workers, spawned: their own peaks). Off Linux: getrusage's ru_maxrss, without children."""
    import multiprocessing

    own = _vm_hwm("self")
    if own is None:
        try:
            import resource

            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB elsewhere
        except (ImportError, OSError):
            return None
    return own + sum(_vm_hwm(str(p.pid)) or 0 for p in multiprocessing.active_children())


def _vm_hwm(pid: str) -> int | None:
    """VmHWM of /proc/<pid>/status in bytes; None where unreadable (not Linux, or the process ended)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def format_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    seconds = int(round(max(seconds, 0)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}"


# ----------------------------------------------------------------------------- wall-time breakdown


class Timings:
    """Wall seconds per named part of the run (compile, data_wait, log, eval, checkpoint); the report
    shows compute/other = wall time - their sum."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def as_dict(self) -> dict[str, float]:
        return dict(self.seconds)


# ----------------------------------------------------------------------------- run metadata


def run_metadata(cfg: Config, data: dict[str, Any] | None = None) -> dict[str, Any]:
    """What produced this run: git commit (when in a repository), config, packages, devices, CPU, host; and
    `data`, the files each split reads with their fingerprints (jaxloop.data.identity), when given."""
    import importlib.metadata
    import os
    import platform
    import socket
    import subprocess

    import jax

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", *args],
                capture_output=True,
                text=True,
                timeout=5,
                cwd=os.path.dirname(os.path.abspath(__file__)),
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    from jaxloop.config.run import to_dict

    dirty = git("status", "--porcelain")
    devices = jax.devices()
    return {
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(dirty) if dirty is not None else None,
        "config": to_dict(cfg),
        "packages": {
            p: version(p)
            for p in (
                "jaxloop",
                "jax",
                "jaxlib",
                "flax",
                "optax",
                "orbax-checkpoint",
                "grain",
                "numpy",
                "scikit-learn",
                "torch",
            )
        },
        "python": platform.python_version(),
        "devices": [str(d) for d in devices],
        "device_kind": devices[0].device_kind if devices else None,
        "backend": jax.default_backend(),
        "process_count": jax.process_count(),
        "memory_source": memory_source(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "argv": sys.argv,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "started_unix": time.time(),
        **({"data": data} if data is not None else {}),
    }


# ----------------------------------------------------------------------------- profiler


class Profiler:
    """Captures a jax.profiler trace of updates [profile_start, profile_start + profile_steps) into
    run_dir/profile: an XPlane file for TensorBoard's profile plugin and a Perfetto trace
    (perfetto_trace.json.gz) for ui.perfetto.dev, both under profile/plugins/profile/<timestamp>/.
    With `timings`, the seconds spent starting and stopping (writing) the trace count as "profile"."""

    def __init__(self, start: int, steps: int, directory: str | Path, timings: Timings | None = None):
        """Updates [start, start + steps) (steps 0: off; log.profile_start / log.profile_steps) into `directory`."""
        self.start, self.stop = start, start + steps
        self.enabled = steps > 0
        self.dir = Path(directory)
        self.active = False
        self.timings = timings

    def before_call(self, step: int, updates: int) -> None:
        """Call with the number of updates completed before a call that runs `updates` more: the trace
        covers the calls that run any update of the window."""
        import jax

        if self.enabled and not self.active and step < self.stop and step + updates > self.start:
            t0 = time.perf_counter()
            jax.profiler.start_trace(str(self.dir), create_perfetto_trace=True)
            self.active = True
            self._count(t0)
        elif self.active and step >= self.stop:
            self.close()

    def close(self) -> None:
        import jax

        if self.active:
            t0 = time.perf_counter()
            jax.profiler.stop_trace()
            self.active = False
            self._count(t0)

    def _count(self, t0: float) -> None:
        if self.timings is not None:
            self.timings.add("profile", time.perf_counter() - t0)
