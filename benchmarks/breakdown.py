"""Where an update's time goes in the loop: data wait, forward, backward, optimizer, and host work with the rest.

The row `breakdown.gpt64` times, in this process, three compiled variants of the GPT's update on the same
batches: the forward alone (the loss), forward + backward (the gradients) and the whole update (gradients and
the optimizer: benchmarks.step.JaxUpdate), each once over a block of calls after its warm-up; and in a child, the
loop (`jaxloop.train.run`, as the loop.* rows: metrics.jsonl's step_ms and data_wait_ms). `split_update` turns
those into parts that sum to the loop's time per update:

    forward   = fwd                        backward = fwd+bwd - fwd           optimizer = update - fwd+bwd
    data_wait = the loop's data wait       host_and_rest = loop - data_wait - (forward + backward + optimizer)

A difference below 0 (timing noise between variants) counts as 0, and when the device parts exceed the loop's
time less its data wait (the update timed alone ran slower than inside the loop) they are scaled down to fit,
host_and_rest then 0: the parts always sum to the whole. A trace (--log.profile_steps, docs/observing.md) shows
the same split as the device's own events.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.common import Options, Row, failed, median, run_child

PARTS = ("data_wait", "forward", "backward", "optimizer", "host_and_rest")


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


def variant_times(cfg: Any, splits: Any, calls: int) -> dict[str, float]:
    """Seconds per call of the compiled forward, forward + backward, and whole update of cfg's model, each timed
    once over `calls` calls after one warm-up call (the same first micro-batches of the record order)."""
    import jax

    from benchmarks.step import JaxUpdate, host_batches
    from jaxloop.update.step import cross_entropy_loss

    batches = host_batches(cfg, splits, 2)
    update = JaxUpdate(cfg, splits, batches)
    state = update.state
    rng = jax.random.PRNGKey(0)

    def loss(params: Any, batch: Any) -> Any:
        bound, _ = state.model.bind(params, state.model_state, True, rng, state.policy)
        return cross_entropy_loss(bound, batch, True)[0]

    forward = jax.jit(loss).lower(state.params, update.batches[0]).compile()
    fwd_bwd = jax.jit(jax.grad(loss)).lower(state.params, update.batches[0]).compile()

    def timed(fn: Any) -> float:
        jax.block_until_ready(fn(state.params, update.batches[0]))
        t0 = time.perf_counter()
        out = None
        for i in range(calls):
            out = fn(state.params, update.batches[i % len(update.batches)])
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / calls

    times = {"forward": timed(forward), "fwd_bwd": timed(fwd_bwd)}
    update(1)
    times["update"] = update(calls)
    return times


def breakdown_row(opts: Options) -> Row:
    """breakdown.gpt64: the loop's ms per update by part (PARTS) for the GPT at context 64, batch 12."""
    from benchmarks.step import make_cfg, set_threads, splits_for

    row = Row(
        "breakdown.gpt64",
        "where the loop's update goes, GPT ctx64 b12 (4x128): data wait, forward, backward, "
        "optimizer, host and the rest",
        unit="ms/update",
        goal="info",
    )
    try:
        set_threads(opts)
        cfg = make_cfg("gpt64")
        variants = variant_times(cfg, splits_for(opts, "gpt64"), 20 if opts.quick else 200)
        steps = 30 if opts.quick else 300
        c = run_child(
            [
                "-m",
                "benchmarks.driver",
                "loop",
                "--shape",
                "gpt64",
                "--accum",
                "1",
                "--steps",
                str(steps),
                "--reps",
                "1",
                "--dir",
                str(opts.workdir / row.name),
            ],
            threads=opts.threads,
        )
        r = c.json()
        wait = [w for w in r.get("data_wait_ms", []) if w is not None]
        loop_s = median(r["loop_step_ms"]) / 1e3
        parts = split_update(
            loop_s, (median(wait) if wait else 0.0) / 1e3, variants["forward"], variants["fwd_bwd"], variants["update"]
        )
        row.jax = loop_s * 1e3
        row.extra = {"breakdown_ms": rounded(parts), "variants_ms": rounded(variants)}
        row.notes = (
            "; ".join(f"{k} {v:.3f} ms" for k, v in row.extra["breakdown_ms"].items())
            + f" (variants timed alone: forward {variants['forward'] * 1e3:.3f}, forward+backward "
            f"{variants['fwd_bwd'] * 1e3:.3f}, update {variants['update'] * 1e3:.3f} ms)"
        )
        return row
    except Exception as e:  # noqa: BLE001
        return failed(row, e)
