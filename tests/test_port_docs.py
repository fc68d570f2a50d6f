"""docs/porting.md's Python blocks run as they are written (each in a fresh namespace), and its first block,
the front-page example of the port check, stays a short copyable program. (Its bash block is run by
tests/test_port_command.py.)"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from jaxloop.parity import training

pytestmark = pytest.mark.torch
DOC = Path(__file__).resolve().parents[1] / "docs" / "porting.md"
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def blocks(kind: str = "python") -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", DOC.read_text(), re.S)


def test_the_front_page_example_is_about_20_lines():
    assert 15 <= len(blocks()[0].strip().splitlines()) <= 25


@pytest.mark.parametrize("index", range(len(blocks())))
def test_python_block_runs(index, capsys):
    exec(compile(blocks()[index], f"{DOC.name} block {index}", "exec"), {"__name__": f"porting_block_{index}"})
    if index == 0:
        n = 2 * (7 + len(training.update_configs(1.0)))  # per precision: 6 forward rows, gradients, a row per update config
        assert f"{n} of {n} checks within tolerance" in capsys.readouterr().out
