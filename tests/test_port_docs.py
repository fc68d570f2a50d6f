"""docs/porting.md's first Python block, the front-page example of the port check, stays a short copyable
program and prints its table's verdict (the page's blocks are run by tests/docs_blocks.py; its bash block's
output is checked by tests/test_port_command.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from docs_blocks import runnable

from jaxloop.parity import training

pytestmark = pytest.mark.torch
DOC = Path(__file__).resolve().parents[1] / "docs" / "porting.md"
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def test_the_front_page_example_is_about_20_lines():
    assert 15 <= len(runnable(DOC, "python", torch=True)[0].body.strip().splitlines()) <= 25


def test_the_front_page_example_prints_that_every_check_is_within_tolerance(doc_run):
    out = doc_run(DOC, "python", torch=True)
    assert out.returncode == 0, out.stderr[-3000:]
    n = 2 * (
        8 + len(training.update_configs(1.0))
    )  # per precision: 6 forward rows, 2 gradient rows, a row per update config
    assert f"{n} of {n} checks within tolerance" in out.outputs[0]


README = DOC.parents[1] / "README.md"


def test_compare_runs_a_trajectory_only_when_asked_and_the_command_100_by_default(capsys):
    """README and docs: compare() checks a trajectory when given trajectory=N; the command runs 100 updates."""
    import flax.linen as nn
    import numpy as np
    import torch

    from jaxloop.parity import compare
    from jaxloop.parity.__main__ import main

    torch.manual_seed(0)
    batch = {"x": np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)}
    plain = compare(torch.nn.Linear(3, 2), nn.Dense(2), batch, precisions=("fp64",), checks=("forward",))
    asked = compare(torch.nn.Linear(3, 2), nn.Dense(2), batch, precisions=("fp64",), checks=("forward",), trajectory=2)
    assert not [r for r in plain.rows if r.check.startswith("trajectory")]
    assert [r.check for r in asked.rows if r.check.startswith("trajectory")][
        0
    ] == "trajectory (2 updates): loss of every update"
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "updates of the trajectory check (0 = none; default 100)" in " ".join(capsys.readouterr().out.split())


def test_the_readme_says_the_check_needs_torch_and_how_to_get_it():
    section = README.read_text().split("## Check your own port")[1].split("\n## ")[0]
    assert 'pip install -e ".[test]"' in section and "pip install torch" in section and "Python 3.11" in section
    pyproject = (DOC.parents[1] / "pyproject.toml").read_text()
    assert "\"torch==2.13.0; python_version < '3.12'\"" in pyproject
    assert "\"transformers==4.57.6; python_version < '3.12'\"" in pyproject and "transformers 4.57.6" in section
