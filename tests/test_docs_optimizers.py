"""docs/optimizers.md's promises: every code block runs as written (python blocks in-process, bash blocks as
subprocesses), each in a fresh directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "optimizers.md"
ROOT = DOC.parents[1]


def _blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", DOC.read_text(), re.S)


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_python_block_runs(index, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    exec(compile(_blocks("python")[index], f"{DOC.name} python block {index}", "exec"), {"__name__": "__doc__"})
    assert capsys.readouterr().out.strip(), "the block prints its result"


@pytest.mark.parametrize("index", range(len(_blocks("bash"))))
def test_bash_block_runs(index, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(["bash", "-c", _blocks("bash")[index].replace("python ", f"{sys.executable} ", 1)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_explorer_block_prints_one_cycles_start_peak_and_end(tmp_path):
    block = next(b for b in _blocks("bash") if "jaxloop.schedule" in b)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(["bash", "-c", block.replace("python ", f"{sys.executable} ", 1)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    rows = {int(line.split()[0]): float(line.split()[1]) for line in out.stdout.splitlines() if line.strip()[:1].isdigit()}
    assert rows == {0: pytest.approx(4e-5), 299: pytest.approx(1e-3), 999: pytest.approx(4e-9)}
    assert (tmp_path / "one_cycle.png").stat().st_size > 0
