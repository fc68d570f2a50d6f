"""The README's promises: the two opening commands (the own-model snippets are run by test_task.py)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_block_after(heading: str) -> str:
    text = README.read_text()
    section = text[text.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_opens_with_the_two_commands():
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)[:2]
    assert blocks[0].strip().endswith("python -m jaxloop.train")
    assert blocks[1].strip().endswith("python -m pytest tests parity_tests")
    assert (README.parent / ".ci" / "run").read_text().count('pip install -q -e ".[test]"') == 1
