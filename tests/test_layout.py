"""The package's layers are its subpackages, and nothing imports upward (the layer order docs/architecture.md draws): a module
imports jaxloop modules only from its own layer or the layers below, at the top of the file or inside a
function alike; torch_ref imports only the shared modules (SHARED: config, rundir, the data sources), which import
neither jax nor torch."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# layer of each subpackage (and of the top-level modules: the commands and the public namespace)
LAYERS = {
    "config": 0,
    "rundir": 0,
    "data": 0,
    "model": 1,
    "update": 2,
    "checkpoint": 3,
    "observe": 3,
    "runtime": 3,
    "loop": 4,
    "parity": 5,
}
# the jax-free, torch-free modules both loops import: torch_ref imports only these
SHARED = ("jaxloop.config", "jaxloop.rundir", "jaxloop.data.sources", "jaxloop.data.shards", "jaxloop.data.identity")
TOP = 6  # jaxloop/__init__ (the namespace), errors; the commands train, prepare, sample, report, schedule
PUBLIC_BELOW_TOP: set[str] = set()  # jaxloop.errors re-exports from config, rundir and data: it sits on top
BUILDERS = ("build",)  # the exceptions' public home re-exports jaxloop.config.errors only


def _layer(module: str) -> int:
    parts = module.split(".")
    if module in PUBLIC_BELOW_TOP:
        return 0
    if len(parts) >= 2 and parts[1] in LAYERS:
        return LAYERS[parts[1]]
    return TOP


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, skip: tuple[str, ...] = ()) -> set[str]:
    """Every module `path` imports by absolute name, anywhere in the file (function-level imports too), but
    inside the functions named in `skip`."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name in skip for n in ast.walk(f)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}  # `from jaxloop.loop import runner`
    return out


def _upward_imports(package: str) -> list[str]:
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        me = _module_name(path)
        mine = _layer(me) if package == "jaxloop" else 0
        # a config class builds what it configures: the config classes' `build` methods import, when called, the layer
        # that implements it (an optimizer's optax transformation); importing the core imports none of it
        for name in _imports(path, skip=BUILDERS if me.startswith(("jaxloop.config.", "jaxloop.core.")) else ()):
            if not (name == "jaxloop" or name.startswith("jaxloop.")):
                continue
            if package == "jaxloop" and me == "jaxloop":
                continue  # the namespace names everything (lazily)
            if _layer(name) > mine:
                found.append(f"{me} -> {name}")
    return found


def test_no_jaxloop_module_imports_from_a_layer_above_its_own():
    assert _upward_imports("jaxloop") == []


def test_torch_ref_imports_only_the_shared_jax_free_modules():
    found = [
        f"{_module_name(p)} -> {name}"
        for p in sorted((ROOT / "torch_ref").rglob("*.py"))
        for name in _imports(p)
        if (name == "jaxloop" or name.startswith("jaxloop."))
        and not any(name == s or name.startswith(s + ".") for s in SHARED)
    ]
    assert found == []


def test_every_shared_module_imports_without_jax_or_torch():
    modules = sorted(
        m
        for m in (_module_name(p) for p in (ROOT / "jaxloop").rglob("*.py"))
        if any(m == s or m.startswith(s + ".") for s in SHARED)
    )
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps([m for m in ('jax', 'torch', 'flax', 'optax', 'orbax.checkpoint') if m in sys.modules]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True, cwd=ROOT
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_the_top_level_holds_only_the_namespace_the_commands_and_the_layers():
    top = sorted(
        p.name
        for p in (ROOT / "jaxloop").iterdir()
        if p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists())
    )
    assert top == sorted(
        [
            "__init__.py",
            "errors.py",
            "train.py",
            "prepare.py",
            "sample.py",
            "schedule.py",
            "report.py",
            "export.py",
            *LAYERS,
        ]
    ), top


def _private_imports() -> list[str]:
    """`module -> import` for each import of a dependency's private module (`_src`, or any part of the dotted
    name with a leading underscore) by a jaxloop or torch_ref module."""
    found = []
    for package in ("jaxloop", "torch_ref"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in _imports(path):
                if name.split(".")[0] in ("jaxloop", "torch_ref", "__future__"):
                    continue
                if any(part.startswith("_") for part in name.split(".")):
                    found.append(f"{_module_name(path)} -> {name}")
    return sorted(set(found))


def test_no_module_imports_a_private_module_of_a_dependency():
    # mutants seen failing: orbax.checkpoint._src.futures imported back into jaxloop.checkpoint.manager;
    # jax._src.xla_bridge back in jaxloop.runtime.determinism
    assert _private_imports() == []
