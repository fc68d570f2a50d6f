"""The optimizer and schedule config classes (jaxloop.config.optimizers, jaxloop.config.schedules): each holds
only the fields its choice reads, with its own defaults; config.json stores them nested; the flat flags are put
onto them; a run directory saved in the flat form (tests/data/old_config) still resumes with its stored values."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from jaxloop import OptimConfig, PlateauConfig, SGDConfig, StepConfig
from jaxloop.config.cli import UsageError, parse_config, parse_or_exit
from jaxloop.config.optimizers import OPTIMIZERS, AdagradConfig, AdamWConfig, LionConfig
from jaxloop.config.run import (
    ConfigError,
    changed_fields,
    from_dict,
    preset,
    resume_conflicts,
    rewrite_flat,
    to_dict,
    validate,
)
from jaxloop.config.schedules import SCHEDULES, OneCycleConfig

OLD = Path(__file__).parent / "data" / "old_config"


FLAT = ["sgd_one_cycle.json", "adamw_plateau.json", "default.json", "adagrad.json", "lion_step.json"]


@pytest.mark.parametrize("name", FLAT)
def test_a_run_dir_saved_in_the_old_flat_form_resumes_by_name_without_conflicts(name, tmp_path):
    # the flat optim section is read into its choices' classes, each stored value kept (the fields its choices
    # do not read dropped), and the run goes on with no conflict; what it writes back is the nested form
    saved = json.loads((OLD / name).read_text())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(OLD / name, run_dir / "config.json")
    cfg = parse_config(["--run_dir", str(run_dir)], check_paths=False)
    assert resume_conflicts(saved, cfg) == []
    changed = changed_fields(saved, cfg)
    assert changed.pop("run_dir") == [saved["run_dir"], str(run_dir)]
    assert all(before is None for before, _ in changed.values()), changed  # only fields added since: recorded
    optim = to_dict(cfg)["optim"]
    assert optim["optimizer"]["name"] == saved["optim"]["name"]
    assert optim["lr_schedule"]["name"] == saved["optim"]["schedule"]
    stored = (
        {**saved["optim"], **saved["optim"]["plateau"]} if saved["optim"]["schedule"] == "plateau" else saved["optim"]
    )
    for section in ("optimizer", "lr_schedule"):
        for key, value in optim[section].items():
            assert key == "name" or value == stored[key], (section, key)


def test_a_stored_run_keeps_the_values_it_stored_where_the_classes_defaults_changed():
    # adagrad's eps was 1e-8 and lion's b2 0.999 when these runs were saved (one default per flat name);
    # the classes' defaults are torch's now (1e-10; lion's paper 0.99), the stored runs keep theirs
    # mutant seen failing: the upgrade building the class from its defaults instead of the stored values
    adagrad = from_dict(json.loads((OLD / "adagrad.json").read_text()))
    assert adagrad.optim.optimizer == AdagradConfig(eps=1e-8) != AdagradConfig()
    lion = from_dict(json.loads((OLD / "lion_step.json").read_text()))
    assert lion.optim.optimizer == LionConfig(b2=0.999) != LionConfig()


def test_the_default_runs_old_config_json_reads_as_todays_default_run():
    # the default run's optimizer (AdamW) and schedule keep every value: its losses stay bit-identical
    old = from_dict(json.loads((OLD / "default.json").read_text()))
    assert old.optim == preset("digits").optim and old.optim.optimizer == AdamWConfig()


def test_the_old_form_is_read_into_the_classes_of_its_choices():
    cfg = parse_config(["--config", str(OLD / "sgd_one_cycle.json")], check_paths=False)
    assert cfg.optim == OptimConfig(
        optimizer=SGDConfig(momentum=0.9), lr_schedule=OneCycleConfig(div_factor=10.0), peak_lr=1e-2
    )
    cfg = parse_config(["--config", str(OLD / "adamw_plateau.json")], check_paths=False)
    assert cfg.optim.lr_schedule == PlateauConfig(patience=3) and cfg.optim.optimizer.b2 == 0.99


def test_every_presets_old_config_json_reads_as_the_preset():
    # presets.json holds every preset's config.json in the flat form (61bf00e): each reads as today's preset
    stored = json.loads((OLD / "presets.json").read_text())
    for name, old in stored.items():
        assert from_dict(old).optim == preset(name).optim, name


def test_config_json_stores_the_nested_classes():
    # config.json and the checkpoints' config item: optim.optimizer and optim.lr_schedule, each its class's name
    # and fields, beside the shared fields; read back as the same config
    optim = to_dict(preset("gpt2-finetune"))["optim"]
    assert optim == {
        "optimizer": {"name": "adamw", "weight_decay": 0.1, "b1": 0.9, "b2": 0.95, "eps": 1e-8},
        "lr_schedule": {"name": "constant", "init_lr": 0.0, "warmup_steps": 0},
        "peak_lr": 3e-5,
        "clip_norm": 1.0,
        "accum_steps": 4,
        "ema_decay": 0.0,
    }
    for name in ("digits", "shakespeare", "debug", "gpt2-small", "gpt2-finetune"):
        assert from_dict(json.loads(json.dumps(to_dict(preset(name))))) == preset(name), name


def test_a_nested_section_names_its_class_and_takes_that_class_defaults(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  optimizer:\n    name: adagrad\n    lr_decay: 0.01\n  lr_schedule:\n    name: plateau\n")
    cfg = parse_config(["--config", str(path)], check_paths=False)
    assert cfg.optim.optimizer == AdagradConfig(lr_decay=0.01) and cfg.optim.lr_schedule == PlateauConfig()
    path.write_text("optim:\n  optimizer:\n    name: sgd\n    b1: 0.8\n")
    with pytest.raises(ConfigError) as e:
        parse_config(["--config", str(path)], check_paths=False)
    assert e.value.field_path == "optim.optimizer.b1"


def test_a_flag_the_chosen_optimizer_does_not_read_is_refused_naming_its_readers():
    with pytest.raises(ConfigError) as e:
        parse_config(["--optim.name", "sgd", "--optim.b1", "0.8"], check_paths=False)
    assert e.value.field_path == "optim.b1"
    assert "optim.name=sgd does not read it; read by optim.name=adamw, optim.name=adam, optim.name=lion" in str(e.value)


def test_python_refuses_a_field_the_chosen_class_does_not_hold():
    with pytest.raises(TypeError, match="b1"):
        SGDConfig(b1=0.8)  # structurally: the class has no such field
    with pytest.raises(AttributeError, match="momentum"):
        _ = OptimConfig().optimizer.momentum  # adamw holds no momentum


@pytest.mark.parametrize(
    "flat", [dict(name="sgd"), dict(schedule="step"), dict(momentum=0.9), dict(warmup_steps=10), dict(plateau=None)]
)
def test_optim_config_takes_the_nested_classes_only(flat):
    """Python writes the form config.json stores (issue 44.1): a flat key (the flags' form) is no keyword of
    OptimConfig, nor of a replace of one. Mutant: OptimConfig's former __init__ that put flat keywords through
    rewrite_flat (accepted them)."""
    key = next(iter(flat))
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{key}'"):
        OptimConfig(**flat)
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{key}'"):
        replace(OptimConfig(), **flat)
    o = OptimConfig(optimizer=SGDConfig(momentum=0.9), lr_schedule=StepConfig(step_size=100), peak_lr=0.1)
    assert (o.name, o.schedule, o.optimizer.momentum, o.lr_schedule.step_size) == ("sgd", "step", 0.9, 100)


def test_the_flags_flat_keys_and_the_classes_build_the_same_config():
    flat = rewrite_flat(OptimConfig(), dict(name="sgd", momentum=0.9, schedule="step", step_size=100, peak_lr=0.1))
    assert flat == OptimConfig(optimizer=SGDConfig(momentum=0.9), lr_schedule=StepConfig(step_size=100), peak_lr=0.1)


def test_the_classes_errors_name_the_flag_path():
    with pytest.raises(ConfigError) as e:
        SGDConfig(momentum=1.5).validate()
    assert e.value.field_path == "optim.momentum" and "a number in [0, 1)" in str(e.value)
    with pytest.raises(ConfigError) as e:
        PlateauConfig(patience=-1).validate(1e-3, 10)
    assert e.value.field_path == "optim.plateau.patience"


TORCH_NAMES = {"b1": ("betas", 0), "b2": ("betas", 1)}
"""jaxloop's field -> torch's argument (and index in it), where the names differ."""


@pytest.mark.torch  # reads torch.optim's signatures
def test_each_optimizer_class_defaults_to_torchs_defaults():
    # torch's documented defaults (read from the installed torch's signatures; Lion: torch_ref.lion, the
    # paper's and lion-pytorch's betas (0.9, 0.99)), but weight_decay: jaxloop's 1e-4 for every class, the
    # default run's (bit-identical to the recorded reference)
    # mutant seen failing: AdagradConfig.eps back at 1e-8; LionConfig.b2 back at 0.999
    import inspect

    import torch

    from torch_ref.lion import Lion

    torch_class = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
    torch_class |= {"rmsprop": torch.optim.RMSprop, "adagrad": torch.optim.Adagrad, "lion": Lion}
    assert set(torch_class) == set(OPTIMIZERS)
    for name, cls in OPTIMIZERS.items():
        params = inspect.signature(torch_class[name]).parameters
        for field in cls.field_names():
            if field == "weight_decay":
                continue
            arg, index = TORCH_NAMES.get(field, (field, None))
            want = params[arg].default if index is None else params[arg].default[index]
            assert getattr(cls(), field) == want, (name, field)
    assert AdagradConfig().eps == 1e-10 and LionConfig().b2 == 0.99
    assert {cls().weight_decay for cls in OPTIMIZERS.values()} == {1e-4}


def test_a_flag_that_switches_the_class_gives_that_class_its_own_defaults():
    # --optim.name adagrad: torch's Adagrad eps (1e-10), not AdamW's 1e-8; a flag given with it still applies
    cfg = parse_config(["--optim.name", "adagrad"], check_paths=False)
    assert cfg.optim.optimizer == AdagradConfig()
    cfg = parse_config(["--optim.name", "lion", "--optim.b1", "0.95"], check_paths=False)
    assert cfg.optim.optimizer == LionConfig(b1=0.95)
    cfg = parse_config(["--optim.eps", "1e-8", "--optim.name", "adagrad"], check_paths=False)
    assert cfg.optim.optimizer == AdagradConfig(eps=1e-8)  # the flag, though it equals adamw's default
    assert set(OPTIMIZERS) == {"adamw", "adam", "sgd", "rmsprop", "adagrad", "lion"} and len(SCHEDULES) == 12


def _help(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parse_config([*argv, "--help"])
    return out.getvalue().replace("-", "_")


def test_help_after_optim_name_lists_that_optimizers_fields_with_their_docs():
    text = _help(["--optim.name", "sgd", "--optim.schedule", "step"])
    for flag in ("momentum", "dampening", "nesterov", "weight_decay", "step_size", "gamma", "warmup_steps", "peak_lr"):
        assert f"__optim.{flag}" in text, flag
    assert "the gradient enters the momentum buffer times (1 _ dampening)" in " ".join(text.split())
    for other in ("b1", "eps", "alpha", "pct_start", "plateau.patience"):
        assert f"__optim.{other} " not in text, other
    assert "__optim.b1 " in _help([]), "the plain --help lists every field"


def test_a_validated_config_keeps_the_default_runs_optimizer():
    cfg = validate(preset("digits"), check_paths=False)
    assert type(cfg.optim.optimizer).__name__ == "AdamWConfig" and cfg.optim.schedule == "warmup_cosine"


def test_the_report_names_the_optimizer_of_a_nested_or_an_older_flat_config():
    # report.md's optimizer row reads the saved config.json: the nested form, or a flat one of an earlier run
    # mutant seen failing: the row reading optim.name only (every nested run shown as adamw)
    from jaxloop.observe.run_report import _chosen

    nested = to_dict(parse_config(["--optim.name", "lion"], check_paths=False))["optim"]
    flat = json.loads((OLD / "sgd_one_cycle.json").read_text())["optim"]
    assert [_chosen(o, "optimizer", "name", "adamw") for o in (nested, flat)] == ["lion", "sgd"]
    assert [_chosen(o, "lr_schedule", "schedule", "") for o in (nested, flat)] == ["warmup_cosine", "one_cycle"]


@pytest.mark.parametrize(
    "nested,flat",
    [
        (
            "--optim.optimizer.name sgd --optim.optimizer.momentum 0.9 --optim.optimizer.nesterov "
            "--optim.lr_schedule.name step --optim.lr_schedule.step_size 100 --optim.lr_schedule.warmup_steps 5",
            "--optim.name sgd --optim.momentum 0.9 --optim.nesterov --optim.schedule step --optim.step_size 100 "
            "--optim.warmup_steps 5",
        ),
        (  # = and dashes, as every flag; the chosen class the preset's (adamw, warmup_cosine)
            "--optim.optimizer.b1=0.95 --optim.optimizer.weight-decay 0.1 --optim.lr-schedule.end-lr=1e-4",
            "--optim.b1=0.95 --optim.weight_decay 0.1 --optim.end_lr=1e-4",
        ),
        (  # plateau's fields are config.json's optim.lr_schedule.patience, the flat flags' optim.plateau.patience
            "--optim.lr_schedule.name plateau --optim.lr_schedule.patience 3 --optim.optimizer.name lion "
            "--optim.optimizer.b2 0.98",
            "--optim.schedule plateau --optim.plateau.patience 3 --optim.name lion --optim.b2 0.98",
        ),
    ],
)
def test_the_nested_flags_config_json_paths_give_the_config_the_flat_flags_give(nested, flat):
    # mutant seen failing: flatten_optim_flags returning argv as it is (tyro knows no --optim.optimizer.*)
    got = parse_config(nested.split(), check_paths=False)
    assert got == parse_config(flat.split(), check_paths=False)
    assert got.optim != preset("digits").optim


@pytest.mark.parametrize(
    "argv,names",
    [
        ("--optim.optimizer.warmup_steps 5", ["--optim.optimizer.warmup_steps", "adamw", "weight_decay, b1, b2, eps"]),
        ("--optim.name sgd --optim.optimizer.b1=0.8", ["--optim.optimizer.b1", "sgd", "momentum"]),
        ("--optim.lr_schedule.momentum 0.9", ["--optim.lr_schedule.momentum", "warmup_cosine", "--optim.optimizer."]),
        ("--optim.b1 0.9 --optim.optimizer.b1 0.95", ["--optim.b1", "--optim.optimizer.b1", "give one"]),
    ],
)
def test_a_nested_flag_under_the_wrong_part_or_given_twice_is_refused_in_one_line_naming_it(argv, names, capsys):
    # mutant seen failing: no check that the field is the chosen class's (warmup_steps silently set the schedule's)
    with pytest.raises(SystemExit) as e:
        parse_or_exit(argv.split(), "jaxloop.train")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert all(n in err for n in names), err


def test_a_typo_in_a_nested_flag_gets_the_closest_nested_flag():
    # mutant seen failing: known_flags without the nested flags (the closest was then a flat one, or none)
    with pytest.raises(
        UsageError, match=r"unknown flag --optim.optimizer.momentun; did you mean --optim.optimizer.momentum\?"
    ):
        parse_config(["--optim.name", "sgd", "--optim.optimizer.momentun", "0.9"], check_paths=False)
    with pytest.raises(UsageError, match=r"did you mean --optim.lr_schedule.warmup_steps\?"):
        parse_config(["--optim.lr_schedule.warmup_stesp", "3"], check_paths=False)
