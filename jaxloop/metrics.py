"""Run metrics: console progress, metrics.jsonl (always) and TensorBoard writers, memory, the wall-time
breakdown, run metadata and the profiler.

Records are plain dicts of Python scalars; floats are written at full precision (repr) so that two runs
can be compared bit for bit. A resumed run first truncates metrics.jsonl to the records up to the
update it resumes from and tells TensorBoard to purge later events (purge_step), so a resumed run's
files read the same as an uninterrupted run's.

Progress (log.progress): ``bar`` is a tqdm bar on stderr (update, loss, lr, updates/s, ETA; messages
and evaluation lines are written above it); ``plain`` prints one line per logged update, thinned to at
most about PLAIN_LINES lines per run (plus one at least every PLAIN_MAX_GAP_S seconds), so CI logs
stay readable; ``auto`` is ``bar`` when stderr is a terminal and ``plain`` otherwise; ``off`` prints
no progress (messages such as early stopping are still printed).
"""

from __future__ import annotations

import functools
import io
import json
import math
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterator

from jaxloop.config import Config

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"
PROFILE_DIR = "profile"
PLAIN_LINES = 50
"""Plain progress prints about this many update lines per run (every log record on short runs)."""
PLAIN_MAX_GAP_S = 60.0
"""... and never stays silent for longer than this while records arrive."""

# TensorBoard tag group of each record key (other train keys go under train/, eval keys under eval/).
TAG_GROUPS = {
    "loss": "train", "lr": "train", "grad_norm": "train", "skipped": "train", "loss_scale": "train",
    "updates_per_s": "throughput", "samples_per_s": "throughput", "tokens_per_s": "throughput",
    "step_ms": "time", "data_wait_ms": "time",
    "mem_bytes": "memory",
}


def read_records(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of run_dir/metrics.jsonl (an unfinished last line, from a killed run, is ignored)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


@dataclass
class BestTracker:
    """Best validation metric so far and evaluations since it improved (for early stopping)."""

    mode: str
    patience: int = 0
    best: float | None = None
    best_step: int | None = None
    since_best: int = 0

    def update(self, step: int, value: float) -> bool:
        """Record an evaluation; True when early stopping should end the run."""
        better = self.best is None or (value < self.best if self.mode == "min" else value > self.best)
        if better:
            self.best, self.best_step, self.since_best = value, step, 0
        else:
            self.since_best += 1
        return self.patience > 0 and self.since_best >= self.patience

    def as_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "since_best": self.since_best}


def tb_tag(kind: str, key: str) -> str:
    """The TensorBoard tag of a record key: train/loss, eval/val_loss, throughput/samples_per_s, ..."""
    if kind == "eval":
        return f"eval/{key}"
    return f"{TAG_GROUPS.get(key, 'train')}/{key}"


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
    return "process resident set size (psutil RSS; the CPU backend reports no device statistics)"


def memory_bytes() -> int | None:
    """Accelerator: the first local device's peak bytes in use; CPU: this process's resident set (RSS)."""
    stats = _device_memory_stats()
    if stats:
        for key in ("peak_bytes_in_use", "bytes_in_use"):
            if key in stats:
                return int(stats[key])
    try:
        return int(_process().memory_info().rss)
    except Exception:  # noqa: BLE001 - no psutil or no /proc: no memory figure
        return None


@functools.lru_cache(maxsize=1)
def _process() -> Any:
    import psutil

    return psutil.Process()


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


# ----------------------------------------------------------------------------- progress


def _isatty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _sized(stream: IO[str]) -> bool:
    """Whether the terminal reports its size (some pseudo-terminals report 0 x 0)."""
    import os

    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
        return False
    return size.columns > 0 and size.lines > 0


class Progress:
    """The console side of a run: a tqdm bar, plain lines, or nothing (see the module doc)."""

    def __init__(self, mode: str, total: int, start: int, stream: IO[str] | None = None, log_every: int = 1):
        self.stream = stream if stream is not None else sys.stderr
        if mode == "auto":
            mode = "bar" if _isatty(self.stream) else "plain"
        self.mode, self.total, self.start = mode, total, start
        self._bar = None  # created at the first record, so that compilation does not skew the rate/ETA
        # plain: print every `cadence`-th logged update, the first and the last
        per_line = max(1, math.ceil(max(total - start, 1) / (max(log_every, 1) * PLAIN_LINES)))
        self._cadence = per_line * max(log_every, 1)
        self._next_line = start
        self._last_line_t = 0.0
        self._first: tuple[int, float] | None = None

    def _new_bar(self, step: int) -> Any:
        from tqdm import tqdm

        # a terminal that reports its size gets a bar that follows its width; one that reports 0 x 0
        # (or a forced bar on a non-terminal) gets a fixed 100-column bar instead of nothing
        sized = _sized(self.stream)
        return tqdm(
            total=self.total, initial=step, file=self.stream, unit=" updates", dynamic_ncols=sized,
            ncols=None if sized else 100, nrows=None if sized else 40, smoothing=0.1, desc="train",
            bar_format="{desc} {percentage:3.0f}%|{bar}| update {n_fmt}/{total_fmt} "
                       "[{elapsed}<{remaining}, {rate_noinv_fmt}{postfix}]",
        )

    def eta_s(self, step: int, updates_per_s: float | None) -> float | None:
        """Seconds to `total` at the wall-clock rate seen so far (evaluation and saving included)."""
        now = time.perf_counter()
        if self._first is None:
            self._first = (step, now)
        first_step, first_t = self._first
        if step > first_step and now > first_t:
            rate = (step - first_step) / (now - first_t)
        else:
            rate = updates_per_s or 0.0
        return (self.total - step) / rate if rate > 0 else None

    def train(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        eta = self.eta_s(step, record.get("updates_per_s"))
        if self.mode == "bar":
            first = self._bar is None
            if first:
                self._bar = self._new_bar(step)
            self._bar.set_postfix_str(f"loss {record['loss']:.4f}, lr {record.get('lr', math.nan):.2e}", refresh=first)
            self._bar.update(step - self._bar.n)
        elif self.mode == "plain":
            now = time.perf_counter()
            due = (step >= self._next_line or step >= self.total or now - self._last_line_t >= PLAIN_MAX_GAP_S)
            if not due:
                return
            while self._next_line <= step:
                self._next_line += self._cadence
            self._last_line_t = now
            pct = 100.0 * step / self.total if self.total else 100.0
            line = (f"update {step}/{self.total} ({pct:.0f}%) loss {record['loss']:.4f} "
                    f"lr {record.get('lr', math.nan):.2e} "
                    f"{record.get('updates_per_s', 0.0):.1f} updates/s ETA {format_duration(eta)}")
            if record.get("mem_bytes") is not None:
                line += f" mem {format_bytes(record['mem_bytes'])}"
            self._print(line)

    def eval(self, record: dict[str, Any]) -> None:
        if self.mode == "off":
            return
        vals = " ".join(f"{k} {v:.4f}" for k, v in record.items() if k != "step" and isinstance(v, (int, float)))
        self.message(f"eval at update {record['step']}: {vals}")

    def message(self, text: str) -> None:
        """A line that does not break the bar (tqdm.write above it)."""
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            self._print(text)

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


# ----------------------------------------------------------------------------- the run logger


class RunLogger:
    """Writes training and evaluation records (metrics.jsonl, TensorBoard) and shows progress.

    On resume keeps only records up to start_step. `train` adds `mem_bytes` (memory_bytes()) to each
    record; `peak_mem_bytes` is the largest seen in this run, earlier sessions of a resumed run included.
    """

    def __init__(self, cfg: Config, run_dir: str | Path, *, start_step: int, total_steps: int,
                 stream: IO[str] | None = None, writes: bool = True):
        """writes=False (processes other than 0 of a multi-process run): no files, no progress."""
        self.cfg, self.total_steps, self.start_step = cfg, total_steps, start_step
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self._file: IO[str] | None = None
        self._tb = None
        self.peak_mem_bytes: int | None = None
        if writes:
            kept = [r for r in read_records(run_dir) if r.get("step", 0) <= start_step]
            with open(self.path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
            self._file = open(self.path, "a", buffering=1)
            mems = [r["mem_bytes"] for r in kept if r.get("kind") == "train" and r.get("mem_bytes") is not None]
            self.peak_mem_bytes = max(mems) if mems else None
        if writes and cfg.log.tensorboard:
            SummaryWriter = summary_writer_class()
            # purge_step: TensorBoard hides events of earlier sessions from this update on. The suffix
            # keeps a session that starts within the same second as the previous one from overwriting
            # its file, and sorts the files in session order (TensorBoard reads them in name order).
            self._tb = SummaryWriter(str(self.run_dir / TB_DIR), purge_step=start_step + 1, flush_secs=10,
                                     filename_suffix=f".{time.time_ns():020d}")
            self._tb.add_text("config", "```\n" + json.dumps(_config_dict(cfg), indent=2) + "\n```", start_step)
        self._progress = Progress(cfg.log.progress if writes else "off", total_steps, start_step, stream,
                                  cfg.log_every)

    def train(self, record: dict[str, Any]) -> None:
        record = dict(record)
        mem = memory_bytes()
        if mem is not None:
            record["mem_bytes"] = mem
            self.peak_mem_bytes = max(mem, self.peak_mem_bytes or 0)
        self._write({"kind": "train", **record})
        self._scalars("train", record)
        self._progress.train(record)

    def eval(self, record: dict[str, Any]) -> None:
        self._write({"kind": "eval", **record})
        self._scalars("eval", record)
        self._progress.eval(record)

    def message(self, text: str) -> None:
        self._progress.message(text)

    def _scalars(self, kind: str, record: dict[str, Any]) -> None:
        if self._tb is None:
            return
        step = int(record["step"])
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._tb.add_scalar(tb_tag(kind, key), float(value), step)

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._progress.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._file is not None and not self._file.closed:
            self._file.close()


def summary_writer_class() -> type:
    """tensorboardX's SummaryWriter, imported without importing torch.

    tensorboardX imports torch whenever it is installed (only to recognise torch tensors), which costs a
    JAX run about 1.5 s and a few hundred MB of resident memory; while it is imported here, `import
    torch` fails and tensorboardX falls back to numpy. A process that already imported torch (or
    tensorboardX) is left as it is.
    """
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` raises ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        if "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]
    return SummaryWriter


def _config_dict(cfg: Config) -> dict[str, Any]:
    from jaxloop.config import to_dict

    return to_dict(cfg)


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
    devices = jax.devices()
    return {
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(dirty) if dirty is not None else None,
        "config": to_dict(cfg),
        "packages": {p: version(p) for p in ("jaxloop", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint",
                                             "grain", "numpy", "scikit-learn", "torch")},
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
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "started_unix": time.time(),
    }


# ----------------------------------------------------------------------------- profiler


class Profiler:
    """Captures a jax.profiler trace of updates [profile_start, profile_start + profile_steps) into
    run_dir/profile: an XPlane file for TensorBoard's profile plugin and a Perfetto trace
    (perfetto_trace.json.gz) for ui.perfetto.dev, both under profile/plugins/profile/<timestamp>/.
    With `timings`, the seconds spent starting and stopping (writing) the trace count as "profile"."""

    def __init__(self, cfg: Config, run_dir: str | Path, timings: Timings | None = None):
        self.start, self.stop = cfg.log.profile_start, cfg.log.profile_start + cfg.log.profile_steps
        self.enabled = cfg.log.profile_steps > 0
        self.dir = Path(run_dir) / PROFILE_DIR
        self.active = False
        self.timings = timings

    def before_update(self, step: int) -> None:
        """Call with the number of updates completed before the next one runs."""
        import jax

        if self.enabled and not self.active and self.start <= step < self.stop:
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
