"""Collection of jaxloop's own tests where torch is not installed (Python 3.12+, where the test extra leaves
it out): the modules that import torch at their top are left out of collection in a run that deselects
the `torch` marker (`-m "not torch"`, as CI's Python 3.12 run does). Any other run that reaches them
without torch fails to import them (No module named 'torch'), as it should: it asked for their tests.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

# Modules whose every test is marked `torch` (module-level pytestmark) and that import torch at their top.
TORCH_MODULES = frozenset({"test_torch_ref.py"})


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    deselected = "not torch" in (config.option.markexpr or "")
    if collection_path.name in TORCH_MODULES and deselected and importlib.util.find_spec("torch") is None:
        return True
    return None
