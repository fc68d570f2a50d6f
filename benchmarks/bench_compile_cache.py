"""Time to the first update of a second run, with --compile_cache (JAX's persistent compilation cache) and without.

    python benchmarks/bench_compile_cache.py [--rounds 3] [--shakespeare_steps 5]

For each preset (the default digits run, and the shakespeare preset on tests/data's text) and each
round, both ways in turn (their order alternated each round): with the cache, a first run fills a fresh
cache directory; then a second run into a fresh run_dir is timed from Popen to its first train record in
metrics.jsonl (log_every 1). The store of compiled executables this once also compared (a third way, up to
the commit that removed jaxloop/loop/executables.py) is measured against JAX's cache in docs/speed.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import run_child  # noqa: E402

MODES = ("jax", "none")


def preset_flags(name: str, shakespeare_steps: int) -> list[str]:
    if name == "digits":
        return ["--steps", "50"]
    text = ROOT / "tests" / "data" / "tinyshakespeare_60k.txt"
    return [
        "--preset",
        "shakespeare",
        "--data.path",
        str(text),
        "--steps",
        str(shakespeare_steps),
        "--optim.warmup_steps",
        "1",
    ]


def first_update_s(mode: str, flags: list[str], run_dir: Path, cache: Path) -> float:
    """Seconds from Popen to the first train record of one run."""
    args = [
        "-m",
        "jaxloop.train",
        *flags,
        "--run_dir",
        str(run_dir),
        "--log_every",
        "1",
        "--eval_every",
        "0",
        "--log.progress",
        "off",
        "--log.no-report",
        "--resume",
        "never",
        "--compile_cache",
        "" if mode == "none" else str(cache),
    ]
    box: dict[str, float] = {}
    metrics = run_dir / "metrics.jsonl"
    t0 = time.perf_counter()

    def poll() -> bool:
        try:
            if any('"train"' in line for line in metrics.read_text().splitlines()):
                box["t"] = time.perf_counter() - t0
                return True
        except OSError:
            pass
        return False

    child = run_child(args, poll=poll)
    if child.rc != 0 or "t" not in box:
        raise RuntimeError(f"{mode} run exited {child.rc}: {child.stderr[-400:]}")
    return box["t"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--shakespeare_steps", type=int, default=5)
    p.add_argument("--presets", nargs="+", default=["digits", "shakespeare"])
    args = p.parse_args()
    times: dict[str, dict[str, list[float]]] = {name: {m: [] for m in MODES} for name in args.presets}
    with tempfile.TemporaryDirectory() as work:
        for r in range(args.rounds):
            order = MODES[r % 2 :] + MODES[: r % 2]
            for name in args.presets:
                flags = preset_flags(name, args.shakespeare_steps)
                for mode in order:
                    base = Path(work) / f"{name}-{mode}-{r}"
                    if mode != "none":
                        first_update_s(mode, flags, base / "first", base / "cache")  # fills the cache
                    t = first_update_s(mode, flags, base / "second", base / "cache")
                    times[name][mode].append(t)
                    print(f"round {r} {name:12s} {mode:6s} {t:6.2f} s", flush=True)
    print("\npreset        " + "".join(f"{m:>22s}" for m in MODES))
    for name in args.presets:
        cells = "".join(f"{statistics.median(v):8.2f} ({min(v):.2f}-{max(v):.2f})" for v in times[name].values())
        print(f"{name:12s}  {cells}")
    print(json.dumps(times))


if __name__ == "__main__":
    main()
