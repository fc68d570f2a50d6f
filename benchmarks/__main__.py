"""`python -m benchmarks`: jaxloop against torch_ref and against its own compiled step, in one table.

    python -m benchmarks                         # every row (tens of minutes on 2 cores)
    python -m benchmarks --quick                 # a smoke version (short runs, fewer rows; < 2 min quiet)
    python -m benchmarks --only step.mlp.k1      # one row (or a prefix: --only step; repeatable)
    python -m benchmarks --out results.json      # also write the rows, machine and versions as JSON
    python -m benchmarks --markdown BENCHMARKS.md [--from-json results.json]   # (re)write the record
    python -m benchmarks --list                  # the row names
    python -m benchmarks --gpu [--tiny] [--out F] # a lent GPU in one shot (benchmarks/gpu.py; gpu.sh installs first)

Each row prints jaxloop's figure, the reference's, their ratio, the goal and whether it was met. Rows
that cannot run here (no GPU) print as unmeasured; a row that fails prints as failed with the error,
and the others still run. The measurements themselves are described in BENCHMARKS.md and in each
row's module (benchmarks/step.py: in-process rows; benchmarks/procs.py: child-process rows).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import Options, Row, add_text_option, as_dict, machine, save_record, use_text
from jaxloop.rundir.atomic import atomic_write_text

# rows left out under --quick unless named with --only (their cost is mostly another compile)
# (--quick keeps one row per kind of measurement, on the smallest shapes: a smoke check, not a record)
QUICK_SKIP = (
    "step.gpt64.k4",
    "step.gpt128.k1",
    "step.gpt128.k4",
    "eval.gpt128",
    "loop.mlp.k4",
    "loop.gpt64.k1",
    "loop.gpt64.k4",
    "startup.compile",
    "memory.step.mlp",
    "memory.step.gpt128",
    "memory.plan",
    "checkpoint",
    "gpt2.cpu",
    "breakdown.gpt64",
    "sample.gpt",
)
FULL_SKIP = ("eval.gpt64",)  # the quick stand-in for eval.gpt128


def registry() -> list[tuple[str, Callable[[Options], Row | list[Row]]]]:
    """(name, function) in run order; a function may return several rows (names share its prefix)."""
    from benchmarks import bench_gpt2, bench_sample, breakdown, plan, procs, step

    rows: list[tuple[str, Callable[[Options], Any]]] = [("peak", step.matmul_peak)]
    for shape in ("mlp", "gpt64", "gpt128"):
        for k in (1, 4):
            rows.append((f"step.{shape}.k{k}", lambda o, s=shape, k=k: step.step_row(o, s, k)))
    rows.append(("eval.gpt64", lambda o: step.eval_row(o, "gpt64")))
    rows.append(("eval.gpt128", lambda o: step.eval_row(o, "gpt128")))
    for shape in ("mlp", "gpt64"):
        for k in (1, 4):
            rows.append((f"loop.{shape}.k{k}", lambda o, s=shape, k=k: procs.loop_row(o, s, k)))
    rows += [
        ("breakdown.gpt64", breakdown.breakdown_row),
        ("sample.gpt", bench_sample.sample_row),
        ("e2e.shakespeare64", procs.e2e_row),
        ("e2e.script64", procs.script64_row),
        ("startup.compile", procs.compile_row),
        ("startup.cache", procs.cache_row),
        ("startup.digits", procs.digits_row),
        ("memory.e2e", lambda o: procs.memory_row(o, "e2e")),
        ("memory.digits", lambda o: procs.memory_row(o, "digits")),
        ("memory.step.mlp", lambda o: procs.step_memory_row(o, "mlp")),
        ("memory.step.gpt128", lambda o: procs.step_memory_row(o, "gpt128")),
        ("memory.plan", plan.plan_rows),
        ("data", procs.data_row),
        ("checkpoint", procs.checkpoint_row),
        ("accel", procs.accel_rows),
        ("gpt2.cpu", bench_gpt2.cpu_row),
        ("gpt2.gpu", bench_gpt2.gpu_row),
    ]
    return rows


def selected(name: str, only: list[str] | None, quick: bool) -> bool:
    if only:
        return any(name == o or name.startswith(o + ".") or o.startswith(name + ".") for o in only)
    return name not in (QUICK_SKIP if quick else FULL_SKIP)


def run(
    opts: Options, only: list[str] | None = None, save: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Run the selected rows; `save` gets the result so far after each row (a killed run keeps its rows)."""
    info = machine()
    info["threads"] = {"xla_cpu": f"all {opts.threads} cores (default Eigen pool)", "torch": opts.threads}
    results: list[Row] = []
    t0 = time.perf_counter()
    for name, fn in registry():
        if not selected(name, only, opts.quick):
            continue
        t = time.perf_counter()
        opts.log(f"[benchmarks] {name} ...")
        out = fn(opts)
        for row in out if isinstance(out, list) else [out]:
            if only and not any(
                row.name == o or row.name.startswith(o + ".") or name == o or name.startswith(o + ".") for o in only
            ):
                continue
            results.append(row)
            opts.log(f"[benchmarks]   {format_row(row)}  ({time.perf_counter() - t:.1f} s)")
        if save is not None:
            save({"machine": info, "rows": [as_dict(r) for r in results]})
    info["harness_s"] = time.perf_counter() - t0
    info["quick"] = opts.quick
    try:
        import os

        info["load_avg_at_end"] = os.getloadavg()
    except OSError:
        pass
    return {"machine": info, "rows": [as_dict(r) for r in results]}


# ----------------------------------------------------------------------------- output


def _num(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        a = abs(v)
        if a >= 1000:
            return f"{v:,.0f}"
        if a >= 100:
            return f"{v:.1f}"
        return f"{v:.{digits}g}"
    return str(v)


def _met(r: dict[str, Any]) -> str:
    if r["status"] != "ok":
        return r["status"]
    if r["met"] is None:
        return "-"
    return "yes" if r["met"] else "NO"


def format_row(row: Row) -> str:
    r = as_dict(row)
    return (
        f"{r['name']}: jax {_num(r['jax'])} / ref {_num(r['ref'])} {r['unit']}, ratio {_num(r['ratio'])} "
        f"(goal {r['goal'] or '-'}: {_met(r)}) {r['notes']}"
    )


COLUMNS = ("row", "jaxloop", "reference", "unit", "ratio", "goal", "met")


def table_cells(result: dict[str, Any]) -> list[list[str]]:
    mixed = result["machine"].get("quick") == "mixed"
    return [
        [
            r["name"] + (f" [{r.get('mode')}]" if mixed else ""),
            _num(r["jax"]),
            _num(r["ref"]),
            r["unit"],
            _num(r["ratio"]),
            r["goal"] or "-",
            _met(r),
        ]
        for r in result["rows"]
    ]


def header_lines(result: dict[str, Any]) -> list[str]:
    m = result["machine"]
    v = ", ".join(f"{k} {val}" for k, val in m["versions"].items() if val)
    lines = [
        f"machine: {m['cpu']}, {m['cores']} cores{', ' + m['accelerator'] if m.get('accelerator') else ''}, "
        f"{m['platform']}; python {m['python']}",
        f"versions: {v}",
        f"threads: XLA:CPU {m['threads']['xla_cpu']}; torch.set_num_threads({m['threads']['torch']}) "
        f"(children: OMP_NUM_THREADS={m['threads']['torch']}){'; XLA_FLAGS ' + m['xla_flags'] if m.get('xla_flags') else ''}",
        f"taken {m['time_utc']}{' with --quick' if m.get('quick') is True else ''}"
        f"{' partly with --quick (rows marked [quick])' if m.get('quick') == 'mixed' else ''}; load average at start "
        f"{_load(m.get('load_avg_at_start'))}, at end {_load(m.get('load_avg_at_end'))}; harness {m.get('harness_s', 0):.0f} s",
    ]
    for other in m.get("elsewhere", []):
        lines.append(
            f"rows {', '.join(other['rows'])} measured on another machine: "
            + "; ".join(header_lines({"machine": other["machine"]}))
        )
    return lines


def _load(v: Any) -> str:
    return "/".join(f"{x:.1f}" for x in v) if v else "?"


def print_table(result: dict[str, Any], file=sys.stdout) -> None:
    cells = table_cells(result)
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(COLUMNS)]
    for line in header_lines(result):
        print(line, file=file)
    print(file=file)
    print(" | ".join(c.ljust(w) for c, w in zip(COLUMNS, widths)), file=file)
    print("-+-".join("-" * w for w in widths), file=file)
    for row in cells:
        print(" | ".join(c.ljust(w) for c, w in zip(row, widths)), file=file)
    print(file=file)
    print("notes (ratio = jaxloop / reference unless said otherwise):", file=file)
    for r in result["rows"]:
        print(f"  {r['name']}: {r['what']}. {r['notes']}", file=file)


NOTES = Path(__file__).resolve().parents[1] / "docs" / "benchmark-notes.md"
"""What each row measures and the findings: BENCHMARKS.md carries it from its first `##` heading on."""


def notes() -> str:
    """docs/benchmark-notes.md from its first `##` heading on (its title and introduction left out)."""
    text = NOTES.read_text()
    return text[text.index("\n## ") + 1 :]


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Benchmarks",
        "",
        "Generated by `python -m benchmarks --markdown BENCHMARKS.md` (rewrite it from a saved run with "
        "`--from-json FILE`). Do not edit the tables by hand.",
        "",
    ]
    lines += [f"- {line}" for line in header_lines(result)]
    gpu = any(r["name"].startswith("accel") and r["status"] != "unmeasured" for r in result["rows"])
    if not gpu:
        lines.append("- accelerator rows: unmeasured, no GPU on this machine")
    lines += ["", "| " + " | ".join(COLUMNS) + " | notes |", "|" + "---|" * (len(COLUMNS) + 1)]
    for r, cells in zip(result["rows"], table_cells(result)):
        note = f"{r['what']}. {r['notes']}".replace("|", "/")
        lines.append("| " + " | ".join(cells) + f" | {note} |")
    lines += ["", notes().strip(), ""]
    return "\n".join(lines)


def _same_machine(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a.get(k) == b.get(k) for k in ("cpu", "cores", "platform", "accelerator"))


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from several runs: rows by name (later runs replace earlier ones), order of first sight.
    The machine is the first run's; rows from a run on another machine (a GPU's) are listed with theirs,
    also when a run given is itself a merged one."""
    rows: dict[str, dict[str, Any]] = {}
    measured_on: dict[str, dict[str, Any]] = {}
    for res in results:
        quick = res["machine"].get("quick")
        by_name = {name: other["machine"] for other in res["machine"].get("elsewhere", []) for name in other["rows"]}
        for r in res["rows"]:
            r = dict(r)
            r.setdefault("mode", "quick" if quick else "full")
            rows[r["name"]], measured_on[r["name"]] = r, by_name.get(r["name"], res["machine"])
    here = [res["machine"] for res in results if _same_machine(res["machine"], results[0]["machine"])]
    machine = {k: v for k, v in results[0]["machine"].items() if k != "elsewhere"}
    if len({bool(m.get("quick")) for m in here}) > 1:
        machine["quick"] = "mixed"
    if len(here) > 1:
        machine["time_utc"] = " + ".join(m["time_utc"] for m in here)
        machine["harness_s"] = sum(m.get("harness_s", 0) for m in here)
    order = {name: i for i, (name, _) in enumerate(registry())}

    def rank(r: dict[str, Any]) -> tuple[int, str]:
        name = r["name"]
        best = max((k for k in order if name == k or name.startswith(k + ".")), key=len, default=None)
        return (order[best] if best is not None else len(order), name)

    ranked = sorted(rows.values(), key=rank)
    elsewhere: list[dict[str, Any]] = []  # one entry per other machine's run, in the order its rows come
    for r in ranked:
        m = measured_on[r["name"]]
        if _same_machine(m, machine):
            continue
        entry = next((e for e in elsewhere if e["machine"] == m), None)
        if entry is None:
            elsewhere.append(entry := {"rows": [], "machine": m})
        entry["rows"].append(r["name"])
    if elsewhere:
        machine["elsewhere"] = elsewhere
    return {"machine": machine, "rows": ranked}


def read_record(path: str) -> dict[str, Any]:
    """A saved run (--out's JSON), or SystemExit naming the file: a record cut short or edited by hand is
    refused, not merged into BENCHMARKS.md with rows missing."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SystemExit(f"--from-json {path}: not a readable benchmark record ({e})") from None
    if (
        not isinstance(record, dict)
        or not isinstance(record.get("machine"), dict)
        or not isinstance(record.get("rows"), list)
    ):
        raise SystemExit(f"--from-json {path}: not a benchmark record (it needs 'machine' and 'rows', as --out writes)")
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short runs and fewer rows (smoke check)")
    p.add_argument("--only", action="append", metavar="ROW", help="run this row or row prefix (repeatable)")
    p.add_argument("--out", metavar="FILE.json", help="write the results as JSON")
    p.add_argument("--markdown", metavar="FILE.md", help="write the results as the BENCHMARKS.md record")
    p.add_argument(
        "--from-json",
        metavar="FILE.json",
        nargs="+",
        help="take the results from saved --out files, run nothing (several: rows merged by name, later "
        "files win; machine from the first, rows run on another machine named with theirs)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores, as XLA:CPU)")
    p.add_argument("--list", action="store_true", help="print the row names and exit")
    p.add_argument(
        "--gpu",
        action="store_true",
        help="GPT-2 small on a GPU in one shot: jaxloop, torch eager and "
        "torch.compile, deterministic kernels on/off, cuDNN/XLA attention, the loop (benchmarks/gpu.py); "
        "the JSON record goes to benchmarks/records/gpu-<device>.json or --out",
    )
    p.add_argument("--tiny", action="store_true", help="with --gpu: the same path at a CPU size (CI's check)")
    add_text_option(p)
    args = p.parse_args(argv)
    if args.gpu:
        from benchmarks import gpu

        record = gpu.run(args.tiny, Path(args.out) if args.out else None, None if args.tiny else gpu.BUDGET_S)
        failed = [
            f"{section}.{name}"
            for section in gpu.PARTS
            for name, entry in record[section].items()
            if isinstance(entry, dict) and entry.get("status") == "failed"
        ]
        if failed:
            print(f"python -m benchmarks --gpu: failed: {', '.join(failed)} (errors in the record)", file=sys.stderr)
        return 1 if failed else 0
    use_text(args)
    if args.list:
        for name, _ in registry():
            print(
                name
                + (
                    "  (skipped under --quick)"
                    if name in QUICK_SKIP
                    else "  (--quick only)"
                    if name in FULL_SKIP
                    else ""
                )
            )
        return 0
    if args.from_json:
        result = merge([read_record(f) for f in args.from_json])
    else:
        from jaxloop.config.run import Config
        from jaxloop.runtime.determinism import request_deterministic_ops
        from jaxloop.runtime.host_memory import retain_freed_memory

        # The step rows run jaxloop and torch in this process: both get the allocator policy jaxloop.run
        # sets for a run (children running either CLI have their own: jaxloop's sets it, torch_ref's not),
        # and jaxloop's steps the XLA flags jaxloop.run sets (deterministic GPU kernels; nothing on a CPU).
        retain_freed_memory()
        if Config().deterministic:
            request_deterministic_ops()
        opts = Options(quick=args.quick)
        if args.threads:
            opts.threads = args.threads
        result = run(opts, args.only, (lambda r: save_record(args.out, r)) if args.out else None)
    print_table(result)
    if args.out:
        save_record(args.out, result)
    if args.markdown:
        atomic_write_text(args.markdown, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
