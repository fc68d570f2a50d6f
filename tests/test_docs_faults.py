"""docs/faults.md: each python block prints what its comments say (the blocks run as tests/docs_blocks.py runs
them), and its exit statuses are the CLI's."""

from __future__ import annotations

import re
from pathlib import Path

from docs_blocks import runnable

from jaxloop.config import cli

DOC = Path(__file__).resolve().parents[1] / "docs" / "faults.md"


def test_every_python_block_prints_what_its_comments_say(doc_run):
    # mutant seen failing: a comment of a block changed to say another message
    out = doc_run(DOC, "python")
    assert out.returncode == 0, out.stderr[-3000:]
    code = runnable(DOC, "python", torch=False)
    assert len(out.outputs) == len(code)
    for block, printed in zip(code, out.outputs):
        for _, comment in re.findall(r"print\((\w+)\)\s*#\s*(.*)", block.body):
            shown = re.escape(comment).replace(r"\.\.\.", ".*")
            assert re.search(shown, printed), (comment, printed)


def test_the_exit_statuses_are_the_clis():
    text = DOC.read_text()
    statuses = {
        cli.EXIT_NONFINITE: "too many non-finite updates",
        cli.EXIT_BAD_INPUT: "bad input",
        cli.EXIT_CHECKPOINT_WRITE: "a checkpoint could not be written",
        cli.EXIT_OUT_OF_MEMORY: "out of memory",
    }
    for code, words in statuses.items():
        assert f"{code} {words}" in text, (code, words)
    assert "130 / 143 stopped by SIGINT / SIGTERM" in text and sorted(cli.EXIT_SIGNAL.values()) == [130, 143]
