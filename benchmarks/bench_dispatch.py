"""jax's CPU calls on a worker thread (its default) against on the dispatching thread (run_cpu_calls_inline).

Each contender is a fresh process (jax reads the setting when it starts its backend), both with the
loop's host memory policy (jaxloop.host_memory.retain_freed_memory), alternated over rounds on the same
batches: the update as your own loop would call it (K = 1: one compiled train_step per micro-batch, as
row step.* of `python -m benchmarks`) and as jaxloop's loop calls it (one call of 10 updates, a lax.scan).
Printed per shape: ms per update (median over rounds) and the page faults per update, which is where
the worker thread's time goes for calls whose temporaries outgrow glibc's secondary-arena heaps (64 MiB).

    python benchmarks/bench_dispatch.py                       # about 3 minutes on 2 cores
    python benchmarks/bench_dispatch.py --shapes gpt128 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("worker", "inline")
PER_CALL = 10  # updates in one of the loop's calls (its lax.scan over stacked micro-batches)


def child(shape: str, mode: str, blocks: int) -> dict[str, float]:
    """In a fresh process: ms and page faults per update, separate calls and the loop's scanned call."""
    from jaxloop.host_memory import retain_freed_memory, run_cpu_calls_inline

    retain_freed_memory()
    if mode == "inline" and not run_cpu_calls_inline():
        raise SystemExit("jax's backend started before run_cpu_calls_inline, or the environment chose")
    from benchmarks.step import JaxUpdate, host_batches, make_cfg
    from loopcore.sources import load_splits

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
            faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / (-(-updates // per_call) * per_call))
        out[f"{name}_ms"], out[f"{name}_faults"] = statistics.median(ms), statistics.median(faults)
        del update
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["mlp", "gpt64", "gpt128"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--blocks", type=int, default=3, help="timed blocks per child")
    p.add_argument("--child", nargs=2, metavar=("SHAPE", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.blocks)))
        return
    env = {k: v for k, v in os.environ.items() if k != "JAX_CPU_ENABLE_ASYNC_DISPATCH"}
    print(f"{'shape':8} {'mode':7} {'step ms':>9} {'faults':>8} {'scan ms':>9} {'faults':>8}   (per update)")
    for shape in args.shapes:
        runs = {m: [] for m in MODES}
        for _ in range(args.rounds):
            for mode in MODES:
                out = subprocess.run([sys.executable, __file__, "--child", shape, mode, "--blocks", str(args.blocks)],
                                     capture_output=True, text=True, env=env, check=True)
                runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
        med = {m: {k: statistics.median(r[k] for r in runs[m]) for k in runs[m][0]} for m in MODES}
        for mode in MODES:
            m = med[mode]
            print(f"{shape:8} {mode:7} {m['step_ms']:9.3f} {m['step_faults']:8.0f} {m['scan_ms']:9.3f} {m['scan_faults']:8.0f}")
        print(f"{shape:8} inline/worker: step {med['inline']['step_ms'] / med['worker']['step_ms']:.2f}, "
              f"scan {med['inline']['scan_ms'] / med['worker']['scan_ms']:.2f}")


if __name__ == "__main__":
    main()
