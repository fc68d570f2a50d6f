"""How long the training loop is blocked by an async checkpoint save, as a ratio to a synchronous save.

Both save the same TrainState (GPTs of 19M and 85M params: params + Adam moments + accumulator, 290 MiB
and 1.3 GiB) with jaxloop's Checkpointer, as the loop saves, alternating async and sync rounds in one
run; the blocked time is what `Checkpointer.save` costs the caller (for async, the background write
continues and is awaited before the next round, outside the measurement). The async blocked time is
mostly a fixed per-leaf cost plus a host copy, so the ratio falls as the state grows. Goal: <= 0.1.

    python benchmarks/bench_checkpoint.py [--rounds 5] [--sizes 512x6 768x12]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import jax
import numpy as np

from jaxloop.checkpoint import Checkpointer, quiet_orbax
from jaxloop.config import CheckpointConfig, Config, DataConfig, ModelConfig
from jaxloop.models import make_model
from jaxloop.state import create_train_state


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sizes", nargs="+", default=["512x6", "768x12"], help="GPT d_model x n_layers")
    args = p.parse_args()
    quiet_orbax()
    for size in args.sizes:
        d_model, n_layers = (int(v) for v in size.split("x"))
        measure(d_model, n_layers, args.rounds)


def measure(d_model: int, n_layers: int, rounds: int) -> None:
    model_cfg = ModelConfig(kind="gpt", context=128, d_model=d_model, n_layers=n_layers, n_heads=8)
    base = Config(preset="shakespeare", model=model_cfg, data=DataConfig(source="text", path="unused"))
    state = create_train_state(base, make_model(base, 65), np.zeros((1, 128), np.int32))
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    n_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    print(f"state: {n_params / 1e6:.1f}M params, {n_bytes / 2**20:.0f} MiB to save; device {jax.devices()[0]}")

    blocked: dict[str, list[float]] = {"async": [], "sync": []}
    total: dict[str, list[float]] = {"async": [], "sync": []}
    with tempfile.TemporaryDirectory() as tmp:
        ckpts = {mode: Checkpointer(Config(run_dir=f"{tmp}/{mode}", model=model_cfg,
                                           checkpoint=CheckpointConfig(keep_last=1, keep_best=0,
                                                                       async_save=mode == "async")),
                                    f"{tmp}/{mode}")
                 for mode in ("async", "sync")}
        try:
            for step in range(1, rounds + 2):
                for mode, ckpt in ckpts.items():
                    t0 = time.perf_counter()
                    ckpt.save(step, state, {"position": step}, check_finite=False)  # as the loop saves
                    t1 = time.perf_counter()
                    ckpt.wait()
                    t2 = time.perf_counter()
                    if step > 1:  # the first round warms up compilation of the finiteness check and I/O paths
                        blocked[mode].append(t1 - t0)
                        total[mode].append(t2 - t0)
        finally:
            for ckpt in ckpts.values():
                ckpt.close()
    med = {m: statistics.median(v) for m, v in blocked.items()}
    for m in ("sync", "async"):
        print(f"{m:5s}: blocked median {1e3 * med[m]:8.1f} ms  (save committed after median "
              f"{1e3 * statistics.median(total[m]):8.1f} ms; rounds {', '.join(f'{1e3 * t:.0f}' for t in blocked[m])} ms)")
    print(f"ratio async/sync blocked time: {med['async'] / med['sync']:.3f}  (goal <= 0.1)")


if __name__ == "__main__":
    main()
