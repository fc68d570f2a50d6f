"""The benchmark harness cannot rot: its quick mode runs the smallest row and prints the table.

No assertion on any time: only on the shape of what the harness produces.
"""

from __future__ import annotations

import io
import json

from benchmarks.__main__ import COLUMNS, main, markdown, print_table, registry, run
from benchmarks.common import Options


def test_quick_smallest_row_prints_one_table_row(tmp_path):
    result = run(Options(quick=True, smoke=True, workdir=tmp_path, log=lambda s: None), only=["step.mlp.k1"])
    assert [r["name"] for r in result["rows"]] == ["step.mlp.k1"]
    row = result["rows"][0]
    assert row["status"] == "ok", row["notes"]
    assert row["jax"] > 0 and row["ref"] > 0 and row["ratio"] > 0
    assert row["goal"] == "<= 0.5" and row["met"] in (True, False)
    assert set(row["extra"]["ms"]) == {"jaxloop", "torch eager"}
    m = result["machine"]
    assert m["cores"] >= 1 and m["cpu"] and m["versions"]["jax"] and m["versions"]["torch"]

    out = io.StringIO()
    print_table(result, file=out)
    lines = out.getvalue().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("row "))
    assert [c.strip() for c in lines[header].split("|")] == list(COLUMNS)
    cells = [c.strip() for c in lines[header + 2].split("|")]
    assert len(cells) == len(COLUMNS) and cells[0] == "step.mlp.k1" and cells[-1] in ("yes", "NO")

    md = markdown(result)
    assert "| step.mlp.k1 |" in md and "unmeasured, no GPU" in md or "accel" in md

    saved = tmp_path / "r.json"
    saved.write_text(json.dumps(result))
    assert main(["--from-json", str(saved), "--markdown", str(tmp_path / "B.md")]) == 0
    assert (tmp_path / "B.md").read_text() == md


def test_every_row_is_listed_once():
    names = [name for name, _ in registry()]
    assert len(names) == len(set(names))
    for prefix in ("peak", "step.", "eval.", "loop.", "e2e.", "startup.", "memory.", "data", "checkpoint", "accel"):
        assert any(n.startswith(prefix) for n in names), prefix
