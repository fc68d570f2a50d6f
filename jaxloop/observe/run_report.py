"""The run report: report.md plus PNG plots, for a finished, early-stopped, resumed or killed run.

    python -m jaxloop.report RUN_DIR      (the command: jaxloop/report.py)

Reads only files of the run directory: metrics.jsonl (the records), config.json, metadata.json, and
summary.json and resumes.jsonl when they exist (a killed run has no summary.json: the report then says
so and works from the records alone). Writes RUN_DIR/report.md, loss.png (train and validation loss,
accuracy), lr.png (the learning rate of every logged update) and throughput.png (samples or tokens
per second, step time and data wait). Imports no jax. Exit status 2 (one line on stderr) when RUN_DIR
is not a run directory.
"""

from __future__ import annotations

import io
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jaxloop.observe.runinfo import format_bytes, format_duration
from jaxloop.observe.update_breakdown import PART_NOTES, rounded, split_update
from jaxloop.rundir.atomic import atomic_write_bytes, atomic_write_text
from jaxloop.rundir.layout import CHECKPOINT_DIR, METRICS_FILE, PROFILE_DIR, TB_DIR, RunLayout
from jaxloop.rundir.records import read_records

PLOTS = {"loss": "loss.png", "lr": "lr.png", "throughput": "throughput.png"}
TIMING_ORDER = ("setup", "compile", "data_wait", "eval", "checkpoint", "log", "profile", "breakdown")
TIMING_NOTES = {
    "setup": "loading data, metadata, initialising and restoring the state: before the loop",
    "compile": "tracing and compiling the train step",
    "data_wait": "the step waiting for the next batch",
    "eval": "validation passes (eval step compilation included)",
    "checkpoint": "blocking part of the saves, and awaiting the last one",
    "log": "fetching metrics, writing records and progress",
    "profile": "starting and writing the jax.profiler trace",
    "breakdown": "--log.breakdown: compiling and timing the update's variants, after the last update",
}


class NotARunError(ValueError):
    """RUN_DIR holds no run (no config.json and no metrics.jsonl)."""


@dataclass
class Run:
    """Everything the report reads from a run directory."""

    run_dir: Path
    config: dict[str, Any]
    metadata: dict[str, Any]
    summary: dict[str, Any] | None
    resumes: list[dict[str, Any]]
    train: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)

    @property
    def last_step(self) -> int:
        steps = [r["step"] for r in self.train + self.evals]
        return max(steps) if steps else 0


def load_run(run_dir: str | Path) -> Run:
    """The run's files; NotARunError when run_dir holds neither config.json nor metrics.jsonl."""
    run_dir = Path(run_dir)
    layout = RunLayout(run_dir)
    if not run_dir.is_dir():
        raise NotARunError(f"{run_dir} is not a directory")
    config = layout.read_json(layout.config)
    if not isinstance(config, dict) and not layout.metrics.exists():
        raise NotARunError(f"{run_dir} is not a jaxloop run directory (no {layout.config.name} or {METRICS_FILE})")
    metadata = layout.read_json(layout.metadata)
    summary = layout.read_json(layout.summary)
    resumes = []
    if layout.resumes.exists():
        for line in layout.resumes.read_text().splitlines():
            try:
                resumes.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    records = read_records(run_dir)
    return Run(
        run_dir=run_dir,
        config=config if isinstance(config, dict) else {},
        metadata=metadata if isinstance(metadata, dict) else {},
        summary=summary if isinstance(summary, dict) else None,
        resumes=resumes,
        train=[r for r in records if r.get("kind") == "train" and "step" in r],
        evals=[r for r in records if r.get("kind") == "eval" and "step" in r],
    )


# ----------------------------------------------------------------------------- numbers


def _cfg(run: Run, path: str, default: Any = None) -> Any:
    node: Any = run.config
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool) or isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5):
            return f"{v:.{digits - 1}e}"
        return f"{v:.{digits}f}"
    return str(v)


def _rate(v: float | None, digits: int) -> str:
    """A rate in fixed point whatever its size (_fmt turns 1e5 and more into 1e+05 at one digit)."""
    return "n/a" if v is None else f"{v:.{digits}f}"


def best_of(run: Run) -> dict[str, Any]:
    """The best validation metric: summary.json's when present, else recomputed from the eval records
    with the run's checkpoint.best_metric / best_mode (the first of equal values wins, as in the loop)."""
    metric = _cfg(run, "checkpoint.best_metric", "val_loss")
    mode = _cfg(run, "checkpoint.best_mode", "min")
    if run.summary and isinstance(run.summary.get("best"), dict) and run.summary["best"].get("value") is not None:
        b = run.summary["best"]
        return {
            "metric": b.get("metric", metric),
            "mode": mode,
            "value": b["value"],
            "step": b.get("step"),
            "checkpoint_step": b.get("checkpoint_step"),
            "source": "summary.json",
        }
    best = None
    for r in run.evals:
        v = r.get(metric)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        if best is None or (v < best[0] if mode == "min" else v > best[0]):
            best = (v, r["step"])
    return {
        "metric": metric,
        "mode": mode,
        "value": best[0] if best else None,
        "step": best[1] if best else None,
        "checkpoint_step": None,
        "source": "metrics.jsonl",
    }


RATE_BASIS = "compiling and evaluation excluded, the time checkpoint saves block the loop included"
"""What the loop's rates and step_ms count (jaxloop.loop.host_loop.Throughput): its wall time over each logged interval,
less evaluation (paused) and compiling (the interval restarts after it); an async save's blocking part stays in."""


def throughput(run: Run) -> dict[str, float | None]:
    """Training-time rates (RATE_BASIS): updates/s, samples/s, tokens/s, and the median step time and data
    wait of the logged intervals."""
    updates_per_s = None
    if run.summary and run.summary.get("updates_per_s"):
        updates_per_s = float(run.summary["updates_per_s"])
    else:  # recompute from the records: each covers the updates since the previous one
        total_updates, total_s, prev = 0, 0.0, 0
        for r in run.train:
            n = r["step"] - prev
            prev = r["step"]
            if n > 0 and r.get("step_ms") is not None:
                total_updates += n
                total_s += n * r["step_ms"] / 1e3
        updates_per_s = total_updates / total_s if total_s > 0 else None
    k = _cfg(run, "optim.accum_steps", 1) or 1
    batch = _cfg(run, "batch_size", 0) or 0
    samples = updates_per_s * k * batch if updates_per_s is not None else None
    tokens = None
    if samples is not None and _cfg(run, "model.kind") == "gpt":
        tokens = samples * _cfg(run, "model.context", 0)

    def median(key: str) -> float | None:
        vals = [r[key] for r in run.train if isinstance(r.get(key), (int, float))]
        return statistics.median(vals) if vals else None

    lm = run.metadata.get("language_model") or {}
    mfu = None
    if tokens is not None and lm.get("peak") and lm.get("flops_per_token"):
        p = lm["peak"]
        mfu = tokens * float(lm["flops_per_token"]) / (float(p["flops_per_s"]) * int(p["devices"]))
    return {
        "updates_per_s": updates_per_s,
        "samples_per_s": samples,
        "tokens_per_s": tokens,
        "mfu": mfu,
        "step_ms": median("step_ms"),
        "data_wait_ms": median("data_wait_ms"),
    }


def mfu_lines(run: Run, tp: dict[str, float | None]) -> list[str]:
    """The report's MFU and attention lines of a built-in GPT run (metadata.json's language_model)."""
    lm = run.metadata.get("language_model")
    if not lm:
        return []
    n = lm.get("params", {})
    count = (
        f"{float(lm['flops_per_token']) / 1e6:,.1f} MFLOP/token by {lm.get('flops_count')} "
        f"(N = {n.get('matmul', 0):,} matmul parameters of {n.get('total', 0):,}; docs/language-models.md)"
    )
    p = lm.get("peak")
    mfu = tp.get("mfu")
    if mfu is not None and p:
        out = [f"- MFU: {100 * mfu:.2f}% ({count}; peak {p['source']}, x {p['devices']} device(s))"]
    else:
        out = [f"- MFU: n/a (no peak FLOP/s known for this device; {count})"]
    a = lm.get("attention") or {}
    out.append(f"- attention: {a.get('used', 'n/a')} ({a.get('why', '')})")
    utils = [r["mem_util"] for r in run.train if isinstance(r.get("mem_util"), (int, float))]
    if utils:
        out.append(f"- device memory: up to {100 * max(utils):.1f}% of the device's limit in use (memory_stats)")
    return out


def peak_memory(run: Run) -> int | None:
    if run.summary and run.summary.get("peak_mem_bytes") is not None:
        return int(run.summary["peak_mem_bytes"])
    mems = [r["mem_bytes"] for r in run.train if r.get("mem_bytes") is not None]
    return max(mems) if mems else None


def wall_time(run: Run) -> tuple[float | None, str]:
    """Wall seconds of the (last session of the) run and where the figure comes from."""
    if run.summary and run.summary.get("wall_time_s") is not None:
        return float(run.summary["wall_time_s"]), "summary.json"
    started = run.metadata.get("started_unix")
    path = RunLayout(run.run_dir).metrics
    if started is not None and path.exists():
        return max(path.stat().st_mtime - float(started), 0.0), (
            "estimated: from metadata.json's start to the last write of metrics.jsonl"
        )
    return None, "unknown (no summary.json and no start time in metadata.json)"


def time_breakdown(run: Run) -> list[tuple[str, float, str]] | None:
    """(part, seconds, note) rows ending with compute/other = wall - the timed parts, and wall."""
    if not run.summary or not isinstance(run.summary.get("timings_s"), dict):
        return None
    wall = run.summary.get("wall_time_s")
    if wall is None:
        return None
    timings = {k: float(v) for k, v in run.summary["timings_s"].items()}
    names = [n for n in TIMING_ORDER if n in timings] + sorted(n for n in timings if n not in TIMING_ORDER)
    rows = [(n, timings[n], TIMING_NOTES.get(n, "")) for n in names]
    rows.append(
        (
            "compute/other",
            float(wall) - sum(timings.values()),
            "wall time minus the parts above: the updates themselves and untimed host work",
        )
    )
    rows.append(("wall", float(wall), "the whole run() call (this session)"))
    return rows


def update_breakdown(run: Run, tp: dict[str, Any]) -> list[tuple[str, float, str]] | None:
    """(part, ms per update, note) rows of --log.breakdown (jaxloop.observe.update_breakdown.PARTS) ending with
    the loop's median step time they sum to; None without the measurement or a logged step time."""
    measured = (run.summary or {}).get("update_breakdown")
    if not isinstance(measured, dict) or tp.get("step_ms") is None:
        return None
    v = measured["variants_s"]
    parts = split_update(
        tp["step_ms"] / 1e3, (tp.get("data_wait_ms") or 0.0) / 1e3, v["forward"], v["fwd_bwd"], v["update"]
    )
    rows = [(name, ms, PART_NOTES[name]) for name, ms in rounded(parts).items()]
    rows.append(("update", round(tp["step_ms"], 3), "the loop's median time per update (metrics.jsonl's step_ms)"))
    return rows


# ----------------------------------------------------------------------------- plots


def _figure(rows: int = 1, height: float = 3.6):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(8, height * rows), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)[:, 0]
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig, axes


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _mark_events(ax, run: Run, best: dict[str, Any]) -> None:
    for i, r in enumerate(run.resumes):
        ax.axvline(r.get("step", 0), color="grey", linestyle=":", linewidth=1, label="resumed" if i == 0 else None)
    if best.get("step") is not None:
        ax.axvline(
            best["step"],
            color="tab:green",
            linestyle="--",
            linewidth=1,
            label=f"best {best['metric']} (update {best['step']})",
        )


def _marker(x: list[int]) -> str | None:
    """Points marked on a short series: a line of one point draws nothing (a run shorter than log_every
    logs only its last update)."""
    return "." if len(x) <= 60 else None


def plot_loss(run: Run, path: Path, best: dict[str, Any]) -> Any:
    """loss.png: the train loss of each logged update, the validation metrics; returns the figure."""
    has_acc = any("val_acc" in r for r in run.evals)
    fig, axes = _figure(2 if has_acc else 1)
    ax = axes[0]
    x, y = _series(run.train, "loss")
    ax.plot(x, y, color="tab:blue", linewidth=1, marker=_marker(x), label="train loss (of each logged update)")
    for key, style in (
        ("val_loss", dict(color="tab:orange", marker="o")),
        ("ema_val_loss", dict(color="tab:red", marker="s", linestyle="--")),
    ):
        x, y = _series(run.evals, key)
        if x:
            ax.plot(x, y, markersize=4, label=key, **style)
    _mark_events(ax, run, best)
    losses = [
        r[k]
        for rs, k in ((run.train, "loss"), (run.evals, "val_loss"), (run.evals, "ema_val_loss"))
        for r in rs
        if isinstance(r.get(k), (int, float)) and math.isfinite(r[k]) and r[k] > 0
    ]
    if losses and max(losses) / min(losses) > 100:
        ax.set_yscale("log", nonpositive="clip")  # losses spanning orders of magnitude
    ax.set_ylabel("loss")
    ax.set_title("Loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if has_acc:
        ax = axes[1]
        for key, style in (
            ("val_acc", dict(color="tab:orange", marker="o")),
            ("ema_val_acc", dict(color="tab:red", marker="s", linestyle="--")),
        ):
            x, y = _series(run.evals, key)
            if x:
                ax.plot(x, y, markersize=4, label=key, **style)
        ax.set_ylabel("accuracy")
        ax.set_title("Validation accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[-1].set_xlabel("update")
    save_figure(fig, path)
    return fig


def _schedule_line(optim: dict[str, Any], steps: Any) -> str:
    """The schedule as jaxloop.update.schedules.describe words it, from the saved config (the fields it reads)."""
    from jaxloop.config.run import OptimConfig, from_dict

    try:
        from jaxloop.update.schedules import describe

        return describe(from_dict(optim, _cls=OptimConfig), int(steps))
    except (ValueError, TypeError, KeyError):  # a config written by another version: its own words
        return f"{_chosen(optim, 'lr_schedule', 'schedule', 'warmup_cosine')} (peak_lr {optim.get('peak_lr')})"


def _chosen(optim: dict[str, Any], section: str, flat_key: str, default: str) -> str:
    """The chosen class's name in a saved optim section: nested (optim.optimizer.name) or an older flat one."""
    nested = optim.get(section)
    return str(nested.get("name", default) if isinstance(nested, dict) else optim.get(flat_key, default))


def plot_lr(run: Run, path: Path) -> None:
    fig, (ax,) = _figure(1)
    x, y = _series(run.train, "lr")
    ax.plot(x, y, color="tab:purple", marker=_marker(x), linewidth=1.2)
    ax.set_title("Learning rate applied at each logged update (read back from the optimizer)")
    ax.set_xlabel("update")
    ax.set_ylabel("learning rate")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax.grid(alpha=0.3)
    save_figure(fig, path)


def plot_throughput(run: Run, path: Path) -> Any:
    """throughput.png: the rate and the step time and data wait of each logged interval; returns the figure."""
    fig, axes = _figure(2)
    key, label = (
        ("tokens_per_s", "tokens/s") if any("tokens_per_s" in r for r in run.train) else ("samples_per_s", "samples/s")
    )
    x, y = _series(run.train, key)
    axes[0].plot(x, y, color="tab:green", linewidth=1, marker=_marker(x))
    axes[0].set_ylabel(label)
    axes[0].set_title(
        f"Throughput ({label}, measured per device call: a call's updates share its time)\n({RATE_BASIS})", fontsize=10
    )
    axes[0].grid(alpha=0.3)
    for k, color, lab in (
        ("step_ms", "tab:blue", "step time (ms/update)"),
        ("data_wait_ms", "tab:orange", "data wait (ms/update)"),
    ):
        x, y = _series(run.train, k)
        if x:
            axes[1].plot(x, y, color=color, linewidth=1, marker=_marker(x), label=lab)
    axes[1].set_ylabel("ms per update")
    axes[1].set_xlabel("update")
    axes[1].set_title("Where an update's time goes")
    axes[1].grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    save_figure(fig, path)
    return fig


# ----------------------------------------------------------------------------- the report


def _status(run: Run) -> str:
    steps = _cfg(run, "steps")
    if run.summary is None:
        return (
            f"**unfinished**: no summary.json (the run was killed or is still running); the figures below "
            f"come from metrics.jsonl, whose last record is at update {run.last_step} of {steps}."
        )
    reason = run.summary.get("stop_reason", "completed")
    final_step = run.summary.get("final_step")
    if reason == "completed":
        return f"**completed**: {final_step} of {steps} updates."
    if reason == "early_stopping":
        return (
            f"**stopped early** at update {final_step} of {steps}: no better "
            f"{_cfg(run, 'checkpoint.best_metric')} in {_cfg(run, 'patience')} evaluations (patience)."
        )
    return f"**stopped** ({reason}) at update {final_step} of {steps}."


def _model_line(run: Run) -> str:
    m = run.config.get("model", {}) if isinstance(run.config.get("model"), dict) else {}
    if m.get("kind") == "gpt":
        return (
            f"gpt: context {m.get('context')}, d_model {m.get('d_model')}, {m.get('n_layers')} layers, "
            f"{m.get('n_heads')} heads"
        )
    if m:
        return f"mlp: hidden {tuple(m.get('hidden', ()))}, {m.get('activation')}"
    return "n/a"


def render(run: Run, plots: dict[str, str]) -> str:
    """The text of report.md."""
    best = best_of(run)
    tp = throughput(run)
    peak = peak_memory(run)
    wall, wall_src = wall_time(run)
    md = run.metadata
    lines = [
        f"# Run report: {run.run_dir.name or run.run_dir}",
        "",
        f"Run directory `{run.run_dir}`; written {time.strftime('%Y-%m-%d %H:%M:%S')} by `python -m jaxloop.report` "
        "from metrics.jsonl, config.json, metadata.json"
        + (", summary.json" if run.summary else "")
        + (" and resumes.jsonl" if run.resumes else "")
        + ".",
        "",
        f"Status: {_status(run)}",
    ]
    if run.resumes:
        at = ", ".join(str(r.get("step")) for r in run.resumes)
        lines += [
            "",
            f"Resumed {len(run.resumes)} time(s), from the checkpoints at update(s) {at}; wall time and "
            "the time breakdown cover the last session only.",
        ]

    o = run.config.get("optim", {}) if isinstance(run.config.get("optim"), dict) else {}
    d = run.config.get("data", {}) if isinstance(run.config.get("data"), dict) else {}
    commit = md.get("git_commit")
    lines += [
        "",
        "## Run",
        "",
        "| | |",
        "|---|---|",
        f"| preset | {_cfg(run, 'preset', 'n/a')} |",
        f"| data | {d.get('source', 'n/a')}{' ' + d['path'] if d.get('path') else ''} |",
        f"| model | {_model_line(run)} |",
        f"| updates | {_cfg(run, 'steps', 'n/a')} (batch {_cfg(run, 'batch_size', 'n/a')} x accumulation "
        f"{o.get('accum_steps', 1)}) |",
        f"| precision | {_cfg(run, 'precision', 'n/a')} |",
        f"| optimizer | {_chosen(o, 'optimizer', 'name', 'adamw')} |",
        f"| schedule | {_schedule_line(o, _cfg(run, 'steps', 0))} |",
        f"| EMA | {o.get('ema_decay') if o.get('ema_decay') else 'off'} |",
        f"| git | {(commit[:12] + (' (uncommitted changes)' if md.get('git_dirty') else '')) if commit else 'n/a'} |",
        f"| devices | {', '.join(md.get('devices', [])) or 'n/a'} ({md.get('backend', 'n/a')}) |",
        f"| host | {md.get('host', 'n/a')}, {md.get('cpu', 'n/a')}, {md.get('cpu_count', 'n/a')} CPUs |",
    ]

    # final and best
    final: dict[str, Any] = {}
    final_step = None
    if run.summary and isinstance(run.summary.get("final"), dict):
        final, final_step = run.summary["final"], run.summary.get("final_step")
    elif run.evals:
        final = {k: v for k, v in run.evals[-1].items() if k not in ("kind", "step")}
        final_step = run.evals[-1]["step"]
    lines += ["", "## Metrics", ""]
    if run.train:
        last = run.train[-1]
        lows = [r["loss"] for r in run.train if isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"])]
        lines.append(
            f"Train loss: {_fmt(last.get('loss'))} at update {last['step']} (mean over the last logged "
            f"interval); lowest logged {_fmt(min(lows) if lows else None)}."
        )
        lines.append("")
    if final:
        lines += [f"| validation metric | final (update {final_step}) | best (update) |", "|---|---|---|"]
        mode_of = lambda k: "max" if k.endswith("acc") else "min"
        for key, value in final.items():
            series = [(r["step"], r[key]) for r in run.evals if isinstance(r.get(key), (int, float))]
            series = [s for s in series if math.isfinite(s[1])]
            if series:
                pick = (min if mode_of(key) == "min" else max)(series, key=lambda s: s[1])
                best_cell = f"{_fmt(pick[1])} ({pick[0]})"
            else:
                best_cell = "n/a"
            lines.append(f"| {key} | {_fmt(value)} | {best_cell} |")
        lines.append("")
    else:
        lines += ["No evaluation yet.", ""]
    if best["value"] is not None:
        ck = (
            ""
            if best.get("checkpoint_step") is None
            else (f"; best of the checkpoints kept: update {best['checkpoint_step']}")
        )
        lines.append(
            f"Best by checkpoint.best_metric ({best['metric']}, {best['mode']}): **{_fmt(best['value'])}** "
            f"at update {best['step']}{ck} (from {best['source']})."
        )
    else:
        lines.append(f"Best by checkpoint.best_metric ({best['metric']}): no evaluation yet.")
    if run.summary and run.summary.get("skipped_updates"):
        lines += ["", f"Skipped (non-finite) updates: {run.summary['skipped_updates']}."]

    # throughput and memory
    lines += ["", "## Throughput and memory", ""]
    rate_src = "summary.json" if run.summary and run.summary.get("updates_per_s") else "metrics.jsonl step times"
    lines.append(f"- updates/s: {_rate(tp['updates_per_s'], 2)} (training time: {RATE_BASIS}; from {rate_src})")
    lines.append(f"- samples/s: {_rate(tp['samples_per_s'], 1)}")
    if tp["tokens_per_s"] is not None:
        lines.append(f"- tokens/s: {_rate(tp['tokens_per_s'], 1)}")
    lines += mfu_lines(run, tp)
    lines.append(
        f"- median step time: {_fmt(tp['step_ms'], 2)} ms/update; median data wait: "
        f"{_fmt(tp['data_wait_ms'], 3)} ms/update"
    )
    lines.append(
        f"- peak memory: {format_bytes(peak)}"
        + (
            f" ({peak} bytes; {md['memory_source']})"
            if peak is not None and md.get("memory_source")
            else f" ({peak} bytes)"
            if peak is not None
            else ""
        )
    )

    # time and cost
    lines += ["", "## Where the time went", ""]
    rows = time_breakdown(run)
    if rows is None:
        lines.append("No breakdown: summary.json (written at the end of a run) is missing.")
    else:
        total = rows[-1][1]
        lines += ["| part | seconds | % of wall | what |", "|---|---:|---:|---|"]
        for name, secs, note in rows:
            pct = 100.0 * secs / total if total else 0.0
            lines.append(f"| {name} | {secs:.3f} | {pct:.1f}% | {note} |")
    lines += ["", "## Where an update's time goes", ""]
    parts = update_breakdown(run, tp)
    if parts is None:
        lines.append("Not measured: pass --log.breakdown to time the update's compiled variants at the end of the run.")
    else:
        assert run.summary is not None, "update_breakdown() found the measurement in the summary"
        measured = run.summary["update_breakdown"]
        v, calls = measured["variants_s"], int(measured.get("updates_per_call", 1))
        lines += [
            f"The loop's median update split by part (updates of {measured['accum_steps']} micro-batch(es); each "
            f"device call of the loop runs {calls} update(s): ms/call = {calls} x ms/update); "
            f"forward, backward and optimizer from its compiled variants timed apart after the run, "
            f"{measured['calls']} calls each (forward {v['forward'] * 1e3:.3f}, forward + backward "
            f"{v['fwd_bwd'] * 1e3:.3f}, update {v['update'] * 1e3:.3f} ms); measuring took "
            f"{measured['cost_s']:.2f} s ({measured['compile_s']:.2f} s of it compiling). Parts timed slower alone "
            "than the loop's update are scaled down to fit it.",
            "",
            "| part | ms/update | ms/call | % | what |",
            "|---|---:|---:|---:|---|",
        ]
        whole = parts[-1][1]
        for name, ms, note in parts:
            pct = 100.0 * ms / whole if whole else 0.0
            lines.append(f"| {name} | {ms:.3f} | {ms * calls:.3f} | {pct:.1f}% | {note} |")
    lines += ["", "## Cost", ""]
    price = float(_cfg(run, "log.price_per_hour", 0.0) or 0.0)
    lines.append(f"Wall time: {format_duration(wall)} ({_fmt(wall, 2) if wall is not None else 'n/a'} s; {wall_src}).")
    lines.append("")
    if wall is None:
        lines.append("Cost: unknown (no wall time).")
    elif price > 0:
        hours = wall / 3600.0
        lines.append(
            f"Cost: ${hours * price:.4f} = {hours:.4f} h x ${price:g}/h (wall hours x log.price_per_hour; "
            "machine time only)."
        )
    else:
        lines.append("Cost: not computed: log.price_per_hour is 0 (pass --log.price_per_hour to price the machine).")

    # plots and files
    lines += ["", "## Plots", ""]
    if plots:
        for name, file in plots.items():
            lines += [f"![{name}]({file})", ""]
    else:
        lines += ["No training records yet: no plots.", ""]
    lines += ["## Files", "", f"- `{METRICS_FILE}`: every record (JSON lines)"]
    if (run.run_dir / TB_DIR).is_dir():
        lines.append(f"- `{TB_DIR}/`: TensorBoard events (`tensorboard --logdir {run.run_dir / TB_DIR}`)")
    if (run.run_dir / PROFILE_DIR).is_dir():
        lines.append(
            f"- `{PROFILE_DIR}/`: jax.profiler trace (TensorBoard profile plugin, or the "
            "*.trace.json.gz / perfetto_trace.json.gz file at https://ui.perfetto.dev)"
        )
    if (run.run_dir / CHECKPOINT_DIR).is_dir():
        lines.append(f"- `{CHECKPOINT_DIR}/`: Orbax checkpoints")
    lines.append("")
    return "\n".join(lines)


def write_report(run_dir: str | Path) -> Path:
    """Write report.md and its PNGs into run_dir; returns the report's path."""
    run = load_run(run_dir)
    best = best_of(run)
    plots: dict[str, str] = {}
    if run.train or run.evals:
        plot_loss(run, run.run_dir / PLOTS["loss"], best)
        plots["loss"] = PLOTS["loss"]
    if run.train:
        plot_lr(run, run.run_dir / PLOTS["lr"])
        plot_throughput(run, run.run_dir / PLOTS["throughput"])
        plots["lr"], plots["throughput"] = PLOTS["lr"], PLOTS["throughput"]
    path = RunLayout(run.run_dir).report
    atomic_write_text(path, render(run, plots))
    return path


def save_figure(fig: Any, path: Path) -> None:
    """A plot of the report as a PNG, replaced atomically (a reader, or a kill, sees the old or the new one)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    atomic_write_bytes(path, buffer.getvalue())
