"""--log.breakdown: the report of a GPT run splits the loop's median update into data wait, forward, backward,
optimizer and host with the rest (jaxloop.observe.update_breakdown), measured once at the end of the run.
Consistency of the figures, never their size: the machine's speed is not under test."""

from __future__ import annotations

import contextlib
import io
import re
import statistics
from dataclasses import replace

import numpy as np
import pytest

from jaxloop.config.cli import parse_config
from jaxloop.loop.runner import run
from jaxloop.observe.run_report import load_run, render
from jaxloop.observe.update_breakdown import PARTS
from jaxloop.rundir.records import read_records

TINY_GPT = [
    "--preset",
    "shakespeare",
    "--steps",
    "12",
    "--batch_size",
    "8",
    "--eval_every",
    "0",
    "--log_every",
    "3",
    "--optim.warmup_steps",
    "2",
    "--checkpoint.every",
    "0",
    "--log.no_tensorboard",
    "--model.context",
    "16",
    "--model.d_model",
    "32",
    "--model.n_layers",
    "1",
    "--model.n_heads",
    "2",
]


@pytest.fixture(scope="module")
def breakdown_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("breakdown")
    rng = np.random.default_rng(0)
    words = "to be or not that is the question whether tis nobler in mind suffer slings arrows".split()
    (base / "tiny.txt").write_text("\n".join(" ".join(rng.choice(words, size=9)) for _ in range(200)) + "\n")
    run_dir = base / "run"
    cfg = parse_config(
        [*TINY_GPT, "--data.path", str(base / "tiny.txt"), "--run_dir", str(run_dir), "--log.breakdown", "--log.report"]
    )
    with contextlib.redirect_stderr(io.StringIO()):
        summary = run(cfg)
    return run_dir, summary


def _table(md: str) -> dict[str, float]:
    section = md.split("## Where an update's time goes", 1)[1].split("\n## ", 1)[0]
    return {m[1]: float(m[2]) for m in re.finditer(r"^\| (\w+) \| ([0-9.]+) \|", section, re.M)}


def test_the_report_holds_every_part_and_the_loops_update(breakdown_run):
    run_dir, _ = breakdown_run
    rows = _table((run_dir / "report.md").read_text())
    assert tuple(rows) == (*PARTS, "update")
    assert min(rows.values()) >= 0.0


def test_the_parts_sum_to_the_loops_median_update(breakdown_run):
    run_dir, _ = breakdown_run
    rows = _table((run_dir / "report.md").read_text())
    step_ms = statistics.median(r["step_ms"] for r in read_records(run_dir) if r["kind"] == "train")
    assert rows["update"] == pytest.approx(step_ms, abs=0.0005)  # printed to 0.001 ms
    # five parts each rounded to 0.001 ms (0.0005 off at most) against the whole rounded as well
    assert sum(rows[p] for p in PARTS) == pytest.approx(rows["update"], abs=6 * 0.0005 + 1e-9)


def test_the_per_call_column_is_the_updates_of_one_device_call(breakdown_run):
    run_dir, summary = breakdown_run
    # 12 updates, no evaluation, no save before the end: one device call runs all 12 (host_loop.updates_per_call;
    # the logged records come from the call's stacked metrics)
    assert summary["update_breakdown"]["updates_per_call"] == 12
    section = (run_dir / "report.md").read_text().split("## Where an update's time goes", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| \w+ \| ([0-9.]+) \| ([0-9.]+) \|", section, re.M)
    assert len(rows) == len(PARTS) + 1
    for per_update, per_call in rows:  # both printed to 0.001 ms: 12 x 0.0005 ms off at most, and 0.0005 more
        assert float(per_call) == pytest.approx(12 * float(per_update), abs=13 * 0.0005 + 1e-9)


def test_the_variants_and_their_cost_are_in_the_summary(breakdown_run):
    _, summary = breakdown_run
    measured = summary["update_breakdown"]
    assert set(measured["variants_s"]) == {"forward", "fwd_bwd", "update"}
    assert all(t > 0 for t in measured["variants_s"].values())
    # what measuring cost is counted in the run's wall-time breakdown, compiling included
    assert summary["timings_s"]["breakdown"] >= measured["cost_s"] >= measured["compile_s"] > 0


def test_without_the_flag_the_report_says_how_to_measure(breakdown_run):
    run = load_run(breakdown_run[0])
    summary = {k: v for k, v in run.summary.items() if k != "update_breakdown"}
    md = render(replace(run, summary=summary), plots={})
    assert "Not measured: pass --log.breakdown" in md
    assert not _table(md)
