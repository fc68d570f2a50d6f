"""Per-device bytes of the training state at distributed.fsdp = 1, 2, 4 on 4 (forced host) devices.

The state is the shakespeare preset's GPT (or --d_model / --n_layers) with everything a run keeps:
params, the optimizer state (Adam's mu and nu, MultiSteps' accumulator and counters), the EMA of the
params, and fp16's loss-scale state. It is built straight into its shards (jaxloop.update.distributed.
create_sharded), and per device we count the bytes of the shards that device holds. Expected: the
replicated state's bytes / N for the sharded leaves, plus the small leaves every device keeps whole
(biases, norm scales, counters, the rng and the loss scale: `replicated_bytes`).

    python benchmarks/bench_memory.py                  # a few seconds; sets its own XLA_FLAGS
    python benchmarks/bench_memory.py --d_model 512 --n_layers 8 --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

DEVICES = 4
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402  (after XLA_FLAGS)

from benchmarks.common import add_text_option, text_path, use_text  # noqa: E402
from jaxloop.config.cli import parse_config  # noqa: E402
from jaxloop.data.sources import load_splits  # noqa: E402
from jaxloop.loop.task import create_train_state  # noqa: E402
from jaxloop.model.builtin import make_model  # noqa: E402
from jaxloop.update.distributed import create_sharded, make_mesh, state_bytes_per_device  # noqa: E402


def step_memory(cfg, splits, state, mesh) -> dict:
    """XLA's own accounting of the compiled train step on one device: arguments (the state's shards and
    the batch's), outputs, temporaries (activations, gathered weights, gradients), aliased (donated)."""
    from jaxloop.data.sources import record_order
    from jaxloop.update.distributed import pin_shardings, shard_batch
    from jaxloop.update.step import train_step

    batch = shard_batch(splits.train.get(record_order(cfg, splits.num_train, 0, 1)[0]), mesh)
    m = pin_shardings(train_step, state).lower(state, batch).compile().memory_analysis()
    return {
        "step_argument_bytes": m.argument_size_in_bytes,
        "step_output_bytes": m.output_size_in_bytes,
        "step_temp_bytes": m.temp_size_in_bytes,
        "step_alias_bytes": m.alias_size_in_bytes,
    }


def measure(argv: list[str], fsdp: int, step: bool = False) -> dict:
    cfg = parse_config([*argv, "--distributed.fsdp", str(fsdp)], "bench_memory", check_paths=False)
    splits = load_splits(cfg)
    model = make_model(cfg.model, splits.num_classes, cfg.precision)
    state = create_sharded(lambda: create_train_state(cfg, model, splits.example_x), make_mesh(cfg.distributed))
    per_device = state_bytes_per_device(state)
    leaves = jax.tree.leaves(state)
    extra = step_memory(cfg, splits, state, make_mesh(cfg.distributed)) if step else {}
    return {
        **extra,
        "fsdp": fsdp,
        "mesh": f"data {DEVICES // fsdp} x fsdp {fsdp}",
        "leaves": len(leaves),
        "sharded_leaves": sum(not x.sharding.is_fully_replicated for x in leaves),
        "total_bytes": sum(x.nbytes for x in leaves),  # one whole copy of the state
        "replicated_bytes": sum(x.nbytes for x in leaves if x.sharding.is_fully_replicated),
        "per_device_bytes": max(per_device.values()),
        "per_device_min_bytes": min(per_device.values()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_text_option(p)  # the text the GPT's vocabulary comes from
    p.add_argument("--d_model", type=int, default=128)
    p.add_argument("--n_layers", type=int, default=4)
    p.add_argument(
        "--step",
        action="store_true",
        help="also compile the train step and print XLA's per-device memory analysis of it (slow)",
    )
    p.add_argument("--json", action="store_true", help="also print the rows as one JSON line")
    a = p.parse_args()
    use_text(a)
    argv = [
        "--preset",
        "shakespeare",
        "--data.path",
        str(text_path()),
        "--model.d_model",
        str(a.d_model),
        "--model.n_layers",
        str(a.n_layers),
        "--precision",
        "fp16",
        "--optim.ema_decay",
        "0.999",
        "--optim.accum_steps",
        "4",
    ]
    rows = [measure(argv, n, a.step) for n in (1, 2, 4)]
    full = rows[0]["per_device_bytes"]
    print(
        f"GPT d_model {a.d_model}, {a.n_layers} layers, context 128; state = params + Adam mu, nu + "
        f"MultiSteps accumulator + EMA + loss scale; {DEVICES} devices"
    )
    print(
        f"{'fsdp':>4}  {'mesh':<16} {'sharded leaves':>14}  {'per device':>12}  {'of replicated':>13}  "
        f"{'bound: 1/N + small':>18}  {'small (replicated)':>18}"
    )
    for r in rows:
        n = r["fsdp"]
        bound = f"{(full / n + r['replicated_bytes']) / 2**20:>14.2f} MiB" if n > 1 else f"{'-':>18}"
        small = f"{r['replicated_bytes'] / 2**10:>14.1f} KiB" if n > 1 else f"{'(all)':>18}"
        print(
            f"{n:>4}  {r['mesh']:<16} {r['sharded_leaves']:>6} of {r['leaves']:<5}  "
            f"{r['per_device_bytes'] / 2**20:>9.2f} MiB  {r['per_device_bytes'] / full:>12.1%}  "
            f"{bound}  {small}"
        )
    if a.step:
        print("\ncompiled train step (the preset's batch_size 32 x context 128), per device, XLA memory_analysis:")
        print(f"{'fsdp':>4}  {'arguments':>12}  {'temporaries':>12}  {'outputs':>12}  {'donated':>12}")
        for r in rows:
            mib = lambda k, r=r: f"{r[k] / 2**20:>8.2f} MiB"  # noqa: E731
            print(
                f"{r['fsdp']:>4}  {mib('step_argument_bytes')}  {mib('step_temp_bytes')}  "
                f"{mib('step_output_bytes')}  {mib('step_alias_bytes')}"
            )
    if a.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
