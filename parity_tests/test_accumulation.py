"""Gradient accumulation: K micro-batches of B records make the same update as one batch of K*B.

In each framework (jaxloop: optax.MultiSteps' running mean of the K gradients; torch_ref: backward of
loss / K, K times) and across them, in float64, over 6 updates of the digits MLP with a warmup of 3
(so the rate changes every update). The K*B batch of update u is micro-batches uK .. uK+K-1 joined.
Measure: per-tensor relative L2 difference of the params after every update.
"""

from __future__ import annotations

from dataclasses import replace

import jax
import numpy as np
import pytest
import torch

from jaxloop.data.sources import load_splits, record_order
from jaxloop.update import step as update_step
from jaxloop.update.schedules import make_schedule
from parity_tests.harness import (
    curve_rel_diff,
    flat_params,
    host,
    jax_mode,
    jax_run,
    jax_state,
    mlp_cfg,
    optim,
    schedule_fields,
    torch_run,
    tree_rel_diff,
)

train_step = jax.jit(update_step.train_step, donate_argnums=0)  # as the loop builds it

K, B, UPDATES = 4, 8, 6


def _cfgs():
    small = optim(schedule_fields(mlp_cfg(precision="fp64", steps=10, batch_size=B), warmup_steps=3), accum_steps=K)
    big = optim(schedule_fields(mlp_cfg(precision="fp64", steps=10, batch_size=K * B), warmup_steps=3), accum_steps=1)
    return small, big


@pytest.fixture(scope="module")
def runs():
    small, big = _cfgs()
    splits = load_splits(small)
    order = record_order(small, splits.num_train, 0, K * UPDATES)
    micro = [splits.train.get(row) for row in order]
    joined = [
        {k: np.concatenate([m[k] for m in micro[u * K : (u + 1) * K]]) for k in ("x", "y")} for u in range(UPDATES)
    ]
    as_torch = lambda b: (torch.from_numpy(np.array(b["x"])), torch.from_numpy(np.array(b["y"])))  # noqa: E731
    jk = jax_run(small, splits, UPDATES, snapshot_every=1, batches=iter(micro))
    j1 = jax_run(big, splits, UPDATES, snapshot_every=1, init_params=jk.init, batches=iter(joined))
    tk = torch_run(small, splits, jk.init, UPDATES, snapshot_every=1, batches=iter(map(as_torch, micro)))
    t1 = torch_run(big, splits, jk.init, UPDATES, snapshot_every=1, batches=iter(map(as_torch, joined)))
    return dict(jk=jk, j1=j1, tk=tk, t1=t1, small=small, splits=splits, micro=micro)


def _worst(a, b) -> float:
    return max(tree_rel_diff(a.snapshots[u], b.snapshots[u])[0] for u in a.snapshots)


def _loss_rel(a, b) -> float:
    return float(np.max(np.abs(a.losses - b.losses) / np.abs(b.losses)))


def test_jaxloop_k_micro_batches_equal_one_batch_of_k_times_b(runs, parity):
    parity.check(
        f"accumulation fp64: jaxloop K={K}x{B} vs 1x{K * B}, params after each update",
        _worst(runs["jk"], runs["j1"]),
        1e-12,
        "a running mean of K gradients vs the gradient of the mean loss: the same mean, rounded differently",
        kind="own",
    )
    parity.check(
        f"accumulation fp64: jaxloop K={K}x{B} vs 1x{K * B}, loss",
        _loss_rel(runs["jk"], runs["j1"]),
        1e-12,
        "mean of K means of B vs mean of K*B",
        kind="own",
    )


def test_torch_ref_k_micro_batches_equal_one_batch_of_k_times_b(runs, parity):
    parity.check(
        f"accumulation fp64: torch_ref K={K}x{B} vs 1x{K * B}, params after each update",
        _worst(runs["tk"], runs["t1"]),
        1e-12,
        "the sum of K backward passes of loss/K vs one of the mean loss",
        kind="own",
    )


def test_accumulated_updates_agree_across_frameworks(runs, parity):
    parity.check(
        f"accumulation fp64: jaxloop vs torch_ref, K={K}x{B}, params after each update",
        _worst(runs["jk"], runs["tk"]),
        1e-12,
        "running mean vs sum of gradients/K, then the same clip and AdamW",
    )
    parity.check(
        f"accumulation fp64: jaxloop vs torch_ref, K={K}x{B}, loss and grad_norm",
        max(
            _loss_rel(runs["jk"], runs["tk"]),
            float(np.max(np.abs(runs["jk"].grad_norms - runs["tk"].grad_norms) / runs["tk"].grad_norms)),
        ),
        1e-12,
        "mean of the K micro-batch losses; norm of the mean gradient",
    )


def test_schedule_advances_once_per_update_in_both(runs, parity):
    """jaxloop's lr metric is the same for the K micro-steps of an update and moves only between
    updates; torch_ref steps its scheduler once per update. Both give update u the rate of update u."""
    small, splits, micro = runs["small"], runs["splits"], runs["micro"]
    with jax_mode("fp64"):
        state = jax_state(small, splits, runs["jk"].init)
        per_micro = []
        for batch in micro:
            state, m = train_step(state, batch)
            per_micro.append((float(m["lr"]), bool(m["updated"]), int(state.step)))
        schedule = [float(make_schedule(small.optim, small.steps)(u)) for u in range(UPDATES)]
        host(state.params)
    lrs = np.array([r[0] for r in per_micro]).reshape(UPDATES, K)
    assert [r[1] for r in per_micro] == [(i % K == K - 1) for i in range(K * UPDATES)], "one update per K micro-batches"
    assert [r[2] for r in per_micro] == [(i + 1) // K for i in range(K * UPDATES)], "the update count"
    # lr is read from the optimizer's state: the rate it applied in the update that closed the window;
    # between updates the state still holds the previous update's rate.
    assert np.all(lrs[1:, :-1] == lrs[:-1, -1:]), "the rate changes only when an update is applied"
    assert len(set(lrs[:, -1])) == UPDATES, "and moves at every update (warmup)"
    parity.check(
        "accumulation: rate of update u, jaxloop (K micro-steps, K=1) vs torch_ref (K, K=1) vs schedule(u)",
        max(curve_rel_diff(x, schedule) for x in (lrs[:, -1], runs["j1"].lrs, runs["tk"].lrs, runs["t1"].lrs)),
        1e-15,
        "the same float64 rate for update u whatever K (a few ulps between formulas)",
    )


# ----------------------------------------------------------------------------- clipping after accumulation

CLIP, CLIP_UPDATES = 0.3, 40
"""The clip norm of the clipped runs: below the mean gradient's norm on most updates (it is 0.26 - 0.5)."""


@pytest.fixture(scope="module")
def clipped():
    """K=4 x 8 runs of the digits MLP in float64 whose mean gradient is clipped on most updates, in both
    frameworks (torch_ref with optax's clip and with its default clip_grad_norm_), and the same updates
    as single batches of 32."""
    small, big = (optim(replace(c, steps=CLIP_UPDATES), clip_norm=CLIP) for c in _cfgs())
    splits = load_splits(small)
    order = record_order(small, splits.num_train, 0, K * CLIP_UPDATES)
    micro = [splits.train.get(row) for row in order]
    joined = [
        {k: np.concatenate([m[k] for m in micro[u * K : (u + 1) * K]]) for k in ("x", "y")} for u in range(CLIP_UPDATES)
    ]
    as_torch = lambda b: (torch.from_numpy(np.array(b["x"])), torch.from_numpy(np.array(b["y"])))  # noqa: E731
    jk = jax_run(small, splits, CLIP_UPDATES, snapshot_every=1, batches=iter(micro))
    j1 = jax_run(big, splits, CLIP_UPDATES, snapshot_every=1, init_params=jk.init, batches=iter(joined))
    tk = torch_run(small, splits, jk.init, CLIP_UPDATES, snapshot_every=1, batches=iter(map(as_torch, micro)))
    t1 = torch_run(big, splits, jk.init, CLIP_UPDATES, snapshot_every=1, batches=iter(map(as_torch, joined)))
    tk_native = torch_run(
        small, splits, jk.init, CLIP_UPDATES, snapshot_every=1, clip="torch", batches=iter(map(as_torch, micro))
    )
    return dict(jk=jk, j1=j1, tk=tk, t1=t1, tk_native=tk_native)


def test_clipping_acts_on_most_accumulated_updates_in_both(clipped, parity):
    fractions = [float(np.mean(clipped[name].grad_norms > CLIP)) for name in ("jk", "tk")]
    parity.check(
        f"clip after accumulation fp64 (K={K}x{B}, clip {CLIP}): 1 - fraction of the {CLIP_UPDATES} updates "
        "clipped (the lower of both)",
        1.0 - min(fractions),
        0.25,
        "the runs are chosen so that clipping acts on at least 3/4 of the updates",
        kind="own",
    )


def test_clipped_accumulated_updates_agree_across_frameworks_and_with_one_big_batch(clipped, parity):
    """Mutants caught (run, seen to fail, reverted): torch_ref clipping each micro-batch's gradient before
    accumulating it (params 1.8e-1 apart: the mean of clipped gradients is not the clipped mean); jaxloop
    clipping each micro-batch in train_step before MultiSteps (1.8e-1)."""
    jk, j1, tk, t1 = (clipped[n] for n in ("jk", "j1", "tk", "t1"))
    parity.check(
        f"clip after accumulation fp64: jaxloop vs torch_ref, K={K}x{B}, params after each of {CLIP_UPDATES} updates",
        _worst(jk, tk),
        1e-12,
        "the same clip of the same mean gradient, then the same AdamW, in float64",
    )
    parity.check(
        "clip after accumulation fp64: jaxloop vs torch_ref, loss and pre-clip grad_norm",
        max(_loss_rel(jk, tk), curve_rel_diff(jk.grad_norms, tk.grad_norms)),
        1e-12,
        "norm of the mean gradient (before clipping)",
    )
    parity.check(
        f"clip after accumulation fp64: K={K}x{B} vs 1x{K * B}, params, jaxloop and torch_ref",
        max(_worst(jk, j1), _worst(tk, t1)),
        1e-12,
        "clipping the mean of K gradients is clipping the gradient of the mean loss",
        kind="own",
    )


def test_torch_default_clip_grad_norm_drift_stays_within_its_analytic_bound(clipped, parity):
    """torch_ref's default clip (torch.nn.utils.clip_grad_norm_: g * clip / (norm + 1e-6)) over the whole
    clipped run, against jaxloop (optax: g * clip / norm). Each clipped gradient is (1 - d_u) times
    optax's, d_u = 1e-6 / (norm_u + 1e-6). Adam normalises a scale away, so an update's step changes by at
    most 2 max_u d_u of its length (first order: the moments' ratio moves by the spread of the scales);
    summed over the run, tensor by tensor: bound = 2 max d * sum_u ||p_u+1 - p_u|| / ||p_final||, plus
    the float64 agreement (1e-12). Measured: the parameter drift; the check also sees that the two clips
    did differ (a torch_ref that silently used optax's clip would give exactly jaxloop's run)."""
    jk, native = clipped["jk"], clipped["tk_native"]
    d = float(np.max(1e-6 / (native.grad_norms[native.grad_norms > CLIP] + 1e-6)))
    flat = [flat_params(jk.init)] + [flat_params(jk.snapshots[u]) for u in sorted(jk.snapshots)]
    path = {
        k: sum(np.linalg.norm(b[k] - a[k]) for a, b in zip(flat[:-1], flat[1:])) / np.linalg.norm(flat[-1][k])
        for k in flat[-1]
        if not k.endswith("attn/qkv/bias")
    }
    bound = 2 * d * max(path.values()) + 1e-12
    drift = _worst(native, jk)
    assert drift > _worst(clipped["tk"], jk), "torch's clip_grad_norm_ moved the run (its 1e-6 is in the update)"
    parity.note("clip: torch clip_grad_norm_ vs optax clip, params drift over the clipped run", drift)
    parity.note("clip: analytic bound on that drift", bound)
    parity.check(
        f"clip fp64: torch_ref's default clip_grad_norm_ vs jaxloop, params over {CLIP_UPDATES} clipped "
        f"updates (bound 2 max d sum ||step|| / ||p|| = {bound:.1e})",
        drift,
        bound,
        "clip / (norm + 1e-6) vs clip / norm: a scale 1 - d on each clipped gradient, which Adam normalises",
    )
