"""The optimizer and schedule menu's parity runs, shared by test_optimizers.py and test_schedules.py.

A combination is an OptimConfig change on the digits MLP (64-32-32-10, batch 32): every optimizer under
the default warmup_cosine schedule, and every schedule under AdamW. Each is run for UPDATES updates by both
loops' drivers (harness.jax_run / torch_run) with K = 1 and K = 4 micro-batches per update, in float64
and float32, from the same initial weights (drawn once by jax) and each loop's own micro-batches (the
same records: test_data_order), with clip_norm CLIP so that clipping acts on most updates. The eight runs
of a combination are made once and shared by its checks (`combination_runs`); torch runs on one thread
(harness.torch_threads).

Checks per combination (`check_combination`): the rate of every update (float64 relative; float32 in ulps
of torch's float64 rate), the loss of every update and the params after UPDATES updates (float64; float32
against a measured bound), and that clipping acted.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from jaxloop.config.optimizers import AdagradConfig, AdamConfig, LionConfig, RMSpropConfig, SGDConfig
from jaxloop.config.run import Config, validate
from jaxloop.config.schedules import (
    ConstantConfig,
    CosineRestartsConfig,
    ExponentialConfig,
    InverseSqrtConfig,
    LinearConfig,
    MultiStepConfig,
    OneCycleConfig,
    PlateauConfig,
    PolynomialConfig,
    StepConfig,
    WSDConfig,
)
from parity_tests.harness import (
    Run,
    curve_rel_diff,
    host,
    jax_mode,
    jax_run,
    jax_state,
    mlp_cfg,
    optim,
    torch_run,
    torch_threads,
    tree_rel_diff,
    ulps_of_value,
)

UPDATES = 300
CLIP = 0.5
"""clip_norm of every combination: the MLP's mean gradient norm is above it on most updates (measured
and checked per combination: `clipped fraction`)."""
VARIANTS = (("fp64", 1), ("fp64", 4), ("fp32", 1), ("fp32", 4))

OPTIMIZERS: dict[str, dict[str, Any]] = {
    "adamw": {},
    "adam": dict(optimizer=AdamConfig(weight_decay=1e-2)),
    "sgd": dict(optimizer=SGDConfig(momentum=0.9, dampening=0.1, weight_decay=1e-2), peak_lr=0.05),
    "sgd_nesterov": dict(optimizer=SGDConfig(momentum=0.9, nesterov=True, weight_decay=1e-2), peak_lr=0.05),
    "rmsprop": dict(optimizer=RMSpropConfig(alpha=0.9, momentum=0.5, centered=True, weight_decay=1e-2), peak_lr=1e-3),
    "adagrad": dict(
        optimizer=AdagradConfig(lr_decay=1e-3, initial_accumulator_value=0.1, weight_decay=1e-2), peak_lr=0.05
    ),
    "lion": dict(optimizer=LionConfig(b2=0.99, weight_decay=0.1), peak_lr=1e-3),
}
"""Each optimizer under warmup_cosine (the default schedule: the rate changes at every update), with the
options that distinguish torch's conventions switched on (dampening, nesterov, centered and momentum,
lr_decay and a starting accumulator, L2 weight decay): OptimConfig fields over mlp_cfg's."""

SCHEDULES: dict[str, dict[str, Any]] = {
    "warmup_cosine": {},
    "constant": dict(lr_schedule=ConstantConfig(warmup_steps=20, init_lr=3e-4)),
    "linear": dict(lr_schedule=LinearConfig(end_lr=0.0)),
    "polynomial": dict(lr_schedule=PolynomialConfig(power=2.0)),  # to 0: polynomial reads no end_lr
    "step": dict(lr_schedule=StepConfig(step_size=60, gamma=0.5)),
    "multistep": dict(lr_schedule=MultiStepConfig(milestones=(60, 150, 200), gamma=0.3)),
    "exponential": dict(lr_schedule=ExponentialConfig(gamma=0.99)),
    "cosine_restarts": dict(lr_schedule=CosineRestartsConfig(warmup_steps=10, t_0=25, t_mult=2)),
    "one_cycle": dict(lr_schedule=OneCycleConfig(pct_start=0.25, three_phase=True)),
    "wsd": dict(lr_schedule=WSDConfig(decay_steps=80, decay_type="1-sqrt")),
    "inverse_sqrt": dict(lr_schedule=InverseSqrtConfig(warmup_steps=30, init_lr=1e-4)),
}
"""Each schedule under AdamW (init_lr 0: torch_ref's warmup is LambdaLR(u / W); init_lr > 0: LinearLR)."""

PLATEAU: dict[str, Any] = dict(lr_schedule=PlateauConfig(factor=0.5, patience=0, threshold=0.05, cooldown=2))
"""plateau's case (it decides at evaluations: test_schedules.py runs it with an evaluation every PLATEAU_EVERY
updates)."""


def combination_cfg(changes: dict[str, Any], precision: str = "fp64", k: int = 1) -> Config:
    cfg = mlp_cfg(precision=precision)
    return validate(optim(cfg, **{"clip_norm": CLIP, "accum_steps": k, **changes}), check_paths=False)


def initial_params(splits: Any) -> Any:
    """The MLP's initial weights, drawn once by jax (float32, exactly representable in float64)."""
    cfg = mlp_cfg(precision="fp32")
    with jax_mode("fp32"):
        return host(jax_state(cfg, splits).params)


def micro_batches(cfg: Config, splits: Any, count: int) -> tuple[list, list]:
    """The first `count` micro-batches as each loop reads them: jaxloop's gather, torch_ref's own order."""
    from jaxloop.data.sources import MicroBatchGather
    from torch_ref.data import micro_batch

    gather = MicroBatchGather(splits.train, cfg.seed, cfg.batch_size)
    return [gather(i) for i in range(count)], [micro_batch(cfg, splits, i) for i in range(count)]


def run_pair(
    cfg: Config, splits: Any, init: Any, batches: tuple[list, list], evaluate_every: int = 0
) -> tuple[Run, Run]:
    """jaxloop's and torch_ref's UPDATES updates of cfg from `init` on `batches` (evaluating every
    evaluate_every updates: harness.jax_run)."""
    j = jax_run(cfg, splits, UPDATES, init_params=init, batches=iter(batches[0]), evaluate_every=evaluate_every)
    with torch_threads(1):
        t = torch_run(cfg, splits, init, UPDATES, batches=iter(batches[1]), evaluate_every=evaluate_every)
    return j, t


def combination_runs(
    changes: dict[str, Any], splits: Any, init: Any, batches: dict[int, tuple[list, list]], evaluate_every: int = 0
) -> dict:
    """{(precision, K): (jax Run, torch Run)} for the four VARIANTS of one combination."""
    return {
        (p, k): run_pair(combination_cfg(changes, p, k), splits, init, batches[k], evaluate_every) for p, k in VARIANTS
    }


def shared_inputs(splits: Any) -> tuple[Any, dict[int, tuple[list, list]]]:
    """(initial params, {K: micro-batches}) for every combination."""
    cfg = mlp_cfg()
    return initial_params(splits), {k: micro_batches(cfg, splits, UPDATES * k) for k in (1, 4)}


FP32_TRAJECTORY = 1e-4
"""float32 bound on the loss of every update and the params after 300 updates, relative: measured at most
3.2e-5 over the 18 combinations (the loss of schedule step, K = 1; params at most 9.8e-6, lion); float32
roundings (~6e-8 each) that differ between XLA and torch (matmul summation order, GELU, the optimizers'
arithmetic) integrated over 300 updates, larger where the rate stays high to the end (step, exponential)."""


def check_combination(
    parity: Any, title: str, runs: dict, *, rate_tolerance: float = 1e-13, rate_reason: str = ""
) -> None:
    """Register and assert every check of one combination (module doc)."""
    for (p, k), (j, t) in runs.items():
        tag = f"{title} K={k} {p}"
        clipped = float(np.mean(j.grad_norms > CLIP))
        parity.check(
            f"{tag}: updates not clipped (clipping must act on at least 30% of them), fraction",
            1 - clipped,
            0.7,
            "clip_norm 0.5 below the mean gradient norm: the clipped update is what is compared",
            kind="own",
        )
        if p == "fp64":
            parity.check(
                f"{tag}: rate of every update ({UPDATES}), relative",
                curve_rel_diff(j.lrs, t.lrs),
                rate_tolerance,
                rate_reason
                or "jaxloop's float64 closed form against torch's class in "
                "float64: a few ulps of operation order (the chained forms' drift included)",
            )
            parity.check(
                f"{tag}: loss of every update, relative",
                curve_rel_diff(j.losses, t.losses),
                1e-10,
                "the same float64 computation in another operation order",
            )
            parity.check(
                f"{tag}: params after {UPDATES} updates, relative", tree_rel_diff(j.params, t.params)[0], 1e-10, "same"
            )
        else:
            parity.check(
                f"{tag}: rate of every update, float32 ulps of torch's float64 rate",
                float(np.max(ulps_of_value(j.lrs, t.lrs))),
                2.0,
                "jaxloop's float32 rate is its float64 rate rounded once (half an ulp), plus the float64 difference",
            )
            parity.check(
                f"{tag}: loss of every update, relative",
                curve_rel_diff(j.losses, t.losses),
                FP32_TRAJECTORY,
                "float32 rounding accumulated over 300 updates (FP32_TRAJECTORY)",
            )
            parity.check(
                f"{tag}: params after {UPDATES} updates, relative",
                tree_rel_diff(j.params, t.params)[0],
                FP32_TRAJECTORY,
                "same",
            )


@pytest.fixture(scope="session")
def menu_inputs():
    """The shared initial weights and micro-batches of every combination (and the splits); made inside the
    parity package's tests, under its x64 fixture."""
    from jaxloop.data.sources import load_splits

    splits = load_splits(mlp_cfg())
    init, batches = shared_inputs(splits)
    return splits, init, batches


@pytest.fixture(scope="session")
def adamw_warmup_cosine(menu_inputs):
    """The combination both sweeps share: AdamW under warmup_cosine (the defaults)."""
    splits, init, batches = menu_inputs
    return combination_runs({}, splits, init, batches)


def sweep_runs(request: Any, table: dict[str, dict[str, Any]], default: str, inputs: tuple) -> tuple[str, dict]:
    """(name, runs) of the sweep's combination request.param from `table`; the sweep's `default` (AdamW
    under warmup_cosine, which both sweeps contain) is the shared adamw_warmup_cosine fixture, run once."""
    name = request.param
    if name == default:
        return name, request.getfixturevalue("adamw_warmup_cosine")
    return name, combination_runs(table[name], *inputs)
