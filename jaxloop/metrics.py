"""Run metrics: metrics.jsonl (always), console progress, wall-time breakdown and run metadata.

Records are plain dicts of Python scalars; floats are written at full precision (repr) so that two runs
can be compared bit for bit.
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from jaxloop.config import Config

METRICS_FILE = "metrics.jsonl"


def read_records(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of run_dir/metrics.jsonl (an unfinished last line, from a killed run, is ignored)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class RunLogger:
    """Writes training and evaluation records; on resume keeps only records up to start_step."""

    def __init__(self, cfg: Config, run_dir: str | Path, *, start_step: int, total_steps: int):
        self.cfg, self.total_steps = cfg, total_steps
        self.path = Path(run_dir) / METRICS_FILE
        kept = [r for r in read_records(run_dir) if r.get("step", 0) <= start_step]
        with open(self.path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        self._file = open(self.path, "a", buffering=1)
        self._plain = cfg.log.progress != "off"

    def train(self, record: dict[str, Any]) -> None:
        self._write({"kind": "train", **record})
        if self._plain:
            print(
                f"update {record['step']}/{self.total_steps} loss {record['loss']:.4f} "
                f"lr {record['lr']:.3g} {record.get('updates_per_s', 0):.1f} updates/s",
                file=sys.stderr, flush=True,
            )

    def eval(self, record: dict[str, Any]) -> None:
        self._write({"kind": "eval", **record})
        if self._plain:
            vals = " ".join(f"{k} {v:.4f}" for k, v in record.items() if k != "step")
            print(f"eval at update {record['step']}: {vals}", file=sys.stderr, flush=True)

    def message(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


class Timings:
    """Wall seconds per named part of the run (compile, data, compute, checkpoint, eval, log)."""

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


def run_metadata(cfg: Config) -> dict[str, Any]:
    """What produced this run: git commit (when in a repository), config, packages, devices, CPU, host."""
    import importlib.metadata
    import os
    import platform
    import socket
    import subprocess

    import jax

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=5,
                                 cwd=os.path.dirname(os.path.abspath(__file__)))
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
    from jaxloop.config import to_dict

    dirty = git("status", "--porcelain")
    return {
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(dirty) if dirty is not None else None,
        "config": to_dict(cfg),
        "packages": {p: version(p) for p in ("jaxloop", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint",
                                             "grain", "numpy", "scikit-learn", "torch")},
        "python": platform.python_version(),
        "devices": [str(d) for d in jax.devices()],
        "backend": jax.default_backend(),
        "process_count": jax.process_count(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "argv": sys.argv,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


class Profiler:
    """Captures a jax.profiler trace of updates [profile_start, profile_start + profile_steps) into
    run_dir/profile (open with TensorBoard's profile plugin or ui.perfetto.dev)."""

    def __init__(self, cfg: Config, run_dir: str | Path):
        self.start, self.stop = cfg.log.profile_start, cfg.log.profile_start + cfg.log.profile_steps
        self.enabled = cfg.log.profile_steps > 0
        self.dir = Path(run_dir) / "profile"
        self.active = False

    def before_update(self, step: int) -> None:
        """Call with the number of updates completed before the next one runs."""
        import jax

        if self.enabled and not self.active and self.start <= step < self.stop:
            jax.profiler.start_trace(str(self.dir))
            self.active = True
        elif self.active and step >= self.stop:
            self.close()

    def close(self) -> None:
        import jax

        if self.active:
            jax.profiler.stop_trace()
            self.active = False
