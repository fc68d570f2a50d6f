"""benchmarks/gpu.sh (python -m benchmarks --gpu) at its CPU size, so that the GPU's one prepared shot cannot fail
for a typo on the day a GPU is lent: every part runs, and the record has the schema the GPU's will have."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu
from benchmarks.breakdown import PARTS

REPO = Path(__file__).resolve().parents[1]
MEASURED = {"status", "s_per_update", "tokens_per_s", "mfu", "peak_mem_bytes"}


@pytest.mark.slow
@pytest.mark.torch  # torch eager and torch.compile are contenders (the test extra has torch on Python 3.11 only)
def test_the_tiny_gpu_script_runs_every_part_into_one_record(tmp_path):
    out = tmp_path / "gpu.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", "benchmarks/gpu.sh", "--tiny", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["schema"] == 1 and record["tiny"] is True and record["device"] == "cpu"
    assert record["size"] == {
        "n_layers": 2,
        "d_model": 64,
        "n_heads": 4,
        "context": 32,
        "batch": 2,
        "vocab": 512,
        "precision": "fp32",
        "loop_updates": 3,
    }
    measured = {
        "gpt2": ["jaxloop", "torch eager", "torch.compile"],
        "deterministic": ["on", "off"],
        "attention": ["xla"],
    }
    for section, names in measured.items():
        for name in names:
            entry = record[section][name]
            assert entry["status"] == "ok", (section, name, entry)
            assert MEASURED <= set(entry), (section, name)
            # tokens/s is the batch's tokens over the seconds per update (float64 division, rounding only)
            assert entry["tokens_per_s"] == pytest.approx(2 * 32 / entry["s_per_update"], rel=1e-12)
            assert entry["mfu"] is None and entry["peak_mem_bytes"] is None, "no table peak or device memory on a CPU"
    assert record["attention"]["cudnn"]["status"] == "unavailable"
    assert record["deterministic"]["on"] == {**record["gpt2"]["jaxloop"], "from": "gpt2.jaxloop"}
    loop = record["loop"]["loop"]
    assert loop["status"] == "ok" and loop["updates"] == 3
    assert loop["tokens_per_s"] == pytest.approx(loop["updates_per_s"] * 2 * 32, rel=1e-12)
    assert record["loop"]["loop_over_update"] == pytest.approx(
        loop["tokens_per_s"] / record["gpt2"]["jaxloop"]["tokens_per_s"], rel=1e-12
    )
    assert record["wall_s"] > 0
    # the loop's median update split by part (benchmarks/breakdown.py), each part printed to 0.001 ms
    assert set(record["breakdown"]["variants_s"]) == {"forward", "fwd_bwd", "update"}
    parts = record["breakdown"]["parts_ms"]
    assert tuple(parts) == PARTS and min(parts.values()) >= 0
    assert abs(sum(parts.values()) - loop["median_step_ms"]) <= (len(PARTS) + 1) * 0.0005 + 1e-9


def test_a_part_that_starts_with_under_a_minute_of_the_budget_left_is_skipped_and_recorded(tmp_path):
    out = tmp_path / "gpu.json"
    record = gpu.run(tiny=True, out=out, budget_s=30.0)
    assert json.loads(out.read_text()) == json.loads(json.dumps(record)), "the record returned is the one written"
    entries = [
        record["gpt2"]["part"],
        record["loop"]["loop"],
        record["attention"]["part"],
        record["deterministic"]["off"],
        record["deterministic"]["on"],
        record["breakdown"]["variants_s"],
    ]
    assert [e["status"] for e in entries] == ["skipped"] * 6
    assert "parts_ms" not in record["breakdown"]
    assert "loop_over_update" not in record["loop"]


def test_the_record_is_named_after_the_device():
    assert gpu.record_path("NVIDIA H100 80GB HBM3", tiny=False) == (
        REPO / "benchmarks" / "records" / "gpu-nvidia-h100-80gb-hbm3.json"
    )
