"""The README's promises: the two opening commands (every other block of README and docs/ is run by test_docs.py)."""

from __future__ import annotations

from pathlib import Path

import docs_blocks

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_opens_with_the_two_commands():
    blocks = [b.body for b in docs_blocks.blocks(README) if b.lang == "bash"][:2]
    assert blocks[0].strip().endswith("python -m jaxloop.train")
    assert blocks[1].strip().endswith("python -m pytest tests parity_tests")
    ci = (README.parent / ".ci" / "run").read_text()
    # CI installs the test extra as the command does (one install function, for Python 3.11 and 3.12) and
    # runs the command's suite on 3.11, then jaxloop's own tests on 3.12
    assert ci.count('pip install -q -e ".[test]"') == 1 and "install python3.11 .venv" in ci
    assert "python -m pytest tests parity_tests" in ci and 'python -m pytest tests -m "not torch"' in ci
