"""The optimizer and schedule config classes (jaxloop.core.optimizers_config, jaxloop.core.schedules_config): each holds
only the fields its choice reads; the flat form of flags, files and config.json is generated from them; a run
directory saved before the classes (tests/data/old_config, written by commit 61bf00e) still resumes."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest

from jaxloop import OptimConfig, PlateauConfig, SGDConfig, StepConfig
from jaxloop.core.cli import parse_config
from jaxloop.core.config import ConfigError, changed_fields, flat_defaults, preset, resume_conflicts, to_dict, validate
from jaxloop.core.optimizers_config import OPTIMIZERS, LionConfig
from jaxloop.core.schedules_config import SCHEDULES, OneCycleConfig

OLD = Path(__file__).parent / "data" / "old_config"


@pytest.mark.parametrize("name", ["sgd_one_cycle.json", "adamw_plateau.json"])
def test_a_run_dir_saved_in_the_old_flat_form_resumes_by_name_without_conflicts(name, tmp_path):
    # debug preset runs whose unread fields hold the preset's values (warmup_steps 4, end_lr 1e-4), not the
    # classes' defaults: they are translated against the preset, and written back the same
    saved = json.loads((OLD / name).read_text())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(OLD / name, run_dir / "config.json")
    cfg = parse_config(["--run_dir", str(run_dir)], check_paths=False)
    assert resume_conflicts(saved, cfg) == []
    added = {f"{section}.{k}": [None, v] for section, fields in ADDED_SINCE.items() for k, v in fields.items()}
    assert changed_fields(saved, cfg) == {"run_dir": [saved["run_dir"], str(run_dir)], **added}  # recorded, no conflict
    assert to_dict(cfg)["optim"] == saved["optim"]


def test_the_old_form_is_read_into_the_classes_of_its_choices():
    cfg = parse_config(["--config", str(OLD / "sgd_one_cycle.json")], check_paths=False)
    assert cfg.optim == OptimConfig(
        optimizer=SGDConfig(momentum=0.9), lr_schedule=OneCycleConfig(div_factor=10.0), peak_lr=1e-2
    )
    cfg = parse_config(["--config", str(OLD / "adamw_plateau.json")], check_paths=False)
    assert cfg.optim.lr_schedule == PlateauConfig(patience=3) and cfg.optim.b2 == 0.99


def test_every_presets_config_json_keeps_its_form_and_key_order():
    # config.json and the checkpoints' config item are this dict: the same keys, order and values as before
    # (a field added since is written too, at its default, and read back from an older file as its default:
    # the old keys keep their order and values)
    stored = json.loads((OLD / "presets.json").read_text())
    for name, want in stored.items():
        # one change on purpose: model.remat is memory.remat=blocks now (tests/test_model_remat.py)
        want["model"].pop("remat")
        got = to_dict(preset(name))
        added = {
            section: {k: v for k, v in fields.items() if k not in want.get(section, {})}
            for section, fields in got.items()
            if isinstance(fields, dict)
        }
        assert added == ADDED_SINCE, name
        old = {
            k: ({f: v for f, v in fields.items() if f not in added.get(k, {})} if isinstance(fields, dict) else fields)
            for k, fields in got.items()
        }
        assert json.dumps(old) == json.dumps(want), name


ADDED_SINCE = {  # the fields added since presets.json was saved (61bf00e), at their defaults in every preset
    "model": {"gelu": "tanh", "ln_eps": 1e-5},
    "data": {"allow_changed": False, "train": "", "val": ""},
    "log": {"trackers": [], "project": "jaxloop", "mlflow_uri": ""},
    "checkpoint": {},
    "distributed": {},
    "memory": {},
    "optim": {},
}


def test_a_flag_the_chosen_optimizer_does_not_read_is_refused_naming_its_readers():
    with pytest.raises(ConfigError) as e:
        parse_config(["--optim.name", "sgd", "--optim.b1", "0.8"], check_paths=False)
    assert e.value.field_path == "optim.b1"
    assert "optim.name=sgd does not read it; read by optim.name=adamw, optim.name=adam, optim.name=lion" in str(e.value)


def test_python_refuses_a_field_the_chosen_class_does_not_hold():
    with pytest.raises(TypeError, match="b1"):
        SGDConfig(b1=0.8)  # structurally: the class has no such field
    with pytest.raises(ConfigError, match="read by optim.name=adamw, optim.name=adam, optim.name=lion"):
        OptimConfig(name="sgd", b1=0.8)  # the flat form names who reads it
    with pytest.raises(AttributeError, match="read by optim.name=sgd, optim.name=rmsprop"):
        _ = OptimConfig().momentum  # adamw holds no momentum


def test_the_flat_keywords_and_the_classes_build_the_same_config():
    flat = OptimConfig(name="sgd", momentum=0.9, schedule="step", step_size=100, peak_lr=0.1)
    assert flat == OptimConfig(optimizer=SGDConfig(momentum=0.9), lr_schedule=StepConfig(step_size=100), peak_lr=0.1)
    assert (flat.name, flat.schedule, flat.momentum, flat.step_size) == ("sgd", "step", 0.9, 100)


def test_the_classes_errors_name_the_flag_path():
    with pytest.raises(ConfigError) as e:
        SGDConfig(momentum=1.5).validate()
    assert e.value.field_path == "optim.momentum" and "a number in [0, 1)" in str(e.value)
    with pytest.raises(ConfigError) as e:
        PlateauConfig(patience=-1).validate(1e-3, 10)
    assert e.value.field_path == "optim.plateau.patience"


def test_a_field_several_classes_hold_has_one_default():
    # the flat form (one --optim.b2 flag for adamw, adam and lion) needs it; flat_defaults checks it
    assert flat_defaults()["b2"] == LionConfig().b2 == OPTIMIZERS["adamw"]().b2
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
