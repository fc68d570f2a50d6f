"""The README's promises: the two opening commands and the 'Your own model' snippet."""

from __future__ import annotations

import contextlib
import io
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


def test_own_model_snippet_trains_a_users_flax_model():
    code = _python_block_after("### Your own model")
    assert len(code.strip().splitlines()) <= 20, "the snippet stays at most 20 lines"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README snippet", "exec"), {})
    steps, loss = out.getvalue().split()
    assert int(steps) == 300, "300 updates of 2 accumulated micro-batches"
    # y = sum(sin(x_i)) over 4 N(0,1) inputs has variance ~1.7, the MSE of predicting 0 at init.
    assert float(loss) < 0.05, f"the regression is learned (below 3% of its initial MSE): final {loss}"
