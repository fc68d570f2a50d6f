"""benchmarks/breakdown.py: the loop's time per update split into data wait, forward, backward, optimizer and host
with the rest. Its arithmetic (the parts are never negative and sum to the whole), not its timings."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.breakdown import PARTS, rounded, split_update

seconds = st.floats(min_value=0.0, max_value=10.0, allow_nan=False)


@given(seconds, seconds, seconds, seconds, seconds)
def test_the_parts_are_never_negative_and_sum_to_the_loops_time(loop, wait, fwd, fwd_bwd, update):
    parts = split_update(loop, wait, fwd, fwd_bwd, update)
    assert tuple(parts) == PARTS
    assert min(parts.values()) >= 0.0
    # float64 sums of five terms: a few ulps of the whole
    assert math.fsum(parts.values()) == pytest.approx(loop, rel=1e-12, abs=1e-15)


@given(seconds, seconds, seconds, seconds, seconds)
def test_the_printed_parts_sum_to_the_whole_within_their_rounding(loop, wait, fwd, fwd_bwd, update):
    shown = rounded(split_update(loop, wait, fwd, fwd_bwd, update))
    # each part rounded to 0.001 ms is off by at most 0.0005 ms, the whole by as much again
    assert abs(sum(shown.values()) - round(loop * 1e3, 3)) <= (len(PARTS) + 1) * 0.0005 + 1e-9


def test_the_variants_differences_are_backward_and_optimizer():
    parts = split_update(10e-3, 1e-3, 2e-3, 6e-3, 7e-3)
    assert rounded(parts) == {"data_wait": 1.0, "forward": 2.0, "backward": 4.0, "optimizer": 1.0, "host_and_rest": 2.0}


def test_device_parts_timed_slower_alone_are_scaled_into_the_loops_time():
    # 8 ms of variants in a loop of 5 ms with 1 ms of data wait: the device parts are halved, nothing is left over
    parts = split_update(5e-3, 1e-3, 2e-3, 6e-3, 8e-3)
    assert rounded(parts) == {"data_wait": 1.0, "forward": 1.0, "backward": 2.0, "optimizer": 1.0, "host_and_rest": 0.0}


def test_the_three_variants_compile_and_run_on_the_gpt(monkeypatch):
    from benchmarks.breakdown import variant_times
    from benchmarks.step import make_cfg
    from jaxloop.data.sources import load_splits

    monkeypatch.setenv("JAXLOOP_BENCH_TEXT", str(Path(__file__).parent / "data" / "tinyshakespeare_60k.txt"))
    cfg = make_cfg("gpt64")
    times = variant_times(cfg, load_splits(cfg), calls=1)
    assert set(times) == {"forward", "fwd_bwd", "update"}
    assert all(math.isfinite(t) and t > 0 for t in times.values())
