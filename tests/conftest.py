"""Collection of jaxloop's own tests where torch is not installed (Python 3.12+, where the test extra leaves
it out): the modules that import torch at their top are left out of collection in a run that deselects
the `torch` marker (`-m "not torch"`, as CI's Python 3.12 run does). Any other run that reaches them
without torch fails to import them (No module named 'torch'), as it should: it asked for their tests.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

MARKED_TORCH = re.compile(r"^pytestmark\s*=.*\bpytest\.mark\.torch\b", re.M)
"""A module whose every test is marked `torch` (module-level pytestmark): it may import torch at its top."""


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    deselected = "not torch" in (config.option.markexpr or "")
    if (deselected and collection_path.suffix == ".py" and importlib.util.find_spec("torch") is None
            and MARKED_TORCH.search(collection_path.read_text(encoding="utf-8"))):
        return True
    return None
