"""XLA:CPU compiler options on the GPT update, side by side in one process: each option set compiles the loop's
train_step (donating, as the loop does) ahead of time through `compile(compiler_options=...)`, is checked to give
the default's state bit for bit after one update, and is timed in interleaved rounds against the default.
`--program forward` does the same for the loop's evaluation step (jaxloop.update.step.make_eval_step: the loss, no
gradients), checked on the loss.

    python benchmarks/xla_options.py --shape gpt128 --rounds 3 --calls 2
    python benchmarks/xla_options.py --shape gpt128 --program forward --only control ynn_individual_dot ynn_off

Prints each round, then one JSON line: per option set [median, min, max] of its ms per update / the default's in
the same round, and whether its update matched the default's bit for bit ("identical") or by how much it moved, and
a hash of its optimized HLO (the same hash: the option changed nothing XLA compiled for this program);
`control` (an option that changes nothing) shows the harness's own bias between two compiles of the same program.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CANDIDATES: dict[str, dict[str, object]] = {
    "default": {},
    # a control: an option that changes nothing (the same HLO), compiled apart: its ratio is the harness's own bias
    "control": {"xla_embed_ir_in_executable": False},
    "thunk_runtime_off": {"xla_cpu_use_thunk_runtime": False},
    "xnnpack": {"xla_cpu_use_xnnpack": True},
    "onednn": {"xla_cpu_use_onednn": True},
    "concurrency_scheduler": {"xla_cpu_enable_concurrency_optimized_scheduler": True},
    "multi_output_fusion": {"xla_cpu_use_multi_output_fusion": True},
    # which ops XLA:CPU hands to YNNPACK (jaxlib 0.10.2's default fuses dots with the ops around them, attention's
    # second dot with its transposes the slowest: docs/speed.md); each dot alone, or none (Eigen's dots)
    "ynn_individual_dot": {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"},
    "ynn_off": {"xla_cpu_experimental_ynn_fusion_type": ""},
}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="gpt128", choices=("gpt64", "gpt128"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--calls", type=int, default=2)
    p.add_argument("--only", nargs="*", default=list(CANDIDATES), help="option sets (default: all)")
    p.add_argument("--order", choices=("alternate", "rotate"), default="rotate", help="each round's order")
    p.add_argument(
        "--program", choices=("update", "forward"), default="update", help="the train step, or the loss alone"
    )
    a = p.parse_args(argv)

    import jax
    import numpy as np

    from benchmarks.step import host_batches, make_cfg
    from jaxloop.data.sources import load_splits
    from jaxloop.loop.task import create_train_state
    from jaxloop.model.builtin import make_model
    from jaxloop.update.step import cross_entropy_loss, make_eval_step, make_train_step

    cfg = make_cfg(a.shape)
    splits = load_splits(cfg)
    batch = jax.device_put(host_batches(cfg, splits, 1)[0])
    model = make_model(cfg.model, splits.num_classes, cfg.precision)
    init = create_train_state(cfg, model, splits.example_x)
    host_init = jax.device_get(init)
    step = jax.jit(make_train_step(cross_entropy_loss), donate_argnums=0)
    if a.program == "forward":
        eval_step = make_eval_step(cross_entropy_loss)

        def forward(state, batch):
            return state, eval_step(state, batch)  # the state passes through: the calls below carry it as an update's

        step = jax.jit(forward)

    def fresh():
        return jax.tree.map(lambda x: jax.device_put(np.asarray(x)) if hasattr(x, "shape") else x, host_init)

    compiled, failed, moved, hlo = {}, {}, {}, {}
    for name in ["default", *[n for n in a.only if n != "default"]]:
        try:
            t0 = time.perf_counter()
            compiled[name] = step.lower(fresh(), batch).compile(compiler_options=CANDIDATES[name] or None)
            print(f"{name}: compiled in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
            hlo[name] = hashlib.sha256(compiled[name].as_text().encode()).hexdigest()[:12]
        except Exception as e:  # noqa: BLE001 - an option this jaxlib does not know
            failed[name] = " ".join(str(e).split())[:200]

    def result(fn) -> object:
        """What a program computes: the params after one update, or the loss."""
        state, metrics = fn(fresh(), batch)
        return jax.device_get(state.params if a.program == "update" else metrics["loss"])

    reference = result(compiled["default"])
    for name, fn in compiled.items():
        params = result(fn)
        diffs = [float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(reference))]
        moved[name] = "identical" if max(diffs) == 0 else f"max |diff| {max(diffs):.3g}"
    states = {name: fresh() for name in compiled}

    def timed(name: str) -> float:
        fn, state = compiled[name], states[name]
        t = time.perf_counter()
        for _ in range(a.calls):
            state, metrics = fn(state, batch)
        jax.block_until_ready((state, metrics))
        states[name] = state
        return (time.perf_counter() - t) / a.calls

    for name in compiled:
        timed(name)  # warm-up
    per_round: list[dict[str, float]] = []
    for r in range(a.rounds):
        names = list(compiled)
        order = (
            names[r % len(names) :] + names[: r % len(names)]
            if a.order == "rotate"
            else (names if r % 2 == 0 else names[::-1])
        )
        per_round.append({name: timed(name) for name in order})
        print(r, {k: round(v * 1e3, 1) for k, v in per_round[-1].items()}, file=sys.stderr)
    out: dict = {
        "shape": a.shape,
        "program": a.program,
        "rounds": a.rounds,
        "calls": a.calls,
        "failed": failed,
        "result": moved,
        "optimized_hlo": hlo,
    }
    for name in compiled:
        ratios = [d[name] / d["default"] for d in per_round]
        ms = [d[name] * 1e3 for d in per_round]
        out[name] = {
            "ratio_to_default": [round(statistics.median(ratios), 3), round(min(ratios), 3), round(max(ratios), 3)],
            "ms": [round(statistics.median(ms), 1), round(min(ms), 1), round(max(ms), 1)],
        }
    out["load_average"] = [round(x, 1) for x in os.getloadavg()]
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
