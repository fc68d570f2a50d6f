"""fp16 dynamic loss scaling: the same scale sequence and the same skipped updates in both.

jaxloop's dynamic_loss_scale (GradScaler's rule: 2^16, halve on a non-finite update, double after 2000 good
ones) against torch.amp.GradScaler under torch_ref, on the digits MLP with 2 micro-batches per update,
fed the same micro-batches with overflows injected: a NaN input at the first (non-emitting) micro-step
of update 3, a huge input (1e5 > fp16's 65504: inf) at the second (emitting) micro-step of update 5,
and a NaN again after the scale has grown back. Exact: scales are powers of 2, flags are booleans.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from jaxloop.data.sources import MicroBatchGather, load_splits
from parity_tests.harness import jax_run, mlp_cfg, model, optim, torch_run, tree_rel_diff

K = 2
GROWTH = 2000
LAST = 5 + GROWTH + 4
"""The update poisoned again once the scale has grown back."""
INJECT = {3 * K + 0: "nan", 5 * K + 1: "huge", LAST * K + 1: "nan"}
"""micro-step index -> what replaces its first record's input."""
UPDATES = 5 + GROWTH + 8


def _cfg(k: int):
    """The fp16 digits MLP (64-32-10, batch 32) of both fixtures, with k micro-batches per update; its schedule
    is UPDATES long in both, so that the injected run and the natural K=2 run are one program (the natural
    runs' 40 updates lie in the 50-update warmup, whose rates do not depend on the length)."""
    return optim(model(mlp_cfg(precision="fp16", batch_size=32, steps=UPDATES), hidden=(32,)), accum_steps=k)


def _micro_batches(cfg, splits):
    gather = MicroBatchGather(splits.train, cfg.seed, cfg.batch_size)
    out = []
    for b in range(UPDATES * K):
        batch = {k: np.array(v) for k, v in gather(b).items()}
        if b in INJECT:
            batch["x"][0] = np.nan if INJECT[b] == "nan" else 1e5
        out.append(batch)
    return out


@pytest.fixture(scope="module")
def runs():
    cfg = _cfg(K)
    splits = load_splits(cfg)
    batches = _micro_batches(cfg, splits)
    j = jax_run(cfg, splits, UPDATES, batches=iter(batches))
    as_torch = lambda b: (torch.from_numpy(b["x"]), torch.from_numpy(b["y"]))  # noqa: E731
    t = torch_run(cfg, splits, j.init, UPDATES, batches=iter(map(as_torch, batches)))
    return j, t


def test_both_skip_exactly_the_updates_with_an_overflow_or_nan(runs, parity):
    j, t = runs
    injected = sorted({b // K for b in INJECT})
    assert list(np.flatnonzero(~j.updated)) == injected, "jaxloop skips the poisoned updates, and only those"
    parity.check(
        f"fp16: updates (of {UPDATES}) applied by one framework and skipped by the other",
        int(np.sum(j.updated != t.updated)),
        0,
        "a non-finite micro-batch poisons its whole update, emitting or not, in both",
    )


def test_both_follow_the_same_loss_scale_sequence(runs, parity):
    j, t = runs
    changes = [0] + list(np.flatnonzero(np.diff(j.loss_scales)) + 1)
    # halved after the skipped updates 3 and 5, doubled after the 2000 good updates 6 .. 2005, halved after LAST
    assert [(int(u), float(j.loss_scales[u])) for u in changes] == [
        (0, 2.0**16),
        (4, 2.0**15),
        (6, 2.0**14),
        (6 + GROWTH, 2.0**15),
        (LAST + 1, 2.0**14),
    ]
    parity.check(
        f"fp16: updates (of {UPDATES}) whose loss scale differs",
        int(np.sum(j.loss_scales != t.loss_scales)),
        0,
        "GradScaler's rule in both: x0.5 on a skipped update, x2 after 2000 good ones",
    )


# ----------------------------------------------------------------------------- natural overflow

NATURAL_UPDATES = 40
BIG_SCALE = 2.0**30
"""The initial loss scale of the natural-overflow runs (GradScaler's default is 2**16): the scaled
gradients overflow float16 (65504) until the scale has been halved enough times."""


@pytest.fixture(scope="module", params=[1, 2], ids=["K1", "K2"])
def natural(request):
    """The digits MLP (64-32-10, batch 32, K=1 and K=2) in fp16 from an initial scale of 2**30, no injected
    overflow: both loops skip updates and halve the scale until the scaled gradients fit in float16;
    and the same in fp32 (the own gaps). Both autocast-like: float16 matmuls, the rest float32.

    K=2 holds because both scale each micro-batch's loss by scale / K (torch_ref:
    `scaler.scale(loss / K).backward()`; jaxloop: dynamic_loss_scale's factor). Mutant caught (run, seen
    to fail, reverted): jaxloop scaling each micro-batch's loss by the whole scale (30 of 40 updates'
    flags and scales differ at K=2)."""
    import jaxloop.model.precision as jp
    import torch_ref.precision as tp

    cfg = _cfg(request.param)
    splits = load_splits(cfg)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jp, "INIT_SCALE", BIG_SCALE)
        mp.setattr(tp, "INIT_SCALE", BIG_SCALE)
        j = jax_run(cfg, splits, NATURAL_UPDATES)
        t = torch_run(cfg, splits, j.init, NATURAL_UPDATES)
    f32 = replace(cfg, precision="fp32")
    jf = jax_run(f32, splits, NATURAL_UPDATES, init_params=j.init)
    tf = torch_run(f32, splits, j.init, NATURAL_UPDATES)
    return j, t, jf, tf


def test_natural_overflow_gives_the_same_skips_and_scales(natural, parity):
    """Mutant caught (run, seen to fail, reverted): torch_ref's GradScaler with backoff factor 0.25 instead of
    0.5 (fewer skips, other scales)."""
    j, t, _, _ = natural
    skipped = int(np.sum(~j.updated))
    assert skipped >= 3 and j.loss_scales[0] == BIG_SCALE, "the scale starts too high and is halved by overflow"
    assert j.updated[-10:].all(), "and then the updates go through"
    parity.check(
        f"fp16 natural overflow (init scale 2^30, {skipped} skips): updates skipped by one framework only, "
        "and updates whose loss scale differs",
        int(np.sum(j.updated != t.updated)) + int(np.sum(j.loss_scales != t.loss_scales)),
        0,
        "an overflow of the scaled gradient in either framework's float16 backward; the scale halves by 2, "
        "so only a gradient within rounding of the fp16 limit could split the decisions",
    )


def test_natural_overflow_fp16_trajectories_agree_within_the_own_fp16_gaps(natural, parity):
    """Loss (RMS over the updates, relative) and params (after the last update) of the fp16 runs across the
    frameworks, against each framework's own fp16-vs-fp32 gap: at most twice the smaller."""
    j, t, jf, tf = natural
    rel = lambda a, b: np.abs(a - b) / np.abs(b)  # noqa: E731
    rms = lambda v: float(np.sqrt(np.mean(v**2)))  # noqa: E731
    lj, lt, lc = rms(rel(j.losses, jf.losses)), rms(rel(t.losses, tf.losses)), rms(rel(j.losses, t.losses))
    pj, pt, pc = (
        tree_rel_diff(j.params, jf.params)[0],
        tree_rel_diff(t.params, tf.params)[0],
        tree_rel_diff(j.params, t.params)[0],
    )
    parity.check(
        f"fp16 natural overflow: loss RMS over {NATURAL_UPDATES} updates, jax vs torch (bound 2 x min own "
        f"fp16-fp32 gap; gaps {lj:.1e}, {lt:.1e})",
        lc,
        2 * min(lj, lt),
        "each framework's float16 matmul rounding compounds over the run",
    )
    parity.check(
        f"fp16 natural overflow: params after {NATURAL_UPDATES} updates, jax vs torch (bound 2 x min own gap; "
        f"gaps {pj:.1e}, {pt:.1e})",
        pc,
        2 * min(pj, pt),
        "same",
    )
