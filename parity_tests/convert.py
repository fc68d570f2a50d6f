"""Move a run's newest checkpoint between the two loops, so the other one resumes it.

    python -m parity_tests.convert --from torch SRC_RUN_DIR DST_RUN_DIR   # torch_ref -> jaxloop
    python -m parity_tests.convert --from jax   SRC_RUN_DIR DST_RUN_DIR   # jaxloop -> torch_ref

then `python -m jaxloop.train --config DST_RUN_DIR/config.json` (or `python -m torch_ref.train ...`)
continues the run from the converted update. DST_RUN_DIR must not hold a checkpoint yet; it gets
config.json (the source run's, run_dir changed), vocab.json (text runs), metrics.jsonl (the source's
records up to the converted update) and the converted checkpoint.

What maps to what (one optimizer update u = applied updates so far):

| torch_ref checkpoint                        | jaxloop TrainState / checkpoint items                      |
|---------------------------------------------|------------------------------------------------------------|
| model weights (Linear (out, in))            | params (Dense kernels (in, out): transposed)               |
| AdamW state per parameter: step, exp_avg,   | ScaleByAdamState(count, mu, nu) (transposed like the       |
| exp_avg_sq                                  | weights)                                                   |
| state.step; LambdaLR last_epoch             | MultiStepsState.gradient_step; the schedule's counts       |
|                                             | (inject_hyperparams); ScaleByAdamState.count (all u)       |
| (between updates: no partial gradients)     | MultiStepsState.mini_step = 0, acc_grads = 0               |
| GradScaler scale, _growth_tracker (fp16)    | LossScaleState(scale, good_steps)                          |
| skipped, bad_streak                         | SkipWindowsState skipped, bad_streak (poisoned = False)    |
| EMA list (model.parameters() order)         | ema_params                                                 |
| position (micro-batches consumed)           | data item: loader state at that position                   |
| extra["best"] (best-metric tracker)         | data item: best                                            |
| header metrics                              | the checkpoint's metrics (for best-checkpoint retention)   |

Not carried over: jax's PRNG key (jaxloop derives it from the seed and never advances it) and
torch's RNG states (a converted torch_ref checkpoint gets the fresh state's, which is the state an
uninterrupted run without dropout has); dropout masks differ between the frameworks anyway.

This module imports both jax and torch; torch_ref itself never imports jax.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxloop.config.run import Config, from_dict, to_dict
from jaxloop.data.sources import Splits, load_splits, write_vocab
from jaxloop.rundir.layout import RunLayout

# ----------------------------------------------------------------------------- state <-> state


def _adam_and_schedule(opt_state: Any) -> tuple[Any, Any]:
    """(the ScaleByAdamState, the schedule's count) inside jaxloop's optimizer state."""
    import optax

    from jaxloop.update.optimizer import INJECTED, find_state

    # the schedule's own clock: inject_hyperparams keeps the wrapped schedule's state by hyperparameter name
    count = find_state(opt_state, INJECTED).hyperparams_states["learning_rate"].count
    return find_state(opt_state, optax.ScaleByAdamState), count


def _get(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def jax_state_from_torch(cfg: Config, splits: Splits, tstate: Any) -> Any:
    """jaxloop's TrainState at torch_ref state `tstate`'s update (call inside harness.jax_mode)."""
    import jax
    import jax.numpy as jnp
    import optax

    from jaxloop.update.optimizer import INJECTED, LossScaleState, SkipWindowsState, find_state, replace_state
    from parity_tests.harness import jax_state
    from torch_ref.models import export_jax_params, param_map

    state = jax_state(cfg, splits, export_jax_params(tstate.model))
    dtype = state.policy.param_dtype
    named = dict(tstate.model.named_parameters())
    mu: dict = {}
    nu: dict = {}
    counts = set()
    for path, name, transpose in param_map(tstate.model):
        p = named[name]
        st = tstate.optimizer.state.get(p, {})
        for moments, key in ((mu, "exp_avg"), (nu, "exp_avg_sq")):
            value = st[key].detach().cpu().numpy() if key in st else np.zeros(tuple(p.shape), np.float64)
            _set(moments, path, np.array(value.T if transpose else value))
        counts.add(int(st["step"]) if "step" in st else 0)
    if counts != {tstate.step}:
        raise ValueError(f"AdamW step counts {sorted(counts)} differ from the update count {tstate.step}")
    count = jnp.asarray(tstate.step, jnp.int32)
    as_like = lambda ref, tree: jax.tree.map(lambda r, v: jnp.asarray(v, dtype), ref, tree)  # noqa: E731

    def fill(node: Any) -> Any:
        if isinstance(node, optax.ScaleByAdamState):
            return optax.ScaleByAdamState(count=count, mu=as_like(node.mu, mu), nu=as_like(node.nu, nu))
        return node

    opt = jax.tree.map(fill, state.opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
    opt = replace_state(
        opt,
        optax.MultiStepsState,
        mini_step=jnp.zeros([], jnp.int32),
        gradient_step=count,
        acc_grads=jax.tree.map(jnp.zeros_like, find_state(opt, optax.MultiStepsState).acc_grads),
    )
    injected = find_state(opt, INJECTED)  # the schedule's clocks: update u
    opt = replace_state(
        opt,
        type(injected),
        count=count,
        hyperparams_states={k: v._replace(count=count) for k, v in injected.hyperparams_states.items()},
    )
    opt = replace_state(
        opt,
        SkipWindowsState,
        poisoned=jnp.zeros([], bool),
        bad_streak=jnp.asarray(tstate.bad_streak, jnp.int32),
        skipped=jnp.asarray(tstate.skipped, jnp.int32),
    )
    if tstate.scaler.is_enabled():
        sd = tstate.scaler.state_dict()
        opt = replace_state(
            opt,
            LossScaleState,
            scale=jnp.asarray(sd["scale"], jnp.float32),
            factor=jnp.asarray(sd["scale"] / cfg.optim.accum_steps, jnp.float32),
            good_steps=jnp.asarray(sd["_growth_tracker"], jnp.int32),
        )
    ema = state.ema_params
    if tstate.ema is not None:
        by_name = dict(zip([n for n, _ in tstate.model.named_parameters()], tstate.ema))
        tree: dict = {}
        for path, name, transpose in param_map(tstate.model):
            value = by_name[name].detach().cpu().numpy()
            _set(tree, path, value.T if transpose else value)
        ema = as_like(state.params, tree)
    return state.replace(opt_state=opt, ema_params=ema)


def torch_state_from_jax(
    cfg: Config, splits: Splits, jstate: Any, position: int, best: dict[str, Any] | None = None
) -> Any:
    """torch_ref's TrainState at jaxloop state `jstate`'s update, its loader at micro-batch `position`."""
    import optax
    import torch

    from jaxloop.update.optimizer import LossScaleState, SkipWindowsState, find_state
    from parity_tests.harness import host
    from torch_ref.models import param_map
    from torch_ref.state import create_torch_state

    opt = jstate.opt_state
    mini_step = int(find_state(opt, optax.MultiStepsState).mini_step)
    if mini_step != 0:
        raise ValueError(
            f"the jax state is inside an accumulation window (mini_step {mini_step}); convert at an update boundary"
        )
    step = int(find_state(opt, optax.MultiStepsState).gradient_step)
    adam, sched_count = _adam_and_schedule(opt)
    if int(adam.count) != step or int(sched_count) != step:
        raise ValueError(f"adam count {int(adam.count)} / schedule count {int(sched_count)} != update {step}")
    tstate = create_torch_state(cfg, splits, init_params=host(jstate.params), device="cpu")
    mu, nu = host(adam.mu), host(adam.nu)
    named = dict(tstate.model.named_parameters())
    ema_by_name = {}
    ema_tree = host(jstate.ema_params) if jstate.ema_params is not None else None
    for path, name, transpose in param_map(tstate.model):
        p = named[name]
        to_torch = lambda a, transpose=transpose, p=p: torch.from_numpy(np.array(a.T if transpose else a)).to(p.dtype)  # noqa: E731
        if step > 0:
            tstate.optimizer.state[p] = {
                "step": torch.tensor(float(step)),
                "exp_avg": to_torch(_get(mu, path)),
                "exp_avg_sq": to_torch(_get(nu, path)),
            }
        if ema_tree is not None:
            ema_by_name[name] = to_torch(_get(ema_tree, path))
    if ema_tree is not None:
        tstate.ema = [ema_by_name[n] for n, _ in tstate.model.named_parameters()]
    # The schedule at update `step`: LambdaLR after `step` scheduler.step() calls.
    lrs = [base * fn(step) for base, fn in zip(tstate.scheduler.base_lrs, tstate.scheduler.lr_lambdas)]
    sd = tstate.scheduler.state_dict()
    sd.update(last_epoch=step, _step_count=step + 1, _last_lr=lrs)
    tstate.scheduler.load_state_dict(sd)
    for group, lr in zip(tstate.optimizer.param_groups, lrs):
        group["lr"] = lr
    if tstate.scaler.is_enabled():
        sd = tstate.scaler.state_dict()
        sd.update(
            scale=float(find_state(opt, LossScaleState).scale),
            _growth_tracker=int(find_state(opt, LossScaleState).good_steps),
        )
        tstate.scaler.load_state_dict(sd)
    tstate.step, tstate.position = step, int(position)
    tstate.skipped = int(find_state(opt, SkipWindowsState).skipped)
    tstate.bad_streak = int(find_state(opt, SkipWindowsState).bad_streak)
    if best is not None:
        tstate.extra["best"] = dict(best)
    return tstate


# ----------------------------------------------------------------------------- run dir <-> run dir


def _config(src: Path, dst: Path) -> Config:
    saved = json.loads(RunLayout(src).config.read_text())
    return from_dict({**saved, "run_dir": str(dst)})


def _copy_records(src: Path, dst: Path, step: int) -> None:
    """The source's metrics.jsonl records up to the converted update (what a resume would keep)."""
    from jaxloop.rundir.records import kept_on_resume, read_records

    kept = [r for r in read_records(src) if kept_on_resume(r, step)]
    (dst / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))


def _prepare(src: Path, dst: Path) -> tuple[Config, Splits]:
    if not RunLayout(src).config.exists():
        raise SystemExit(f"convert: {src} holds no config.json (not a run directory)")
    if RunLayout(dst).checkpoints.exists() and any(RunLayout(dst).checkpoints.iterdir()):
        raise SystemExit(f"convert: {dst} already holds checkpoints; choose an empty run directory")
    cfg = _config(src, dst)
    splits = load_splits(cfg)
    dst.mkdir(parents=True, exist_ok=True)
    # marked as a run's, as a run marks its directory when it starts (jaxloop.rundir.rules): the loop that
    # resumes it takes it for one by that evidence
    RunLayout(dst).marker.write_text(json.dumps({"created": time.time(), "converted_from": str(src)}) + "\n")
    return cfg, splits


def torch_to_jax(src: str | Path, dst: str | Path) -> int:
    """Convert torch_ref run `src`'s newest checkpoint into jaxloop run directory `dst`; its update."""
    from jaxloop.checkpoint.manager import Checkpointer
    from jaxloop.data.pipeline import TrainLoader
    from parity_tests.harness import jax_mode
    from torch_ref.checkpoint import CheckpointManager, _path, _read_header
    from torch_ref.state import create_torch_state

    src, dst = Path(src), Path(dst)
    cfg, splits = _prepare(src, dst)
    manager = CheckpointManager(cfg, src)
    restored = manager.restore_latest()
    if restored is None:
        raise SystemExit(f"convert: {src} holds no valid torch_ref checkpoint")
    step, payload = restored
    metrics = _read_header(_path(manager.directory, step))[0].get("metrics")
    tstate = create_torch_state(cfg, splits, device="cpu")
    tstate.load_state_dict(payload)
    loader = TrainLoader(splits, seed=cfg.seed, batch_size=cfg.batch_size, position=tstate.position)
    loader_state = loader.state()
    loader.close()
    best = payload.get("extra", {}).get("best", {"best": None, "best_step": None, "since_best": 0})
    with jax_mode(cfg.precision):
        jstate = jax_state_from_torch(cfg, splits, tstate)
        ckpt = Checkpointer(
            cfg.checkpoint,
            dst,
            config=to_dict(cfg),
            metadata={"converted_from": "torch_ref", "source": str(src), "step": step},
        )
        try:
            ckpt.save(step, jstate, {"loader": loader_state, "best": best}, metrics=metrics)
        finally:
            ckpt.close()
    RunLayout(dst).config.write_text(json.dumps(to_dict(cfg), indent=2) + "\n")
    write_vocab(str(dst), splits)
    _copy_records(src, dst, step)
    return step


def jax_to_torch(src: str | Path, dst: str | Path) -> int:
    """Convert jaxloop run `src`'s newest checkpoint into torch_ref run directory `dst`; its update."""
    from jaxloop.checkpoint.manager import Checkpointer
    from parity_tests.harness import jax_mode, jax_state
    from torch_ref.checkpoint import CheckpointManager

    src, dst = Path(src), Path(dst)
    cfg, splits = _prepare(src, dst)
    with jax_mode(cfg.precision):
        ckpt = Checkpointer(cfg.checkpoint, src, config=to_dict(cfg))
        try:
            restored = ckpt.restore_latest(jax_state(cfg, splits))
            metrics = ckpt.manager.metrics(restored.step) if restored is not None else None
        finally:
            ckpt.close()
        if restored is None:
            raise SystemExit(f"convert: {src} holds no valid jaxloop checkpoint")
        data = restored.data
        position = int(data["loader"]["position"]) if "loader" in data else int(data["position"])
        tstate = torch_state_from_jax(cfg, splits, restored.state, position, data.get("best"))
    CheckpointManager(cfg, dst).save(restored.step, tstate.state_dict(), dict(metrics) if metrics else None)
    RunLayout(dst).config.write_text(json.dumps(to_dict(cfg), indent=2) + "\n")
    write_vocab(str(dst), splits)
    _copy_records(src, dst, restored.step)
    return restored.step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parity_tests.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--from",
        dest="source",
        choices=("torch", "jax"),
        required=True,
        help="the loop that wrote SRC_RUN_DIR's checkpoints",
    )
    parser.add_argument("src", metavar="SRC_RUN_DIR")
    parser.add_argument("dst", metavar="DST_RUN_DIR")
    args = parser.parse_args(argv)
    import jax

    jax.config.update("jax_enable_x64", True)  # before any array: fp64 needs it; jax_mode turns it off otherwise
    if args.source == "torch":
        step, target = torch_to_jax(args.src, args.dst), "jaxloop.train"
    else:
        step, target = jax_to_torch(args.src, args.dst), "torch_ref.train"
    print(
        f"converted update {step} of {args.src} into {args.dst}; resume with "
        f"python -m {target} --config {Path(args.dst) / 'config.json'}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
