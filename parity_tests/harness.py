"""What every parity test shares: the configs, in-process drivers of both loops, and the measures.

Drivers. `jax_run` feeds jaxloop's `train_step` one micro-batch at a time from jaxloop's own
`TrainLoader`; `torch_run` feeds torch_ref's `train_update` K micro-batches at a time from torch_ref's
own DataLoader. Both start from jaxloop's initial weights (drawn by jax, transferred to torch) and
record, per optimizer update, the loss (float64 mean of its K micro-batch losses, as both loops log
it), the rate and the pre-clip gradient norm, plus parameter snapshots.

Precision. The suite runs with jax's x64 mode on (conftest.py), which fp64 needs. Under x64 a
precision="fp32" state is still float32 leaf for leaf, but optax then evaluates the schedule and the
Adam bias corrections in float64 before rounding them to float32: not the computation a float32
jaxloop run performs (test_trajectory shows the difference). So every non-fp64 jax computation runs
inside `jax_mode(precision)`, which turns x64 off for it: real float32 (and bf16/fp16) jaxloop.

Measures (implemented once in jaxloop.parity.measures, shared with the port check; each test says which
it uses and why):
- `curve_rel_diff(a, b)`: max over updates of |a_u - b_u| / |b_u| (losses, rates).
- `tree_rel_diff(a, b)`: max over parameter tensors of ||a - b||_2 / ||b||_2 (the relative error of
  each tensor as a whole; an elementwise ratio is meaningless for entries that pass through zero).
  Attention key biases are left out: they are a null direction of the model (see
  `test_trajectory.test_attention_key_bias_is_a_null_direction_that_adam_turns_into_noise`).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxloop.config.run import CheckpointConfig, Config, LogConfig, preset, to_dict
from jaxloop.parity import measures
from jaxloop.parity.measures import abs_diff, curve_rel_diff, flat_params, same_length, ulps_of_value  # noqa: F401 (the suite imports them from here)

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT / "tests" / "data" / "tinyshakespeare_60k.txt"
"""The first 60k characters of Tiny Shakespeare, shipped with the tests (tests/data/README.md names its
source); the GPT trains on it: 54k characters train, 6k validate."""
QUIET = LogConfig(progress="off", report=False, tensorboard=False)
F32_EPS = 2.0**-23
F64_EPS = 2.0**-52


# ----------------------------------------------------------------------------- the table


KINDS = ("cross", "own", "finding")


@dataclass
class Check:
    name: str
    measured: float
    tolerance: float
    reason: str
    passed: bool
    test: str = ""
    """The pytest node id of the test that made the check."""
    kind: str = "cross"
    """cross: jaxloop against torch_ref (what the report counts); own: one framework against itself or
    an oracle; finding: a measurement that explains a finding (listed apart)."""


@dataclass
class ParityTable:
    """Every check's measured maximum difference beside its tolerance, and curves for the report."""

    checks: list[Check] = field(default_factory=list)
    series: dict[str, dict[str, list]] = field(default_factory=dict)
    notes: dict[str, float] = field(default_factory=dict)
    """Measurements that explain a finding rather than check a contract (e.g. the size of a fixed defect)."""
    current_test: str = ""

    def check(self, name: str, measured: float, tolerance: float, reason: str, kind: str = "cross") -> None:
        """Record a measured difference and assert it is within tolerance (kind: see Check.kind)."""
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r}: one of {KINDS}")
        measured = float(measured)
        passed = bool(measured <= tolerance)  # NaN fails
        self.checks.append(Check(name, measured, float(tolerance), reason, passed, self.current_test, kind))
        assert passed, f"{name}: measured {measured:.3e} > tolerance {tolerance:.3e} ({reason})"

    def note(self, key: str, value: float) -> None:
        self.notes[key] = float(value)

    def add_series(self, key: str, **columns: Any) -> None:
        """Curves for the report's plots (e.g. loss per update of each framework)."""
        self.series[key] = {k: [float(x) for x in np.asarray(v, dtype=np.float64).ravel()] for k, v in columns.items()}

    def as_dict(self) -> dict[str, Any]:
        return {"checks": [vars(c) for c in self.checks], "series": self.series, "notes": self.notes}

    def lines(self) -> list[str]:
        width = max([len(c.name) for c in self.checks] + [5])
        out = [f"{'check':<{width}}  {'measured':>10}  {'tolerance':>10}  ok"]
        for c in self.checks:
            out.append(f"{c.name:<{width}}  {c.measured:>10.3e}  {c.tolerance:>10.3e}  {'yes' if c.passed else 'NO'}")
        return out


TABLE = ParityTable()


def write_results(path: str | Path) -> None:
    Path(path).write_text(json.dumps(TABLE.as_dict(), indent=1) + "\n")


# ----------------------------------------------------------------------------- configs


def mlp_cfg(run_dir: str | Path = "runs/parity_mlp", **changes: Any) -> Config:
    """The digits preset with a small MLP (64 -> 32 -> 32 -> 10), batch 32, 300 updates."""
    base = preset("digits")
    cfg = replace(
        base, run_dir=str(run_dir), steps=300, batch_size=32, log=QUIET, model=replace(base.model, hidden=(32, 32))
    )
    return replace(cfg, **changes)


def gpt_cfg(text_path: str | Path, run_dir: str | Path = "runs/parity_gpt", **changes: Any) -> Config:
    """The shakespeare preset with a tiny GPT (context 16, width 32, 2 blocks of 2 heads), batch 8, 300 updates."""
    base = preset("shakespeare")
    cfg = replace(
        base,
        run_dir=str(run_dir),
        steps=300,
        batch_size=8,
        log=QUIET,
        model=replace(base.model, context=16, d_model=32, n_layers=2, n_heads=2),
        data=replace(base.data, path=str(text_path)),
    )
    return replace(cfg, **changes)


def optim(cfg: Config, **changes: Any) -> Config:
    """cfg with OptimConfig fields changed (peak_lr, clip_norm, accum_steps, ema_decay, optimizer, lr_schedule)."""
    return replace(cfg, optim=replace(cfg.optim, **changes))


def optimizer_fields(cfg: Config, **changes: Any) -> Config:
    """cfg with fields of its optimizer's class changed (b1, weight_decay)."""
    return optim(cfg, optimizer=replace(cfg.optim.optimizer, **changes))


def schedule_fields(cfg: Config, **changes: Any) -> Config:
    """cfg with fields of its schedule's class changed (warmup_steps, init_lr)."""
    return optim(cfg, lr_schedule=replace(cfg.optim.lr_schedule, **changes))


def model(cfg: Config, **changes: Any) -> Config:
    return replace(cfg, model=replace(cfg.model, **changes))


# ----------------------------------------------------------------------------- jax side


def jax_mode(precision: str) -> contextlib.AbstractContextManager:
    """x64 on for fp64, off for every other precision (a real float32 / bf16 / fp16 jaxloop)."""
    return jax.enable_x64(precision == "fp64")


def optax_adamw(cfg: Config) -> Any:
    """jaxloop's optimizer as it was before jaxloop.update.optimizer computed the bias corrections exactly:
    MultiSteps(chain(clip, optax.adamw)), optax.adamw's own bias corrections (the same state layout)."""
    import optax

    from jaxloop.update.optimizer import decay_mask
    from jaxloop.update.schedules import make_schedule

    o = cfg.optim
    adamw = optax.adamw(
        make_schedule(cfg.optim, cfg.steps),
        b1=o.optimizer.b1,
        b2=o.optimizer.b2,
        eps=o.optimizer.eps,
        eps_root=0.0,
        weight_decay=o.optimizer.weight_decay,
        mask=decay_mask,
    )
    return optax.MultiSteps(optax.chain(optax.clip_by_global_norm(o.clip_norm), adamw), every_k_schedule=o.accum_steps)


def host(tree: Any) -> Any:
    """A device tree as numpy arrays (copies)."""
    return jax.tree.map(lambda x: np.array(x), jax.device_get(tree))


def set_torch_grads(model: Any, grads: Any) -> list:
    """Put a Flax-shaped gradient tree (device or host) into .grad of torch_ref's model (kernels transposed
    through torch_ref.models.param_map); returns the parameters, for clipping them."""
    import torch

    from torch_ref.models import param_map

    named = dict(model.named_parameters())
    flat = host(grads)
    params = []
    for path, name, transpose in param_map(model):
        g = flat
        for key in path:
            g = g[key]
        p = named[name]
        p.grad = torch.from_numpy(np.array(g.T if transpose else g)).to(p.dtype)
        params.append(p)
    return params


def jax_state(cfg: Config, splits: Any, init_params: Any = None):
    """jaxloop's fresh TrainState for cfg (call inside jax_mode(cfg.precision)); optionally other weights.

    With init_params the state is built around them as jaxloop.loop.task.run_state builds it around the
    model's own (the same rng, optimizer, policy and EMA), without drawing those first: a model's init is
    a compile of its own (the built-in models keep no variables besides params)."""
    from jaxloop.loop.task import create_train_state
    from jaxloop.model.builtin import make_model
    from jaxloop.model.interface import LinenModel
    from jaxloop.model.precision import get_policy
    from jaxloop.update.optimizer import make_optimizer
    from jaxloop.update.state import TrainState
    from jaxloop.update.step import cross_entropy_loss

    module = make_model(cfg.model, splits.num_classes, cfg.precision)
    if init_params is None:
        return create_train_state(cfg, module, splits.example_x)
    policy = get_policy(cfg.precision)
    _, step_rng = jax.random.split(jax.random.PRNGKey(cfg.seed))  # jaxloop.init_state's
    # converted on the host (float32 <-> float64, rounded to nearest even as XLA's convert rounds): a device
    # conversion (or jnp.asarray's copy, jit(stage)) compiles once per parameter shape
    params = jax.tree.map(lambda v: jax.device_put(np.asarray(v, policy.param_dtype)), init_params)
    return TrainState.create(
        model=LinenModel(module=module),
        params=params,
        model_state={},
        rng=step_rng,
        policy=policy,
        tx=make_optimizer(cfg.optim, cfg.steps, policy),
        ema_decay=cfg.optim.ema_decay,
        loss=cross_entropy_loss,
    )


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to n for the block: the suite's small models run 10-20x faster on one
    thread than on two cores that jax's threads also use (measured: 300 MLP updates 7.7 s -> 0.35 s)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@dataclass
class Run:
    """One framework's record of a run, per optimizer update u = 0, 1, ..."""

    losses: np.ndarray
    lrs: np.ndarray
    grad_norms: np.ndarray
    updated: np.ndarray
    loss_scales: np.ndarray
    init: Any
    params: Any
    snapshots: dict[int, Any] = field(default_factory=dict)
    """update count -> params after that many updates."""
    evals: list[tuple[int, float, float]] = field(default_factory=list)
    """(update count, validation metric, the rate of the next update) after each evaluation (evaluate_every)."""


def _jax_val_metric(cfg: Config, splits: Any, state: Any) -> float:
    """checkpoint.best_metric over the validation split (or cfg.eval_batches' subset), as jaxloop.loop.evaluate.ValidationPass
    averages it."""
    from jaxloop.data.pipeline import run_val_batches
    from jaxloop.update.step import eval_step

    sums, weights = [], []
    for batch in run_val_batches(cfg, splits):
        m = jax.device_get(eval_step(state, batch))
        sums.append(m)
        weights.append(float(m["weight"]))
    key = cfg.checkpoint.best_metric.removeprefix("val_")
    return sum(float(m[key]) * w for m, w in zip(sums, weights)) / sum(weights)


def jax_run(
    cfg: Config,
    splits: Any,
    updates: int,
    snapshot_every: int = 0,
    init_params: Any = None,
    batches: Iterator[dict] | None = None,
    x64: bool | None = None,
    evaluate_every: int = 0,
) -> Run:
    """`updates` optimizer updates of jaxloop's train_step on jaxloop's loader (or on `batches`).

    x64: jax's 64-bit mode for the run; default (None) as jax_mode(cfg.precision) sets it.
    evaluate_every: evaluate checkpoint.best_metric every this many updates and, for the plateau schedule,
    let jaxloop.loop.plateau decide the rate as jaxloop.loop.host_loop does (Run.evals).
    """
    from jaxloop.data.pipeline import TrainLoader
    from jaxloop.loop.plateau import Plateau
    from jaxloop.update import step as update_step
    from jaxloop.update.optimizer import set_learning_rate

    train_step = jax.jit(update_step.train_step, donate_argnums=0)  # as the loop builds it

    K = cfg.optim.accum_steps
    rows: list[tuple] = []
    snapshots: dict[int, Any] = {}
    evals: list[tuple[int, float, float]] = []
    plateau = Plateau.of(cfg) if cfg.optim.schedule == "plateau" else None
    with jax_mode(cfg.precision) if x64 is None else jax.enable_x64(x64):
        state = jax_state(cfg, splits, init_params)
        if plateau is not None:
            # placed on the device as the loop places it: set_learning_rate keeps the rate's placement, and
            # an uncommitted state turning committed there would compile train_step and eval_step again
            state = jax.device_put(state, jax.devices()[0])
        init = host(state.params)
        loader = TrainLoader(splits, seed=cfg.seed, batch_size=cfg.batch_size) if batches is None else None
        source = loader if loader is not None else batches
        try:
            for u in range(updates):
                window = []
                for _ in range(K):
                    state, metrics = train_step(state, next(source))
                    window.append(metrics)
                w = jax.device_get(window)
                rows.append(
                    (
                        float(np.mean([float(m["loss"]) for m in w])),
                        float(w[-1].get("lr", np.nan)),
                        float(w[-1].get("grad_norm", np.nan)),
                        bool(w[-1]["updated"]),
                        float(w[-1]["loss_scale"]),
                    )
                )
                if snapshot_every and (u + 1) % snapshot_every == 0:
                    snapshots[u + 1] = host(state.params)
                if evaluate_every and (u + 1) % evaluate_every == 0:
                    metric = _jax_val_metric(cfg, splits, state)
                    if plateau is not None and plateau.step(metric):
                        state = state.replace(opt_state=set_learning_rate(state.opt_state, plateau.rate))
                    evals.append((u + 1, metric, plateau.rate if plateau is not None else math.nan))
        finally:
            if loader is not None:
                loader.close()
        params = host(state.params)
    cols = list(zip(*rows)) if rows else [[]] * 5
    return Run(
        np.asarray(cols[0]),
        np.asarray(cols[1]),
        np.asarray(cols[2]),
        np.asarray(cols[3]),
        np.asarray(cols[4]),
        init,
        params,
        snapshots,
        evals,
    )


# ----------------------------------------------------------------------------- torch side


def torch_run(
    cfg: Config,
    splits: Any,
    init_params: Any,
    updates: int,
    snapshot_every: int = 0,
    clip: str = "optax",
    batches: Iterator | None = None,
    evaluate_every: int = 0,
) -> Run:
    """`updates` optimizer updates of torch_ref's train_update on torch_ref's loader (or on `batches`);
    evaluate_every: evaluate and step a ReduceLROnPlateau as torch_ref.train does (Run.evals)."""
    from torch_ref.data import make_train_loader, make_val_loader
    from torch_ref.models import export_jax_params
    from torch_ref.schedule import after_evaluation
    from torch_ref.state import create_torch_state
    from torch_ref.step import evaluate, train_update

    K = cfg.optim.accum_steps
    state = create_torch_state(cfg, splits, init_params=init_params, device="cpu")
    init = export_jax_params(state.model)
    source = iter(make_train_loader(cfg, splits, position=0, device="cpu")) if batches is None else batches
    rows, snapshots, evals = [], {}, []
    for u in range(updates):
        m = train_update(state, [next(source) for _ in range(K)], clip=clip)
        rows.append((m["loss"], m["lr"], m["grad_norm"], m["updated"], m["loss_scale"]))
        if snapshot_every and (u + 1) % snapshot_every == 0:
            snapshots[u + 1] = export_jax_params(state.model)
        if evaluate_every and (u + 1) % evaluate_every == 0:
            metric = evaluate(state, make_val_loader(cfg, splits, device="cpu"))[cfg.checkpoint.best_metric]
            after_evaluation(state.scheduler, metric)
            plateau = cfg.optim.schedule == "plateau"
            evals.append((u + 1, metric, state.optimizer.param_groups[0]["lr"] if plateau else math.nan))
    cols = list(zip(*rows)) if rows else [[]] * 5
    return Run(
        np.asarray(cols[0]),
        np.asarray(cols[1]),
        np.asarray(cols[2]),
        np.asarray(cols[3]),
        np.asarray(cols[4]),
        init,
        export_jax_params(state.model),
        snapshots,
        evals,
    )


# ----------------------------------------------------------------------------- measures
# One implementation of each measure, shared with the port check (jaxloop.parity.measures): curve_rel_diff,
# ulps_of_value, abs_diff, flat_params, same_length are imported from there; tree_rel_diff leaves key biases out.


def without_key_bias(flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The same parameters with the key third of every attention qkv bias set to 0 (a null direction)."""
    out = dict(flat)
    for key, value in flat.items():
        if key.endswith("attn/qkv/bias"):
            c = value.shape[-1] // 3
            value = value.copy()
            value[c : 2 * c] = 0.0
            out[key] = value
    return out


def tree_rel_diff(a: Any, b: Any) -> tuple[float, str]:
    """(max over tensors of ||a - b||_2 / ||b||_2, the tensor attaining it); key biases left out."""
    return measures.tree_rel_diff(a, b, prepare=without_key_bias)


def records(run_dir: str | Path, kind: str = "train") -> list[dict[str, Any]]:
    """The records of kind `kind` in run_dir/metrics.jsonl (both loops write the same file)."""
    from jaxloop.rundir.records import read_records

    return [r for r in read_records(run_dir) if r.get("kind") == kind]


# ----------------------------------------------------------------------------- whole runs (resume)


RESUME_AT = (13, 22, 30)
"""Updates at which the resume runs are interrupted (40 updates, checkpoint every 10, 22 updates per
epoch): 13 mid-epoch and between checkpoints; 22 at the epoch boundary; 30 on a checkpoint, mid-epoch."""


def resume_cfg(run_dir: str | Path) -> Config:
    """The digits MLP in float64, 40 updates of 2 micro-batches, evaluation and checkpoint every 10, one
    update per device call (so that a SIGTERM stops jaxloop at the update torch_ref is stopped at)."""
    cfg = optim(
        schedule_fields(
            mlp_cfg(run_dir, precision="fp64", steps=40, eval_every=10, log_every=1, updates_per_call=1),
            warmup_steps=10,
        ),
        accum_steps=2,
    )
    return replace(cfg, checkpoint=CheckpointConfig(every=10, keep_last=2, keep_best=1))


def interrupt_jax_run(cfg: Config, k: int) -> None:
    """jaxloop.train.run(cfg) stopped by a real SIGTERM delivered while update k - 1 is logged (log_every
    1, updates_per_call 1): the loop has already dispatched update k's call; it finishes it, saves update k
    and raises Interrupted, as on a cluster's preemption. (k - 1 must not be an evaluation or checkpoint
    update: there the loop dispatches nothing before evaluating and saving.)"""
    import signal

    from jaxloop.config.cli import Interrupted
    from jaxloop.loop.runner import run
    from jaxloop.observe.logger import RunLogger

    original = RunLogger.train

    def train(self, record):
        original(self, record)
        if record["step"] == k - 1:
            signal.raise_signal(signal.SIGTERM)

    RunLogger.train = train
    try:
        run(cfg)
    except Interrupted:
        return
    finally:
        RunLogger.train = original
    raise AssertionError(f"the run was not interrupted at update {k}")


def jax_checkpoint(cfg: Config, splits: Any, step: int | None = None):
    """(step, TrainState, data item) of run_dir's newest checkpoint (or of `step`), restored read-only."""
    import orbax.checkpoint as ocp

    from jaxloop.checkpoint.manager import Checkpointer

    with jax_mode(cfg.precision):
        ckpt = Checkpointer(cfg.checkpoint, cfg.run_dir, config=to_dict(cfg))
        try:
            target = jax_state(cfg, splits)
            step = ckpt.manager.latest_step() if step is None else step
            out = ckpt.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore())
            )
        finally:
            ckpt.close()
    return step, out["state"], dict(out["data"])


def data_position(data: dict[str, Any]) -> int:
    """Micro-batches consumed, from a jaxloop checkpoint's data item (either layout of it)."""
    return int(data["loader"]["position"]) if "loader" in data else int(data["position"])
