"""One rule per config field, declared with the field (jaxloop.config.run: TRAJECTORY, PLAN, HOST): what a
resumed run may change (RESUME_SAFE) is derived from it. The tables below are the specification: a field added
or reclassified without updating them fails here."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from jaxloop.config.run import (
    HOST,
    RESUME_SAFE,
    Config,
    DataConfig,
    Rule,
    builtin_task_fields,
    field_rules,
    resume_conflicts,
    to_dict,
)

HOST_FIELDS = {
    "run_dir",
    "resume",
    "allow_steps_change",
    "compile_cache",
    "retain_host_memory",
    "eval_every",
    "log_every",
    "deterministic",
    "updates_per_call",
    "max_bad_steps",
    "patience",
    "init_from",
    "data.workers",
    "data.prefetch",
    "data.eval_batch_size",
    "data.allow_changed",
    "checkpoint.",
    "log.",
    "distributed.",
}
"""Not the trajectory, the host's business: a resume may change them."""
PLAN_FIELDS = {"memory."}
"""The same math, other compiled code: a resume may change them."""


@dataclass(frozen=True)
class Section:
    declared: int = field(default=0, metadata=HOST)
    new: int = 0


@dataclass(frozen=True)
class Root:
    section: Section = field(default_factory=Section)


def test_every_field_is_classified_by_a_declaration() -> None:
    """A field whose declaration (or its section's) names no rule would silently be TRAJECTORY: name one."""
    assert [k for k, rule in field_rules().items() if rule is None] == []


def test_the_resume_safe_fields_are_the_host_and_plan_fields() -> None:
    assert set(RESUME_SAFE) == HOST_FIELDS | PLAN_FIELDS


def test_the_seed_and_the_evaluation_subset_change_the_run() -> None:
    """Other initial values, data order or evaluation batches: the same code, another trajectory."""
    base = Config()
    assert resume_conflicts(to_dict(base), replace(base, seed=1, eval_batches=2)) == [
        "eval_batches: 0 -> 2",
        "seed: 0 -> 1",
    ]


def test_an_undeclared_field_changes_the_run() -> None:
    """The safe choice for a field nobody classified: a resume refuses a change of it."""
    rules = field_rules(Root)
    assert rules == {"section.declared": Rule(resume_safe=True), "section.new": None}


def test_a_field_declared_host_inside_a_run_changing_section_is_resume_safe() -> None:
    """data.workers (HOST) inside data (TRAJECTORY): the field's own declaration wins over its section's."""
    base = Config()
    workers = replace(base, data=DataConfig(workers=2))
    assert resume_conflicts(to_dict(base), workers) == []
    path = replace(base, data=DataConfig(val_fraction=0.3))
    assert resume_conflicts(to_dict(base), path) == ["data.val_fraction: 0.2 -> 0.3"]


def test_the_fields_only_the_builtin_tasks_read_are_the_model_and_the_data_source() -> None:
    """What a run of a Task of one's own refuses set away from its preset's (jaxloop.loop.task.check_builtin_fields):
    every model field by its section's declaration, the data fields that pick and split the records, and
    data.allow_changed (only the built-in sources have a data record to compare)."""
    model = {f"model.{k.split('.')[1]}" for k in field_rules() if k.startswith("model.")}
    assert set(builtin_task_fields()) == model | {
        "data.source",
        "data.path",
        "data.val_fraction",
        "data.train",
        "data.val",
        "data.allow_changed",
    }
    assert "model.kind" in model and "data.workers" not in builtin_task_fields()
