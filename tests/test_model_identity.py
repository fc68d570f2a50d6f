"""The model is part of a run's identity: run_dir/model.json records the trained state's structure, and a
resume with another model is refused (exit 2, one line naming the first differing leaves) before anything
is written or moved, never taken for a damaged checkpoint. The README's "Your own model" case in real
processes; the older-run and wording cases in-process."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import flax.linen as nn
import numpy as np
import pytest

import jaxloop
from jaxloop.config.run import Config, ConfigError, LogConfig, OptimConfig
from jaxloop.config.schedules import WarmupCosineConfig
from jaxloop.rundir.model_identity import model_differences

# The README's "Your own model" snippet (Linen names the output Dense_0: it is built first), the hidden
# width and the activation (default tanh) parameters, with jaxloop.train's exit statuses and one-line errors
# (jaxloop.config.cli.finish).
SCRIPT = textwrap.dedent("""
    import sys
    import flax.linen as nn, numpy as np
    import jaxloop
    from jaxloop.config.cli import finish
    from jaxloop.config.run import Config, LogConfig

    WIDTH = int(sys.argv[2])
    ACTIVATION = getattr(nn, sys.argv[3] if len(sys.argv) > 3 else "tanh")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(ACTIVATION(nn.Dense(WIDTH)(x)))[:, 0]

    def loss(model, batch, train):
        return jaxloop.weighted_mean((model(batch["x"]) - batch["y"]) ** 2, batch), {}

    x = np.random.default_rng(0).normal(size=(1024, 4)).astype(np.float32)
    records = [{"x": xi, "y": np.sin(xi).sum()} for xi in x]
    cfg = Config(run_dir=sys.argv[1], steps=100, batch_size=32, log=LogConfig(progress="off", tensorboard=False))
    sys.exit(finish("mine.py", cfg, lambda: jaxloop.run(cfg, jaxloop.Task(Net(), loss, train=records[:896],
                                                                       val=records[896:]))))
""")


def _files(run_dir: Path) -> dict[str, str]:
    """sha256 of every file of a run but its lock's holder record, by relative path."""
    return {
        str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and not p.name.startswith(".lock")
    }


def test_the_readme_model_edited_on_the_same_run_dir_is_refused_and_nothing_changes(tmp_path):
    # mutant seen failing: check_same_model() not called (the issue's case: "checkpoint at update 100 is
    # damaged (ValueError: ... not compatible with the stored shape ...)", a fresh run, exit 0, files rewritten)
    script = tmp_path / "mine.py"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "mine"
    first = subprocess.run(
        [sys.executable, str(script), str(run_dir), "32"], capture_output=True, text=True, timeout=300
    )
    assert first.returncode == 0, first.stderr
    before = _files(run_dir)
    assert {"metrics.jsonl", "summary.json", "report.md", "model.json", "checkpoints/100/digest/metadata"} <= set(
        before
    )

    edited = subprocess.run(
        [sys.executable, str(script), str(run_dir), "64"], capture_output=True, text=True, timeout=300
    )
    assert edited.returncode == 2, edited.stderr
    lines = edited.stderr.strip().splitlines()
    assert len(lines) == 1, edited.stderr
    assert lines[0].startswith(
        "mine.py: error: resume='auto' is not allowed: a model that matches the checkpointed "
        "run's (model.json); these differ: params/Dense_0/kernel: (32, 1) in the run, (64, 1) "
        "now; params/Dense_1/bias: (32,) in the run, (64,) now; params/Dense_1/kernel: (4, 32) "
        "in the run, (4, 64) now (and 9 more). "
    ), lines[0]
    assert "Config(run_dir=NEW_DIR)" in lines[0] and 'Config(resume="never")' in lines[0], (
        "the ways forward in a Python caller's terms"
    )
    assert "damaged" not in edited.stderr and not (run_dir / "checkpoints_damaged").exists()
    assert _files(run_dir) == before, "metrics, summary, report, checkpoints and model.json byte-identical"


def _mine(tmp_path: Path, run_dir: str, *args: str) -> subprocess.CompletedProcess:
    """The README's script (SCRIPT) on `run_dir` as given (relative to tmp_path), width and activation `args`."""
    script = tmp_path / "mine.py"
    script.write_text(SCRIPT)
    return subprocess.run(
        [sys.executable, str(script), run_dir, *args], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )


def test_an_older_run_on_a_relative_run_dir_with_an_edited_model_is_refused_and_nothing_changes(tmp_path):
    # The case: `run_dir="runs/mine"` as the README writes it, a run from before model.json, stopped
    # before its end, then the model edited: Orbax read no metadata from the relative path, the comparison was
    # skipped, and the shape error was taken for damage: checkpoint 100 moved aside, a fresh run, exit 0.
    # (mutant seen failing: _state_metadata without .absolute(): the refusal came only from the restore, after
    # metadata.json and resumes.jsonl were written)
    first = _mine(tmp_path, "runs/mine", "32")
    assert first.returncode == 0, first.stderr
    run_dir = tmp_path / "runs" / "mine"
    (run_dir / "model.json").unlink()  # a run from before model.json ...
    (run_dir / "summary.json").unlink()  # ... stopped before its end
    before = _files(run_dir)

    edited = _mine(tmp_path, "runs/mine", "64")
    assert edited.returncode == 2, edited.stderr
    lines = edited.stderr.strip().splitlines()
    assert len(lines) == 1, edited.stderr
    assert lines[0].startswith(
        "mine.py: error: resume='auto' is not allowed: a model that matches the checkpointed "
        "run's (its latest checkpoint); these differ: params/Dense_0/kernel: (32, 1) in the "
        "run, (64, 1) now; "
    ), lines[0]
    assert not (run_dir / "checkpoints_damaged").exists()
    assert _files(run_dir) == before, "metrics.jsonl, checkpoints and every other file byte-identical"


def test_a_same_shape_change_of_the_computation_is_refused_in_one_line(tmp_path):
    # tanh -> relu: every leaf's shape the same, the forward pass another. The same model in another process
    # traces to the same fingerprint (the finished run is "already complete"); the edited one is refused,
    # finished run or not (mutant seen failing: "computation" left out of this_model's record: the relu run
    # "already complete", exit 0, and a killed one resumed with "changed": {})
    first = _mine(tmp_path, "runs/mine", "32")
    assert first.returncode == 0, first.stderr
    run_dir = tmp_path / "runs" / "mine"
    again = _mine(tmp_path, "runs/mine", "32", "tanh")
    assert again.returncode == 0 and "already complete: this run ended at update 100" in again.stderr, again.stderr
    before = _files(run_dir)

    for stopped in (False, True):
        if stopped:
            (run_dir / "summary.json").unlink()  # a run stopped before its end
            before = _files(run_dir)
        edited = _mine(tmp_path, "runs/mine", "32", "relu")
        assert edited.returncode == 2, edited.stderr
        lines = edited.stderr.strip().splitlines()
        assert len(lines) == 1, edited.stderr
        assert lines[0].startswith(
            "mine.py: error: resume='auto' is not allowed: a model that computes what the checkpointed run's did "
            "(model.json); the model's computation changed (its loss traces to other operations), though every "
            "leaf's shape and dtype match. To train the new model, start a new run: Config(run_dir=NEW_DIR) (add "
            "init_from='runs/mine' to start from this run's weights); to continue this run with it on purpose, "
            'delete "computation" from runs/mine/model.json; '
        ), lines[0]
        assert _files(run_dir) == before, "nothing written or moved"


class Net(nn.Module):
    width: int = 8
    activation: str = "tanh"

    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(getattr(nn, self.activation)(nn.Dense(self.width)(x)))[:, 0]


class OtherNet(Net):
    pass


def _loss(model, batch, train):
    return jaxloop.weighted_mean((model(batch["x"]) - batch["y"]) ** 2, batch), {}


def _task(model: nn.Module) -> jaxloop.Task:
    x = np.random.default_rng(0).normal(size=(96, 4)).astype(np.float32)
    records = [{"x": xi, "y": np.float32(np.sin(xi).sum())} for xi in x]
    return jaxloop.Task(model, _loss, train=records[:64], val=records[64:])


def _cfg(run_dir: Path) -> Config:
    return Config(
        run_dir=str(run_dir),
        steps=4,
        batch_size=16,
        eval_every=4,
        log_every=4,
        optim=OptimConfig(lr_schedule=WarmupCosineConfig(warmup_steps=1)),
        log=LogConfig(progress="off", tensorboard=False, report=False),
    )


def test_a_run_without_model_json_is_compared_with_its_latest_checkpoint(tmp_path):
    # a run directory from before model.json: another model is still refused, from the checkpoint's Orbax
    # metadata (mutant seen failing: saved_structure() not consulted: the checkpoint damaged and moved aside)
    jaxloop.run(_cfg(tmp_path), _task(Net()))
    (tmp_path / "model.json").unlink()
    with pytest.raises(
        ConfigError,
        match=r"\(its latest checkpoint\); these differ: params/Dense_0/kernel: \(8, 1\) in "
        r"the run, \(16, 1\) now",
    ):
        jaxloop.run(_cfg(tmp_path), _task(Net(width=16)))
    assert not (tmp_path / "model.json").exists() and not (tmp_path / "checkpoints_damaged").exists()


def test_a_run_without_model_json_resumes_with_its_model_and_gains_the_record(tmp_path):
    # mutant seen failing: the record written only for a new run (an older run never gains one)
    jaxloop.run(_cfg(tmp_path), _task(Net()))
    record = (tmp_path / "model.json").read_text()
    (tmp_path / "model.json").unlink()
    (tmp_path / "summary.json").unlink()  # killed before its end (a finished run re-run writes nothing at all)
    jaxloop.run(_cfg(tmp_path), _task(Net()))
    assert json.loads((tmp_path / "resumes.jsonl").read_text())["step"] == 4, "it resumed"
    assert (tmp_path / "model.json").read_text() == record


def test_the_model_class_is_part_of_the_identity(tmp_path):
    # the same leaves, another class: refused too (mutant seen failing: the class left out of the comparison)
    jaxloop.run(_cfg(tmp_path), _task(Net()))
    with pytest.raises(ConfigError, match=r"these differ: the model's class: Net in the run, OtherNet now\."):
        jaxloop.run(_cfg(tmp_path), _task(OtherNet()))


def test_differences_name_shapes_dtypes_and_leaves_present_on_one_side_only():
    run = {
        "model": "Net",
        "leaves": [
            ["params/Dense_0/kernel", [4, 32], "float32"],
            ["params/b", [2], "float32"],
            ["params/gone", [3], "float32"],
        ],
    }
    now = {
        "model": "Net",
        "leaves": [
            ["params/Dense_0/kernel", [4, 64], "float32"],
            ["params/b", [2], "bfloat16"],
            ["params/new", [5], "float32"],
        ],
    }
    assert model_differences(run, now) == [
        "params/Dense_0/kernel: (4, 32) in the run, (4, 64) now",
        "params/b: (2,) float32 in the run, (2,) bfloat16 now",
        "params/new: absent in the run, (5,) now",
        "params/gone: (3,) in the run, absent now",
    ]
    assert model_differences(run, now, dtypes=False)[1:] == [
        "params/new: absent in the run, (5,) now",
        "params/gone: (3,) in the run, absent now",
    ]
    assert model_differences(run, json.loads(json.dumps(run))) == []


def test_a_fresh_start_replaces_the_record_of_a_run_killed_before_its_first_checkpoint(tmp_path):
    # with no checkpoint there is nothing to resume: the record is replaced, not compared
    # (mutant seen failing: the record written only when missing)
    (tmp_path / ".jaxloop-run").write_text("{}\n")  # the killed run had started (its marker is written first)
    (tmp_path / "model.json").write_text(json.dumps({"model": "Old", "leaves": []}))
    jaxloop.run(_cfg(tmp_path), _task(Net()))
    assert json.loads((tmp_path / "model.json").read_text())["model"] == "Net"


def test_another_models_checkpoints_under_an_intact_model_json_are_refused_not_damaged(tmp_path):
    # The case: a wider model's checkpoints copied into a run whose model.json is intact: all called
    # damaged, moved aside, the run restarted at 0 (mutant seen failing: the checkpoints' own structures left
    # out of check_same_model: refused only by the restore, after metadata.json and resumes.jsonl were written)
    mine, other = tmp_path / "mine", tmp_path / "other"
    jaxloop.run(_cfg(mine), _task(Net()))
    jaxloop.run(_cfg(other), _task(Net(width=16)))
    (mine / "summary.json").unlink()  # stopped before its end
    shutil.rmtree(mine / "checkpoints")
    shutil.copytree(other / "checkpoints", mine / "checkpoints")
    before = _files(mine)
    with pytest.raises(
        ConfigError,
        match=r"\(its latest checkpoint\); these differ: params/Dense_0/kernel: \(16, 1\) in "
        r"the run, \(8, 1\) now",
    ):
        jaxloop.run(_cfg(mine), _task(Net()))
    assert _files(mine) == before and not (mine / "checkpoints_damaged").exists()


def test_a_checkpoint_of_another_structure_is_a_refusal_of_the_restore_not_damage(tmp_path):
    # The Checkpointer's own guard, whatever its caller checked: a step of other shapes raises
    # CheckpointMismatch and stays in place (mutant seen failing: check_structure() not called in
    # restore_latest(): "checkpoint at update 1 is damaged (ValueError: ... shape ...)", moved aside)
    from jaxloop.checkpoint.manager import Checkpointer, CheckpointMismatch
    from jaxloop.loop.task import run_state

    cfg = _cfg(tmp_path)
    narrow, wide = (run_state(cfg, _task(Net(width=w))) for w in (8, 16))
    ckpt = Checkpointer(cfg.checkpoint, tmp_path)
    try:
        ckpt.save(1, narrow, {"position": 1})
        ckpt.wait()
        with pytest.raises(
            CheckpointMismatch,
            match=r"the checkpoint of update 1 holds another: params/Dense_0/"
            r"kernel: \(8, 1\) in the run, \(16, 1\) now",
        ):
            ckpt.restore_latest(wide)
    finally:
        ckpt.close()
    assert (tmp_path / "checkpoints" / "1").is_dir() and not (tmp_path / "checkpoints_damaged").exists()


def test_a_record_without_a_computation_is_accepted_and_gains_it(tmp_path):
    # An older jaxloop's model.json (leaves only), or one whose "computation" was deleted to accept a change on
    # purpose (as the refusal says): the run resumes with the model given and records its computation
    # (mutant seen failing: a record without a computation counted as changed: refused)
    jaxloop.run(_cfg(tmp_path), _task(Net()))
    record = json.loads((tmp_path / "model.json").read_text())
    del record["computation"]
    (tmp_path / "model.json").write_text(json.dumps(record))
    (tmp_path / "summary.json").unlink()  # stopped before its end
    jaxloop.run(_cfg(tmp_path), _task(Net(activation="relu")))
    assert json.loads((tmp_path / "resumes.jsonl").read_text())["step"] == 4, "it resumed"
    relu = json.loads((tmp_path / "model.json").read_text())["computation"]
    (tmp_path / "summary.json").unlink()
    with pytest.raises(ConfigError, match=r"the model's computation changed"):
        jaxloop.run(_cfg(tmp_path), _task(Net()))  # tanh again: now a change of the recorded relu run
    assert relu["traced_with"].startswith("jax ")


def test_a_finished_run_re_run_from_python_says_so_and_returns_its_final_state(tmp_path, capfd):
    # as the command does, and with the state the run ended with: its digest is the summary's (mutant seen
    # failing: the finished run's RunResult built with state=None, as before: no state, no line)
    from jaxloop.update.state import state_digest

    first = jaxloop.run(_cfg(tmp_path), _task(Net()))
    before = _files(tmp_path)
    capfd.readouterr()
    again = jaxloop.run(_cfg(tmp_path), _task(Net()))
    err = capfd.readouterr().err
    assert err.strip().splitlines()[-1].startswith("already complete: this run ended at update 4 (completed); "), err
    assert again["already_complete"] and again["final_step"] == 4
    assert state_digest(again.state) == first["state_digest"] == state_digest(first.state), "bit for bit"
    assert again.state.user_model()["params"].keys() == first.state.user_model()["params"].keys()
    assert _files(tmp_path) == before, "nothing written"


class Shaped(nn.Module):
    """Two 4x4 layers whose order can be swapped and an output scale: the same leaves whatever the fields."""

    scale: float = 1.0
    swap: bool = False

    @nn.compact
    def __call__(self, x):
        a, b = nn.Dense(4, name="a"), nn.Dense(4, name="b")
        h = a(nn.tanh(b(x))) if self.swap else b(nn.tanh(a(x)))
        return nn.Dense(1)(h)[:, 0] * self.scale


def test_the_fingerprint_sees_a_constant_and_the_order_of_layers_not_only_shapes(tmp_path):
    # the same shapes in every variant; the computation's fingerprint tells them apart and is the same for
    # the same model traced twice (mutant seen failing: Literal values left out of jaxpr_text: the scale
    # 2.0 fingerprinted as 1.0)
    from jaxloop.loop.model_check import this_model

    def record(model):
        task = _task(model)
        return this_model(_cfg(tmp_path), task, task.splits())

    base, scaled, swapped, again = (record(m) for m in (Shaped(), Shaped(scale=2.0), Shaped(swap=True), Shaped()))
    assert base["leaves"] == scaled["leaves"] == swapped["leaves"]
    fingerprints = [r["computation"]["sha256"] for r in (base, scaled, swapped)]
    assert len(set(fingerprints)) == 3, fingerprints
    assert again["computation"] == base["computation"]
