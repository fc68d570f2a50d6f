"""The optimizer and schedule fields of the config: each is read by the optimizers and schedules that use
it and refused, naming the field, its value and who ignores it, when set for one that does not; flags,
YAML, --help; resuming with a changed field is refused; jaxloop.loop.plateau against torch's ReduceLROnPlateau."""

from __future__ import annotations

import contextlib
import io
import json
import math
from dataclasses import fields, replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxloop.config.cli import parse_config
from jaxloop.config.optimizers import OPTIMIZERS
from jaxloop.config.run import (
    Config,
    ConfigError,
    PlateauConfig,
    flat_hints,
    preset,
    resume_conflicts,
    rewrite_flat,
    to_dict,
    validate,
)
from jaxloop.config.schedules import SCHEDULES
from jaxloop.loop.plateau import Plateau


def _check(**flat) -> Config:
    """The default Config with optim's flat keys `flat` (the flags' form: rewrite_flat), validated."""
    return validate(replace(Config(), optim=rewrite_flat(Config().optim, flat)), check_paths=False)


@pytest.mark.parametrize(
    "name,field,value",
    [
        ("sgd", "b2", 0.99),
        ("sgd", "eps", 1e-6),
        ("adamw", "momentum", 0.9),
        ("adam", "nesterov", True),
        ("rmsprop", "dampening", 0.1),
        ("adagrad", "alpha", 0.9),
        ("lion", "eps", 1e-6),
        ("lion", "lr_decay", 0.1),
    ],
)
def test_a_field_the_optimizer_does_not_read_is_refused_naming_it(name, field, value):
    with pytest.raises(ConfigError) as e:
        _check(name=name, **{field: value})
    message = str(e.value)
    assert e.value.field_path == f"optim.{field}" and f"optim.{field}={value!r}" in message
    assert f"optim.name={name} does not read it" in message


@pytest.mark.parametrize(
    "schedule,changes",
    [
        ("step", dict(step_size=10, end_lr=1e-3)),
        ("one_cycle", dict(warmup_steps=10)),
        ("warmup_cosine", dict(gamma=0.5)),
        ("plateau", dict(init_lr=1e-4)),
        ("constant", dict(plateau=PlateauConfig(patience=3))),
    ],
)
def test_a_field_the_schedule_does_not_read_is_refused_naming_it(schedule, changes):
    with pytest.raises(ConfigError, match=f"optim.schedule={schedule} does not read it"):
        _check(schedule=schedule, **changes)


def test_the_default_of_a_field_is_the_presets():
    # the shakespeare preset sets b2 = 0.99 and weight_decay = 0.1: sgd leaves b2 alone and reads weight_decay
    cfg = preset("shakespeare")
    cfg = replace(cfg, data=replace(cfg.data, path="input.txt"))  # not read: check_paths=False
    validate(replace(cfg, optim=rewrite_flat(cfg.optim, dict(name="sgd", momentum=0.9))), check_paths=False)
    with pytest.raises(ConfigError, match="optim.b2=0.999"):
        validate(replace(cfg, optim=rewrite_flat(cfg.optim, dict(name="sgd", b2=0.999))), check_paths=False)


def test_every_governed_field_is_read_by_someone_and_every_optim_field_is_governed_or_shared():
    governed = {
        f if not c.prefix else c.prefix.rstrip(".")
        for table in (OPTIMIZERS, SCHEDULES)
        for c in table.values()
        for f in c.field_names()
    }
    shared = {"name", "schedule", "peak_lr", "clip_norm", "accum_steps", "ema_decay"}
    assert governed | shared == set(flat_hints())


@pytest.mark.parametrize(
    "changes,field",
    [
        (dict(schedule="step"), "optim.step_size"),
        (dict(schedule="multistep"), "optim.milestones"),
        (dict(schedule="cosine_restarts"), "optim.t_0"),
        (dict(schedule="wsd"), "optim.decay_steps"),
        (dict(schedule="wsd", decay_steps=451), "optim.decay_steps"),
        (dict(schedule="multistep", milestones=(5, 3)), "optim.milestones"),
        (dict(name="sgd", nesterov=True), "optim.nesterov"),
        (dict(name="sgd", momentum=0.9, dampening=0.1, nesterov=True), "optim.nesterov"),
        (dict(name="sgd", momentum=1.0), "optim.momentum"),
        (dict(schedule="one_cycle", pct_start=0.001), "optim.pct_start"),
        (dict(schedule="one_cycle", pct_start=0.6, three_phase=True), "optim.pct_start"),
        (dict(schedule="plateau", plateau=PlateauConfig(factor=1.0)), "optim.plateau.factor"),
    ],
)
def test_schedule_and_optimizer_values_out_of_range_name_the_field(changes, field):
    with pytest.raises(ConfigError) as e:
        _check(**changes)
    assert e.value.field_path == field


def test_flags_read_naturally_and_yaml_nests_plateau(tmp_path):
    cfg = parse_config(
        [
            "--optim.schedule",
            "one_cycle",
            "--optim.div_factor",
            "10",
            "--optim.three_phase",
            "--optim.anneal_strategy",
            "linear",
        ],
        check_paths=False,
    )
    assert (cfg.optim.schedule, cfg.optim.lr_schedule.div_factor, cfg.optim.lr_schedule.three_phase) == (
        "one_cycle",
        10.0,
        True,
    )
    cfg = parse_config(
        ["--optim.schedule", "multistep", "--optim.milestones", "100", "200", "--optim.gamma", "0.5"], check_paths=False
    )
    assert cfg.optim.lr_schedule.milestones == (100, 200)
    cfg = parse_config(["--optim.name", "sgd", "--optim.momentum", "0.9", "--optim.nesterov"], check_paths=False)
    assert cfg.optim.optimizer.nesterov
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  schedule: plateau\n  plateau:\n    patience: 3\n    factor: 0.5\n")
    cfg = parse_config(["--config", str(path), "--optim.plateau.cooldown", "2"], check_paths=False)
    assert cfg.optim.lr_schedule == PlateauConfig(patience=3, factor=0.5, cooldown=2)


def test_help_documents_every_optimizer_and_schedule_field():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parse_config(["--help"])
    text = out.getvalue().replace("-", "_")
    for name in flat_hints():  # every flat field (the flags), which the classes hold
        assert f"__optim.{name}" in text, name
    for f in fields(PlateauConfig):
        assert f"__optim.plateau.{f.name}" in text, f.name
    assert "ReduceLROnPlateau" in text and "OneCycleLR" in text


@pytest.mark.parametrize(
    "changes",
    [
        dict(name="sgd"),
        dict(schedule="exponential"),
        dict(name="sgd", momentum=0.9),
        dict(schedule="plateau", plateau=PlateauConfig(patience=2)),
    ],
)
def test_resuming_with_another_optimizer_or_schedule_is_refused_naming_the_fields(changes):
    # another class is one conflict, its stored name; the same class with another field names that field
    saved = to_dict(Config())
    conflicts = resume_conflicts(saved, _check(**changes))
    named = {c.split(":")[0] for c in conflicts}
    want = {f"optim.{'optimizer' if k == 'name' else 'lr_schedule'}.name" for k in changes if k in ("name", "schedule")}
    assert named == want


def test_a_config_saved_before_the_menu_resumes_with_the_defaults():
    saved = to_dict(Config())
    optimizer, schedule = saved["optim"].pop("optimizer"), saved["optim"].pop("lr_schedule")
    # the optim section as jaxloop wrote it before the menu: flat, adamw's and warmup_cosine's fields only
    saved["optim"].update({k: v for k, v in {**optimizer, **schedule}.items() if k != "name"})
    assert resume_conflicts(saved, Config()) == []
    assert resume_conflicts(saved, _check(name="adam")) == ["optim.optimizer.name: 'adamw' -> 'adam'"]


# ----------------------------------------------------------------------------- plateau's decision


def _torch_plateau(mode, factor, patience, threshold, threshold_mode, cooldown, min_lr, eps, rate):
    import torch

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=rate)
    return opt, torch.optim.lr_scheduler.ReduceLROnPlateau(
        opt,
        mode=mode,
        factor=factor,
        patience=patience,
        threshold=threshold,
        threshold_mode=threshold_mode,
        cooldown=cooldown,
        min_lr=min_lr,
        eps=eps,
    )


@pytest.mark.torch
@settings(max_examples=150, deadline=None)
@given(
    mode=st.sampled_from(["min", "max"]),
    threshold_mode=st.sampled_from(["rel", "abs"]),
    factor=st.sampled_from([0.1, 0.5, 0.9]),
    patience=st.integers(0, 3),
    cooldown=st.integers(0, 3),
    threshold=st.sampled_from([0.0, 1e-4, 0.02, 0.05]),
    min_lr=st.sampled_from([0.0, 1e-3]),
    eps=st.sampled_from([1e-8, 1e-3]),
    steps=st.lists(st.floats(0.9, 1.1), min_size=1, max_size=25),
)
def test_plateau_decides_as_torchs_reduce_lr_on_plateau(
    mode, threshold_mode, factor, patience, cooldown, threshold, min_lr, eps, steps
):
    """The same metric sequence: the same rate after every evaluation, bit for bit, and the same counters;
    the decision state survives a JSON round trip (a checkpoint) at any point. The metrics are a random walk
    of relative steps within 10% (a validation curve's), so that they often land near the thresholds."""
    metrics = list(np.cumprod(steps) * 3.0)
    settings_ = dict(
        mode=mode,
        factor=factor,
        patience=patience,
        threshold=threshold,
        threshold_mode=threshold_mode,
        cooldown=cooldown,
        min_lr=min_lr,
        eps=eps,
        rate=0.1,
    )
    ours = Plateau(**settings_)
    opt, theirs = _torch_plateau(**settings_)
    for i, m in enumerate(metrics):
        reduced = ours.step(m)
        before = opt.param_groups[0]["lr"]
        theirs.step(m)
        assert ours.rate == opt.param_groups[0]["lr"] and reduced == (opt.param_groups[0]["lr"] < before)
        assert (ours.num_bad_epochs, ours.cooldown_counter, ours.last_epoch) == (
            theirs.num_bad_epochs,
            theirs.cooldown_counter,
            theirs.last_epoch,
        )
        assert (ours.best if ours.best is not None else theirs.mode_worse) == theirs.best
        if i % 3 == 1:
            restored = Plateau(**{**settings_, "rate": math.nan})
            restored.load(json.loads(json.dumps(ours.as_dict())))
            assert restored == ours
            ours = restored
