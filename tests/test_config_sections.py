"""Each section of the config checks its own fields (`section.validate()`, as `validate(cfg)` calls it), and
`validate(cfg)` keeps only the rules that join sections: a section's error names its field by its flag path."""

from __future__ import annotations

from dataclasses import replace

import pytest

from jaxloop import (
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    DistributedConfig,
    LogConfig,
    MemoryConfig,
    ModelConfig,
    OptimConfig,
    validate,
)
from jaxloop.config.schedules import WarmupCosineConfig

BAD = [  # (a section with one field not allowed, the flag path its error names)
    (ModelConfig(d_model=130, n_heads=4), "model.n_heads"),
    (DataConfig(val_fraction=1.5), "data.val_fraction"),
    (CheckpointConfig(best_mode="lowest"), "checkpoint.best_mode"),
    (LogConfig(price_per_hour=-1.0), "log.price_per_hour"),
    (DistributedConfig(num_processes=2, process_id=2), "distributed.process_id"),
    (MemoryConfig(remat="some"), "memory.remat"),
]


@pytest.mark.parametrize("section, path", BAD, ids=[p for _, p in BAD])
def test_a_section_refuses_its_own_bad_field_by_itself(section, path):
    with pytest.raises(ConfigError) as e:
        section.validate()
    assert e.value.field_path == path


@pytest.mark.parametrize("section, path", BAD, ids=[p for _, p in BAD])
def test_validate_refuses_the_same_field_in_a_whole_config(section, path):
    cfg = replace(Config(), **{path.split(".")[0]: section})
    with pytest.raises(ConfigError) as e:
        validate(cfg, check_paths=False)
    assert e.value.field_path == path


def test_the_optim_section_checks_its_schedule_against_the_runs_steps():
    # a warmup longer than the run is the schedule's own rule, given the run's steps by OptimConfig.validate
    optim = OptimConfig(lr_schedule=WarmupCosineConfig(warmup_steps=30))
    optim.validate(steps=30)
    with pytest.raises(ConfigError) as e:
        optim.validate(steps=20)
    assert e.value.field_path == "optim.warmup_steps"


def test_the_rules_that_join_sections_stay_with_the_whole_config():
    # each section alone is fine; together they are not (split must divide the batch; gpt needs text)
    MemoryConfig(split=3).validate()
    with pytest.raises(ConfigError) as e:
        validate(replace(Config(), memory=MemoryConfig(split=3)), check_paths=False)
    assert e.value.field_path == "memory.split"
    ModelConfig(kind="gpt").validate()
    with pytest.raises(ConfigError) as e:
        validate(replace(Config(), model=ModelConfig(kind="gpt")), check_paths=False)
    assert e.value.field_path == "model.kind"


def test_memory_auto_fit_is_refused_unless_true_or_false():
    # the one bool field a section checks itself (with checks.check_type, as the optimizer classes check theirs);
    # mutant seen failing: the check removed from MemoryConfig.validate
    with pytest.raises(ConfigError) as e:
        MemoryConfig(auto_fit="yes").validate()
    assert (e.value.field_path, e.value.allowed) == ("memory.auto_fit", "true or false")
