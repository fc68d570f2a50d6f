"""The benchmark harness cannot rot: its quick mode runs the smallest row and prints the table.

No assertion on any time: only on the shape of what the harness produces.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.__main__ import COLUMNS, main, markdown, merge, print_table, registry, run
from benchmarks.common import Options
from jaxloop.rundir.atomic import is_temporary


@pytest.mark.torch  # the row runs torch_ref's eager update beside jaxloop's step
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


RECORD = Path(__file__).resolve().parents[1] / "benchmarks" / "records" / "cpu-xeon-2026-12-04.json"
"""A whole run as --out wrote it (BENCHMARKS.md's record)."""


def _record() -> dict:
    return json.loads(RECORD.read_text())


def test_benchmarks_md_is_what_its_saved_runs_generate(tmp_path):
    # BENCHMARKS.md is generated, never edited: its saved runs (docs/speed.md names them) rewrite it exactly,
    # so a table edited by hand, or notes changed without regenerating it, fail here; and so does a changed byte in
    # a saved run's figures (mutant seen failing: step.mlp.k1's ratio 0.243 -> 0.343 in the record)
    records = RECORD.parent
    regenerated = tmp_path / "B.md"
    argv = ["--from-json", str(RECORD), str(records / "gpu-h100-2026-11-24.json"), "--markdown", str(regenerated)]
    assert main(argv) == 0
    assert regenerated.read_text() == (records.parents[1] / "BENCHMARKS.md").read_text()


def test_a_failed_rewrite_of_the_record_keeps_the_one_before_and_leaves_no_temporary(tmp_path, monkeypatch):
    # the harness rewrites --out after every row (and the GPU script after every part): a rewrite that fails
    # or is killed part-way (the disk full at its fsync here; tests/test_atomic.py kills the same writer)
    # leaves the previous record whole, never a truncated one
    saved, out = tmp_path / "saved.json", tmp_path / "out.json"
    saved.write_text(json.dumps(_record()))
    out.write_text("the record before")

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError):
        main(["--from-json", str(saved), "--out", str(out)])
    assert out.read_text() == "the record before"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "saved.json"]


KILLED_INSIDE_THE_REWRITE = """
import os, signal, sys
from benchmarks.__main__ import main
os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGKILL)  # the new bytes written, the rename not yet done
main(sys.argv[1:])
"""


def test_the_harness_killed_inside_its_record_rewrite_leaves_the_record_before_whole(tmp_path):
    # a real SIGKILL of `python -m benchmarks ... --out FILE` between writing the new record and renaming it over
    # the old one: FILE is the record before, byte for byte, and still reads as a record
    # mutant seen failing: save_record writing FILE in place (open 'w', write, fsync): FILE is the new record
    root = RECORD.parents[2]
    new, out = tmp_path / "new.json", tmp_path / "out.json"
    new.write_text((RECORD.parent / "gpu-h100-2026-11-24.json").read_text())
    before = RECORD.read_bytes()
    out.write_bytes(before)
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_INSIDE_THE_REWRITE, "--from-json", str(new), "--out", str(out)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert out.read_bytes() == before
    (left,) = [p for p in tmp_path.iterdir() if p.name not in ("new.json", "out.json")]
    assert is_temporary(left.name), left.name  # the rewrite the kill cut, beside the record it never replaced
    assert main(["--from-json", str(out), "--markdown", str(tmp_path / "B.md")]) == 0


@pytest.mark.parametrize(
    "damage",
    [
        lambda text: text[: len(text) // 2],  # cut short: a copy interrupted
        lambda text: text.replace('"rows"', '"r\x00ws"'),  # a byte changed: no rows
        lambda text: "[]",  # another file's JSON
    ],
    ids=["cut-short", "byte-changed", "not-a-record"],
)
def test_a_damaged_record_is_refused_naming_the_file_and_the_flag(tmp_path, damage):
    bad = tmp_path / "run.json"
    bad.write_text(damage(json.dumps(_record())))
    with pytest.raises(SystemExit, match=rf"--from-json {re.escape(str(bad))}: not a"):
        main(["--from-json", str(bad), "--markdown", str(tmp_path / "B.md")])
    assert not (tmp_path / "B.md").exists(), "nothing is written from a damaged record"


def test_the_memory_plan_rows_measure_each_plan_against_the_plain_one(tmp_path):
    # --smoke: a tiny GPT, one round; only the shape of the rows is checked (no time is asserted)
    result = run(Options(quick=True, smoke=True, workdir=tmp_path, log=lambda s: None), only=["memory.plan"])
    rows = {r["name"]: r for r in result["rows"]}
    assert sorted(rows) == sorted(f"memory.plan.{p}" for p in ("blocks", "dots_saveable", "full", "split2", "split4"))
    for row in rows.values():
        assert row["status"] == "ok", row["notes"]
        assert row["jax"] > 0 and row["ref"] > 0 and row["ratio"] == pytest.approx(row["jax"] / row["ref"])
        assert row["extra"]["temp_bytes"] > 0 and row["extra"]["temp_bytes_plain"] > 0
    # splitting in four keeps a quarter of the micro-batch's activations alive at once
    assert rows["memory.plan.split4"]["extra"]["temp_ratio"] < rows["memory.plan.split2"]["extra"]["temp_ratio"] < 1


def test_every_row_is_listed_once():
    names = [name for name, _ in registry()]
    assert len(names) == len(set(names))
    for prefix in ("peak", "step.", "eval.", "loop.", "e2e.", "startup.", "memory.", "data", "checkpoint", "accel"):
        assert any(n.startswith(prefix) for n in names), prefix


def _result(cpu: str, time_utc: str, *names: str) -> dict:
    machine = {
        "cpu": cpu,
        "cores": 2,
        "platform": "Linux",
        "python": "3.11",
        "versions": {"jax": "0.10"},
        "threads": {"xla_cpu": "all", "torch": 2},
        "time_utc": time_utc,
        "harness_s": 10.0,
    }
    row = {
        "status": "ok",
        "jax": 1.0,
        "ref": 2.0,
        "unit": "ms",
        "ratio": 0.5,
        "goal": "info",
        "met": None,
        "what": "w",
        "notes": "",
    }
    return {"machine": machine, "rows": [dict(row, name=n) for n in names]}


def test_merged_rows_from_another_machine_are_named_with_that_machine():
    # later runs replace earlier rows by name: the GPU run's step.mlp.k1 replaces T1's, T3's loop.mlp.k1
    # replaces T1's; only this machine's runs (T1, T3) make up its time and harness seconds
    gpu = _result("EPYC", "T2", "accel.fp32", "step.mlp.k1")
    gpu["machine"]["accelerator"] = "NVIDIA H100"  # the same CPU, but a GPU beside it: another machine
    merged = merge([_result("EPYC", "T1", "step.mlp.k1", "loop.mlp.k1"), gpu, _result("EPYC", "T3", "loop.mlp.k1")])
    assert merged["machine"]["cpu"] == "EPYC" and merged["machine"]["time_utc"] == "T1 + T3"
    assert merged["machine"]["harness_s"] == 20.0
    (other,) = merged["machine"]["elsewhere"]
    assert other["rows"] == ["step.mlp.k1", "accel.fp32"] and other["machine"]["accelerator"] == "NVIDIA H100"
    out = io.StringIO()
    print_table(merged, file=out)
    assert (
        "rows step.mlp.k1, accel.fp32 measured on another machine: machine: EPYC, 2 cores, NVIDIA H100"
        in out.getvalue()
    )


def test_merged_rows_a_later_run_here_takes_back_from_another_machine_are_this_machine_s():
    gpu = _result("Xeon", "T2", "accel.fp32", "step.mlp.k1")
    gpu["machine"]["accelerator"] = "NVIDIA H100"
    merged = merge([_result("EPYC", "T1", "loop.mlp.k1"), gpu, _result("EPYC", "T3", "step.mlp.k1")])
    (other,) = merged["machine"]["elsewhere"]
    assert other["rows"] == ["accel.fp32"]
    # a merged result merged again (a record rewritten from its JSON) keeps which rows came from where
    again = merge([merged])
    assert again == merged


def test_bench_dispatch_children_get_their_mode_s_glibc_settings_and_no_dispatch_choice(monkeypatch):
    """Each contender's process starts with its own glibc setting, added to a GLIBC_TUNABLES the caller set
    (glibc reads one variable, colon-separated), and without the caller's JAX_CPU_ENABLE_ASYNC_DISPATCH, which
    would otherwise decide the dispatch for every contender alike."""
    from benchmarks.bench_dispatch import child_env

    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.tcache_count=0")
    monkeypatch.setenv("JAX_CPU_ENABLE_ASYNC_DISPATCH", "0")
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    huge, arena, worker = child_env("hugepages"), child_env("one-arena"), child_env("worker")
    assert huge["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=0:glibc.malloc.hugetlb=1"
    assert arena["MALLOC_ARENA_MAX"] == "1" and arena["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=0"
    assert "MALLOC_ARENA_MAX" not in worker and worker["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=0"
    assert not any("JAX_CPU_ENABLE_ASYNC_DISPATCH" in env for env in (huge, arena, worker))


def test_dot_floor_canonical_form_of_hand_worked_dimension_numbers():
    from benchmarks.dot_floor import Dot

    # attention scores as XLA:CPU states them: batch (b, h), contract d of both -> 48 products [64,32]@[32,64]
    scores = Dot((12, 4, 64, 32), (12, 4, 32, 64), (((3,), (2,)), ((0, 1), (0, 1))))
    assert scores.canonical() == (48, 64, 32, 64) and scores.flops == 2.0 * 48 * 64 * 32 * 64
    # a weight gradient with both operands transposed: contract the lhs's first axis and the rhs's last
    grad = Dot((768, 512), (128, 768), (((0,), (1,)), ((), ())))
    assert grad.canonical() == (1, 512, 768, 128)


def test_dot_floor_reads_every_dot_of_a_compiled_module_with_its_operand_shapes():
    import jax
    import jax.numpy as jnp

    from benchmarks.dot_floor import hlo_dots

    def f(a, b, x, y):
        return a @ b, jnp.einsum("bij,bjk->bik", x, y)

    args = (jnp.ones((32, 48)), jnp.ones((48, 16)), jnp.ones((4, 8, 24)), jnp.ones((4, 24, 40)))
    dots = hlo_dots(jax.jit(f).lower(*args).compile().as_text())
    # however XLA:CPU lays the products out, each keeps its batch and its M x K x N
    assert sorted(d.flops for d in dots) == sorted([2.0 * 32 * 48 * 16, 2.0 * 4 * 8 * 24 * 40])
    assert sorted(d.canonical()[0] for d in dots) == [1, 4]


@pytest.mark.torch  # the row's reference is a PyTorch script
def test_script64_row_smoke_runs_both_sides_and_reports_their_losses(tmp_path, monkeypatch):
    # 20 updates on the shipped 60k-character slice: checks the row's plumbing, measures nothing
    from benchmarks.common import TEXT_ENV

    monkeypatch.setenv(TEXT_ENV, str(Path(__file__).parent / "data" / "tinyshakespeare_60k.txt"))
    result = run(Options(smoke=True, workdir=tmp_path, log=lambda s: None), only=["e2e.script64"])
    (row,) = result["rows"]
    assert row["name"] == "e2e.script64" and row["status"] == "ok", row["notes"]
    assert row["jax"] > 0 and row["ref"] > 0 and row["goal"] == "<= 0.9" and row["met"] in (True, False)
    losses, update_ms = row["extra"]["val_loss"], row["extra"]["update_ms"]
    # after 20 updates both models are near the unigram entropy, far below uniform (log 59 = 4.08)
    assert 2.0 < losses["jaxloop"] < 3.9 and 2.0 < losses["script"] < 3.9, losses
    assert update_ms["jaxloop"] > 0 and update_ms["script"] > 0
    assert row["extra"]["script"]["iters"] == 20
    # equal evaluation work: one evaluation each (the script's estimate at iteration 0, jaxloop's at the end)
    assert row["extra"]["evaluations"] == {"jaxloop": 1, "script": 1}
    assert (tmp_path / "script64-jaxloop" / "summary.json").is_file()


def test_benchmark_text_is_taken_by_path_with_a_clear_message_when_absent(tmp_path, monkeypatch):
    from benchmarks.common import TEXT_ENV, text_path

    monkeypatch.setenv(TEXT_ENV, str(tmp_path / "missing.txt"))
    with pytest.raises(FileNotFoundError, match="--data.path FILE"):
        text_path()
    (tmp_path / "t.txt").write_text("some text")
    monkeypatch.setenv(TEXT_ENV, str(tmp_path / "t.txt"))
    assert text_path() == tmp_path / "t.txt"


def test_gpt2_gpu_row_without_a_gpu_says_unmeasured(monkeypatch):
    from benchmarks import bench_gpt2

    monkeypatch.setattr(bench_gpt2, "gpu_present", lambda: False)
    row = bench_gpt2.gpu_row(Options(quick=True))
    assert (row.status, row.notes) == ("unmeasured", "unmeasured: no GPU lent to this task")
    assert {"gpt2.cpu", "gpt2.gpu"} <= {name for name, _ in registry()}


def test_the_sample_row_times_the_cached_and_the_whole_window_generation_of_the_same_tokens(tmp_path):
    # --smoke: a one-layer GPT, one round; the shape of the row and that both contenders drew the same tokens
    result = run(Options(quick=True, smoke=True, workdir=tmp_path, log=lambda s: None), only=["sample.gpt"])
    (row,) = result["rows"]
    assert row["status"] == "ok", row["notes"]
    assert row["jax"] > 0 and row["ref"] > 0 and row["ratio"] == pytest.approx(row["jax"] / row["ref"])
    assert row["extra"]["same_tokens"] is True and set(row["extra"]["tokens_per_s"]) == {"kv cache", "whole window"}
    assert row["extra"]["generate_again_s"] > 0 and row["extra"]["compiled_call_s"] > 0


def test_the_attention_layout_variants_replace_the_second_dot_and_compute_the_same_attention():
    # benchmarks/attention_layout.py times jaxloop's attention against a variant of its second dot; a variant that
    # replaced nothing would be timed as jaxloop's own program and reported "bit for bit", so it must refuse.
    # Same math, another accumulation order: float32 close (1e-6 relative), not bit for bit.
    import jax
    import numpy as np

    from benchmarks.attention_layout import second_dot
    from jaxloop.model.attention import dot_product_attention

    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (2, 5, 3, 4)) for i in range(3))
    plain = np.asarray(dot_product_attention(q, k, v))
    for variant in ("v_first", "barrier"):
        with second_dot(variant):
            np.testing.assert_allclose(np.asarray(dot_product_attention(q, k, v)), plain, rtol=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="nothing was replaced"):
        with second_dot("v_first"):
            pass
