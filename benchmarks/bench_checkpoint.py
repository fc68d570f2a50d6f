"""How long the training loop is blocked by an async checkpoint save, as a ratio to a synchronous save.

Both save the same TrainState (GPTs of 19M and 85M params: params + Adam moments + accumulator, 290 MiB
and 1.3 GiB) with jaxloop's Checkpointer, as the loop saves, in one run:

1. blocked: what `Checkpointer.save` costs the caller, async and sync rounds alternating (for async,
   the background write continues and is awaited before the next round, outside the measurement).
2. lost: the wall time a loop of donating steps over the whole state (an optimizer-like elementwise
   update) loses per save against the same loop without saves. This also counts what an async save
   costs outside save(): the hand-over thread and Orbax's writer competing for the same CPU cores and
   memory bandwidth, and the step after a save allocating fresh buffers instead of donating. Rounds
   are long enough for a background save to finish within the next round.

3. restore: the median time `Checkpointer.restore_latest` takes to read the synchronous save back into
   the state (with its digest checked, where the code checks one), and the digest's own cost: computing
   a save's (`checkpoint_digest`, in the hand-over thread for an async save) and a restore's check
   (`leaf_digests` of the restored state). The same script runs against an older checkout (before
   digests) for the before/after comparison: it then prints the restore time alone.

4. cpu (`--cpu`): the process CPU seconds a committed (sync) save costs, the state handed to Orbax as
   jax.Arrays or as the zero-copy NumPy views the loop hands it on one CPU process, alternating (each
   goes first every other round).
   Size `mlp` is the digits MLP's state (36 small leaves), where Orbax's fixed costs dominate; a third
   contender, one leaf of 4 floats saved with the same items, is the floor no state can go below.

Goal: blocked async / sync <= 0.1.

    python benchmarks/bench_checkpoint.py [--rounds 5] [--sizes 512x6 768x12]
    python benchmarks/bench_checkpoint.py --cpu --sizes mlp 512x6
"""

from __future__ import annotations

import argparse
import inspect
import logging
import math
import statistics
import tempfile
import time
from typing import Any

import jax
import numpy as np

from jaxloop.checkpoint.manager import Checkpointer
from jaxloop.config.run import CheckpointConfig, Config, DataConfig, ModelConfig, to_dict
from jaxloop.loop.task import create_train_state
from jaxloop.model.builtin import make_model
from jaxloop.update.state import TrainState


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sizes", nargs="+", default=["512x6", "768x12"], help="GPT d_model x n_layers, or mlp")
    p.add_argument("--cpu", action="store_true", help="measure Orbax's CPU per save, jax.Arrays vs NumPy views")
    args = p.parse_args()
    # The benchmark awaits each async save from this thread; Orbax then counts that wait against the next
    # save (on the hand-over thread) and warns "Waiting for previous save". Not a delay of any save here.
    logging.getLogger("absl").setLevel(logging.ERROR)
    for size in args.sizes:
        if args.cpu:
            measure_cpu(size, args.rounds)
        else:
            d_model, n_layers = (int(v) for v in size.split("x"))
            measure(d_model, n_layers, args.rounds)


def _state(size: str) -> tuple[ModelConfig, TrainState]:
    """The model config and fresh TrainState of a size: "mlp" (digits) or "DxL" (GPT d_model x n_layers)."""
    if size == "mlp":
        base = Config()
        return base.model, create_train_state(
            base, make_model(base.model, 10, base.precision), np.zeros((1, 64), np.float32)
        )
    d_model, n_layers = (int(v) for v in size.split("x"))
    model_cfg = ModelConfig(kind="gpt", context=128, d_model=d_model, n_layers=n_layers, n_heads=8)
    base = Config(preset="shakespeare", model=model_cfg, data=DataConfig(source="text", path="unused"))
    return model_cfg, create_train_state(base, make_model(base.model, 65, base.precision), np.zeros((1, 128), np.int32))


def measure_cpu(size: str, rounds: int) -> None:
    """Process CPU seconds per committed sync save: Orbax given jax.Arrays vs the loop's NumPy views."""
    from jaxloop.checkpoint.manager import _for_orbax, _host_views

    model_cfg, state = _state(size)
    views = _for_orbax(state, _host_views(state))
    print(
        f"state {size}: {len(jax.tree.leaves(state))} leaves, {sum(x.nbytes for x in jax.tree.leaves(state)) / 2**20:.1f} MiB; "
        f"views are NumPy: {all(isinstance(v, np.ndarray) for v in jax.tree.leaves(views))}"
    )
    floor = {"x": np.zeros(4, np.float32)}  # Orbax's fixed cost per save: the same items, almost no bytes
    cpu: dict[str, list[float]] = {"jax.Array": [], "NumPy views": [], "one 4-float leaf": []}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Checkpointer(
            CheckpointConfig(keep_last=1, keep_best=0, async_save=False),
            tmp,
            config=to_dict(Config(run_dir=tmp, model=model_cfg)),
        )
        saved = 0
        try:
            for step in range(1, 2 * rounds + 3):
                trio = (("jax.Array", state), ("NumPy views", views), ("one 4-float leaf", floor))
                for name, tree in trio if step % 2 else trio[::-1]:  # the order reverses every other round
                    c0 = time.process_time()
                    saved += 1
                    ckpt._save(saved, tree, {"position": saved}, None)  # noqa: SLF001
                    ckpt.wait()
                    if step > 2:  # the first rounds warm up Orbax's and the file system's paths
                        cpu[name].append(time.process_time() - c0)
        finally:
            ckpt.close()
    med = {k: statistics.median(v) for k, v in cpu.items()}
    print(
        f"process CPU per save (median of {len(cpu['jax.Array'])}): jax.Array {1e3 * med['jax.Array']:.1f} ms, "
        f"NumPy views {1e3 * med['NumPy views']:.1f} ms; ratio {med['NumPy views'] / med['jax.Array']:.2f}; "
        f"one 4-float leaf (Orbax's floor) {1e3 * med['one 4-float leaf']:.1f} ms"
    )


def measure(d_model: int, n_layers: int, rounds: int) -> None:
    model_cfg, state = _state(f"{d_model}x{n_layers}")
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    n_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    print(f"state: {n_params / 1e6:.1f}M params, {n_bytes / 2**20:.0f} MiB to save; device {jax.devices()[0]}")

    with tempfile.TemporaryDirectory() as tmp:
        ckpts = {
            mode: Checkpointer(
                CheckpointConfig(keep_last=1, keep_best=0, async_save=mode == "async"),
                f"{tmp}/{mode}",
                config=to_dict(Config(run_dir=f"{tmp}/{mode}", model=model_cfg)),
            )
            for mode in ("async", "sync")
        }
        try:
            blocked, committed = measure_blocked(ckpts, state, rounds)
            restore_s = measure_restore(ckpts["sync"], state, rounds)
            lost, step_ms, steps_per_round = measure_lost(ckpts, state, rounds, statistics.median(blocked["sync"]))
        finally:
            for ckpt in ckpts.values():
                ckpt.close()
    med = {m: statistics.median(v) for m, v in blocked.items()}
    for m in ("sync", "async"):
        print(
            f"{m:5s}: blocked median {1e3 * med[m]:8.1f} ms  (save committed after median "
            f"{1e3 * statistics.median(committed[m]):8.1f} ms; rounds {', '.join(f'{1e3 * t:.0f}' for t in blocked[m])} ms)"
        )
    print(f"ratio async/sync blocked time: {med['async'] / med['sync']:.3f}  (goal <= 0.1)")
    print(
        f"restore: median {1e3 * statistics.median(restore_s):.1f} ms "
        f"(rounds {', '.join(f'{1e3 * t:.0f}' for t in restore_s)} ms)"
    )
    digest = measure_digest(state, rounds)
    if digest is not None:
        print(
            f"digest: save {1e3 * digest[0]:.1f} ms (the hand-over thread's, for an async save), restore check "
            f"{1e3 * digest[1]:.1f} ms (medians)"
        )
    print(
        f"loop of donating steps ({step_ms:.1f} ms each, a save every {steps_per_round}): wall time lost per save "
        f"sync {1e3 * lost['sync']:.1f} ms, async {1e3 * lost['async']:.1f} ms; "
        f"ratio async/sync lost time: {lost['async'] / lost['sync']:.3f}"
    )


def measure_blocked(
    ckpts: dict[str, Checkpointer], state: TrainState, rounds: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    blocked: dict[str, list[float]] = {"async": [], "sync": []}
    committed: dict[str, list[float]] = {"async": [], "sync": []}
    for step in range(1, rounds + 2):
        for mode, ckpt in ckpts.items():
            t0 = time.perf_counter()
            ckpt.save(step, state, {"position": step}, check_finite=False)  # as the loop saves
            t1 = time.perf_counter()
            ckpt.wait()
            t2 = time.perf_counter()
            if step > 1:  # the first round warms up the I/O paths
                blocked[mode].append(t1 - t0)
                committed[mode].append(t2 - t0)
    return blocked, committed


def measure_restore(ckpt: Checkpointer, state: TrainState, rounds: int) -> list[float]:
    """Seconds per restore_latest of the last committed save, into a target like the loop's."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        restored = ckpt.restore_latest(state)
        jax.block_until_ready(restored.state)
        times.append(time.perf_counter() - t0)
    return times


def measure_digest(state: TrainState, rounds: int) -> tuple[float, float] | None:
    """Median seconds of a save's digest (over the NumPy views a CPU save hands Orbax) and of a restore's
    check (over the state's arrays); None for code without digests."""
    import jaxloop.checkpoint.manager as checkpoint

    if not hasattr(checkpoint, "checkpoint_digest"):
        return None
    from jaxloop.update.state import leaf_digests

    views = checkpoint._for_orbax(state, checkpoint._host_views(state))  # noqa: SLF001
    step = (1,) if "step" in inspect.signature(checkpoint.checkpoint_digest).parameters else ()  # since it records it
    save, check = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        checkpoint.checkpoint_digest(views, {"position": 1}, *step)
        t1 = time.perf_counter()
        leaf_digests(state)
        save.append(t1 - t0)
        check.append(time.perf_counter() - t1)
    return statistics.median(save), statistics.median(check)


def _bump(state: TrainState) -> TrainState:
    """An optimizer-like elementwise update of every float leaf: reads and writes the whole state."""

    def f(x: Any) -> Any:
        return x * 0.999 + 1e-3 if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x

    return state.replace(params=jax.tree.map(f, state.params), opt_state=jax.tree.map(f, state.opt_state))


def measure_lost(
    ckpts: dict[str, Checkpointer], state: TrainState, rounds: int, sync_s: float
) -> tuple[dict[str, float], float, int]:
    step = jax.jit(_bump, donate_argnums=0)
    state = jax.tree.map(lambda x: x.copy(), state)  # our own buffers: the steps donate them
    state = jax.block_until_ready(step(state))
    t0 = time.perf_counter()
    for _ in range(5):
        state = step(state)
    state = jax.block_until_ready(state)
    step_s = (time.perf_counter() - t0) / 5
    steps_per_round = max(2, math.ceil(2 * sync_s / step_s))  # a background save ends within a round

    def run(mode: str | None, start: int) -> float:
        nonlocal state
        t0 = time.perf_counter()
        for r in range(rounds):
            for _ in range(steps_per_round):
                state = step(state)
            if mode is not None and r < rounds - 1:  # the last round only runs, under the last save
                ckpts[mode].save(start + r, state, {"position": r}, check_finite=False)
        state = jax.block_until_ready(state)
        elapsed = time.perf_counter() - t0
        if mode is not None:
            ckpts[mode].wait()
        return elapsed

    wall: dict[str | None, list[float]] = {None: [], "sync": [], "async": []}
    for repeat in range(3):  # interleaved, medians: the machine's load drifts
        for mode in (None, "sync", "async"):
            wall[mode].append(run(mode, start=1000 * (repeat + 1)))
    base = statistics.median(wall[None])
    lost = {m: (statistics.median(wall[m]) - base) / (rounds - 1) for m in ("sync", "async")}
    return lost, 1e3 * step_s, steps_per_round


if __name__ == "__main__":
    main()
