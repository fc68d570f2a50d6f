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
    if (
        deselected
        and collection_path.suffix == ".py"
        and importlib.util.find_spec("torch") is None
        and MARKED_TORCH.search(collection_path.read_text(encoding="utf-8"))
    ):
        return True
    return None


@pytest.fixture(scope="session")
def doc_run(tmp_path_factory):
    """doc_run(page, lang, torch=False) -> docs_blocks.PageRun: a page's blocks of `lang` run once per session
    (tests/docs_blocks.py), for every test that promises something of them."""
    import docs_blocks

    runs: dict = {}

    def get(page: Path, lang: str, torch: bool = False) -> docs_blocks.PageRun:
        key = (page, lang, torch)
        if key not in runs:
            runs[key] = docs_blocks.run(page, lang, torch, docs_blocks.workdir(tmp_path_factory.mktemp("docs")))
        return runs[key]

    return get
