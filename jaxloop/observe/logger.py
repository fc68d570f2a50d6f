"""Run metrics sinks: console progress, metrics.jsonl (always), TensorBoard writers and the experiment trackers
(log.trackers: W&B, MLflow; jaxloop.observe.trackers).

Records are plain dicts of Python scalars; floats are written at full precision (repr) so that two runs
can be compared bit for bit. A resumed run first truncates metrics.jsonl to the records up to the
update it resumes from and tells TensorBoard to purge later events (purge_step), so a resumed run's
files read the same as an uninterrupted run's.

Progress (log.progress) is shown once per device call (the loop's flush), never for each of a call's
records in a burst: ``bar`` is a tqdm bar on stderr (update, loss, lr, updates/s, ETA; messages
and evaluation lines are written above it); ``plain`` prints the last due record of a call, thinned to at
most about PLAIN_LINES lines per run (plus one at least every PLAIN_MAX_GAP_S seconds), so CI logs
stay readable, each with the rate over the updates since the line before and an ETA from the wall-clock
rate between calls (metrics.jsonl keeps every record's own interval, which for updates run in one device
call is the call's share); ``auto`` is ``bar`` when stderr is a terminal and ``plain`` otherwise; ``off`` prints
no progress (messages such as early stopping are still printed).
"""

from __future__ import annotations

import io
import json
import math
import sys
import time
from pathlib import Path
from typing import IO, Any

from jaxloop.config.run import LogConfig
from jaxloop.observe.runinfo import format_bytes, format_duration, memory_bytes
from jaxloop.rundir.layout import RunLayout
from jaxloop.rundir.records import rewrite_for_resume

PLAIN_LINES = 50
"""Plain progress prints about this many update lines per run (every log record on short runs)."""
PLAIN_MAX_GAP_S = 60.0
"""... and never stays silent for longer than this while records arrive."""

# TensorBoard tag group of each record key (other train keys go under train/, eval keys under eval/).
TAG_GROUPS = {
    "loss": "train",
    "lr": "train",
    "grad_norm": "train",
    "skipped": "train",
    "loss_scale": "train",
    "updates_per_s": "throughput",
    "samples_per_s": "throughput",
    "tokens_per_s": "throughput",
    "mfu": "throughput",
    "step_ms": "time",
    "data_wait_ms": "time",
    "mem_bytes": "memory",
    "mem_util": "memory",
}


def tb_tag(kind: str, key: str) -> str:
    """The TensorBoard tag of a record key: train/loss, eval/val_loss, hook/name, throughput/samples_per_s, ..."""
    if kind in ("eval", "hook"):
        return f"{kind}/{key}"
    return f"{TAG_GROUPS.get(key, 'train')}/{key}"


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
        self._since_line = [0, 0.0]  # updates and seconds (from the records' step_ms) since the last line
        self._last_step = start
        self._pending: tuple[dict[str, Any], float] | None = None  # the record the next flush() shows

    def _new_bar(self, step: int) -> Any:
        from tqdm import tqdm

        # a terminal that reports its size gets a bar that follows its width; one that reports 0 x 0
        # (or a forced bar on a non-terminal) gets a fixed 100-column bar instead of nothing
        sized = _sized(self.stream)
        return tqdm(
            total=self.total,
            initial=step,
            file=self.stream,
            unit=" updates",
            dynamic_ncols=sized,
            ncols=None if sized else 100,
            nrows=None if sized else 40,
            smoothing=0.1,
            desc="train",
            bar_format="{desc} {percentage:3.0f}%|{bar}| update {n_fmt}/{total_fmt} "
            "[{elapsed}<{remaining}, {rate_noinv_fmt}{postfix}]",
        )

    def eta_s(self, step: int, updates_per_s: float | None) -> float | None:
        """Seconds to `total` at the wall-clock rate seen so far (evaluation and saving included), measured
        from one progress update (one device call) to the next, never between the records of one call."""
        now = time.perf_counter()
        if self._first is None:
            self._first = (step, now)
        first_step, first_t = self._first
        if step > first_step and now > first_t:
            rate = (step - first_step) / (now - first_t)
        else:
            rate = updates_per_s or 0.0
        return (self.total - step) / rate if rate > 0 else None

    def _smoothed_rate(self, record: dict[str, Any], step: int) -> float:
        """updates/s over every update since the previous printed line (the records' own intervals summed)."""
        updates = step - self._last_step
        self._last_step = step
        if record.get("step_ms") is not None and updates > 0:
            self._since_line[0] += updates
            self._since_line[1] += updates * float(record["step_ms"]) / 1e3
        n, seconds = self._since_line
        return n / seconds if seconds > 0 else float(record.get("updates_per_s", 0.0))

    def train(self, record: dict[str, Any]) -> None:
        """A train record: shown at the next `flush()` (the loop flushes once per device call), so that the
        updates of one call make one progress update and the ETA is timed between calls."""
        step = int(record["step"])
        rate = self._smoothed_rate(record, step)
        if self.mode == "bar":
            self._pending = (record, rate)
        elif self.mode == "plain":
            if step >= self._next_line or step >= self.total:
                while self._next_line <= step:
                    self._next_line += self._cadence
                self._pending = (record, rate)
            elif time.perf_counter() - self._last_line_t >= PLAIN_MAX_GAP_S and self._pending is None:
                self._pending = (record, rate)

    def flush(self) -> None:
        """Show the last record due since the previous flush: one line (or bar update) per device call."""
        pending, self._pending = self._pending, None  # taken once: a signal's message may flush from its thread
        if pending is None:
            return
        record, rate = pending
        step = int(record["step"])
        eta = self.eta_s(step, record.get("updates_per_s"))
        if self.mode == "bar":
            bar, first = self._bar, self._bar is None
            if bar is None:
                bar = self._bar = self._new_bar(step)
            bar.set_postfix_str(f"loss {record['loss']:.4f}, lr {record.get('lr', math.nan):.2e}", refresh=first)
            bar.update(step - bar.n)
            return
        self._last_line_t = time.perf_counter()
        pct = 100.0 * step / self.total if self.total else 100.0
        self._since_line = [0, 0.0]
        line = (
            f"update {step}/{self.total} ({pct:.0f}%) loss {record['loss']:.4f} "
            f"lr {record.get('lr', math.nan):.2e} "
            f"{rate:.1f} updates/s ETA {format_duration(eta)}"
        )
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
        self.flush()  # the progress it follows first
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            self._print(text)

    def _print(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def close(self) -> None:
        self.flush()
        if self._bar is not None:
            self._bar.close()
            self._bar = None


# ----------------------------------------------------------------------------- the run logger


class RunLogger:
    """Writes training and evaluation records (metrics.jsonl, TensorBoard) and shows progress.

    On resume keeps only records up to start_step. `train` adds `mem_bytes` (memory_bytes()) to a
    record that has none; `peak_mem_bytes` is the largest seen in this run, earlier sessions of a resumed
    run included. metrics.jsonl is written through a buffer: `flush()` after a batch of records (the
    loop: once per call), evaluation records and close() flush it.
    """

    def __init__(
        self,
        run_dir: str | Path,
        log: LogConfig,
        *,
        start_step: int,
        total_steps: int,
        log_every: int = 1,
        config: dict[str, Any] | None = None,
        stream: IO[str] | None = None,
        writes: bool = True,
    ):
        """log: progress mode and TensorBoard; config: shown as TensorBoard text; writes=False (processes
        other than 0 of a multi-process run): no files, no progress."""
        self.total_steps, self.start_step = total_steps, start_step
        self.run_dir = Path(run_dir)
        self.layout = RunLayout(self.run_dir)
        self.path = self.layout.metrics
        self._file: IO[str] | None = None
        self._tb = None
        self.peak_mem_bytes: int | None = None
        if writes:
            kept = rewrite_for_resume(run_dir, start_step)  # atomic: a kill inside loses no earlier record
            self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()
            mems = [r["mem_bytes"] for r in kept if r.get("kind") == "train" and r.get("mem_bytes") is not None]
            self.peak_mem_bytes = max(mems) if mems else None
        if writes and log.tensorboard:
            SummaryWriter = summary_writer_class()
            # purge_step: TensorBoard hides events of earlier sessions from this update on. The suffix
            # keeps a session that starts within the same second as the previous one from overwriting
            # its file, and sorts the files in session order (TensorBoard reads them in name order).
            self._tb = SummaryWriter(
                str(self.layout.tb), purge_step=start_step + 1, flush_secs=10, filename_suffix=f".{time.time_ns():020d}"
            )
            if config is not None:
                self._tb.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", start_step)
        self._progress = Progress(log.progress if writes else "off", total_steps, start_step, stream, log_every)
        self._trackers = None
        if writes and log.trackers:
            from jaxloop.observe.trackers import Trackers

            self._trackers = Trackers(run_dir, log.trackers, log.project, log.mlflow_uri, config)

    def train(self, record: dict[str, Any]) -> None:
        record = dict(record)
        mem = record["mem_bytes"] if "mem_bytes" in record else memory_bytes()
        if mem is not None:
            record["mem_bytes"] = mem
            self.peak_mem_bytes = max(mem, self.peak_mem_bytes or 0)
        self._write({"kind": "train", **record})
        self._scalars("train", record)
        self._track("train", record)
        self._progress.train(record)

    def eval(self, record: dict[str, Any]) -> None:
        self._write({"kind": "eval", **record})
        self.flush()
        self._scalars("eval", record)
        self._track("eval", record)
        self._progress.eval(record)

    def flush(self) -> None:
        """Write the buffered records to metrics.jsonl (one write: a write releases the GIL, and a
        thread holding it then can keep the loop waiting for milliseconds)."""
        if self._file is not None:
            self._file.flush()
        if self._trackers is not None:
            self._trackers.flush()
        self._progress.flush()

    def message(self, text: str) -> None:
        self._progress.message(text)

    def hook(self, step: int, scalars: dict[str, float]) -> None:
        """A hook's scalars: a `hook` record in metrics.jsonl and TensorBoard scalars under hook/."""
        self._write({"kind": "hook", "step": int(step), **scalars})
        self._scalars("hook", {"step": step, **scalars})
        self._track("hook", {"step": step, **scalars})

    def text(self, step: int, name: str, text: str) -> None:
        """A hook's text: a `hook` record {name: text} and TensorBoard text under hook/."""
        self._write({"kind": "hook", "step": int(step), name: text})
        if self._tb is not None:
            self._tb.add_text(f"hook/{name}", text, int(step))

    def image(self, step: int, name: str, image: Any) -> Path | None:
        """A hook's image (an [H, W] or [H, W, 3|4] array in [0, 1]): run_dir/hooks/<name>-<step>.png, a `hook`
        record naming the file, and a TensorBoard image under hook/. Returns the file's path."""
        import numpy as np

        if self._file is None:
            return None
        array = np.clip(np.asarray(image, np.float32), 0.0, 1.0)
        if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[-1] not in (1, 3, 4)):
            raise ValueError(f"an image is [H, W] or [H, W, 1|3|4] (got shape {array.shape})")
        self.layout.hooks.mkdir(exist_ok=True)
        path = self.layout.hooks / f"{name}-{int(step)}.png"
        from matplotlib import image as mpimg

        mpimg.imsave(
            path,
            array[..., 0] if array.ndim == 3 and array.shape[-1] == 1 else array,
            cmap="gray" if array.ndim == 2 else None,
            vmin=0.0,
            vmax=1.0,
        )
        self._write({"kind": "hook", "step": int(step), name: str(path.relative_to(self.run_dir))})
        if self._tb is not None:
            self._tb.add_image(
                f"hook/{name}", array if array.ndim == 3 else array[..., None], int(step), dataformats="HWC"
            )
        return path

    def _scalars(self, kind: str, record: dict[str, Any]) -> None:
        """The record's numbers as one TensorBoard event: tensorboardX sends each event through a
        multiprocessing queue to its writer (about 0.1 ms a put), so one per scalar cost a log line ~1 ms."""
        if self._tb is None:
            return
        # protobuf builds summary_pb2's classes at run time, and tensorboardX ships no stub for the module
        from tensorboardX.proto.summary_pb2 import Summary  # pyright: ignore[reportAttributeAccessIssue]
        from tensorboardX.summary import scalar

        values = [
            v
            for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
            for v in scalar(tb_tag(kind, key), float(value)).value
        ]
        self._tb._get_file_writer().add_summary(Summary(value=values), int(record["step"]))

    def _track(self, kind: str, record: dict[str, Any]) -> None:
        if self._trackers is not None:
            self._trackers.log(kind, record)

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._progress.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._trackers is not None:
            self._trackers.close()
            self._trackers = None
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
