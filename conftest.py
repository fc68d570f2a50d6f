"""What both suites (tests/, parity_tests/) share: JAX's persistent compilation cache for the session.

The suites compile the same programs many times: every in-process `jaxloop.run`, port check and parity
configuration traces anew, and the `python -m jaxloop.train` children compile the built-in tasks with the
command's default --compile_cache. With the in-process compiles pointed at that same directory, a program
compiled once anywhere in the session is loaded after that, as a user's second run loads it. A test that
gives a run its own compile_cache still gets that directory for the run (jaxloop.runtime.settings); a test that
needs the cache off runs a child with `--compile_cache ""`. JAX's settings are put back when the session
ends. Results do not depend on it: a loaded executable is the one compiled (tests/test_train.py checks the
bits of a run that loaded every call).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling


@pytest.fixture(scope="session", autouse=True)
def compilation_cache_for_the_session() -> Iterator[Path]:
    from jaxloop.config.run import Config
    from jaxloop.runtime.compilation import compilation_cache

    with compilation_cache(Path(Config().compile_cache).expanduser()) as directory:
        yield directory


# ----------------------------------------------------------------------------- parallel workers (pytest-xdist)

JOINED = {
    "parity_tests/test_convert.py": "parity_tests/test_resume.py",  # conftest.resume_runs (package scope)
    "tests/test_docs_faults.py": "docs/faults.md",  # doc_run: a page's run, read by its tests in test_docs.py
    "tests/test_docs_optimizers.py": "docs/optimizers.md",
    "tests/test_port_docs.py": "docs/porting.md",
    "tests/test_port_command.py": "docs/porting.md",
}
"""Modules that share a fixture wider than a module with another unit: run on the same worker, the fixture
is built once (a module missing here only costs its build on a second worker)."""
PAGE = re.compile(r"\[((?:docs/)?[\w.-]+\.md)\b")
"""tests/test_docs.py's case ids begin with the page (`[docs/data.md-torch]`)."""


def unit(nodeid: str) -> str:
    """The unit of work a worker runs whole: a test module (its module fixtures are built once), the modules of
    JOINED with theirs, tests/test_docs.py's tests of one page (doc_run: the page's blocks run once)."""
    module = nodeid.split("::")[0]
    page = PAGE.search(nodeid) if module == "tests/test_docs.py" else None
    return page[1] if page else JOINED.get(module, module)


class Units(LoadScopeScheduling):
    """pytest-xdist's --dist loadscope, with the units above for scopes."""

    def _split_scope(self, nodeid: str) -> str:
        return unit(nodeid)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log) -> LoadScopeScheduling | None:
    """`--dist loadscope` (pyproject.toml's addopts) schedules the units above."""
    return Units(config, log) if config.getvalue("dist") == "loadscope" else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A warning names the units that build a shared fixture again (a module missing from JOINED above): the
    package's resume_runs outside one unit, a docs page's run read outside the page's unit."""
    resume_units = {unit(item.nodeid) for item in items if "resume_runs" in item.fixturenames}
    apart = [f"resume_runs in {sorted(resume_units)}"] if len(resume_units) > 1 else []
    for item in items:
        page = getattr(item, "callspec", None) and item.callspec.params.get("page")
        page = page or getattr(getattr(item, "module", None), "DOC", None)
        if "doc_run" in item.fixturenames and page:
            page = str(Path(page).relative_to(config.rootpath))
            if unit(item.nodeid) != page:
                apart.append(f"{item.nodeid} reads {page}'s run")
    if apart:
        warnings.warn(f"conftest.py's JOINED misses these (each builds its fixture again): {apart}", stacklevel=1)
