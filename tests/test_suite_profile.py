"""benchmarks/suite_profile.py: the pytest plugin that counts each test module's seconds and JAX compiles,
read through its JSON from a pytest run on two xdist workers (the README's command runs two)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

MODULES = {
    "test_compiles_once.py": """
import jax, numpy as np

def doubled(x):
    return x * 2

def test_one_compile():
    jax.jit(doubled).lower(np.ones(3, np.float32)).compile()
""",
    "test_compiles_nothing.py": """
def test_nothing():
    assert sum(range(4)) == 6
""",
    "test_cache_answers.py": """
import jax, numpy as np
from jaxloop.runtime.compilation import compilation_cache

def f(x):
    return x + 1

def test_compiled_then_loaded(tmp_path):
    with compilation_cache(tmp_path / "xla"):
        jax.jit(f)(np.ones(4, np.float32))
        jax.clear_caches()  # the in-memory cache forgets it: the second call reads the persistent cache
        jax.jit(f)(np.ones(4, np.float32))
""",
    "test_runs_a_child.py": """
import subprocess, sys

def test_a_child_that_spends_cpu():
    subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3 * 10**6))"], check=True)
""",
}


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> dict:
    """The plugin's JSON from one pytest run of MODULES on two xdist workers."""
    tmp_path = tmp_path_factory.mktemp("profiled")
    for name, text in MODULES.items():
        (tmp_path / name).write_text(text)
    out = tmp_path / "profile.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", "-p", "benchmarks.suite_profile"]
        + ["--suite-profile-json", str(out), "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "suite profile" in proc.stdout and "jit(doubled) (test_compiles_once.py)" in proc.stdout, (
        "the tables are printed at the end"
    )
    return json.loads(out.read_text())


def test_the_profile_counts_each_modules_compiles_and_cache_reads_across_workers(profile):
    rows = {r["module"]: r for r in profile["modules"]}
    assert set(rows) == set(MODULES)
    once, nothing, cached, child = (
        rows["test_compiles_once.py"],
        rows["test_compiles_nothing.py"],
        rows["test_cache_answers.py"],
        rows["test_runs_a_child.py"],
    )
    # exactly one XLA compile: one lowered program compiled once, nothing else jitted
    assert (once["compiles"], once["hits"]) == (1, 0) and once["compile_s"] > 0 and once["lower_s"] > 0
    assert (nothing["compiles"], nothing["hits"], nothing["compile_s"]) == (0, 0, 0)
    # the second jit call after clear_caches is answered from disk: a hit, not a compile
    assert (cached["compiles"], cached["hits"]) == (1, 1)
    assert all(r["test_s"] > 0 for r in rows.values())
    # the child's loop (3e6 squares, about 0.2 s of CPU) is counted as the child's, not the test process's;
    # a module that starts no child has none (0.1 s: well above getrusage's resolution, well below the loop)
    assert child["child_cpu_s"] > 0.1 and child["compiles"] == 0
    assert once["child_cpu_s"] == nothing["child_cpu_s"] == cached["child_cpu_s"] == 0
    assert once["cpu_s"] > 0 and once["cpu_s"] >= once["compile_s"] * 0.5, "a compile spends the process's CPU"


def test_the_profile_names_each_program_with_its_compiles_and_the_module_that_compiled_it(profile):
    programs = {r["program"]: r for r in profile["programs"]}
    # jit names a program after its function: the two modules' programs, nothing else compiled anywhere
    assert set(programs) == {"jit(doubled)", "jit(f)"}
    doubled, f = programs["jit(doubled)"], programs["jit(f)"]
    assert (doubled["compiles"], doubled["hits"], doubled["top_module"]) == (1, 0, "test_compiles_once.py")
    assert (f["compiles"], f["hits"], f["top_module"]) == (1, 1, "test_cache_answers.py")
    assert doubled["compile_s"] > 0 and f["compile_s"] > 0
