"""Where a CPU call's temporaries come from: jax's worker thread (its default) against the dispatching
thread (run_cpu_calls_inline), glibc's transparent huge pages, and one malloc arena for every thread.

Each contender is a fresh process (jax reads the dispatch setting when it starts its backend, glibc its
tunables when the process starts), all with the loop's host memory policy
(jaxloop.runtime.host_memory.retain_freed_memory), alternated over rounds on the same batches: the update as your
own loop would call it (K = 1: one compiled train_step per micro-batch, as row step.* of `python -m
benchmarks`) and as jaxloop's loop calls it (one call of 10 updates, a lax.scan). Printed per shape:
ms per update (median over rounds), the page faults per update, which is where the worker thread's time
goes for calls whose temporaries outgrow glibc's secondary-arena heaps (64 MiB), and each contender's
time over the worker thread's.

    python benchmarks/bench_dispatch.py                       # about 10 minutes on 2 cores
    python benchmarks/bench_dispatch.py --shapes gpt128 --modes worker hugepages --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import add_text_option, use_text  # noqa: E402

# name: (environment added at process start, run_cpu_calls_inline)
MODES = {
    "worker": ({}, False),  # jax's default: calls on its worker thread, allocating from a secondary arena
    "inline": ({}, True),
    "hugepages": ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, False),  # mmapped blocks madvised huge (glibc >= 2.35)
    "one-arena": ({"MALLOC_ARENA_MAX": "1"}, False),  # every thread allocates from the main heap, under one lock
}
PER_CALL = 10  # updates in one of the loop's calls (its lax.scan over stacked micro-batches)


def start(mode: str) -> None:
    """First thing in a contender's fresh process, before jax starts: the loop's host memory policy and
    the mode's dispatch (its glibc settings came with the process's environment, child_env)."""
    from jaxloop.runtime.host_memory import retain_freed_memory, run_cpu_calls_inline

    retain_freed_memory()
    if MODES[mode][1] and not run_cpu_calls_inline():
        raise SystemExit("jax's backend started before run_cpu_calls_inline, or the environment chose")


def child(shape: str, mode: str, blocks: int) -> dict[str, float]:
    """In a fresh process: ms and page faults per update, separate calls and the loop's scanned call."""
    start(mode)
    from benchmarks.step import JaxUpdate, host_batches, make_cfg
    from jaxloop.data.sources import load_splits

    cfg = make_cfg(shape)
    splits = load_splits(cfg)
    batches = host_batches(cfg, splits, 2 * PER_CALL)
    updates = {"mlp": 200, "gpt64": 20, "gpt128": 4}[shape]
    out = {}
    for name, per_call in (("step", 1), ("scan", PER_CALL)):
        update = JaxUpdate(cfg, splits, batches, per_call)
        update(updates)  # warm-up
        ms, faults = [], []
        for _ in range(blocks):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            ms.append(1e3 * update(updates))
            faults.append(
                (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / (-(-updates // per_call) * per_call)
            )
        out[f"{name}_ms"], out[f"{name}_faults"] = statistics.median(ms), statistics.median(faults)
        del update
    return out


def child_env(mode: str) -> dict[str, str]:
    """The caller's environment without a dispatch choice, with the mode's glibc settings added."""
    from jaxloop.runtime.host_memory import ASYNC_DISPATCH

    env = {k: v for k, v in os.environ.items() if k != ASYNC_DISPATCH.upper()}
    for key, value in MODES[mode][0].items():
        env[key] = f"{env[key]}:{value}" if key == "GLIBC_TUNABLES" and env.get(key) else value
    return env


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["mlp", "gpt64", "gpt128"])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--blocks", type=int, default=3, help="timed blocks per child")
    p.add_argument("--child", nargs=2, metavar=("SHAPE", "MODE"), help=argparse.SUPPRESS)
    add_text_option(p)
    args = p.parse_args()
    use_text(args)
    if args.child:
        print(json.dumps(child(*args.child, args.blocks)))
        return
    modes = ["worker", *(m for m in args.modes if m != "worker")]  # the baseline of every ratio
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(
        f"glibc {os.confstr('CS_GNU_LIBC_VERSION') if hasattr(os, 'confstr') else '?'}; transparent huge pages: "
        f"{thp.read_text().strip() if thp.exists() else 'absent'}"
    )
    print(
        f"{'shape':8} {'mode':9} {'step ms':>9} {'faults':>8} {'/worker':>7} {'scan ms':>9} {'faults':>8} {'/worker':>7}"
        "   (per update)"
    )
    for shape in args.shapes:
        runs = {m: [] for m in modes}
        for _ in range(args.rounds):
            for mode in modes:
                out = subprocess.run(
                    [sys.executable, __file__, "--child", shape, mode, "--blocks", str(args.blocks)],
                    capture_output=True,
                    text=True,
                    env=child_env(mode),
                    check=True,
                )
                runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
        med = {m: {k: statistics.median(r[k] for r in runs[m]) for k in runs[m][0]} for m in modes}
        base = med["worker"]
        for mode in modes:
            m = med[mode]
            print(
                f"{shape:8} {mode:9} {m['step_ms']:9.3f} {m['step_faults']:8.0f} {m['step_ms'] / base['step_ms']:7.2f} "
                f"{m['scan_ms']:9.3f} {m['scan_faults']:8.0f} {m['scan_ms'] / base['scan_ms']:7.2f}"
            )


if __name__ == "__main__":
    main()
