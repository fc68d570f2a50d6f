"""Checkpoint rotation: for the same saves and metrics both keep the same steps and name the same best.

jaxloop: real Orbax saves (jaxloop.checkpoint.manager.Checkpointer) of a tiny TrainState. torch_ref: its pure
rule (torch_ref.checkpoint.kept_steps / best_step) and its CheckpointManager writing real files.
Compared after every save: the kept steps and the best step. Exact (they are integers).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from jaxloop.checkpoint.manager import Checkpointer
from jaxloop.config.run import CheckpointConfig, Config, ModelConfig, to_dict
from parity_tests.harness import QUIET, jax_mode
from torch_ref.checkpoint import CheckpointManager, best_step, kept_steps

SCENARIOS = {
    # name: (checkpoint config, [(step, val_loss or None), ...]); val_acc = 1 - val_loss
    "min, ties, saves without metrics, keep_every": (
        CheckpointConfig(keep_last=2, keep_best=2, keep_every=5, async_save=False),
        [
            (1, 0.9),
            (2, 0.5),
            (3, 0.7),
            (4, 0.5),
            (5, 0.8),
            (6, None),
            (7, 0.45),
            (8, 0.45),
            (9, 0.6),
            (10, None),
            (11, 0.9),
            (12, 0.45),
            (13, None),
        ],
    ),
    "max (val_acc), ties, keep 1 best and 1 last": (
        CheckpointConfig(keep_last=1, keep_best=1, best_metric="val_acc", best_mode="max", async_save=False),
        [(10, 0.9), (20, 0.5), (30, 0.5), (40, None), (50, 0.7), (60, 0.5), (70, 0.8), (75, None)],
    ),
    "fewer evaluated saves than keep_best": (
        CheckpointConfig(keep_last=1, keep_best=3, async_save=False),
        [(1, None), (2, 0.5), (3, None), (4, None), (5, 0.4), (6, None), (7, 0.6), (8, 0.3), (9, None)],
    ),
    "no best tracking, keep every 4th": (
        CheckpointConfig(keep_last=3, keep_best=0, keep_every=4, async_save=False),
        [(s, (0.1 * s) % 0.7) for s in range(1, 14)],
    ),
    "min, all equal metrics": (
        CheckpointConfig(keep_last=2, keep_best=2, async_save=False),
        [(s, 0.25) for s in (3, 6, 9, 12, 15)] + [(16, None)],
    ),
}


def _metrics(value):
    return None if value is None else {"val_loss": value, "val_acc": 1.0 - value}


def _tiny_state(cfg: Config):
    from jaxloop.loop.task import create_train_state
    from jaxloop.model.builtin import make_model

    return create_train_state(cfg, make_model(cfg.model, 3, cfg.precision), np.zeros((1, 4), np.float32))


@pytest.fixture(scope="module")
def histories(tmp_path_factory):
    """Per scenario, after every save: (jaxloop's kept steps, best), (torch_ref rule), (torch_ref manager)."""
    out = {}
    for index, (name, (ckpt_cfg, saves)) in enumerate(SCENARIOS.items()):
        root = tmp_path_factory.mktemp(f"rotation{index}")
        cfg = Config(run_dir=str(root / "jax"), log=QUIET, model=ModelConfig(hidden=(4,)), checkpoint=ckpt_cfg)
        jax_hist, rule_hist, manager_hist = [], [], []
        with jax_mode("fp32"):
            state = _tiny_state(cfg)
            ckpt = Checkpointer(cfg.checkpoint, root / "jax", config=to_dict(cfg))
            manager = CheckpointManager(replace(cfg, run_dir=str(root / "torch")), root / "torch")
            try:
                by_step = {}
                for step, value in saves:
                    ckpt.save(step, state, {"position": step}, metrics=_metrics(value))
                    ckpt.wait()
                    jax_hist.append((ckpt.all_steps(), ckpt.best_step()))
                    by_step[step] = _metrics(value)
                    kept = kept_steps([s for s, _ in saves[: len(by_step)]], by_step, cfg)
                    rule_hist.append((kept, best_step([(s, by_step[s]) for s in kept], cfg)))
                    manager.save(step, {"model": {}, "step": step}, _metrics(value))
                    manager_hist.append((manager.all_steps(), manager.best_step()))
            finally:
                ckpt.close()
        out[name] = (jax_hist, rule_hist, manager_hist)
    return out


def test_both_keep_the_same_steps_after_every_save(histories, parity):
    differing = sum(
        j[0] != r[0] or j[0] != m[0]
        for jax_hist, rule_hist, manager_hist in histories.values()
        for j, r, m in zip(jax_hist, rule_hist, manager_hist)
    )
    saves = sum(len(s) for _, s in SCENARIOS.values())
    parity.check(
        f"rotation ({len(SCENARIOS)} sequences, {saves} saves): saves after which the kept steps differ "
        "(Orbax vs torch_ref rule and manager)",
        differing,
        0,
        "the same retention rule: newest keep_last, best keep_best of the evaluated, every keep_every-th",
    )


def test_both_report_the_same_best_step_after_every_save(histories, parity):
    differing = sum(
        j[1] != r[1] or j[1] != m[1]
        for jax_hist, rule_hist, manager_hist in histories.values()
        for j, r, m in zip(jax_hist, rule_hist, manager_hist)
    )
    parity.check(
        "rotation: saves after which the best step differs (ties: the newer wins in both)",
        differing,
        0,
        "the same metric, mode and tie rule",
    )


def test_the_sequences_exercise_ties_and_unevaluated_saves(histories):
    # min: val_loss 0.45 at 7, 8 and 12, so the best two are 12 and 8 (the newer of equals wins); the last
    # two are 12 and 13 (13 saved without metrics); every 5th: 5 and 10.
    assert histories["min, ties, saves without metrics, keep_every"][0][-1] == ([5, 8, 10, 12, 13], 12)
    # max val_acc: 0.5 at 20, 30 and 60, so 60 is the best; the last is 75 (no metrics).
    assert histories["max (val_acc), ties, keep 1 best and 1 last"][0][-1] == ([60, 75], 60)
