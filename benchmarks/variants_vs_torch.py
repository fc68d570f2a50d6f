"""The update's compiled variants (forward, forward + backward, whole update) against torch_ref eager's, side by side
in one process on the same weights and batches: where jaxloop's update gains or loses against torch's.

    python benchmarks/variants_vs_torch.py --shape gpt128 --rounds 3 --calls 4

Each round times jaxloop's three variants (jaxloop.observe.update_breakdown.variant_times, what --log.breakdown
uses), the loop's donated train_step (benchmarks.step.JaxUpdate), then torch_ref's forward (the loss), forward +
backward, and whole update (torch_ref.step.train_update), `calls` calls each; rounds interleaved. Prints each
round, then one JSON line: per figure [median, min, max] in ms and the ratios jaxloop / torch per round's median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="gpt128", choices=("gpt64", "gpt128"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = p.parse_args(argv)

    import jax
    import torch

    from benchmarks.step import JaxUpdate, TorchUpdate, host_batches, make_cfg
    from jaxloop.data.sources import load_splits
    from jaxloop.observe.update_breakdown import variant_times
    from jaxloop.update.step import cross_entropy_loss
    from torch_ref.step import cross_entropy_loss as torch_loss
    from torch_ref.step import forward as torch_forward

    torch.set_num_threads(a.threads)
    cfg = make_cfg(a.shape)
    splits = load_splits(cfg)
    batches = host_batches(cfg, splits, 4)
    jaxloop_update = JaxUpdate(cfg, splits, batches)
    torch_update = TorchUpdate(cfg, splits, batches, jaxloop_update.init_params)
    first = [jax.device_put(batches[0])]

    def torch_variants() -> dict[str, float]:
        state, (x, y) = torch_update.state, torch_update.batches[0]

        def loss() -> torch.Tensor:
            return torch_loss(torch_forward(state, x), y)[0]

        out, t = {}, time.perf_counter()
        for _ in range(a.calls):
            loss().item()
        out["forward"], t = (time.perf_counter() - t) / a.calls, time.perf_counter()
        for _ in range(a.calls):
            state.optimizer.zero_grad(set_to_none=True)
            loss().backward()
        out["fwd_bwd"] = (time.perf_counter() - t) / a.calls
        state.optimizer.zero_grad(set_to_none=True)
        out["update"] = torch_update(a.calls)
        return out

    jaxloop_update(1), torch_update(1), torch_variants()  # warm-up
    rounds: dict[str, list[dict[str, float]]] = {"jaxloop": [], "torch": []}
    for r in range(a.rounds):
        v = variant_times(jaxloop_update.state, cross_entropy_loss, first, a.calls)
        v.pop("compile_s")
        v["loop_step"] = jaxloop_update(a.calls)
        rounds["jaxloop"].append(v)
        rounds["torch"].append(torch_variants())
        print(r, {k: {n: round(x * 1e3, 1) for n, x in rs[-1].items()} for k, rs in rounds.items()}, file=sys.stderr)

    def spread(xs: list[float], digits: int) -> list[float]:
        return [round(statistics.median(xs), digits), round(min(xs), digits), round(max(xs), digits)]

    out: dict = {"shape": a.shape, "rounds": a.rounds, "calls": a.calls, "threads": a.threads}
    for who, rs in rounds.items():
        for name in rs[0]:
            out[f"{who}.{name}_ms"] = spread([d[name] * 1e3 for d in rs], 1)
    pairs = {"forward": "forward", "fwd_bwd": "fwd_bwd", "update": "update", "loop_step": "update"}
    for mine, theirs in pairs.items():
        out[f"ratio.{mine}"] = spread([j[mine] / t[theirs] for j, t in zip(rounds["jaxloop"], rounds["torch"])], 3)
    out["load_average"] = [round(x, 1) for x in os.getloadavg()]
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
