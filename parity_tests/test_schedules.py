"""Every schedule of the menu against torch's own scheduler classes (Hugging Face's LambdaLRs for wsd and
inverse_sqrt, which torch has no class for), under AdamW.

- rates (no training): for each schedule a few variants over 300 updates (warmup or none, init_lr 0 or
  not, the schedule's own options): jaxloop's float64 table against torch_ref's scheduler (stepped as
  the loop steps it) and both against the long-double oracle of the documented formulas
  (parity_tests/oracle.py menu_lr_oracle); jaxloop's float32 rate against the oracle in ulps.
- trajectories (menu.check_combination): 300 updates, K = 1 and 4, float64 and float32, per schedule.
- plateau: the trajectories with an evaluation every PLATEAU_EVERY updates, where jaxloop.loop.plateau and torch's
  ReduceLROnPlateau decide; the decisions must fall on the same evaluations. Through the real loops
  (jaxloop.run, torch_ref.train.run), also across a resume between two reductions.
- torch's chained forms: SequentialLR(LinearLR, CosineAnnealingLR), the classes for warmup_cosine (torch_ref
  runs its exact LambdaLR), and OneCycleLR's textbook annealing, measured against the oracle.

Mutant caught (run, seen to fail, reverted): jaxloop's multistep counting a milestone from the update
before it (bisect_left for bisect_right): the multistep rates differ by 2.3 relative; every other
schedule passes.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from jaxloop.config.run import CheckpointConfig, PlateauConfig, switched, validate
from jaxloop.config.schedules import SCHEDULES as SCHEDULE_CLASSES
from jaxloop.config.schedules import WarmupCosineConfig
from jaxloop.update.schedules import make_schedule, rates
from parity_tests.harness import (
    F64_EPS,
    RESUME_AT,
    curve_rel_diff,
    interrupt_jax_run,
    jax_mode,
    mlp_cfg,
    records,
    resume_cfg,
    torch_threads,
    ulps_of_value,
)
from parity_tests.menu import (  # noqa: F401
    PLATEAU,
    SCHEDULES,
    UPDATES,
    adamw_warmup_cosine,
    check_combination,
    combination_cfg,
    combination_runs,
    menu_inputs,
    sweep_runs,
)
from parity_tests.oracle import menu_oracle_table
from torch_ref.schedule import lr_table, warmup_cosine_classes

RATE_VARIANTS = {
    "constant": [dict(warmup_steps=0), dict(warmup_steps=20, init_lr=3e-4), dict()],
    "linear": [dict(end_lr=0.0), dict(warmup_steps=0, end_lr=1e-4), dict(init_lr=1e-4, warmup_steps=30)],
    "polynomial": [dict(), dict(power=2.0, warmup_steps=0), dict(power=0.5, init_lr=1e-5)],
    "step": [
        dict(step_size=60, gamma=0.5),
        dict(step_size=1, gamma=0.99, warmup_steps=0),
        dict(step_size=7, gamma=0.3, init_lr=1e-4),
    ],
    "multistep": [dict(milestones=(60, 150, 200), gamma=0.3), dict(milestones=(1, 2, 249), gamma=0.5, warmup_steps=0)],
    "exponential": [dict(gamma=0.99), dict(gamma=0.95, warmup_steps=0)],
    "cosine_restarts": [dict(t_0=25, t_mult=2), dict(t_0=50, warmup_steps=0), dict(t_0=7, t_mult=3, end_lr=0.0)],
    "one_cycle": [
        dict(),
        dict(three_phase=True, pct_start=0.25),
        dict(anneal_strategy="linear"),
        dict(three_phase=True, anneal_strategy="linear", div_factor=10.0, final_div_factor=100.0),
    ],
    "wsd": [
        dict(decay_steps=60),
        dict(decay_steps=250, decay_type="linear", end_lr=0.0),
        dict(decay_steps=80, decay_type="1-sqrt", warmup_steps=0),
    ],
    "inverse_sqrt": [dict(), dict(warmup_steps=0), dict(warmup_steps=30, timescale=100, init_lr=1e-4)],
}


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    diff = np.abs(a - b)
    return float(np.max(np.where(diff == 0, 0.0, diff / np.where(b == 0, 1e-300, np.abs(b)))))


def one_cycle_bound(cfg) -> float:
    """How far torch's OneCycleLR may be from the exact rate: its textbook annealing (cos(pi f) + 1 and
    (b - a) f + a) loses an ulp of the phase's start near a phase's end, where the rate is its end: relative
    error up to a few ulps times start / end, at most div_factor * final_div_factor."""
    return 4 * F64_EPS * cfg.optim.lr_schedule.div_factor * cfg.optim.lr_schedule.final_div_factor


def _variant_cfg(schedule: str, changes: dict):
    """The schedule's class with `changes` to its fields, over mlp_cfg's warmup_cosine (whose warmup a warmup
    schedule keeps: run.switched)."""
    base = mlp_cfg().optim.lr_schedule
    return combination_cfg({"lr_schedule": replace(switched(base, SCHEDULE_CLASSES[schedule]), **changes)}, "fp64")


@pytest.mark.parametrize("schedule", list(RATE_VARIANTS))
def test_rates_of_every_variant_agree_with_torch_and_the_oracle(schedule, parity):
    cross, own, ulps, torch_off, bound = 0.0, 0.0, 0.0, 0.0, 1e-13
    for changes in RATE_VARIANTS[schedule]:
        cfg = _variant_cfg(schedule, changes)
        oracle = menu_oracle_table(cfg, UPDATES)
        jax64 = rates(cfg.optim, cfg.steps)[:UPDATES]
        torch64 = np.asarray(lr_table(cfg, UPDATES))
        with jax_mode("fp32"):
            jax32 = np.asarray(make_schedule(cfg.optim, cfg.steps)(np.arange(UPDATES)), np.float64)
        cross, own = max(cross, _rel(jax64, torch64)), max(own, _rel(jax64, oracle))
        torch_off = max(torch_off, _rel(torch64, oracle))
        ulps = max(ulps, float(np.max(ulps_of_value(jax32, oracle))))
        if schedule == "one_cycle":
            bound = max(bound, one_cycle_bound(cfg))
    n = len(RATE_VARIANTS[schedule])
    reason = (
        "jaxloop's float64 closed form against torch's class stepped as the loop steps it: a few ulps of "
        "operation order, the chained forms' drift included"
    )
    if schedule == "one_cycle":
        reason = (
            "torch's textbook annealing cancels near each phase's end (one_cycle_bound: 4 ulps x div_factor x "
            "final_div_factor); jaxloop's sin^2 form does not (see the oracle check)"
        )
    parity.check(
        f"schedule {schedule}: rate of every update, {n} variants x {UPDATES} updates, fp64, relative",
        cross,
        bound,
        reason,
    )
    parity.check(
        f"schedule {schedule}: jaxloop's fp64 rate vs the long-double oracle, relative",
        own,
        1e-13,
        "the documented formula in float64, cancellation-free: a few ulps",
        kind="own",
    )
    parity.check(
        f"schedule {schedule}: jaxloop's fp32 rate vs the oracle, float32 ulps of the rate",
        ulps,
        2.0,
        "the float64 table rounded once to float32 (half an ulp)",
        kind="own",
    )
    if schedule == "one_cycle":
        parity.check(
            "schedule one_cycle: torch's OneCycleLR vs the long-double oracle, relative (its textbook annealing)",
            torch_off,
            bound,
            "how far torch's own class is from the documented rate: the "
            "cancellation of (cos(pi f) + 1) and of (b - a) f + a near a phase's end",
            kind="finding",
        )


CHAINED_COSINE = [
    (300, 50, 0.0, 3e-3, 3e-5),
    (300, 50, 0.0, 3e-3, 0.0),
    (300, 0, 0.0, 1e-3, 0.0),
    (300, 10, 3e-4, 3e-3, 0.0),
    (300, 100, 1e-4, 1e-3, 0.0),
]
"""(steps, warmup, init, peak, end) of warmup_cosine measured through torch's own classes."""


def test_torch_chained_warmup_cosine_classes_drift_from_the_closed_form(parity):
    """SequentialLR(LinearLR or LambdaLR warmup, CosineAnnealingLR) is what a torch user writes for
    warmup_cosine. CosineAnnealingLR steps a chained form, lr_u = (1 + cos(pi t_u)) / (1 + cos(pi t_{u-1}))
    (lr_{u-1} - eta_min) + eta_min: near the end of the cosine both (1 + cos) cancel, so with eta_min = 0
    each rate is off by ~1e-16 / (pi / D)^2 relative (2e-12 at D = 300), and the errors compound. torch_ref
    runs warmup_cosine as a LambdaLR of the closed form instead (exact; test_learning_rate.py)."""
    worst, at = 0.0, None
    for steps, warmup, init, peak, end in CHAINED_COSINE:
        cfg = validate(
            replace(
                combination_cfg({}, "fp64"),
                steps=steps,
                optim=replace(
                    combination_cfg({}, "fp64").optim,
                    lr_schedule=WarmupCosineConfig(warmup_steps=warmup, init_lr=init, end_lr=end),
                    peak_lr=peak,
                ),
            ),
            check_paths=False,
        )
        chained = np.asarray(lr_table(cfg, steps, build=warmup_cosine_classes))
        err = _rel(chained, menu_oracle_table(cfg, steps))
        if err > worst:
            worst, at = err, (steps, warmup, init, peak, end)
    parity.check(
        "schedule warmup_cosine: torch's SequentialLR(LinearLR, CosineAnnealingLR) vs the oracle, relative",
        worst,
        1e-11,
        f"CosineAnnealingLR's chained (1 + cos) ratio cancels near the cosine's end (~2e-12 per "
        f"update at D = 300 with eta_min 0); worst config (steps, warmup, init, peak, end) = {at}",
        kind="finding",
    )


# ----------------------------------------------------------------------------- trajectories


@pytest.fixture(scope="module", params=list(SCHEDULES))
def schedule_runs(request, menu_inputs):
    """One schedule's four trajectories in both loops under AdamW (warmup_cosine: the shared default)."""
    return sweep_runs(request, SCHEDULES, "warmup_cosine", menu_inputs)


def test_trajectories_rates_and_losses_agree(schedule_runs, parity):
    name, runs = schedule_runs
    tolerance, reason = 1e-13, ""
    if name == "one_cycle":
        tolerance = one_cycle_bound(combination_cfg(SCHEDULES[name]))
        reason = "torch's OneCycleLR textbook annealing (one_cycle_bound); jaxloop's is exact (the rates test)"
    check_combination(parity, f"schedule {name}", runs, rate_tolerance=tolerance, rate_reason=reason)


# ----------------------------------------------------------------------------- plateau


PLATEAU_EVERY = 10
"""Evaluations (validation loss over the whole split) every 10 updates: 30 decisions in 300 updates."""


def decision_margin(metrics: list[float], cfg) -> float:
    """The smallest relative distance of a metric from the value that would have changed its decision
    (best * (1 - threshold): ReduceLROnPlateau's rel/min rule), replaying the decisions."""
    p, best, margin = cfg.optim.lr_schedule, None, np.inf
    for m in metrics:
        if best is not None:
            margin = min(margin, abs(m - best * (1 - p.threshold)) / abs(m))
        if best is None or m < best * (1 - p.threshold):
            best = m
    return float(margin)


@pytest.fixture(scope="module")
def plateau_runs(menu_inputs):
    return combination_runs(PLATEAU, *menu_inputs, evaluate_every=PLATEAU_EVERY)


def test_plateau_trajectories_rates_and_losses_agree(plateau_runs, parity):
    check_combination(
        parity,
        "schedule plateau",
        plateau_runs,
        rate_reason="the same float64 products rate * factor in both (jaxloop.loop.plateau, ReduceLROnPlateau): equal",
    )


def test_plateau_reduces_the_rate_at_the_same_evaluations(plateau_runs, parity):
    cfg = combination_cfg(PLATEAU)
    for (p, k), (j, t) in plateau_runs.items():
        reduced = lambda run: [
            u
            for (u, _, r), (_, _, before) in zip(run.evals, [(0, 0, cfg.optim.peak_lr)] + run.evals)  # noqa: E731
            if r < before
        ]
        jr, tr = reduced(j), reduced(t)
        assert len(tr) >= 3, f"the plateau run reduces its rate several times (torch_ref: at {tr})"
        parity.check(
            f"schedule plateau K={k} {p}: evaluations where the reductions differ (jaxloop at {jr})",
            len(set(jr) ^ set(tr)),
            0,
            "the same metric (to rounding) under the same rule",
        )
        parity.check(
            f"schedule plateau K={k} {p}: rates after each evaluation, relative",
            curve_rel_diff([r for *_, r in j.evals], [r for *_, r in t.evals]),
            0.0,
            "the same float64 products rate * factor",
        )
        margin = decision_margin([m for _, m, _ in t.evals], cfg)
        parity.check(
            f"schedule plateau K={k} {p}: 1e-4 / (smallest relative distance of a metric from its decision boundary)",
            1e-4 / margin,
            1.0,
            "the decisions compared are not within rounding of the boundary "
            "(float32 metrics differ by ~1e-6 across frameworks)",
            kind="own",
        )


@pytest.fixture(scope="module")
def plateau_resume(tmp_path_factory):
    """The real loops (jaxloop.run, torch_ref.train.run) under plateau, fp64, 40 updates of 2 micro-batches,
    an evaluation every 5: uninterrupted, and interrupted at update 22 (between reductions) and resumed."""
    from jaxloop.data.sources import load_splits
    from jaxloop.loop.runner import run as jax_train
    from parity_tests.harness import host, jax_state
    from torch_ref.train import run as torch_train

    k = RESUME_AT[1]
    base = tmp_path_factory.mktemp("plateau_resume")
    cfg = resume_cfg(base / "jax")
    cfg = validate(
        replace(
            cfg,
            eval_every=5,
            checkpoint=CheckpointConfig(every=10, keep_last=3, keep_best=0),
            optim=replace(cfg.optim, lr_schedule=PlateauConfig(factor=0.5, patience=0, threshold=0.1, cooldown=1)),
        ),
        check_paths=False,
    )
    splits = load_splits(cfg)
    with jax_mode("fp64"):
        init = host(jax_state(cfg, splits).params)
    at = lambda name: replace(cfg, run_dir=str(base / name))  # noqa: E731
    out = {"k": k, "jax": at("jax"), "torch": at("torch"), "jax_k": at("jax_k"), "torch_k": at("torch_k")}
    jax_train(out["jax"])
    interrupt_jax_run(out["jax_k"], k)
    shutil.copytree(out["jax_k"].run_dir, base / "jax_k_interrupted")
    out["jax_k_interrupted"] = base / "jax_k_interrupted"
    jax_train(out["jax_k"])
    with torch_threads(1):
        torch_train(out["torch"], init_params=init, clip="optax", device="cpu", splits=splits)
        torch_train(out["torch_k"], init_params=init, clip="optax", stop_after=k, device="cpu", splits=splits)
        torch_train(out["torch_k"], clip="optax", device="cpu", splits=splits)
    return out


def _lr_by_update(run_dir) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in records(run_dir)}


def _digest(run_dir) -> str:
    return json.loads((Path(run_dir) / "summary.json").read_text())["state_digest"]


def _reductions(run_dir) -> list[int]:
    """Updates after whose evaluation the rate went down (the rate logged at update u + 1 < at u)."""
    lr = _lr_by_update(run_dir)
    return [u for u in sorted(lr) if u + 1 in lr and lr[u + 1] < lr[u]]


def test_plateau_reductions_are_the_same_in_both_real_loops_and_across_a_resume(plateau_resume, parity):
    out, k = plateau_resume, plateau_resume["k"]
    jr, tr = _reductions(out["jax"].run_dir), _reductions(out["torch"].run_dir)
    interrupted = records(out["jax_k_interrupted"])
    assert max(r["step"] for r in interrupted) == k, "the interrupted run stopped at the update it was stopped at"
    parity.check(
        f"schedule plateau: real loops (jaxloop.run, torch_ref.train.run), evaluations where the reductions "
        f"differ (at {jr})",
        len(set(jr) ^ set(tr)),
        0,
        "the same metric (float64) under the same rule",
    )
    assert any(u < k for u in jr) and any(u > k for u in jr), f"reductions on both sides of the resume at {k}: {jr}"
    parity.check(
        "schedule plateau: real loops, logged rate of every update, jaxloop vs torch_ref, relative",
        curve_rel_diff(
            list(_lr_by_update(out["jax"].run_dir).values()), list(_lr_by_update(out["torch"].run_dir).values())
        ),
        0.0,
        "the same float64 products rate * factor",
    )
    differing = 0
    for name in ("jax", "torch"):
        full, resumed = out[name].run_dir, out[f"{name}_k"].run_dir
        differing += _lr_by_update(full) != _lr_by_update(resumed)
        differing += [r["loss"] for r in records(full)] != [r["loss"] for r in records(resumed)]
        differing += _digest(full) != _digest(resumed)
    parity.check(
        f"schedule plateau: real loops resumed at update {k} (between reductions), runs differing from the "
        "uninterrupted (rates, losses, state digest; both loops)",
        differing,
        0,
        "the decision state is checkpointed (jaxloop: the data item; torch_ref: the scheduler's state_dict)",
    )
