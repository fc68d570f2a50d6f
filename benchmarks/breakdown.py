"""Where an update's time goes in the loop: data wait, forward, backward, optimizer, and host work with the rest.

The row `breakdown.gpt64` times, in this process, three compiled variants of the GPT's update on the same
batches (jaxloop.observe.update_breakdown, what `--log.breakdown` puts in a run's report): the forward alone
(the loss), forward + backward (the gradients) and the whole update (gradients and the optimizer), each once over
a block of calls after its warm-up; and in a child, the loop (`jaxloop.train.run`, as the loop.* rows:
metrics.jsonl's step_ms and data_wait_ms). `split_update` turns those into parts that sum to the loop's time per
update (forward; backward = fwd+bwd - fwd; optimizer = update - fwd+bwd; data_wait; host_and_rest = the rest).
A trace (--log.profile_steps, docs/observing.md) shows the same split as the device's own events.
"""

from __future__ import annotations

from typing import Any

from benchmarks.common import Options, Row, failed, median, run_child
from jaxloop.observe.update_breakdown import PARTS, rounded, split_update

__all__ = ["PARTS", "breakdown_row", "rounded", "split_update", "variant_times"]


def variant_times(cfg: Any, splits: Any, calls: int) -> dict[str, float]:
    """Seconds per update of the compiled forward, forward + backward, and whole update of cfg's model
    (jaxloop.observe.update_breakdown.variant_times), each timed once over `calls` calls after one warm-up call,
    on the first micro-batch of the record order."""
    import jax

    from benchmarks.step import host_batches
    from jaxloop.loop.task import create_train_state
    from jaxloop.model.builtin import make_model
    from jaxloop.observe.update_breakdown import variant_times as timed_variants
    from jaxloop.update.step import cross_entropy_loss

    state = create_train_state(cfg, make_model(cfg.model, splits.num_classes, cfg.precision), splits.example_x)
    batches = [jax.device_put(b) for b in host_batches(cfg, splits, cfg.optim.accum_steps)]
    times = timed_variants(state, cross_entropy_loss, batches, calls)
    return {k: times[k] for k in ("forward", "fwd_bwd", "update")}


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
