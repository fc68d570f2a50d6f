"""The GPT update's floor: its matrix products alone, summed, beside the whole update and the step goal.

Every dot of jaxloop's compiled train_step (XLA:CPU's optimized HLO, fused or not, with its operand
shapes and dimension numbers) is timed alone three ways: jitted as XLA:CPU is handed it (that
dot_general), jitted as the same B x (M x K @ K x N) product in the canonical layout, and as torch.matmul
of that canonical product on the same threads. Their sums are printed beside the update itself
(jaxloop's compiled train_step and torch_ref's eager update, interleaved, as row step.*.k1 of `python -m
benchmarks`) and the goal (0.7x torch eager). If the dots alone, each in its fastest layout, take
about the goal's time, no change outside the dots meets it: the rest of the update (layer norms,
softmax, GELU, the optimizer) would have to take no time at all.

    python benchmarks/dot_floor.py                   # gpt64 and gpt128, about 5 minutes on 2 cores
    python benchmarks/dot_floor.py --shapes gpt64 --rounds 3
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import add_text_option, use_text  # noqa: E402

GOAL = 0.7  # step.gpt*: jaxloop's update <= 0.7x torch eager's
_ARRAY = re.compile(r"%([\w.\-]+) = \w+\[([\d,]*)\]")
_DOT = re.compile(r"= \w+\[[\d,]*\]\S* dot\(%([\w.\-]+), %([\w.\-]+)\)")


class Dot(NamedTuple):
    """One dot of an HLO module: operand shapes and dimension numbers as lax.dot_general takes them."""

    lhs: tuple[int, ...]
    rhs: tuple[int, ...]
    dimension_numbers: tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]

    def canonical(self) -> tuple[int, int, int, int]:
        """(B, M, K, N): the same product as a batch of B [M, K] @ [K, N] matmuls."""
        (lc, _), (lb, _) = self.dimension_numbers
        b = math.prod(self.lhs[i] for i in lb)
        k = math.prod(self.lhs[i] for i in lc)
        return b, math.prod(self.lhs) // (b * k), k, math.prod(self.rhs) // (b * k)

    @property
    def flops(self) -> float:
        b, m, k, n = self.canonical()
        return 2.0 * b * m * k * n


def _dims(line: str, key: str) -> tuple[int, ...]:
    m = re.search(key + r"=\{([\d,]*)\}", line)
    return tuple(int(d) for d in m.group(1).split(",") if d) if m else ()


def hlo_dots(hlo: str) -> list[Dot]:
    """Every dot instruction of an HLO module's text (inside fusions too), operands resolved by name."""
    shapes = {m.group(1): tuple(int(d) for d in m.group(2).split(",") if d) for m in _ARRAY.finditer(hlo)}
    dots = []
    for line in hlo.splitlines():
        m = _DOT.search(line)
        if m:
            dn = (
                (_dims(line, "lhs_contracting_dims"), _dims(line, "rhs_contracting_dims")),
                (_dims(line, "lhs_batch_dims"), _dims(line, "rhs_batch_dims")),
            )
            dots.append(Dot(shapes[m.group(1)], shapes[m.group(2)], dn))
    return dots


def per_call(
    fn: Callable[[], object], sync: Callable[[object], object], rounds: int, min_block_s: float = 0.02
) -> float:
    """Median seconds per call over `rounds` blocks, each long enough to time."""
    sync(fn())
    t0 = time.perf_counter()
    sync(fn())
    reps = max(3, math.ceil(min_block_s / max(time.perf_counter() - t0, 1e-7)))
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = None
        for _ in range(reps):
            out = fn()
        sync(out)  # host waits for the block's last call
        times.append((time.perf_counter() - t0) / reps)
    return sorted(times)[len(times) // 2]


def dot_times(dot: Dot, rounds: int) -> dict[str, float]:
    """Seconds for one dot alone: XLA:CPU as given, XLA:CPU canonical, torch canonical."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from jax import lax

    rng = np.random.default_rng(0)
    b, m, k, n = dot.canonical()
    a, c = (jax.device_put(rng.standard_normal(s, dtype=np.float32)) for s in (dot.lhs, dot.rhs))
    ca, cc = (rng.standard_normal(s, dtype=np.float32) for s in ((b, m, k), (b, k, n)))
    as_given = jax.jit(lambda x, y: lax.dot_general(x, y, dot.dimension_numbers, precision=lax.Precision.HIGHEST))
    canonical = jax.jit(lambda x, y: jnp.matmul(x, y, precision=lax.Precision.HIGHEST))
    ja, jc, ta, tc = jax.device_put(ca), jax.device_put(cc), torch.from_numpy(ca), torch.from_numpy(cc)
    return {
        "xla as given": per_call(lambda: as_given(a, c), jax.block_until_ready, rounds),
        "xla canonical": per_call(lambda: canonical(ja, jc), jax.block_until_ready, rounds),
        "torch canonical": per_call(lambda: torch.matmul(ta, tc), lambda out: out, rounds),
    }


def measure(shape: str, rounds: int) -> dict:
    """The update (jaxloop, torch eager, interleaved) and its dots' times alone, in ms."""
    import torch

    from benchmarks.common import median, sized_interleaved
    from benchmarks.step import JaxUpdate, TorchUpdate, host_batches, make_cfg
    from jaxloop.data.sources import load_splits

    torch.set_num_threads(os.cpu_count() or 1)  # the same threads as XLA:CPU, as in the step rows
    cfg = make_cfg(shape)
    splits = load_splits(cfg)
    batches = host_batches(cfg, splits, 4)
    jx = JaxUpdate(cfg, splits, batches)
    contenders = {"jaxloop": jx, "torch eager": TorchUpdate(cfg, splits, batches, jx.init_params)}
    updates = {k: 1e3 * median(v) for k, v in sized_interleaved(contenders, rounds, block_s=1.0).items()}
    dots = hlo_dots(jx.step.as_text())
    sums = {"xla as given": 0.0, "xla canonical": 0.0, "torch canonical": 0.0, "xla best": 0.0}
    for dot in dots:
        t = dot_times(dot, rounds)
        for key, v in t.items():
            sums[key] += 1e3 * v
        sums["xla best"] += 1e3 * min(t["xla as given"], t["xla canonical"])
    return {"update_ms": updates, "dots_ms": sums, "dots": len(dots), "gflop": sum(d.flops for d in dots) / 1e9}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["gpt64", "gpt128"], choices=["gpt64", "gpt128"])
    p.add_argument("--rounds", type=int, default=5)
    add_text_option(p)
    args = p.parse_args()
    use_text(args)
    from benchmarks.bench_dispatch import start

    start("worker")  # the loop's host memory policy and jax's default dispatch, as the step rows have
    for shape in args.shapes:
        r = measure(shape, args.rounds)
        u, d = r["update_ms"], r["dots_ms"]
        goal = GOAL * u["torch eager"]
        print(
            f"{shape}: {r['dots']} dots, {r['gflop']:.2f} GFLOP per update; ms, and the ratio to torch eager's update"
        )
        rows = [
            ("update, jaxloop (compiled train_step)", u["jaxloop"]),
            ("update, torch_ref eager", u["torch eager"]),
            (f"goal ({GOAL}x torch eager)", goal),
            ("dots alone, XLA:CPU as the step hands them", d["xla as given"]),
            ("dots alone, XLA:CPU, best of that and canonical", d["xla best"]),
            ("dots alone, torch.matmul canonical", d["torch canonical"]),
            ("jaxloop's update outside its dots (vs XLA best)", u["jaxloop"] - d["xla best"]),
            ("torch's update outside its dots", u["torch eager"] - d["torch canonical"]),
        ]
        for label, ms in rows:
            print(f"  {label:50} {ms:8.2f} {ms / u['torch eager']:6.2f}")


if __name__ == "__main__":
    main()
