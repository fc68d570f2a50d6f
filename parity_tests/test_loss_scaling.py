"""fp16 dynamic loss scaling: the same scale sequence and the same skipped updates in both.

jaxloop's LossScale (GradScaler's rule: 2^16, halve on a non-finite update, double after 2000 good
ones) against torch.amp.GradScaler under torch_ref, on the digits MLP with 2 micro-batches per update,
fed the same micro-batches with overflows injected: a NaN input at the first (non-emitting) micro-step
of update 3, a huge input (1e5 > fp16's 65504: inf) at the second (emitting) micro-step of update 5,
and a NaN again after the scale has grown back. Exact: scales are powers of 2, flags are booleans.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loopcore.sources import MicroBatchGather, load_splits
from parity_tests.harness import jax_run, mlp_cfg, model, optim, torch_run

K = 2
GROWTH = 2000
LAST = 5 + GROWTH + 4
"""The update poisoned again once the scale has grown back."""
INJECT = {3 * K + 0: "nan", 5 * K + 1: "huge", LAST * K + 1: "nan"}
"""micro-step index -> what replaces its first record's input."""
UPDATES = 5 + GROWTH + 8


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
    cfg = optim(model(mlp_cfg(precision="fp16", batch_size=8, steps=UPDATES), hidden=(16,)), accum_steps=K)
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
    parity.check(f"fp16: updates (of {UPDATES}) applied by one framework and skipped by the other",
                 int(np.sum(j.updated != t.updated)), 0,
                 "a non-finite micro-batch poisons its whole update, emitting or not, in both")


def test_both_follow_the_same_loss_scale_sequence(runs, parity):
    j, t = runs
    changes = [0] + list(np.flatnonzero(np.diff(j.loss_scales)) + 1)
    # halved after the skipped updates 3 and 5, doubled after the 2000 good updates 6 .. 2005, halved after LAST
    assert [(int(u), float(j.loss_scales[u])) for u in changes] == [
        (0, 2.0**16), (4, 2.0**15), (6, 2.0**14), (6 + GROWTH, 2.0**15), (LAST + 1, 2.0**14)]
    parity.check(f"fp16: updates (of {UPDATES}) whose loss scale differs", int(np.sum(j.loss_scales != t.loss_scales)), 0,
                 "GradScaler's rule in both: x0.5 on a skipped update, x2 after 2000 good ones")
