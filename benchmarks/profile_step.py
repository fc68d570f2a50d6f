"""Where the compiled update's time goes, thunk by thunk, under each of bench_dispatch's modes.

Each mode is a fresh process (as in bench_dispatch.py: the loop's host memory policy, the mode's glibc
environment and dispatch setting): a `jax.profiler` trace of `--calls` calls of the compiled train_step
(one micro-batch per call, as the step rows), read back with `jax.profiler.ProfileData`. Printed: wall
ms per update, the time XLA:CPU's thunks take summed over its threads (the YNNPACK fusions, which hold
the dots, apart from the rest), and the thunks that take longest under the first mode beside the others.

    python benchmarks/profile_step.py                               # gpt128, worker thread vs inline
    python benchmarks/profile_step.py --shape gpt64 --modes worker hugepages --top 20
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_dispatch import MODES, child_env, start  # noqa: E402
from benchmarks.common import add_text_option, use_text  # noqa: E402

EXECUTOR = "ThunkExecutor"  # the executor's own spans, which hold the thunks' (not counted twice)


def child(shape: str, mode: str, calls: int) -> dict:
    """In a fresh process: ms per update, and ms per update of every thunk name summed over XLA's threads."""
    start(mode)
    import jax
    from jax.profiler import ProfileData

    from benchmarks.step import JaxUpdate, host_batches, make_cfg
    from jaxloop.data.sources import load_splits

    cfg = make_cfg(shape)
    splits = load_splits(cfg)
    update = JaxUpdate(cfg, splits, host_batches(cfg, splits, 4))
    update(3)  # warm-up: the first calls grow the heaps the policy then keeps
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            ms = 1e3 * update(calls)
        data = ProfileData.from_file(str(next(Path(trace_dir).rglob("*.xplane.pb"))))
    thunks: collections.Counter = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if line.name.startswith("tf_XLAEigen"):  # the threads that run the thunks
                for event in line.events:
                    if EXECUTOR not in event.name:
                        thunks[event.name] += event.duration_ns / 1e6 / calls
    if not thunks:
        raise SystemExit(
            f"no thunk events on the trace's tf_XLAEigen threads (lines: "
            f"{sorted({line.name for plane in data.planes for line in plane.lines})}): has jax renamed them?"
        )
    return {"ms": ms, "thunks": dict(thunks)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="gpt128", choices=["mlp", "gpt64", "gpt128"])
    p.add_argument("--modes", nargs="+", default=["worker", "inline"], choices=list(MODES))
    p.add_argument("--calls", type=int, default=4, help="traced calls (one update each)")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--child", nargs=2, metavar=("SHAPE", "MODE"), help=argparse.SUPPRESS)
    add_text_option(p)
    args = p.parse_args()
    use_text(args)
    if args.child:
        print(json.dumps(child(*args.child, args.calls)))
        return
    runs = {}
    for mode in args.modes:
        out = subprocess.run(
            [sys.executable, __file__, "--child", args.shape, mode, "--calls", str(args.calls)],
            capture_output=True,
            text=True,
            env=child_env(mode),
            check=True,
        )
        runs[mode] = json.loads(out.stdout.strip().splitlines()[-1])

    def total(mode: str, dots: bool | None = None) -> float:
        return sum(
            ms for name, ms in runs[mode]["thunks"].items() if dots is None or name.startswith("ynn_fusion") == dots
        )

    print(f"{args.shape}, ms per update ({args.calls} traced calls)   " + "".join(f"{m:>10}" for m in args.modes))
    for label, f in (
        ("wall", lambda m: runs[m]["ms"]),
        ("thunks, all threads", total),
        ("  YNNPACK fusions (dots)", lambda m: total(m, True)),
        ("  the rest", lambda m: total(m, False)),
    ):
        print(f"{label:38}" + "".join(f"{f(m):10.1f}" for m in args.modes))
    first = runs[args.modes[0]]["thunks"]
    for name in sorted(first, key=first.get, reverse=True)[: args.top]:
        print(f"  {name[:36]:36}" + "".join(f"{runs[m]['thunks'].get(name, 0.0):10.2f}" for m in args.modes))


if __name__ == "__main__":
    main()
