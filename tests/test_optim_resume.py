"""Resume for every optimizer and schedule through the real `jaxloop.run`: a run killed after a checkpoint
and resumed ends bit-identical to the uninterrupted one (the plateau decision state included); a resume
that changes the optimizer or the schedule is refused naming the fields.

Twelve short runs of the debug preset (MLP 32, batch 32): each schedule paired with an optimizer in turn,
so that all six optimizers and all twelve schedules are covered. 16 updates, evaluation and checkpoint
every 4. The kill is simulated as a SIGKILL right after the checkpoint at update 8 leaves the run
directory: a copy of the finished run's directory without its later checkpoints and summary.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

import jaxloop
from jaxloop.config.optimizers import (
    AdagradConfig,
    AdamConfig,
    AdamWConfig,
    LionConfig,
    OptimizerConfig,
    RMSpropConfig,
    SGDConfig,
)
from jaxloop.config.run import CheckpointConfig, ConfigError, LogConfig, preset
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
    ScheduleConfig,
    StepConfig,
    WarmupCosineConfig,
    WSDConfig,
)
from jaxloop.rundir.records import read_records

RESUME_FROM = 8

W = 4
"""The debug preset's warmup, kept by every schedule that has one."""

COMBOS = [  # (the schedule, the optimizer)
    (WarmupCosineConfig(warmup_steps=W, end_lr=1e-4), AdamWConfig()),
    (ConstantConfig(warmup_steps=W), AdamConfig()),
    (LinearConfig(warmup_steps=W), SGDConfig(momentum=0.9, dampening=0.1)),
    (PolynomialConfig(warmup_steps=W, power=2.0), RMSpropConfig(momentum=0.5, centered=True)),
    (StepConfig(warmup_steps=W, step_size=3), AdagradConfig(lr_decay=0.01)),
    (MultiStepConfig(warmup_steps=W, milestones=(3, 7)), LionConfig(b2=0.99)),
    (ExponentialConfig(warmup_steps=W, gamma=0.9), AdamWConfig()),
    (CosineRestartsConfig(warmup_steps=W, t_0=3, t_mult=2), AdamConfig()),
    (OneCycleConfig(), SGDConfig(momentum=0.9, nesterov=True)),
    (WSDConfig(warmup_steps=W, decay_steps=4), RMSpropConfig()),
    (InverseSqrtConfig(warmup_steps=W), AdagradConfig(initial_accumulator_value=0.1)),
    (PlateauConfig(patience=0, threshold=0.5, factor=0.5), LionConfig()),
]


def _cfg(run_dir: Path, schedule: ScheduleConfig | None = None, optimizer: OptimizerConfig | None = None):
    """The debug preset's run with `schedule` and `optimizer` (its own where None)."""
    base = preset("debug")
    return replace(
        base,
        run_dir=str(run_dir),
        steps=16,
        eval_every=4,
        log_every=1,
        optim=replace(
            base.optim,
            lr_schedule=schedule or base.optim.lr_schedule,
            optimizer=optimizer or base.optim.optimizer,
        ),
        checkpoint=CheckpointConfig(every=4, keep_last=5, keep_best=0),
        log=LogConfig(progress="off", report=False, tensorboard=False),
    )


def _killed_after(run_dir: Path, step: int, to: Path) -> None:
    """`to`: run_dir as a SIGKILL right after the checkpoint at `step` would have left it."""
    shutil.copytree(run_dir, to)
    for ckpt in (to / "checkpoints").iterdir():
        if ckpt.name.isdigit() and int(ckpt.name) > step:
            shutil.rmtree(ckpt)
    (to / "summary.json").unlink()


def _logged(run_dir: Path) -> list[tuple]:
    return [(r["kind"], r["step"], r.get("loss"), r.get("lr"), r.get("val_loss")) for r in read_records(run_dir)]


@pytest.mark.parametrize("schedule,optimizer", COMBOS, ids=[f"{s.name}-{o.name}" for s, o in COMBOS])
def test_a_resumed_run_is_bit_identical_to_the_uninterrupted_one(schedule, optimizer, tmp_path):
    full = tmp_path / "full"
    summary = jaxloop.run(_cfg(full, schedule, optimizer))
    _killed_after(full, RESUME_FROM, tmp_path / "resumed")
    resumed = jaxloop.run(replace(_cfg(tmp_path / "resumed", schedule, optimizer), resume="must"))
    assert json.loads((tmp_path / "resumed" / "resumes.jsonl").read_text())["step"] == RESUME_FROM
    assert resumed["state_digest"] == summary["state_digest"]
    assert _logged(tmp_path / "resumed") == _logged(full)
    if schedule.name == "plateau":
        lr = {r["step"]: r["lr"] for r in read_records(full) if r["kind"] == "train"}
        cuts = [u for u in range(1, 16) if lr[u + 1] < lr[u]]
        assert any(u <= RESUME_FROM for u in cuts) and any(u > RESUME_FROM for u in cuts), (
            f"reductions before and after the resume at {RESUME_FROM}: {cuts}"
        )


@pytest.mark.parametrize(
    "changes,named",
    [  # named by their config.json paths
        (dict(optimizer=SGDConfig()), "optim.optimizer.name"),
        (dict(lr_schedule=ExponentialConfig(warmup_steps=W)), "optim.lr_schedule.name"),
        (dict(optimizer=AdamWConfig(b1=0.8)), "optim.optimizer.b1"),
    ],
)
def test_resuming_with_a_changed_optimizer_or_schedule_is_refused(changes, named, tmp_path):
    # the preset's own optimizer and schedule over the resume test's 16 updates: the first combination's run,
    # whose programs the session's compile cache holds
    cfg = _cfg(tmp_path)
    jaxloop.run(cfg)
    with pytest.raises(ConfigError) as e:
        jaxloop.run(replace(cfg, optim=replace(cfg.optim, **changes)))
    assert e.value.field_path == "resume" and named in str(e.value)
