"""Observability: progress, metrics.jsonl / TensorBoard writers, memory, time breakdown, validation with
EMA and early stopping, the run report, profiling, run metadata and sampling.

Three short runs serve several tests (module-scoped, in-process through jaxloop.train.run with
configs parsed from CLI flags): a debug run with EMA, profiling, report and a price; a debug run that
stops early; and a tiny character-level (shakespeare preset) run on a small text file.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from jaxloop import sample as sample_mod
from jaxloop.config.cli import parse_config
from jaxloop.config.run import preset
from jaxloop.data.sources import encode, read_vocab
from jaxloop.loop.runner import is_compile_line, run
from jaxloop.model.builtin import MLP, init_params, make_model
from jaxloop.observe.logger import RunLogger
from jaxloop.report import main as report_main
from jaxloop.rundir.records import BestTracker, read_records
from jaxloop.runtime.compilation import compilation_cache
from jaxloop.update.optimizer import skip_nonfinite_windows
from jaxloop.update.state import TrainState
from jaxloop.update.step import cross_entropy_loss, train_step

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def _train(argv: list[str]) -> tuple[dict, str]:
    """jaxloop.train.run on a config parsed from flags; returns (summary, what it printed to stderr)."""
    cfg = parse_config(argv)
    err = io.StringIO()  # not a terminal: log.progress auto prints plain lines
    with contextlib.redirect_stderr(err):
        summary = run(cfg)
    return summary, err.getvalue()


def _cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([PY, "-m", *args], capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout)


DEBUG = [
    "--preset",
    "debug",
    "--optim.ema_decay",
    "0.9",
    "--log.profile_start",
    "3",
    "--log.profile_steps",
    "2",
    "--log.report",
    "--log.price_per_hour",
    "2.5",
]


@pytest.fixture(scope="module")
def debug_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("obs") / "debug"
    summary, err = _train(DEBUG + ["--run_dir", str(run_dir)])
    return run_dir, summary, err


EARLY = [
    "--preset",
    "debug",
    "--steps",
    "60",
    "--eval_every",
    "2",
    "--log_every",
    "2",
    "--patience",
    "2",
    "--optim.peak_lr",
    "0.05",
    "--checkpoint.every",
    "0",
    "--log.no_tensorboard",
    "--log.report",
]


@pytest.fixture(scope="module")
def early_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("obs") / "early"
    summary, err = _train(EARLY + ["--run_dir", str(run_dir)])
    return run_dir, summary, err


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("obs")
    rng = np.random.default_rng(0)
    words = "to be or not that is the question whether tis nobler in mind suffer slings arrows".split()
    text = "\n".join(" ".join(rng.choice(words, size=rng.integers(4, 10))).capitalize() + "." for _ in range(200))
    path = base / "tiny.txt"
    path.write_text(text + "\n")
    run_dir = base / "text"
    summary, err = _train(
        [
            "--preset",
            "shakespeare",
            "--data.path",
            str(path),
            "--run_dir",
            str(run_dir),
            "--steps",
            "20",
            "--batch_size",
            "16",
            "--eval_every",
            "10",
            "--log_every",
            "5",
            "--optim.warmup_steps",
            "4",
            "--checkpoint.every",
            "10",
            "--data.eval_batch_size",
            "64",
            "--model.context",
            "16",
            "--model.d_model",
            "32",
            "--model.n_layers",
            "1",
            "--model.n_heads",
            "2",
        ]
    )
    return run_dir, summary, err


@pytest.fixture(scope="module", autouse=True)
def compile_cache(tmp_path_factory):
    """One persistent compile cache for the module: sample() compiles its call ahead of time on every call, and a
    call of a program compiled before (the same model and length) loads it from here instead."""
    with compilation_cache(tmp_path_factory.mktemp("xla")):
        yield


def _md_number(text: str, pattern: str) -> float:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in report"
    return float(m.group(1))


# ----------------------------------------------------------------------------- report


def test_report_holds_its_pngs_and_numbers(debug_run):
    run_dir, summary, _ = debug_run
    md = (run_dir / "report.md").read_text()
    for png in ("loss.png", "lr.png", "throughput.png"):
        data = (run_dir / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png
        assert f"]({png})" in md
    assert "**completed**: 20 of 20 updates" in md
    assert f"| val_loss | {summary['final']['val_loss']:.4f} |" in md
    assert f"| ema_val_acc | {summary['final']['ema_val_acc']:.4f} |" in md
    assert f"updates/s: {summary['updates_per_s']:.2f}" in md
    assert f"samples/s: {summary['updates_per_s'] * 32:.1f}" in md
    assert "peak memory:" in md and f"({summary['peak_mem_bytes']} bytes;" in md
    hours = summary["wall_time_s"] / 3600
    assert f"Cost: ${hours * 2.5:.4f} = {hours:.4f} h x $2.5/h" in md
    assert "log.price_per_hour" in md


def test_report_time_breakdown_sums_to_wall_time(debug_run):
    run_dir, summary, _ = debug_run
    timings = summary["timings_s"]
    assert {"setup", "compile", "data_wait", "eval", "checkpoint", "log", "profile"} <= set(timings)
    md = (run_dir / "report.md").read_text()
    rows = dict(re.findall(r"^\| ([a-z_/]+) \| (-?[0-9.]+) \| [0-9.-]+% \|", md, flags=re.M))
    assert set(timings) | {"compute/other", "wall"} == set(rows)
    assert float(rows["wall"]) == pytest.approx(summary["wall_time_s"], abs=1e-3)
    other = summary["wall_time_s"] - sum(timings.values())
    assert float(rows["compute/other"]) == pytest.approx(other, abs=2e-3)
    assert 0 <= other < summary["wall_time_s"]


def test_report_cli_covers_a_killed_run(debug_run, tmp_path):
    run_dir, _, _ = debug_run
    killed = tmp_path / "killed"
    shutil.copytree(run_dir, killed, ignore=shutil.ignore_patterns("checkpoints", "profile", "tb", "*.png", "*.md"))
    (killed / "summary.json").unlink()
    lines = (killed / "metrics.jsonl").read_text().splitlines()[:12]  # up to update 11, the eval at 10 included
    (killed / "metrics.jsonl").write_text("\n".join(lines) + '\n{"kind": "train", "step": 12, "lo')
    proc = _cli("jaxloop.report", str(killed))
    assert proc.returncode == 0, proc.stderr
    md = (killed / "report.md").read_text()
    assert "**unfinished**" in md and "last record is at update 11 of 20" in md
    assert "best by checkpoint.best_metric (val_loss, min)" in md.lower()
    assert "estimated" in md  # wall time from metadata's start to the last write of metrics.jsonl
    for png in ("loss.png", "lr.png", "throughput.png"):
        assert (killed / png).stat().st_size > 5000


def test_report_rejects_a_directory_without_a_run(tmp_path, capsys):
    assert report_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a jaxloop run directory" in err
    assert not (tmp_path / "report.md").exists()


def test_summary_and_report_track_the_best_validation_metric(debug_run):
    run_dir, summary, _ = debug_run
    evals = [r for r in read_records(run_dir) if r["kind"] == "eval"]
    best = min(evals, key=lambda r: r["val_loss"])
    assert summary["best"] == {
        "metric": "val_loss",
        "value": best["val_loss"],
        "step": best["step"],
        "checkpoint_step": best["step"],
    }
    md = (run_dir / "report.md").read_text()
    assert f"(val_loss, min): **{best['val_loss']:.4f}** at update {best['step']}" in md


# ----------------------------------------------------------------------------- writers and progress


def test_tensorboard_events_read_back_with_expected_tags(debug_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _, _ = debug_run
    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    expected = {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "eval/val_loss",
        "eval/val_acc",
        "eval/ema_val_loss",
        "eval/ema_val_acc",
        "throughput/samples_per_s",
        "throughput/updates_per_s",
        "time/data_wait_ms",
        "time/step_ms",
        "memory/mem_bytes",
    }
    assert expected <= tags, expected - tags
    records = read_records(run_dir)
    train = [r for r in records if r["kind"] == "train"]
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [r["step"] for r in train]
    np.testing.assert_allclose([e.value for e in loss], [r["loss"] for r in train], rtol=1e-6)
    val = acc.Scalars("eval/val_loss")
    assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in val] == [
        (r["step"], r["val_loss"]) for r in records if r["kind"] == "eval"
    ]


def test_tensorboard_logs_tokens_per_s_for_text(text_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _, _ = text_run
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    tokens = acc.Scalars("throughput/tokens_per_s")
    samples = acc.Scalars("throughput/samples_per_s")
    assert [e.step for e in tokens] == [5, 10, 15, 20]
    for t, s in zip(tokens, samples):
        assert t.value == pytest.approx(s.value * 16, rel=1e-5)


def test_records_are_buffered_until_flush_and_a_records_own_mem_bytes_is_kept(tmp_path):
    # The loop reads memory once per call and flushes once per call: one write, not one per record.
    cfg = replace(preset("debug"), log=replace(preset("debug").log, progress="off", tensorboard=False))
    logger = RunLogger(tmp_path, cfg.log, log_every=cfg.log_every, start_step=0, total_steps=6)
    logger.train({"step": 1, "loss": 1.0, "mem_bytes": 123})
    logger.train({"step": 2, "loss": 2.0})
    assert read_records(tmp_path) == [], "buffered"
    logger.flush()
    first, second = read_records(tmp_path)
    assert first["mem_bytes"] == 123, "the record's own reading"
    assert second["mem_bytes"] > 0, "read by the logger when the record has none"
    logger.close()


def test_resume_truncates_metrics_and_purges_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = replace(preset("debug"), log=replace(preset("debug").log, progress="off"))
    logger = RunLogger(tmp_path, cfg.log, log_every=cfg.log_every, start_step=0, total_steps=6)
    for s in range(1, 7):
        logger.train({"step": s, "loss": 10.0 + s, "lr": 0.1})
    logger.close()
    # resumed from the checkpoint at 3
    logger = RunLogger(tmp_path, cfg.log, log_every=cfg.log_every, start_step=3, total_steps=6)
    for s in range(4, 7):
        logger.train({"step": s, "loss": 20.0 + s, "lr": 0.1})
    logger.close()
    assert [(r["step"], r["loss"]) for r in read_records(tmp_path)] == [
        (1, 11.0),
        (2, 12.0),
        (3, 13.0),
        (4, 24.0),
        (5, 25.0),
        (6, 26.0),
    ]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [
        (1, 11.0),
        (2, 12.0),
        (3, 13.0),
        (4, 24.0),
        (5, 25.0),
        (6, 26.0),
    ]


def test_memory_is_recorded_and_its_peak_summarised(debug_run):
    run_dir, summary, _ = debug_run
    mems = [r["mem_bytes"] for r in read_records(run_dir) if r["kind"] == "train"]
    assert len(mems) == 20 and all(isinstance(m, int) and m > 0 for m in mems)
    # the summary samples the peak once more at the end: the final evaluation after the last record counts too
    assert summary["peak_mem_bytes"] >= max(mems)


def test_memory_is_the_device_peak_when_the_device_reports_one(monkeypatch):
    import jaxloop.observe.runinfo as runinfo

    stats = {"bytes_in_use": 5 * 2**20, "peak_bytes_in_use": 7 * 2**20, "bytes_limit": 80 * 2**30}
    monkeypatch.setattr(runinfo, "_device_memory_stats", lambda: stats)  # what a GPU's memory_stats() holds
    assert runinfo.memory_bytes() == 7 * 2**20
    assert runinfo.memory_source().startswith("accelerator peak_bytes_in_use")
    monkeypatch.setattr(runinfo, "_device_memory_stats", lambda: None)  # the CPU backend reports none
    assert runinfo.memory_bytes() > 10 * 2**20  # this process's resident set
    assert runinfo.memory_source().startswith("process resident set size")


def test_plain_progress_lines_when_not_a_terminal(debug_run):
    _, _, err = debug_run
    assert "\r" not in err  # no bar redraws in a CI log
    lines = err.splitlines()
    updates = [ln for ln in lines if ln.startswith("update ")]
    # one line per device call (calls end on the evaluation and checkpoint cadence: 10 and 20), not a
    # burst of one line per record of the call
    assert [int(re.match(r"update (\d+)/20 ", ln).group(1)) for ln in updates] == [10, 20]
    assert re.fullmatch(
        r"update 20/20 \(100%\) loss \d+\.\d{4} lr \S+ [\d.]+ updates/s ETA 0:00:00 mem [\d.]+ [KMG]iB", updates[-1]
    )
    assert sum(ln.startswith("eval at update ") for ln in lines) == 2


def _logger(tmp_path, progress: str, stream, total: int = 10):
    cfg = replace(preset("debug"), log=replace(preset("debug").log, progress=progress, tensorboard=False))
    return RunLogger(tmp_path, cfg.log, log_every=cfg.log_every, start_step=0, total_steps=total, stream=stream)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_progress_is_a_bar_on_a_terminal_and_messages_keep_their_own_line(tmp_path):
    out = _Terminal()
    logger = _logger(tmp_path, "auto", out)
    for s in range(1, 6):
        logger.train({"step": s, "loss": 1.0 / s, "lr": 1e-3, "updates_per_s": 50.0})
    logger.message("early stopping at update 5")
    logger.eval({"step": 5, "val_loss": 0.5})
    logger.close()
    text = out.getvalue()
    assert "\r" in text and "update 5/10" in text and "loss 0.2000" in text and "lr 1.00e-03" in text
    assert "updates/s" in text and "<" in text  # rate and elapsed<remaining (the ETA)
    lines = [seg for ln in text.split("\n") for seg in ln.split("\r")]
    assert "early stopping at update 5" in lines  # tqdm.write: a whole line, not glued to the bar
    assert "eval at update 5: val_loss 0.5000" in lines


def test_progress_off_prints_no_progress(tmp_path):
    out = io.StringIO()
    logger = _logger(tmp_path, "off", out)
    logger.train({"step": 1, "loss": 1.0, "lr": 1e-3})
    logger.eval({"step": 1, "val_loss": 0.5})
    logger.close()
    assert out.getvalue() == ""
    assert len(read_records(tmp_path)) == 2


def test_plain_progress_thins_long_runs(tmp_path):
    out = io.StringIO()
    logger = _logger(tmp_path, "plain", out, total=5000)
    for s in range(1, 5001):
        logger.train({"step": s, "loss": 1.0, "lr": 1e-3, "updates_per_s": 1e6})
        logger.flush()  # the loop flushes once per device call: here, calls of one update
    logger.close()
    steps = [int(m) for m in re.findall(r"^update (\d+)/5000", out.getvalue(), flags=re.M)]
    assert 45 <= len(steps) <= 55 and steps[0] == 1 and steps[-1] == 5000
    assert len(read_records(tmp_path)) == 5000  # metrics.jsonl keeps every record


def test_plain_progress_shows_the_rate_since_the_previous_line_and_the_records_keep_their_own(tmp_path):
    # Updates run in calls of 10: the first record of a call carries the call's share, the others ~0 time
    # (jumping rates, as the issue measured on the digits run: 210 to 2059 updates/s). A line every 10
    # updates shows 10 updates over the 10 records' summed time. Mutant (the record's own rate): fails.
    out = io.StringIO()
    logger = _logger(tmp_path, "plain", out, total=500)
    for s in range(1, 501):
        step_ms = 9.0 if s % 10 == 1 else 0.1  # 9.9 ms per 10 updates: 1010.1 updates/s on average
        logger.train({"step": s, "loss": 1.0, "lr": 1e-3, "updates_per_s": 1e3 / step_ms, "step_ms": step_ms})
        logger.flush()
    logger.close()
    rates = [float(m) for m in re.findall(r"([\d.]+) updates/s", out.getvalue())]
    # lines at updates 1, 10, 20, ...: the first shows record 1, the second updates 2-10 (all 0.1 ms)
    assert rates[:2] == [pytest.approx(1e3 / 9.0, abs=0.05), pytest.approx(1e4)]
    assert all(r == pytest.approx(1010.1, rel=1e-3) for r in rates[2:]), rates[:5]
    assert {r["updates_per_s"] for r in read_records(tmp_path)} == {1e3 / 9.0, 1e3 / 0.1}, "the JSONL keeps each"


def test_plain_progress_is_one_line_per_call_with_an_eta_timed_between_calls(tmp_path, monkeypatch):
    # Calls of 10 updates, 1 s apart on the wall clock: their 10 records arrive in a burst. One line per
    # call, and the ETA from the rate between calls (10 updates/s: 80 updates to go at update 20 = 8 s).
    # Mutant (the ETA timed from record to record, as before): "ETA 0:00:00". Mutant (a line per record): 20 lines.
    import jaxloop.observe.logger as logger_module

    clock = [0.0]
    monkeypatch.setattr(logger_module.time, "perf_counter", lambda: clock[0])
    out = io.StringIO()
    logger = _logger(tmp_path, "plain", out, total=100)
    for call in range(2):
        clock[0] = float(call)
        for s in range(10 * call + 1, 10 * call + 11):
            logger.train({"step": s, "loss": 1.0, "lr": 1e-3, "updates_per_s": 1000.0, "step_ms": 1.0})
        logger.flush()
    logger.close()
    lines = out.getvalue().splitlines()
    assert [ln.split(" (")[0] for ln in lines] == ["update 10/100", "update 20/100"]
    assert "updates/s ETA 0:00:08" in lines[1]


def test_a_resumed_run_says_where_it_resumed_from(debug_run, tmp_path):
    # the debug run stopped after update 10's checkpoint (the one at 20 and its summary gone): the same config
    # resumes it, so the run's calls are the debug run's, compiled already
    run_dir = tmp_path / "resumed"
    shutil.copytree(debug_run[0], run_dir, ignore=shutil.ignore_patterns("20", "summary.json"))
    _, err = _train(DEBUG + ["--run_dir", str(run_dir)])
    # the first line past the announcements of the restore (jaxloop.loop.runner.is_compile_line)
    first = next(line for line in err.splitlines() if not is_compile_line(line))
    assert first == (
        f"resuming from update 10 (checkpoint {run_dir.absolute()}/checkpoints/10), data position 10 "
        "(epoch 0, micro-batch 10 of 44)"
    ), first


# ----------------------------------------------------------------------------- validation, EMA, early stopping


def test_best_tracker_stops_after_patience_evaluations_without_improvement():
    tracker = BestTracker("min", patience=2)
    script = [(10, 1.0), (20, 0.8), (30, 0.9), (40, 0.7), (50, 0.7), (60, 0.75), (70, 0.6)]
    stops = [tracker.update(step, v) for step, v in script[:6]]
    assert stops == [False, False, False, False, False, True]  # 50 ties (not better), 60 worse: stop at 60
    assert tracker.as_dict() == {"best": 0.7, "best_step": 40, "since_best": 2}


def test_best_tracker_max_mode_and_no_patience():
    tracker = BestTracker("max", patience=1)
    assert [tracker.update(s, v) for s, v in [(1, 0.5), (2, 0.6), (3, 0.55)]] == [False, False, True]
    assert (tracker.best, tracker.best_step) == (0.6, 2)
    never = BestTracker("min", patience=0)
    assert not any(never.update(s, float(s)) for s in range(1, 50))  # only worse values, but patience 0


def test_early_stopping_stops_at_the_update_predicted_from_its_evaluations(early_run):
    run_dir, summary, err = early_run
    evals = [r for r in read_records(run_dir) if r["kind"] == "eval"]
    best, since, predicted = math.inf, 0, None
    for r in evals:  # patience 2 on val_loss (min), replayed from the run's own records
        if r["val_loss"] < best:
            best, best_step, since = r["val_loss"], r["step"], 0
        else:
            since += 1
        if since >= 2:
            predicted = r["step"]
            break
    assert predicted is not None and predicted < 60, "the scripted run must stop early"
    assert evals[-1]["step"] == predicted and summary["final_step"] == predicted
    assert summary["stop_reason"] == "early_stopping"
    assert summary["best"]["value"] == best and summary["best"]["step"] == best_step
    assert f"early stopping at update {predicted}: no better val_loss in 2 evaluations" in err
    assert f"**stopped early** at update {predicted} of 60" in (run_dir / "report.md").read_text()


def _tiny_state(ema_decay: float, accum: int = 1):
    model = MLP(hidden=(4,), classes=3)
    x = np.zeros((1, 5), np.float32)
    params = init_params(model, jax.random.PRNGKey(0), x)
    tx = skip_nonfinite_windows(optax.sgd(0.5), accum)  # K micro-batches per update
    return TrainState.create(
        apply_fn=model.apply,
        params=params,
        tx=tx,
        rng=jax.random.PRNGKey(1),
        ema_decay=ema_decay,
        loss=cross_entropy_loss,
    )


def _batch(i: int) -> dict:
    rng = np.random.default_rng(i)
    return {"x": rng.normal(size=(8, 5)).astype(np.float32), "y": rng.integers(0, 3, size=8).astype(np.int32)}


def test_ema_equals_hand_computed_average():
    d = 0.8
    state = _tiny_state(d)
    step = jax.jit(train_step)  # one compile, not one per operation run eagerly
    ema = jax.tree.map(np.asarray, jax.device_get(state.params))
    for i in range(4):
        state, _ = step(state, _batch(i))
        params = jax.device_get(state.params)
        ema = jax.tree.map(lambda e, p: d * e + (1 - d) * np.asarray(p, np.float64), ema, params)
        jax.tree.map(
            lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6),
            jax.device_get(state.ema_params),
            ema,
        )
    # and the EMA really lags the params
    ema_kernel, kernel = jax.device_get((state.ema_params["out"]["kernel"], state.params["out"]["kernel"]))
    assert not np.allclose(ema_kernel, kernel)


def test_ema_updates_once_per_update_with_accumulation():
    d = 0.5
    state = _tiny_state(d, accum=2)
    step = jax.jit(train_step)
    ema = jax.tree.map(np.asarray, jax.device_get(state.params))
    for i in range(4):
        state, _ = step(state, _batch(i))
        if i % 2 == 1:  # the second micro-batch of each window applies the update
            ema = jax.tree.map(
                lambda e, p: d * e + (1 - d) * np.asarray(p, np.float64), ema, jax.device_get(state.params)
            )
        jax.tree.map(
            lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6),
            jax.device_get(state.ema_params),
            ema,
        )
    assert int(state.step) == 2


def test_validation_evaluates_ema_variants(debug_run):
    run_dir, _, _ = debug_run
    evals = [r for r in read_records(run_dir) if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [10, 20]
    for r in evals:
        assert {"val_loss", "val_acc", "ema_val_loss", "ema_val_acc"} <= set(r)
        assert r["ema_val_loss"] != r["val_loss"]


# ----------------------------------------------------------------------------- profiling and metadata


def test_profiler_writes_a_trace(debug_run):
    run_dir, _, _ = debug_run
    profile = run_dir / "profile"
    assert list(profile.glob("plugins/profile/*/*.xplane.pb"))  # TensorBoard profile plugin
    perfetto = list(profile.glob("plugins/profile/*/perfetto_trace.json.gz"))  # ui.perfetto.dev
    assert perfetto and perfetto[0].stat().st_size > 0


def test_metadata_holds_commit_config_packages_devices_cpu_and_host(debug_run):
    run_dir, _, _ = debug_run
    md = json.loads((run_dir / "metadata.json").read_text())
    for key in (
        "git_commit",
        "git_dirty",
        "config",
        "packages",
        "python",
        "devices",
        "device_kind",
        "backend",
        "process_count",
        "memory_source",
        "cpu",
        "cpu_count",
        "host",
        "platform",
        "argv",
        "xla_flags",
        "started",
        "started_unix",
    ):
        assert key in md, key
    assert md["config"] == json.loads((run_dir / "config.json").read_text())
    assert md["packages"]["jax"] == jax.__version__ and md["packages"]["flax"]
    assert md["devices"] and md["backend"] == jax.default_backend()
    assert md["cpu"] and md["host"]
    in_repo = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO)
    if in_repo.returncode == 0:
        assert md["git_commit"] == in_repo.stdout.strip()


# ----------------------------------------------------------------------------- sampling


def test_sample_returns_text_of_the_requested_length(text_run):
    # 12 tokens, as the greedy test's: its sampling call loads this one's program from the module's compile cache
    run_dir, _, _ = text_run
    text = sample_mod.sample(run_dir, "To be", length=12, temperature=0.8, which="best", seed=3)
    assert len(text) == 12 and set(text) <= set(read_vocab(str(run_dir)))


def test_sample_matches_a_step_by_step_greedy_loop(text_run):
    run_dir, _, _ = text_run
    loaded = sample_mod.load_params(run_dir, "latest")
    assert loaded.step == 20
    cfg = loaded.cfg
    vocab = read_vocab(str(run_dir))
    # longer than the context (16). This 20-update model repeats one character whatever its window, so the sliding
    # itself is held by tests/test_sample.py's greedy test (a model whose argmax follows the window)
    prompt = "To be or not that is the"
    got = sample_mod.sample(run_dir, prompt, length=12, temperature=0.0, loaded=loaded)
    model = make_model(cfg.model, len(vocab), cfg.precision)
    apply = jax.jit(lambda params, x: model.apply({"params": params}, x, train=False))
    ids = list(encode(prompt, vocab))
    for _ in range(12):
        window = np.asarray(ids[-cfg.model.context :], np.int32)[None]
        logits = apply(loaded.params, window)
        ids.append(int(np.argmax(logits[0, -1])))
    assert got == "".join(vocab[i] for i in ids[len(prompt) :])


def test_sample_cli_prints_prompt_and_generated_text(text_run):
    run_dir, _, _ = text_run
    proc = _cli(
        "jaxloop.sample",
        str(run_dir),
        "--prompt",
        "Whether",
        "--length",
        "30",
        "--checkpoint",
        "latest",
        "--temperature",
        "0.7",
        "--seed",
        "1",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Whether") and len(proc.stdout) == len("Whether") + 30 + 1
    assert "from the latest checkpoint (update 20)" in proc.stderr


def test_sample_rejects_bad_input_with_one_line_and_status_2(debug_run, text_run, tmp_path, capsys):
    no_ckpt = tmp_path / "no_ckpt"
    shutil.copytree(text_run[0], no_ckpt, ignore=shutil.ignore_patterns("checkpoints", "tb"))
    cases = [
        ([str(debug_run[0]), "--prompt", "a"], "not a language-model run"),
        ([str(tmp_path / "missing")], "not a jaxloop run directory"),
        ([str(no_ckpt), "--prompt", "To"], "holds no checkpoint"),
        ([str(text_run[0]), "--prompt", "To", "--checkpoint", "middle"], "one of best, latest"),
        ([str(text_run[0]), "--prompt", "Zz"], "outside the vocabulary"),
        ([str(text_run[0]), "--prompt", "To", "--length", "0"], "--length=0"),
        ([str(text_run[0]), "--prompt", "To", "--temperature", "-1"], "--temperature=-1"),
    ]
    for argv, message in cases:
        try:
            status = sample_mod.main(argv)
        except SystemExit as e:
            status = e.code
        captured = capsys.readouterr()
        assert status == 2, argv
        assert captured.err.count("\n") == 1 and message in captured.err, (argv, captured.err)
        assert captured.out == ""


def test_the_report_prints_rates_in_fixed_point_however_large(text_run):
    # A fast machine's tokens/s passes 1e5, where the report's general number format turns to 1e+05;
    # here every rate does (batch 16, context 16)
    from jaxloop.observe.run_report import load_run, render

    run = load_run(text_run[0])
    md = render(replace(run, summary=dict(run.summary, updates_per_s=200000.0)), plots={})
    assert "- updates/s: 200000.00 " in md and "- samples/s: 3200000.0" in md and "- tokens/s: 51200000.0" in md


def test_a_run_without_log_breakdown_spends_nothing_on_it(text_run):
    run_dir, summary, _ = text_run
    # the variants are compiled only with --log.breakdown: a default run's time is the loop's alone
    assert "update_breakdown" not in summary and "breakdown" not in summary["timings_s"]
    assert "Not measured: pass --log.breakdown" in (run_dir / "report.md").read_text()


def test_text_run_report_shows_tokens_per_s(text_run):
    run_dir, summary, _ = text_run
    md = (run_dir / "report.md").read_text()  # the shakespeare preset writes the report at the end
    assert f"tokens/s: {summary['updates_per_s'] * 16 * 16:.1f}" in md
    assert "gpt: context 16, d_model 32, 1 layers, 2 heads" in md
