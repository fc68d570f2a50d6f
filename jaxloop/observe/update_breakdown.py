"""Where an update's time goes: data wait, forward, backward, optimizer, and host work with the rest.

Three compiled variants of the update run on the same micro-batch, each timed once over a block of calls after
a warm-up call: the forward alone (the loss), forward + backward (the gradients) and the whole update (the
loop's own step: gradients and the optimizer). `split_update` turns those and the loop's own figures (its time
and data wait per update) into parts that sum to the loop's time per update:

    forward   = fwd                        backward = fwd+bwd - fwd           optimizer = update - fwd+bwd
    data_wait = the loop's data wait       host_and_rest = loop - data_wait - (forward + backward + optimizer)

A difference below 0 (timing noise between variants) counts as 0, and when the device parts exceed the loop's
time less its data wait (the variants timed alone ran slower than inside the loop) they are scaled down to fit,
host_and_rest then 0: the parts always sum to the whole. Used by `--log.breakdown` (the run report) and by the
benchmark row breakdown.gpt64.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

PARTS = ("data_wait", "forward", "backward", "optimizer", "host_and_rest")
PART_NOTES = {
    "data_wait": "the loop waiting for its next batch (metrics.jsonl's data_wait_ms)",
    "forward": "the loss alone, compiled and timed apart",
    "backward": "forward + backward (the gradients) less the forward",
    "optimizer": "the whole update (the loop's step) less forward + backward",
    "host_and_rest": "the loop's time less all of the above: dispatch, logging, metrics fetch, host work",
}


def split_update(
    loop_s: float, data_wait_s: float, forward_s: float, fwd_bwd_s: float, update_s: float
) -> dict[str, float]:
    """The loop's seconds per update by part (PARTS), from the loop's own figures and the three variants' times;
    the parts are >= 0 and sum to loop_s (data_wait_s is capped at loop_s)."""
    if min(loop_s, data_wait_s, forward_s, fwd_bwd_s, update_s) < 0:
        raise ValueError("times are >= 0")
    wait = min(data_wait_s, loop_s)
    device = {
        "forward": forward_s,
        "backward": max(fwd_bwd_s - forward_s, 0.0),
        "optimizer": max(update_s - max(fwd_bwd_s, forward_s), 0.0),
    }
    room, used = loop_s - wait, sum(device.values())
    if used > room:
        device = {k: v * room / used for k, v in device.items()} if used > 0 else device
    parts = {"data_wait": wait, **device}
    parts["host_and_rest"] = max(loop_s - sum(parts.values()), 0.0)
    return parts


def rounded(parts: dict[str, float], digits: int = 3) -> dict[str, float]:
    """Parts in ms rounded to `digits` decimals, as printed: they sum to the whole within len(parts) * 0.5e-digits ms."""
    return {k: round(v * 1e3, digits) for k, v in parts.items()}


def params_loss(state: Any, loss_fn: Callable[..., Any]) -> Callable[[Any, Any], Any]:
    """loss(params, batch): the update's loss of the state's model (train mode, a fixed rng, float32 matmuls pinned
    as in the loop's step), what the forward and forward + backward variants compile. A new function at each call:
    jax keeps a function's trace, so a caller tracing under other settings needs its own."""
    import jax

    from jaxloop.model.precision import pinned_matmuls

    rng = jax.random.PRNGKey(0)

    def loss(params: Any, batch: Any) -> Any:
        with pinned_matmuls():
            bound, _ = state.model.bind(params, state.model_state, True, rng, state.policy)
            return loss_fn(bound, batch, True)[0]

    return loss


def variant_times(
    state: Any, loss_fn: Callable[..., Any], micro_batches: Sequence[Any], calls: int
) -> dict[str, float]:
    """Seconds per update of the compiled forward, forward + backward (each once per micro-batch) and whole update
    (scan_steps(make_train_step(loss_fn)) over all of `micro_batches`, stacked: one update of len(micro_batches)
    accumulated micro-batches), each timed over `calls` calls after one warm-up call. Float32 matmuls are pinned
    as in the loop's step; nothing is donated, so `state` stays usable. Also `compile_s`: the three compiles."""
    import jax
    import jax.numpy as jnp

    from jaxloop.update.step import make_train_step, scan_steps

    loss = params_loss(state, loss_fn)
    first = micro_batches[0]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *micro_batches)
    t0 = time.perf_counter()
    forward = jax.jit(loss).lower(state.params, first).compile()
    fwd_bwd = jax.jit(jax.grad(loss)).lower(state.params, first).compile()
    update = jax.jit(scan_steps(make_train_step(loss_fn))).lower(state, stacked).compile()
    compile_s = time.perf_counter() - t0

    def timed(fn: Any, *args: Any) -> float:
        jax.block_until_ready(fn(*args))
        t = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        return (time.perf_counter() - t) / calls

    K = len(micro_batches)
    return {
        "forward": K * timed(forward, state.params, first),
        "fwd_bwd": K * timed(fwd_bwd, state.params, first),
        "update": timed(update, state, stacked),
        "compile_s": compile_s,
    }


CALLS = 10
"""Timed calls of each variant for --log.breakdown (after one warm-up call each)."""


def measure_run(
    cfg: Any, loss_fn: Callable[..., Any], state: Any, splits: Any, mesh: Any, updates_per_call: int = 1
) -> dict[str, Any]:
    """--log.breakdown at the end of a run: the variants' seconds per update on the run's first micro-batches (a
    loader of its own, no workers), the updates' accumulation, the updates each of the loop's device calls runs,
    and what measuring cost (`cost_s`: the three compiles and 3 x (CALLS + 1) calls), for summary.json's
    `update_breakdown`; the report splits the run's median step time with them (split_update)."""
    from jaxloop.data.pipeline import TrainLoader
    from jaxloop.update.distributed import shard_batch

    t0 = time.perf_counter()
    K = cfg.optim.accum_steps
    loader = TrainLoader(splits, seed=cfg.seed, batch_size=cfg.batch_size, workers=0)
    try:
        it = iter(loader)
        batches = [shard_batch(next(it), mesh) for _ in range(K)]
    finally:
        loader.close()
    times = variant_times(state, loss_fn, batches, CALLS)
    return {
        "variants_s": {k: times[k] for k in ("forward", "fwd_bwd", "update")},
        "accum_steps": K,
        "updates_per_call": updates_per_call,
        "calls": CALLS,
        "compile_s": times["compile_s"],
        "cost_s": time.perf_counter() - t0,
    }
