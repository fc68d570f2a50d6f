"""Child-process entry points of the harness; each prints one JSON line (the parent adds wall time and peak RSS).

python -m benchmarks.driver loop --shape gpt64 --accum 1 --steps 300 --reps 2 --dir D
python -m benchmarks.driver compile [--cache DIR]
python -m benchmarks.driver stepmem --framework jax|torch --shape mlp --updates 20
python -m benchmarks.driver valloss --run_dir D     # a finished run's latest params, whole validation split
"""

from __future__ import annotations

import time

T_IMPORT = time.perf_counter()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from benchmarks.common import median  # noqa: E402


def _threads() -> int:
    return int(os.environ.get("JAXLOOP_BENCH_THREADS", os.cpu_count() or 1))


def loop(args: argparse.Namespace) -> dict:
    """jaxloop.train.run's time per update (its own step_ms) vs the compiled update alone, interleaved."""
    import jaxloop.train
    from benchmarks.step import JaxUpdate, host_batches, make_cfg
    from jaxloop.config.run import CheckpointConfig, LogConfig
    from jaxloop.data.sources import load_splits

    out: dict = {"loop_step_ms": [], "loop_crosscheck_ms": [], "alone_ms": [], "summaries": []}
    alone = None
    for rep in range(args.reps):
        run_dir = Path(args.dir) / f"run{rep}"
        cfg = make_cfg(
            args.shape,
            args.accum,
            steps=args.steps,
            log_every=10,
            eval_every=0,
            run_dir=str(run_dir),
            resume="never",
            checkpoint=CheckpointConfig(every=100, async_save=True),
            log=LogConfig(progress="off", report=False),
        )
        # a short K=4 run (75 updates) is shorter than the preset's warmup: the schedule's shape is not measured
        cfg = dataclasses.replace(
            cfg,
            optim=dataclasses.replace(
                cfg.optim,
                lr_schedule=dataclasses.replace(
                    cfg.optim.lr_schedule, warmup_steps=min(cfg.optim.lr_schedule.warmup_steps, args.steps)
                ),
            ),
        )
        summary = jaxloop.train.run(cfg)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        train = [r for r in records if r.get("kind") == "train" and "step_ms" in r]
        # every interval after the first, weighted by its updates: the loop's wall time per update, the
        # time its checkpoint saves block it included (step_ms counts it; evaluation is left out)
        spans = [(b["step"] - a["step"], b["step_ms"]) for a, b in zip(train, train[1:])]
        step_ms = [ms for _, ms in spans]
        waits = [r.get("data_wait_ms", 0.0) for r in train][1:]
        out["loop_step_ms"].append(sum(n * ms for n, ms in spans) / sum(n for n, _ in spans))
        out.setdefault("loop_median_step_ms", []).append(median(step_ms))
        out.setdefault("data_wait_ms", []).append(median(waits) if waits else None)
        t = summary.get("timings_s", {})
        outside = sum(t.get(k, 0.0) for k in ("setup", "compile", "eval", "checkpoint", "report"))
        out["loop_crosscheck_ms"].append(1e3 * (summary["wall_time_s"] - outside) / args.steps)
        out["summaries"].append(
            {
                "wall_time_s": summary["wall_time_s"],
                "timings_s": t,
                "final": summary.get("final"),
                "peak_mem_bytes": summary.get("peak_mem_bytes"),
            }
        )
        if alone is None:
            splits = load_splits(cfg)
            alone = JaxUpdate(cfg, splits, host_batches(cfg, splits, 4 * args.accum))
            alone(2)
            per = alone(3)
        n = max(5, int(1.0 / max(per, 1e-6)))
        out["alone_ms"].append(1e3 * median([alone(n) for _ in range(3)]))
    return out


def compile_(args: argparse.Namespace) -> dict:
    """The 4-block GPT (shakespeare preset shape): imports, state creation, first train_step compile."""
    t_start = time.perf_counter()
    from jaxloop.runtime.compilation import enable_compilation_cache, loaded_from_cache

    if args.cache:
        enable_compilation_cache(args.cache)
    import jax

    from benchmarks.step import host_batches, make_cfg
    from jaxloop.data.sources import load_splits
    from jaxloop.loop.task import create_train_state
    from jaxloop.model.builtin import make_model
    from jaxloop.update.step import eval_step, train_step

    t_imported = time.perf_counter()
    cfg = make_cfg(args.shape)
    splits = load_splits(cfg)
    state = create_train_state(cfg, make_model(cfg.model, splits.num_classes, cfg.precision), splits.example_x)
    batch = jax.device_put(host_batches(cfg, splits, 1)[0])
    jax.block_until_ready(state)
    t_state = time.perf_counter()
    c0, t0 = time.process_time(), time.perf_counter()
    step = jax.jit(train_step, donate_argnums=0)  # as the loop builds it
    lowered = step.lower(state, batch)  # trace + lower to StableHLO (Python; JAX's cache cannot skip it)
    c1, t1 = time.process_time(), time.perf_counter()
    with loaded_from_cache() as cache:
        step = lowered.compile()  # XLA compile, or a persistent-cache hit
    compile_s, compile_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    lower_s, lower_cpu_s = t1 - t0, c1 - c0
    t1 = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready((state, m))
    first_update_s = time.perf_counter() - t1
    c0, t0 = time.process_time(), time.perf_counter()
    eval_step.lower(state, batch).compile()
    eval_s, eval_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    return {
        "imports_s": t_imported - T_IMPORT,
        "state_s": t_state - t_imported,
        "compile_s": compile_s,
        "loaded_from_cache": cache["loaded"],
        "lower_s": lower_s,
        "lower_cpu_s": lower_cpu_s,
        "xla_s": compile_s - lower_s,
        "compile_cpu_s": compile_cpu_s,
        "first_update_s": first_update_s,
        "eval_compile_s": eval_s,
        "eval_compile_cpu_s": eval_cpu_s,
        "to_first_update_s": time.perf_counter() - T_IMPORT - eval_s,
        "setup_before_compile_s": t_state - t_start,
    }


def stepmem(args: argparse.Namespace) -> dict:
    """State, compile and `updates` updates of one framework alone (the parent reads the peak RSS)."""
    from benchmarks.step import JaxUpdate, TorchUpdate, host_batches, make_cfg
    from jaxloop.data.sources import load_splits

    cfg = make_cfg(args.shape, args.accum)
    splits = load_splits(cfg)
    batches = host_batches(cfg, splits, 4 * args.accum)
    if args.framework == "jax":
        fn = JaxUpdate(cfg, splits, batches)
    else:
        import torch

        torch.set_num_threads(_threads())
        fn = TorchUpdate(cfg, splits, batches, None)
    fn(1)
    return {"s_per_update": fn(args.updates)}


def valloss(args: argparse.Namespace) -> dict:
    """The loss of a run's latest checkpoint over its whole validation split (eval_batches left out), averaged
    over the records as the loop's evaluation averages them."""
    import jax

    from jaxloop.checkpoint.manager import read_checkpoint
    from jaxloop.config.run import from_dict
    from jaxloop.data.pipeline import eval_batch_size, val_batches
    from jaxloop.data.sources import load_splits
    from jaxloop.loop.task import builtin_task, run_state
    from jaxloop.update.step import eval_step

    cfg = from_dict(json.loads((Path(args.run_dir) / "config.json").read_text()))
    splits = load_splits(cfg)
    task = builtin_task(cfg, splits)
    _, _, saved = read_checkpoint(args.run_dir, "latest")
    state = run_state(cfg, task, splits)
    state = state.replace(
        params=jax.tree.map(lambda a, b: jax.numpy.asarray(b, a.dtype), state.params, saved["params"])
    )
    t0 = time.perf_counter()
    total = weight = 0.0
    for batch in val_batches(splits, eval_batch_size(cfg)):
        m = jax.device_get(eval_step(state, batch))
        total, weight = total + float(m["loss"]) * float(m["weight"]), weight + float(m["weight"])
    return {"val_loss": total / weight, "records": int(weight), "eval_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="mode", required=True)
    a = sub.add_parser("loop")
    a.add_argument("--shape", default="mlp")
    a.add_argument("--accum", type=int, default=1)
    a.add_argument("--steps", type=int, default=100)
    a.add_argument("--reps", type=int, default=1)
    a.add_argument("--dir", required=True)
    c = sub.add_parser("compile")
    c.add_argument("--shape", default="gpt128")
    c.add_argument("--cache", default="")
    m = sub.add_parser("stepmem")
    m.add_argument("--framework", choices=("jax", "torch"), required=True)
    m.add_argument("--shape", default="mlp")
    m.add_argument("--accum", type=int, default=1)
    m.add_argument("--updates", type=int, default=20)
    v = sub.add_parser("valloss")
    v.add_argument("--run_dir", required=True)
    args = p.parse_args(argv)
    fn = {"loop": loop, "compile": compile_, "stepmem": stepmem, "valloss": valloss}[args.mode]
    result = fn(args)
    sys.stdout.flush()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
