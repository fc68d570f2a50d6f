"""Rotating checkpoints, mirroring jaxloop/checkpoint/manager.py (Orbax) with torch.save and plain files.

One file per saved update, run_dir/checkpoints/step_<update:08d>.pt:

    line 1   a JSON header: {"format", "step", "metrics", "sha256", "size"}
    rest     the torch.save bytes of the payload (model, optimizer, scheduler, scaler, RNG states,
             data position, update count, ...), whose sha256 the header holds

written to a temporary file, flushed, fsynced and moved into place with os.replace, so a file is either
absent or whole; a kill mid-save leaves a *.tmp file that the next run removes. A file whose header
does not parse, whose bytes do not match the digest, or that torch.load rejects is damaged: restore
warns (naming the update and the cause), moves it to run_dir/checkpoints_damaged/ and tries the
previous one, as jaxloop does.

Retention is the union of three rules, applied after every save to the checkpoints on disk: the
newest keep_last; the best keep_best by checkpoint.best_metric (best_mode min or max) among checkpoints
saved with evaluation metrics; every checkpoint whose update is a multiple of keep_every. This is the
rule of Orbax's AnyPreservationPolicy(LatestN, BestN(keep_checkpoints_without_metrics=False),
EveryNSteps) that jaxloop configures, including its details: ties in the metric keep the newer
checkpoint (a stable sort), and BestN keeps everything while there are at most keep_best checkpoints.
`preserved` and `kept_steps` are that rule as pure functions, for tests.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from jaxloop.config.run import Config
from jaxloop.rundir.atomic import fsync_dir
from jaxloop.rundir.layout import CHECKPOINT_DIR, DAMAGED_DIR, TORCH_CHECKPOINT, TORCH_CHECKPOINT_FORMAT

FORMAT = TORCH_CHECKPOINT_FORMAT
_NAME = TORCH_CHECKPOINT

Metrics = Mapping[str, float] | float | None


class NonFiniteStateError(RuntimeError):
    """Raised instead of saving a state that holds NaN or Inf."""


class DamagedCheckpoint(Exception):
    """A checkpoint file that cannot be read back whole."""


# ----------------------------------------------------------------------------- retention (pure)


def _metric_value(metrics: Metrics, name: str) -> float | None:
    if metrics is None:
        return None
    if isinstance(metrics, Mapping):
        return float(metrics[name]) if name in metrics else None
    return float(metrics)


def preserved(checkpoints: Sequence[tuple[int, Metrics]], cfg: Config) -> list[bool]:
    """Which of `checkpoints` ((update, metrics) sorted by update) the retention rule keeps.

    metrics is a mapping holding checkpoint.best_metric (or that metric as a float), or None for a
    checkpoint saved without an evaluation.
    """
    c = cfg.checkpoint
    n = len(checkpoints)
    keep = [i >= n - c.keep_last for i in range(n)]
    if c.keep_best:
        if n <= c.keep_best:
            keep = [True] * n
        else:
            scored = [(i, _metric_value(m, c.best_metric)) for i, (_, m) in enumerate(checkpoints)]
            scored = [(i, v) for i, v in scored if v is not None]
            # Ascending for max, descending for min: the best are at the end; ties keep file order,
            # so the newer of two equal checkpoints is the better one.
            ranked = sorted(scored, key=lambda iv: iv[1], reverse=c.best_mode == "min")
            for i, _ in ranked[-c.keep_best :]:
                keep[i] = True
    if c.keep_every:
        for i, (step, _) in enumerate(checkpoints):
            keep[i] = keep[i] or step % c.keep_every == 0
    return keep


def kept_steps(saved: Sequence[int], metrics: Mapping[int, Metrics], cfg: Config) -> list[int]:
    """The updates still on disk after saving `saved` in order, rotating after each save."""
    kept: list[tuple[int, Metrics]] = []
    for step in saved:
        kept = [ck for ck in kept if ck[0] != step] + [(step, metrics.get(step))]
        kept = [ck for ck, keep in zip(kept, preserved(kept, cfg)) if keep]
    return [step for step, _ in kept]


def best_step(checkpoints: Sequence[tuple[int, Metrics]], cfg: Config) -> int | None:
    """The kept update with the best metric (the newer on ties); None without keep_best or metrics."""
    c = cfg.checkpoint
    if not c.keep_best:
        return None
    scored = [(s, _metric_value(m, c.best_metric)) for s, m in checkpoints]
    scored = [(s, v) for s, v in scored if v is not None]
    if not scored:
        return None
    return sorted(scored, key=lambda sv: sv[1], reverse=c.best_mode == "min")[-1][0]


# ----------------------------------------------------------------------------- files


def _path(directory: Path, step: int) -> Path:
    return directory / f"step_{step:08d}.pt"


def _read_header(path: Path) -> tuple[dict[str, Any], bytes]:
    """(header, payload bytes) of a checkpoint file; DamagedCheckpoint if the header is unusable."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DamagedCheckpoint(f"unreadable: {e.strerror}") from None
    end = data.find(b"\n")
    if end < 0:
        raise DamagedCheckpoint("no header line (truncated?)")
    try:
        header = json.loads(data[:end].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DamagedCheckpoint(f"header is not JSON ({e})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise DamagedCheckpoint(f"not a {FORMAT} file")
    return header, data[end + 1 :]


def _finite(obj: Any) -> bool:
    """Every floating tensor (in nested dicts / lists) is finite."""
    if isinstance(obj, torch.Tensor):
        return not obj.is_floating_point() or bool(torch.isfinite(obj).all())
    if isinstance(obj, Mapping):
        return all(_finite(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(_finite(v) for v in obj)
    return True


class CheckpointManager:
    """One run's checkpoints: save (atomic, then rotate), list, and restore the newest valid one."""

    def __init__(self, cfg: Config, run_dir: str | Path):
        self.cfg = cfg
        self.directory = Path(run_dir) / CHECKPOINT_DIR
        self.directory.mkdir(parents=True, exist_ok=True)
        for tmp in self.directory.glob("*.tmp"):  # leftovers of a save interrupted by a kill
            tmp.unlink()
        self._metrics: dict[int, Metrics] = {}
        for step in self._steps_on_disk():
            try:
                self._metrics[step] = _read_header(_path(self.directory, step))[0].get("metrics")
            except DamagedCheckpoint:
                self._metrics[step] = None  # found out (and moved aside) on restore

    @staticmethod
    def has_checkpoint(directory: Path) -> bool:
        """Whether a run's checkpoint directory holds a checkpoint (valid or not)."""
        return directory.is_dir() and any(_NAME.match(p.name) for p in directory.iterdir())

    def _steps_on_disk(self) -> list[int]:
        return sorted(int(m.group(1)) for p in self.directory.iterdir() if (m := _NAME.match(p.name)))

    def all_steps(self) -> list[int]:
        return sorted(self._metrics)

    def best_step(self) -> int | None:
        return best_step(sorted(self._metrics.items()), self.cfg)

    def save(self, step: int, payload: dict[str, Any], metrics: Mapping[str, float] | None = None) -> float:
        """Write the checkpoint of update `step` atomically, then rotate; returns the seconds it took."""
        t0 = time.perf_counter()
        if not _finite({k: payload[k] for k in ("model", "optimizer") if k in payload}):
            raise NonFiniteStateError(f"refusing to save update {step}: the state holds NaN or Inf")
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        body = buffer.getvalue()
        clean = None if metrics is None else {k: float(v) for k, v in metrics.items()}
        header = {
            "format": FORMAT,
            "step": int(step),
            "metrics": clean,
            "sha256": hashlib.sha256(body).hexdigest(),
            "size": len(body),
        }
        path = _path(self.directory, step)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(json.dumps(header).encode("utf-8") + b"\n")
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(self.directory)
        self._metrics[int(step)] = clean
        self._rotate()
        return time.perf_counter() - t0

    def _rotate(self) -> None:
        checkpoints = sorted(self._metrics.items())
        for (step, _), keep in zip(checkpoints, preserved(checkpoints, self.cfg)):
            if not keep:
                _path(self.directory, step).unlink(missing_ok=True)
                del self._metrics[step]

    def load(self, step: int) -> dict[str, Any]:
        """The payload of update `step`; DamagedCheckpoint if it is not whole."""
        header, body = _read_header(_path(self.directory, step))
        if len(body) != header.get("size"):
            raise DamagedCheckpoint(f"{len(body)} payload bytes, the header says {header.get('size')} (truncated?)")
        if hashlib.sha256(body).hexdigest() != header.get("sha256"):
            raise DamagedCheckpoint("payload does not match its sha256")
        try:
            return torch.load(io.BytesIO(body), map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - anything torch.load rejects is damage
            raise DamagedCheckpoint(f"torch.load failed: {type(e).__name__}: {e}") from None

    def restore_latest(self) -> tuple[int, dict[str, Any]] | None:
        """(update, payload) of the newest checkpoint that loads; damaged newer ones are moved aside."""
        for step in sorted(self._metrics, reverse=True):
            try:
                return step, self.load(step)
            except DamagedCheckpoint as e:
                cause = str(e).splitlines()[0][:300] if str(e) else "damaged"
                warnings.warn(
                    f"checkpoint at update {step} is damaged ({cause}); moving it to "
                    f"{DAMAGED_DIR}/ and trying the previous one",
                    stacklevel=2,
                )
                self._quarantine(step)
        return None

    def _quarantine(self, step: int) -> None:
        damaged = self.directory.parent / DAMAGED_DIR
        damaged.mkdir(exist_ok=True)
        src = _path(self.directory, step)
        if src.exists():
            shutil.move(str(src), str(damaged / f"{src.name}-{int(time.time())}"))
        self._metrics.pop(step, None)
