"""`python -m benchmarks --gpu`: the GPU measurements of a lent machine in one shot, into one JSON record.

GPT-2 small (--preset gpt2-small's model, GPT-2's vocabulary) in bf16 at context 1024, batch 16, on token
shards written for the run (random ids: the work per update does not depend on which tokens it reads):

    gpt2           tokens/s, MFU and peak memory of the update: jaxloop (deterministic kernels, the default;
                   model.attention auto), torch_ref eager and torch_ref under torch.compile
    deterministic  jaxloop with XLA's deterministic kernels on (the gpt2 part's figures) and off (XLA_FLAGS, set
                   before jax starts)
    attention      jaxloop with model.attention xla and cudnn (cuDNN's fused attention; unavailable off a GPU)
    loop           `python -m jaxloop.train` for 200 updates on the shards (data, host work and logging
                   included), against the update alone
    breakdown      the loop's median update split into data wait, forward, backward, optimizer, host and the
                   rest (benchmarks/breakdown.py: compiled forward, forward + backward and update variants)

Each part runs in its own process (a child's XLA_FLAGS, memory and failure are its own), one after the other,
and the record is written after each part (a part that fails or runs out of time keeps the others). --tiny is
the same path at a size a 2-core CPU runs in a minute or two (a 2-layer GPT, width 64, context 32, batch 2, fp32,
3 updates per contender; torch.compile with the "eager" backend: dynamo traces the model, inductor is not
run), which CI runs so that the script cannot fail for a typo on the day a GPU is lent. benchmarks/gpu.sh
installs what a bare GPU image lacks from wheels carried in .whl/ and runs this.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxloop.rundir.records import read_records

REPO = Path(__file__).resolve().parents[1]
RECORDS = REPO / "benchmarks" / "records"
SCHEMA = 1
PARTS = ("gpt2", "deterministic", "attention", "loop", "breakdown")
GPT2_VOCAB = 50257
SIZES = {  # the model, the batch and the counts of each size
    "full": {
        "n_layers": 12,
        "d_model": 768,
        "n_heads": 12,
        "context": 1024,
        "batch": 16,
        "vocab": GPT2_VOCAB,
        "precision": "bf16",
        "warm": 3,
        "updates": 20,
        "rounds": 3,
        "loop_updates": 200,
        "log_every": 10,
        "timeout_s": 240,
    },
    "tiny": {
        "n_layers": 2,
        "d_model": 64,
        "n_heads": 4,
        "context": 32,
        "batch": 2,
        "vocab": 512,
        "precision": "fp32",
        "warm": 1,
        "updates": 2,
        "rounds": 1,
        "loop_updates": 3,
        "log_every": 1,
        "timeout_s": 300,
    },
}
DETERMINISTIC = "--xla_gpu_deterministic_ops"
BUDGET_S = 480.0
"""The whole record's time on a GPU (8 minutes): a part is given what is left, and one that starts with less than
a minute left is recorded as skipped."""


def size_of(tiny: bool) -> dict[str, Any]:
    return SIZES["tiny" if tiny else "full"]


def write_shards(directory: Path, s: dict[str, Any]) -> Path:
    """llm.c token shards (train and val) of random ids below the size's vocabulary: enough for the loop's updates
    and a few evaluation batches."""
    from jaxloop.data.shards import write_shard

    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    window = s["context"] + 1
    write_shard(
        str(directory / "gpu_train_000000.bin"),
        rng.integers(0, s["vocab"], (s["loop_updates"] + 8) * s["batch"] * window + window, dtype=np.int64),
    )
    write_shard(str(directory / "gpu_val_000000.bin"), rng.integers(0, s["vocab"], 8 * s["batch"] * window))
    return directory


def gpt_cfg(s: dict[str, Any], shards: Path, attention: str = "auto"):
    """--preset gpt2-small at the size's shape and precision, over the shards."""
    from jaxloop.config.run import preset

    base = preset("gpt2-small")
    model = dataclasses.replace(
        base.model,
        n_layers=s["n_layers"],
        d_model=s["d_model"],
        n_heads=s["n_heads"],
        context=s["context"],
        vocab_size=s["vocab"],
        attention=attention,
    )
    return dataclasses.replace(
        base,
        batch_size=s["batch"],
        precision=s["precision"],
        model=model,
        data=dataclasses.replace(base.data, path=str(shards)),
        eval_batches=1,
    )


def _measure(fn: Any, s: dict[str, Any]) -> float:
    """Median seconds per update of `fn` (a contender called with an update count) after its warm-up."""
    fn(s["warm"])
    return float(np.median([fn(s["updates"]) for _ in range(s["rounds"])]))


def _entry(cfg, s_per_update: float, peak_mem_bytes: int | None, device_kind: str | None) -> dict[str, Any]:
    from jaxloop.model.flops import flops_per_token, table_peak

    tokens_per_s = cfg.batch_size * cfg.model.context / s_per_update
    peak = table_peak(device_kind, cfg.precision) if device_kind else None
    mfu = tokens_per_s * flops_per_token(cfg.model, cfg.model.vocab_size) / peak if peak else None
    return {
        "status": "ok",
        "s_per_update": s_per_update,
        "tokens_per_s": tokens_per_s,
        "mfu": mfu,
        "peak_mem_bytes": peak_mem_bytes,
    }


def _jax_kind() -> str | None:
    import jax

    device = jax.devices()[0]
    return None if device.platform == "cpu" else device.device_kind


def _jax_peak() -> int | None:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def jaxloop_update(s: dict[str, Any], shards: Path, attention: str = "auto") -> dict[str, Any]:
    """jaxloop's compiled update (benchmarks.step.JaxUpdate) at this size."""
    from benchmarks.step import JaxUpdate, host_batches
    from jaxloop.data.sources import load_splits

    cfg = gpt_cfg(s, shards, attention)
    splits = load_splits(cfg)
    update = JaxUpdate(cfg, splits, host_batches(cfg, splits, 2))
    entry = _entry(cfg, _measure(update, s), _jax_peak(), _jax_kind())
    entry["compile_s"] = update.compile_s
    return entry


def torch_updates(s: dict[str, Any], shards: Path, tiny: bool) -> dict[str, Any]:
    """torch_ref's update eager and under torch.compile (benchmarks.step.TorchUpdate), from the same weights."""
    import torch

    from benchmarks.step import TorchUpdate, host_batches
    from jaxloop.data.sources import load_splits

    cfg = gpt_cfg(s, shards)
    splits = load_splits(cfg)
    batches = host_batches(cfg, splits, 2)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kind = torch.cuda.get_device_name() if device == "cuda" else None
    out: dict[str, Any] = {}
    for name in ("torch eager", "torch.compile"):
        try:
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            update = TorchUpdate(cfg, splits, batches, None, device=device)
            if name == "torch.compile":
                update.state.model = torch.compile(update.state.model, backend="eager" if tiny else "inductor")
            seconds = _measure(update, s)
            out[name] = _entry(cfg, seconds, torch.cuda.max_memory_allocated() if device == "cuda" else None, kind)
            del update
        except Exception as e:  # noqa: BLE001 - recorded, the other contender still runs
            out[name] = failure(e)
    return out


def loop_run(s: dict[str, Any], shards: Path) -> dict[str, Any]:
    """`python -m jaxloop.train` for the size's loop updates on the shards: the whole loop's rate."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        args = [
            sys.executable,
            "-m",
            "jaxloop.train",
            "--preset",
            "gpt2-small",
            "--data.path",
            str(shards),
            "--run_dir",
            str(run_dir),
            "--steps",
            str(s["loop_updates"]),
            "--batch_size",
            str(s["batch"]),
            "--precision",
            s["precision"],
            "--model.n_layers",
            str(s["n_layers"]),
            "--model.d_model",
            str(s["d_model"]),
            "--model.n_heads",
            str(s["n_heads"]),
            "--model.context",
            str(s["context"]),
            "--model.vocab_size",
            str(s["vocab"]),
            "--eval_every",
            "0",
            "--eval_batches",
            "1",
            "--checkpoint.every",
            "0",
            "--log_every",
            str(s["log_every"]),
            "--optim.warmup_steps",
            "1",
            "--log.progress",
            "plain",
            "--log.no_tensorboard",
            "--log.no_report",
        ]
        t0 = time.perf_counter()
        proc = subprocess.run(
            args, capture_output=True, text=True, cwd=REPO, env=os.environ.copy(), timeout=s["timeout_s"]
        )
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            return failure(f"exit {proc.returncode}: {proc.stderr.strip()[-400:]}")
        summary = json.loads((run_dir / "summary.json").read_text())
        train = [r for r in read_records(run_dir) if r.get("kind") == "train"][1:] or [{}]  # after the first interval
    rate = float(summary["updates_per_s"])
    step_ms = [r["step_ms"] for r in train if r.get("step_ms") is not None]
    wait_ms = [r["data_wait_ms"] for r in train if r.get("data_wait_ms") is not None]
    return {
        "status": "ok",
        "updates": int(summary["final_step"]),
        "updates_per_s": rate,
        "tokens_per_s": rate * s["batch"] * s["context"],
        "wall_s": wall,
        "median_step_ms": float(np.median(step_ms)) if step_ms else None,
        "median_data_wait_ms": float(np.median(wait_ms)) if wait_ms else 0.0,
        "timings_s": summary.get("timings_s"),
    }


def failure(e: BaseException | str) -> dict[str, Any]:
    text = e if isinstance(e, str) else f"{type(e).__name__}: {e}"
    return {"status": "failed", "error": " ".join(str(text).split())[:600]}


def part(name: str, tiny: bool, shards: Path) -> dict[str, Any]:
    """One part's measurements (run inside its child process)."""
    s = size_of(tiny)
    if name == "gpt2":
        return {"jaxloop": jaxloop_update(s, shards), **torch_updates(s, shards, tiny)}
    if name == "deterministic":
        on = DETERMINISTIC + "=true" in os.environ.get("XLA_FLAGS", "")
        return {"on" if on else "off": jaxloop_update(s, shards)}
    if name == "attention":
        from benchmarks.common import gpu_present

        out = {"xla": jaxloop_update(s, shards, "xla")}
        out["cudnn"] = (
            jaxloop_update(s, shards, "cudnn")
            if gpu_present()
            else {"status": "unavailable", "error": "cuDNN attention needs a GPU"}
        )
        return out
    if name == "loop":
        return {"loop": loop_run(s, shards)}
    if name == "breakdown":
        from benchmarks.breakdown import variant_times
        from jaxloop.data.sources import load_splits

        cfg = gpt_cfg(s, shards)
        return {"variants_s": variant_times(cfg, load_splits(cfg), s["updates"])}
    raise ValueError(f"part {name!r}: one of {', '.join(PARTS)}")


def child_env(deterministic: bool) -> dict[str, str]:
    """The environment of a part's process: XLA's deterministic kernels on or off, no preallocation (jax's peak
    is then what it used), the repository importable."""
    flags = " ".join(t for t in os.environ.get("XLA_FLAGS", "").split() if not t.startswith(DETERMINISTIC))
    flags = f"{flags} {DETERMINISTIC}={'true' if deterministic else 'false'}".strip()
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {
        **os.environ,
        "XLA_FLAGS": flags,
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "PYTHONPATH": path,
        "PYTHONUNBUFFERED": "1",
    }


def run_part(
    name: str, tiny: bool, shards: Path, deterministic: bool = True, left_s: float | None = None
) -> dict[str, Any]:
    """A part in a child process: its JSON (the last stdout line), or a failure naming the exit and stderr (under
    the part's own key: deterministic's "on" or "off", loop's "loop", else "part")."""
    key = ("on" if deterministic else "off") if name == "deterministic" else "loop" if name == "loop" else "part"
    key = "variants_s" if name == "breakdown" else key
    s = size_of(tiny)
    timeout = s["timeout_s"] + 60 if left_s is None else min(s["timeout_s"] + 60, left_s)
    if timeout < 60:
        return {key: {"status": "skipped", "error": f"out of time ({left_s:.0f} s of the budget left)"}}
    args = [sys.executable, "-m", "benchmarks.gpu", "--part", name, "--shards", str(shards)] + (["--tiny"] * tiny)
    try:
        proc = subprocess.run(
            args, capture_output=True, text=True, cwd=REPO, env=child_env(deterministic), timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {key: failure(f"timed out after {timeout:.0f} s")}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {key: failure(f"exit {proc.returncode}: {proc.stderr.strip()[-600:]}")}
    return json.loads(lines[-1])


def device_name() -> str:
    """The GPU's name (nvidia-smi), or "cpu"."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
        name = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    except (OSError, subprocess.TimeoutExpired):
        name = ""
    return name or "cpu"


def record_path(device: str, tiny: bool) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    return RECORDS / f"gpu-{slug}{'-tiny' if tiny else ''}.json"


def run(tiny: bool, out: Path | None = None, budget_s: float | None = None) -> dict[str, Any]:
    """Every part, each in its own process; the record (schema SCHEMA) written to `out` after each part."""
    from benchmarks.common import machine, save_record

    s = size_of(tiny)
    device = device_name()
    out = out or record_path(device, tiny)
    t0 = time.perf_counter()
    record: dict[str, Any] = {
        "schema": SCHEMA,
        "tiny": tiny,
        "device": device,
        "machine": machine(),
        "size": {
            k: s[k]
            for k in ("n_layers", "d_model", "n_heads", "context", "batch", "vocab", "precision", "loop_updates")
        },
    }
    with tempfile.TemporaryDirectory() as tmp:
        shards = write_shards(Path(tmp) / "shards", s)
        # most wanted first (the budget may cut the last); deterministic kernels on are the gpt2 part's jaxloop
        steps = [("gpt2", True), ("loop", True), ("attention", True), ("deterministic", False), ("breakdown", True)]
        for name, deterministic in steps:
            print(f"gpu: {name}{'' if deterministic else ' (deterministic off)'}...", file=sys.stderr, flush=True)
            left = None if budget_s is None else budget_s - (time.perf_counter() - t0)
            record.setdefault(name, {}).update(run_part(name, tiny, shards, deterministic, left))
            record["wall_s"] = time.perf_counter() - t0
            out.parent.mkdir(parents=True, exist_ok=True)
            save_record(out, record)
    on = record["gpt2"].get("jaxloop")
    record["deterministic"] = {
        "on": {**on, "from": "gpt2.jaxloop"}
        if on is not None
        else {"status": "skipped", "error": "no jaxloop figures from the gpt2 part"},
        **record["deterministic"],
    }
    save_record(out, record)
    loop, update = record["loop"].get("loop", {}), record["gpt2"].get("jaxloop", {})
    if loop.get("status") == "ok" and update.get("status") == "ok":
        record["loop"]["loop_over_update"] = loop["tokens_per_s"] / update["tokens_per_s"]
    variants = record["breakdown"].get("variants_s", {})
    if loop.get("status") == "ok" and loop.get("median_step_ms") and "status" not in variants:
        from benchmarks.breakdown import rounded, split_update

        record["breakdown"]["parts_ms"] = rounded(
            split_update(
                loop["median_step_ms"] / 1e3,
                loop["median_data_wait_ms"] / 1e3,
                variants["forward"],
                variants["fwd_bwd"],
                variants["update"],
            )
        )
    save_record(out, record)
    print(f"gpu: wrote {out} in {record['wall_s']:.0f} s", file=sys.stderr)
    return record


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=PARTS, required=True)
    p.add_argument("--shards", required=True)
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args(argv)
    print(json.dumps(part(args.part, args.tiny, Path(args.shards))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
