"""The run report says what the loop's rates count: its wall time per logged interval, compiling and
evaluation left out, the time checkpoint saves block the loop left in (jaxloop.loop.host_loop.Throughput)."""

from __future__ import annotations

from jaxloop.loop.actions import Throughput
from jaxloop.observe.run_report import RATE_BASIS, Run, plot_throughput


def test_step_ms_counts_a_saves_blocking_and_not_an_evaluation():
    # an interval of 10 updates over 3.5 s of wall time: 2.0 s evaluating (paused), 0.5 s blocked by a save
    rate = Throughput(step=0, time=100.0)
    rate.pause(2.0)
    record = rate.interval(10, now=103.5, data_wait=0.0)
    # 1.0 s of updates + 0.5 s of the save's blocking over 10 updates; the evaluation's 2.0 s left out
    assert record["step_ms"] == 150.0 and record["updates_per_s"] == 10 / 1.5


def test_throughput_plot_title_says_saves_blocking_is_included(tmp_path):
    train = [
        {"kind": "train", "step": s, "samples_per_s": 1000.0 + s, "step_ms": 2.0, "data_wait_ms": 0.1}
        for s in (10, 20, 30)
    ]
    run = Run(run_dir=tmp_path, config={"batch_size": 64}, metadata={}, summary=None, resumes=[], train=train)
    fig = plot_throughput(run, tmp_path / "throughput.png")
    title = fig.axes[0].get_title()
    assert RATE_BASIS in title and "saving excluded" not in title
    assert "evaluation excluded" in RATE_BASIS and "saves block the loop included" in RATE_BASIS
    assert (tmp_path / "throughput.png").stat().st_size > 0
