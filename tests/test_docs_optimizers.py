"""docs/optimizers.md's promises: each python block prints its result, and the schedule explorer's block prints
one cycle's start, peak and end and writes its plot (the blocks run as tests/docs_blocks.py runs them)."""

from __future__ import annotations

from pathlib import Path

import pytest
from docs_blocks import runnable

DOC = Path(__file__).resolve().parents[1] / "docs" / "optimizers.md"


def test_every_python_block_prints_its_result(doc_run):
    out = doc_run(DOC, "python")
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(out.outputs) == len(runnable(DOC, "python", torch=False))
    assert all(printed.strip() for printed in out.outputs), out.outputs


def test_the_explorer_block_prints_one_cycles_start_peak_and_end(doc_run):
    out = doc_run(DOC, "bash")
    assert out.returncode == 0, f"{out.failed}\n{out.stderr[-2000:]}"
    index = next(i for i, b in enumerate(runnable(DOC, "bash", torch=False)) if "jaxloop.schedule" in b.body)
    printed = out.outputs[index]
    rows = {int(line.split()[0]): float(line.split()[1]) for line in printed.splitlines() if line.strip()[:1].isdigit()}
    assert rows == {0: pytest.approx(4e-5), 299: pytest.approx(1e-3), 999: pytest.approx(4e-9)}
    assert (out.cwd / "runs" / "one_cycle.png").stat().st_size > 0
