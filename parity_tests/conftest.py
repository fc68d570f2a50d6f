"""Setup of the parity suite: 64-bit jax, the shipped text, and the table of measured differences.

jax's x64 mode is switched on once for the whole package, before any of its tests creates a jax array
(fp64 needs it), and switched back off after the package's last test, so that jaxloop's own tests in
the same pytest session (`pytest tests parity_tests`) run as they would alone. Every float32, bf16 and
fp16 jax computation of the suite runs inside `harness.jax_mode`, which turns x64 off for it (see
harness.py for why).

At the end pytest prints every check's measured maximum difference beside its tolerance.
`--parity-out FILE` also writes them, with the curves the report plots, as JSON.
A skipped or xfailed parity test fails the session: a parity check that does not run proves nothing.
Any warning in a parity test (DeprecationWarnings aside) is an error (filterwarnings "error" on every item of this package) unless
the test itself names it: a damaged-checkpoint fallback, for one, warns, and a parity run that fell
back to a fresh start must not pass quietly.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import pytest

from parity_tests.harness import SHAKESPEARE, TABLE, Check, torch_threads, write_results

_NOT_RUN: list[str] = []
_ORDER: dict[str, int] = {}
"""Each test's place in the collection: a table merged from pytest-xdist's workers is put in this order."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--parity-out", default=None, help="write the measured differences and curves as JSON here")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    _ORDER.update((item.nodeid, i) for i, item in enumerate(items))
    for item in items:
        if here in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.torch)  # every parity test runs torch_ref beside jaxloop
            # prepended: filters a test or its module names itself are applied after these and win.
            # DeprecationWarnings stay ignored as in pyproject.toml (an API's future, not a run's result:
            # e.g. optax.global_norm, which jaxloop.update.step still calls).
            item.add_marker(pytest.mark.filterwarnings("ignore::DeprecationWarning"), append=False)
            item.add_marker(pytest.mark.filterwarnings("error"), append=False)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped or hasattr(report, "wasxfail"):
        _NOT_RUN.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workeroutput"):  # a pytest-xdist worker: its table goes to the controller
        session.config.workeroutput["parity"] = json.dumps({**TABLE.as_dict(), "order": _ORDER})
        return
    out = session.config.getoption("--parity-out", default=None)  # None when this conftest loaded late
    if out:
        write_results(out)
    if _NOT_RUN and session.exitstatus == 0:
        session.exitstatus = 1


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """pytest-xdist's controller: a worker's table, merged into this process's (which reports and writes it)."""
    table = json.loads(getattr(node, "workeroutput", {}).get("parity", "null") or "null")
    if table:
        # in the order one process makes them, whichever worker ends first: by the tests' order of collection
        # (the same in every worker), a test's checks in the order it made them
        _ORDER.update(table["order"])
        merged = [*TABLE.checks, *(Check(**c) for c in table["checks"])]
        TABLE.checks = sorted(merged, key=lambda c: _ORDER.get(c.test, -1))
        TABLE.series = dict(sorted({**TABLE.series, **table["series"]}.items()))
        TABLE.notes = dict(sorted({**TABLE.notes, **table["notes"]}.items()))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if TABLE.checks:
        terminalreporter.section("parity: measured maximum difference vs tolerance")
        for line in TABLE.lines():
            terminalreporter.write_line(line)
    if TABLE.notes:
        terminalreporter.section("parity: measurements behind the findings (see PARITY.md)")
        for key, value in TABLE.notes.items():
            terminalreporter.write_line(f"{key}: {value:.3e}")
    if _NOT_RUN:
        terminalreporter.section("parity: tests that did not run (this fails the session)")
        for nodeid in _NOT_RUN:
            terminalreporter.write_line(nodeid)


@pytest.fixture(scope="package", autouse=True)
def x64():
    """jax's 64-bit mode for every test of the package (fixtures that build jax state request it too)."""
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


@pytest.fixture(scope="package", autouse=True)
def torch_one_thread():
    """torch's intra-op threads at 1 for every test of the package, restored after its last (harness.torch_threads:
    the suite's small models run 10-20x faster on one thread than on two cores that jax's threads also use)."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="session")
def parity():
    """The session's table: parity.check(name, measured, tolerance, reason) records and asserts."""
    return TABLE


@pytest.fixture(autouse=True)
def _current_test(request):
    """Checks made during a test (or its fixtures) are filed under it."""
    TABLE.current_test = request.node.nodeid
    yield


@pytest.fixture(scope="session")
def shakespeare_slice() -> Path:
    """The first 60k characters of Tiny Shakespeare, as shipped in tests/data (read by path)."""
    assert SHAKESPEARE.is_file(), f"Tiny Shakespeare's first 60k characters are expected at {SHAKESPEARE}"
    return SHAKESPEARE


@pytest.fixture(scope="package")
def resume_runs(x64, tmp_path_factory):
    """Both loops' real runs (jaxloop.train.run, torch_ref.train.run) from the same initial weights:
    uninterrupted, and for each k in RESUME_AT interrupted at k (jaxloop: SIGTERM; torch_ref:
    stop_after) and resumed to the end. A copy of each interrupted run directory is kept."""
    import shutil
    from dataclasses import replace

    from jaxloop.data.sources import load_splits
    from jaxloop.loop.runner import run as jax_train
    from parity_tests.harness import RESUME_AT, host, interrupt_jax_run, jax_mode, jax_state, resume_cfg
    from torch_ref.train import run as torch_train

    base = tmp_path_factory.mktemp("resume")
    cfg = resume_cfg(base / "jax")
    splits = load_splits(cfg)
    with jax_mode(cfg.precision):
        init = host(jax_state(cfg, splits).params)
    at = lambda name: replace(cfg, run_dir=str(base / name))  # noqa: E731
    out = {
        "cfg": cfg,
        "splits": splits,
        "init": init,
        "base": base,
        "jax": (at("jax"), jax_train(at("jax"))),
        "torch": (at("torch"), torch_train(at("torch"), init_params=init, clip="optax", device="cpu", splits=splits)),
    }
    for k in RESUME_AT:
        jc, tc = at(f"jax_{k}"), at(f"torch_{k}")
        interrupt_jax_run(jc, k)
        shutil.copytree(jc.run_dir, base / f"jax_{k}_interrupted")
        out[("jax", k)] = (jc, jax_train(jc))
        torch_train(tc, init_params=init, clip="optax", stop_after=k, device="cpu", splits=splits)
        shutil.copytree(tc.run_dir, base / f"torch_{k}_interrupted")
        out[("torch", k)] = (tc, torch_train(tc, clip="optax", device="cpu", splits=splits))
    return out
