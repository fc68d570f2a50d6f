"""Validation, EMA and early stopping: both real loops (jaxloop.train.run, torch_ref.train.run) from the
same initial weights, the digits MLP in float64 with an EMA of the params (optim.ema_decay 0.9), an
evaluation every 3 updates and early stopping (patience 2) on a noisy rate, so that it stops early.

Validation: jaxloop pads the last validation batch with weight-0 records; torch_ref evaluates a short last
batch (the split's size is not a multiple of the eval batch); both average over the records exactly.
Compared per evaluation: val_loss, val_acc, ema_val_loss, ema_val_acc (relative, float64 bound), the
evaluated steps and the update at which each stopped (exact).

Mutants caught (run, seen to fail, reverted): torch_ref averaging the validation loss over batches
instead of records (the short last batch over-weighted): 4.5e-2; torch_ref's EMA update d * p + (1 - d) * e
(decay on the wrong side): 7.6e-1; torch_ref stopping after patience + 1 evaluations without improvement.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from jaxloop.data.sources import load_splits
from parity_tests.harness import curve_rel_diff, host, jax_mode, jax_state, mlp_cfg, optim, records, schedule_fields

KEYS = ("val_loss", "val_acc", "ema_val_loss", "ema_val_acc")


@pytest.fixture(scope="module")
def eval_runs(x64, tmp_path_factory):
    from jaxloop.train import run as jax_train
    from torch_ref.train import run as torch_train

    base = tmp_path_factory.mktemp("eval")
    cfg = optim(
        schedule_fields(
            mlp_cfg(base / "jax", precision="fp64", steps=120, eval_every=3, log_every=1, patience=2), warmup_steps=0
        ),
        ema_decay=0.9,
        peak_lr=0.05,
    )
    splits = load_splits(cfg)
    with jax_mode(cfg.precision):
        init = host(jax_state(cfg, splits).params)
    jsum = jax_train(cfg)
    tcfg = replace(cfg, run_dir=str(base / "torch"))
    tres = torch_train(tcfg, init_params=init, clip="optax", device="cpu", splits=splits)
    return dict(cfg=cfg, splits=splits, jax=(cfg, jsum), torch=(tcfg, tres.summary))


def test_the_last_validation_batch_is_short(eval_runs):
    cfg, splits = eval_runs["cfg"], eval_runs["splits"]
    size = cfg.data.eval_batch_size or cfg.batch_size
    assert len(splits.val) % size != 0, "jaxloop pads the last batch, torch_ref's is short"


def test_validation_and_ema_metrics_agree_at_every_evaluation(eval_runs, parity):
    (jcfg, _), (tcfg, _) = eval_runs["jax"], eval_runs["torch"]
    je, te = records(jcfg.run_dir, "eval"), records(tcfg.run_dir, "eval")
    assert [r["step"] for r in je] == [r["step"] for r in te] and len(je) >= 3
    worst = max(curve_rel_diff([r[k] for r in je], [r[k] for r in te]) for k in KEYS)
    parity.check(
        f"eval fp64 ({len(je)} evaluations): val_loss, val_acc, ema_val_loss, ema_val_acc, relative",
        worst,
        1e-10,
        "the same float64 weights and EMA (test_trajectory's bound); padding with weight 0 vs a "
        "short batch, both averaged over records",
    )
    ema_gap = max(abs(r["ema_val_loss"] - r["val_loss"]) / r["val_loss"] for r in je)
    assert ema_gap > 1e-3, "the EMA weights are not the weights (the EMA is exercised)"


def test_both_stop_early_at_the_same_evaluation(eval_runs, parity):
    (jcfg, jsum), (tcfg, tsum) = eval_runs["jax"], eval_runs["torch"]
    assert jsum["stop_reason"] == "early_stopping", jsum["stop_reason"]
    jlast, tlast = records(jcfg.run_dir)[-1]["step"], records(tcfg.run_dir)[-1]["step"]
    assert jlast < jcfg.steps, "stopped before the end"
    parity.check(
        f"early stopping (patience {jcfg.patience}): |update at which jaxloop stopped ({jlast}) - torch_ref's|",
        abs(jlast - tlast) + (tsum.get("stop_reason") != "early_stopping"),
        0,
        "the same evaluations, the same best-metric rule",
    )
