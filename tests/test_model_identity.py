"""The model is part of a run's identity: run_dir/model.json records the trained state's structure, and a
resume with another model is refused (exit 2, one line naming the first differing leaves) before anything
is written or moved, never taken for a damaged checkpoint. The README's "Your own model" case in real
processes; the older-run and wording cases in-process."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import flax.linen as nn
import numpy as np
import pytest

import jaxloop
from jaxloop.core.config import Config, ConfigError, LogConfig, OptimConfig
from jaxloop.core.identity import model_differences

# The README's "Your own model" snippet (Linen names the output Dense_0: it is built first), the hidden
# width a parameter, with jaxloop.train's exit statuses and one-line errors (jaxloop.core.cli.finish).
SCRIPT = textwrap.dedent("""
    import sys
    import flax.linen as nn, numpy as np
    import jaxloop
    from jaxloop.core.cli import finish
    from jaxloop.core.config import Config, LogConfig

    WIDTH = int(sys.argv[2])

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(nn.tanh(nn.Dense(WIDTH)(x)))[:, 0]

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
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file() and not p.name.startswith(".lock")}


def test_the_readme_model_edited_on_the_same_run_dir_is_refused_and_nothing_changes(tmp_path):
    # mutant seen failing: check_same_model() not called (the issue's case: "checkpoint at update 100 is
    # damaged (ValueError: ... not compatible with the stored shape ...)", a fresh run, exit 0, files rewritten)
    script = tmp_path / "mine.py"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "mine"
    first = subprocess.run([sys.executable, str(script), str(run_dir), "32"], capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    before = _files(run_dir)
    assert {"metrics.jsonl", "summary.json", "report.md", "model.json", "checkpoints/100/digest/metadata"} <= set(before)

    edited = subprocess.run([sys.executable, str(script), str(run_dir), "64"], capture_output=True, text=True, timeout=300)
    assert edited.returncode == 2, edited.stderr
    lines = edited.stderr.strip().splitlines()
    assert len(lines) == 1, edited.stderr
    assert lines[0].startswith("mine.py: error: resume='auto' is not allowed: a model that matches the checkpointed "
                               "run's (model.json); these differ: params/Dense_0/kernel: (32, 1) in the run, (64, 1) "
                               "now; params/Dense_1/bias: (32,) in the run, (64,) now; params/Dense_1/kernel: (4, 32) "
                               "in the run, (4, 64) now (and 9 more). "), lines[0]
    assert "Config(run_dir=NEW_DIR)" in lines[0] and 'Config(resume="never")' in lines[0], \
        "the ways forward in a Python caller's terms"
    assert "damaged" not in edited.stderr and not (run_dir / "checkpoints_damaged").exists()
    assert _files(run_dir) == before, "metrics, summary, report, checkpoints and model.json byte-identical"


class Net(nn.Module):
    width: int = 8

    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.tanh(nn.Dense(self.width)(x)))[:, 0]


class OtherNet(Net):
    pass


def _loss(model, batch, train):
    return jaxloop.weighted_mean((model(batch["x"]) - batch["y"]) ** 2, batch), {}


def _task(model: nn.Module) -> jaxloop.Task:
    x = np.random.default_rng(0).normal(size=(96, 4)).astype(np.float32)
    records = [{"x": xi, "y": np.float32(np.sin(xi).sum())} for xi in x]
    return jaxloop.Task(model, _loss, train=records[:64], val=records[64:])


def _cfg(run_dir: Path) -> Config:
    return Config(run_dir=str(run_dir), steps=4, batch_size=16, eval_every=4, log_every=4,
                  optim=OptimConfig(warmup_steps=1), log=LogConfig(progress="off", tensorboard=False, report=False))


def test_a_run_without_model_json_is_compared_with_its_latest_checkpoint(tmp_path):
    # a run directory from before model.json: another model is still refused, from the checkpoint's Orbax
    # metadata (mutant seen failing: saved_structure() not consulted: the checkpoint damaged and moved aside)
    jaxloop.run(_cfg(tmp_path), _task(Net()))
    (tmp_path / "model.json").unlink()
    with pytest.raises(ConfigError, match=r"\(its latest checkpoint\); these differ: params/Dense_0/kernel: \(8, 1\) in "
                                          r"the run, \(16, 1\) now"):
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
    run = {"model": "Net", "leaves": [["params/Dense_0/kernel", [4, 32], "float32"], ["params/b", [2], "float32"],
                                      ["params/gone", [3], "float32"]]}
    now = {"model": "Net", "leaves": [["params/Dense_0/kernel", [4, 64], "float32"], ["params/b", [2], "bfloat16"],
                                      ["params/new", [5], "float32"]]}
    assert model_differences(run, now) == [
        "params/Dense_0/kernel: (4, 32) in the run, (4, 64) now",
        "params/b: (2,) float32 in the run, (2,) bfloat16 now",
        "params/new: absent in the run, (5,) now",
        "params/gone: (3,) in the run, absent now"]
    assert model_differences(run, now, dtypes=False)[1:] == ["params/new: absent in the run, (5,) now",
                                                              "params/gone: (3,) in the run, absent now"]
    assert model_differences(run, json.loads(json.dumps(run))) == []


def test_a_fresh_start_replaces_the_record_of_a_run_killed_before_its_first_checkpoint(tmp_path):
    # with no checkpoint there is nothing to resume: the record is replaced, not compared
    # (mutant seen failing: the record written only when missing)
    (tmp_path / ".jaxloop-run").write_text("{}\n")  # the killed run had started (its marker is written first)
    (tmp_path / "model.json").write_text(json.dumps({"model": "Old", "leaves": []}))
    jaxloop.run(_cfg(tmp_path), _task(Net()))
    assert json.loads((tmp_path / "model.json").read_text())["model"] == "Net"
