"""docs/faults.md: its code runs as written and its exit statuses are the CLI's."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from loopcore import cli

DOC = Path(__file__).resolve().parents[1] / "docs" / "faults.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_every_python_block_runs_as_written(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(BLOCKS[index], f"docs/faults.md block {index}", "exec"), {})
    # each block prints what its comment says it prints
    for line, comment in re.findall(r"print\((\w+)\)\s*#\s*(.*)", BLOCKS[index]):
        shown = re.escape(comment).replace(r"\.\.\.", ".*")
        assert re.search(shown, out.getvalue()), (comment, out.getvalue())


def test_the_exit_statuses_are_the_clis():
    text = DOC.read_text()
    statuses = {cli.EXIT_NONFINITE: "too many non-finite updates", cli.EXIT_BAD_INPUT: "bad input",
                cli.EXIT_CHECKPOINT_WRITE: "a checkpoint could not be written",
                cli.EXIT_OUT_OF_MEMORY: "out of memory"}
    for code, words in statuses.items():
        assert f"{code} {words}" in text, (code, words)
    assert "130 / 143 stopped by SIGINT / SIGTERM" in text and sorted(cli.EXIT_SIGNAL.values()) == [130, 143]
