"""Rows memory.plan.*: what each memory plan (jaxloop.update.memory_plan) saves and costs on the shakespeare preset's GPT.

For each plan (memory.remat blocks, dots_saveable, full; memory.split 2, 4) against the plain one: the
compiled update's temporaries (XLA's memory_analysis: activations, gradients and workspace, the bytes a
plan is there to cut) and its time per update. Every plan trains the same state on the same batches (the
run's first micro-batches, one update per call); after one warm-up each, blocks of updates are timed
round-robin (plain, blocks, dots_saveable, ... again), median over rounds. jax = the plan's ms/update,
ref = the plain plan's, ratio = jax / ref; the notes and `extra` hold the temporaries and their ratio.

    python -m benchmarks --only memory.plan
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from benchmarks.common import Options, Row, failed, median, sized_interleaved, text_path

PLANS = {
    "blocks": {"remat": "blocks"},
    "dots_saveable": {"remat": "dots_saveable"},
    "full": {"remat": "full"},
    "split2": {"split": 2},
    "split4": {"split": 4},
}


def _cfg(opts: Options):
    """The shakespeare preset (ctx 128, batch 32, 4 x 128); under --smoke a tiny GPT on a generated text."""
    from jaxloop.config.run import preset

    base = preset("shakespeare")
    if not opts.smoke:
        return dataclasses.replace(base, data=dataclasses.replace(base.data, path=str(text_path())))
    text = opts.workdir / "plan-smoke.txt"
    text.write_text("to be or not to be that is the question\n" * 200)
    return dataclasses.replace(
        base,
        batch_size=8,
        model=dataclasses.replace(base.model, context=16, d_model=16, n_layers=1, n_heads=2),
        data=dataclasses.replace(base.data, path=str(text)),
    )


class PlanUpdate:
    """One update per call of the loop's compiled call (scan_steps over one micro-batch) under a memory plan."""

    def __init__(self, cfg, memory, task, splits, batches):
        import jax

        from jaxloop.loop.task import run_state
        from jaxloop.update.memory_plan import Footprint
        from jaxloop.update.step import make_train_step, scan_steps

        self.state = run_state(cfg, task, splits)
        self.batches = [jax.device_put({k: v[None] for k, v in b.items()}) for b in batches]
        call = jax.jit(scan_steps(make_train_step(task.loss, memory)), donate_argnums=0)
        t0 = time.perf_counter()
        self.call = call.lower(self.state, self.batches[0]).compile()
        self.compile_s = time.perf_counter() - t0
        self.footprint = Footprint.of(self.call)
        self.i = 0

    def __call__(self, updates: int) -> float:
        import jax

        t0 = time.perf_counter()
        metrics = None
        for _ in range(updates):
            self.state, metrics = self.call(self.state, self.batches[self.i % len(self.batches)])
            self.i += 1
        jax.block_until_ready((self.state, metrics))  # host waits for the block's last update
        return (time.perf_counter() - t0) / updates


def plan_rows(opts: Options) -> list[Row]:
    names = [f"memory.plan.{p}" for p in PLANS]
    try:
        from jaxloop.config.run import MemoryConfig
        from jaxloop.data.sources import record_order
        from jaxloop.loop.task import builtin_task

        cfg = _cfg(opts)
        task = builtin_task(cfg)
        splits = task.splits()
        batches = [splits.train.get(row) for row in record_order(cfg, splits.num_train, 0, 4)]
        contenders: dict[str, Any] = {"none": PlanUpdate(cfg, MemoryConfig(), task, splits, batches)}
        for name, fields in PLANS.items():
            contenders[name] = PlanUpdate(cfg, MemoryConfig(**fields), task, splits, batches)
        times = sized_interleaved(
            contenders,
            rounds=1 if opts.smoke else 3 if opts.quick else 7,
            block_s=0.01 if opts.smoke else 0.3 if opts.quick else 1.0,
            warm=(1, 1 if opts.smoke else 2),
        )
        med = {name: median(v) for name, v in times.items()}
        plain = contenders["none"].footprint
        rows = []
        for name, row_name in zip(PLANS, names):
            fp = contenders[name].footprint
            temp_ratio = fp.temporaries / max(plain.temporaries, 1)
            row = Row(
                row_name,
                f"update under memory.{'remat' if 'remat' in PLANS[name] else 'split'}="
                f"{next(iter(PLANS[name].values()))} vs the plain plan, GPT ctx{cfg.model.context} "
                f"b{cfg.batch_size} ({cfg.model.n_layers}x{cfg.model.d_model}), fp32",
                jax=1e3 * med[name],
                ref=1e3 * med["none"],
                unit="ms/update",
                ratio=med[name] / med["none"],
                goal="info",
            )
            row.notes = (
                f"temporaries {fp.temporaries / 2**20:.1f} MiB vs {plain.temporaries / 2**20:.1f} MiB "
                f"({temp_ratio:.2f}x); compile {contenders[name].compile_s:.1f} s"
            )
            row.extra = {
                "temp_bytes": fp.temporaries,
                "temp_bytes_plain": plain.temporaries,
                "temp_ratio": temp_ratio,
                "footprint_bytes": fp.total,
                "footprint_bytes_plain": plain.total,
                "rounds_ms": {k: [1e3 * x for x in times[k]] for k in ("none", name)},
            }
            rows.append(row)
        return rows
    except Exception as e:  # noqa: BLE001
        return [failed(Row(name, "memory plan"), e) for name in names]
