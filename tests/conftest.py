"""Collection of jaxloop's own tests where torch is not installed (Python 3.12+, where the test extra leaves
it out): the modules that import torch at their top are skipped at collection, but only in a run that
deselects the `torch` marker (`-m "not torch"`, as CI's Python 3.12 run does); any other run without torch
stops with a usage error instead of passing quietly without them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

# Modules whose every test is marked `torch` (module-level pytestmark) and that import torch at their top.
TORCH_MODULES = frozenset({"test_torch_ref.py"})


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path.name not in TORCH_MODULES or importlib.util.find_spec("torch") is not None:
        return None
    if "not torch" not in (config.option.markexpr or ""):
        raise pytest.UsageError(
            f"{collection_path.name} needs torch, which is not installed: install the test extra on Python 3.11 "
            '(pip install -e ".[test]") or deselect those tests with -m "not torch"')
    return True
