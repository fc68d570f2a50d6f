"""Where the test suite's time goes: a pytest plugin that sums, per test module, the tests' seconds and
JAX's compiles inside them (the README's test-time goal is a question of how many programs the suite
compiles, docs/speed.md "The test suite's time").

    python -m pytest -p benchmarks.suite_profile tests parity_tests                     # a table at the end
    python -m pytest -p benchmarks.suite_profile --suite-profile-json prof.json tests   # and the rows as JSON

Per module: its tests' seconds (setup, call and teardown, as --durations adds them), the XLA compiles
(JAX's /jax/core/compile/backend_compile_duration events, which include the persistent cache's reads:
`hits` counts those), their seconds, and the seconds of tracing and of lowering to MLIR. Child processes
a test starts are inside its seconds but not in its compiles (they are other processes). The CPU the
tests spend: `cpu s`, the test process's own (user + system), and `child cpu s`, that of the child
processes it ended and waited for (getrusage's RUSAGE_CHILDREN); on two cores the suite's wall time is
bounded below by the sum of both over two, so these are the figures a shorter suite must lower.

Per program (jit's name for it, `jit(train_step)`): its compiles, cache reads and compile seconds over the
whole suite, and the module that spent the most of them: which programs a shorter suite must compile less.

Under pytest-xdist each worker measures the tests it runs and hands the figures to the controller on
the test's report (user_properties), so one table covers every worker. jax.monitoring's listeners are
registered in a process at its first test and removed when pytest ends.
"""

from __future__ import annotations

import json
import resource
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

EVENTS = {
    "/jax/core/compile/backend_compile_duration": "compile_s",
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
}
"""jax.monitoring's duration events (jax/_src/dispatch.py's names) -> the column they add to."""
COLUMNS = ("test_s", "cpu_s", "child_cpu_s", "compiles", "hits", "compile_s", "trace_s", "lower_s")
PROGRAM_COLUMNS = ("compiles", "hits", "compile_s")
KEY = "suite_profile"
"""The user_properties entry of a report that carries one test phase's figures."""
PROGRAMS_KEY = "suite_profile_programs"
"""The entry that carries the phase's compiles per program: {name: [compiles, hits, compile_s]}."""
PROGRAMS_SHOWN = 15


def no_programs() -> defaultdict[str, list[float]]:
    """program -> [compiles, hits, compile_s] (PROGRAM_COLUMNS), all zero until counted."""
    return defaultdict(lambda: [0, 0, 0.0])


class Meter:
    """Sums jax.monitoring's events since the last take() (one test phase in this process)."""

    def __init__(self) -> None:
        # jaxloop's name for the event of a compile the persistent cache answered (jax sends it before
        # that compile's duration event); imported here, so that a controller that runs no test never imports jax
        from jaxloop.runtime.compilation import HIT

        self.hit_event = HIT
        self.sums: dict[str, float] = defaultdict(float)
        self.programs = no_programs()
        self.hit_pending = False
        self.cpu = cpu_seconds()

    def on_duration(self, event: str, duration: float, **kwargs: object) -> None:
        column = EVENTS.get(event)
        if column is None:
            return
        if column != "compile_s":
            self.sums[column] += duration
            return
        # a compile is counted once, under its program; the module's compiles are their sum (take()).
        # jax names the program in the event (dispatch.log_elapsed_time's fun_name: "jit(train_step)")
        program = self.programs[str(kwargs.get("fun_name", "?"))]
        program[1 if self.hit_pending else 0] += 1
        program[2] += duration
        self.hit_pending = False

    def on_event(self, event: str, **kwargs: object) -> None:
        if event == self.hit_event:
            self.hit_pending = True

    def take(self) -> tuple[dict[str, float], dict[str, list[float]]]:
        """(the phase's figures, its compiles per program), and start the next phase from zero."""
        cpu = cpu_seconds()
        self.sums["cpu_s"] += cpu[0] - self.cpu[0]
        self.sums["child_cpu_s"] += cpu[1] - self.cpu[1]
        self.cpu = cpu
        programs, self.programs = dict(self.programs), no_programs()
        for i, column in enumerate(PROGRAM_COLUMNS):
            self.sums[column] += sum(figures[i] for figures in programs.values())
        sums, self.sums = dict(self.sums), defaultdict(float)
        return sums, programs


def cpu_seconds() -> tuple[float, float]:
    """(this process's user + system seconds, those of its children that ended and were waited for)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


class Profile:
    """The plugin: a Meter in each process that runs tests, the table in the process that reports."""

    def __init__(self, json_path: str | None, worker: bool) -> None:
        self.json_path = json_path
        self.worker = worker
        self.meter: Meter | None = None
        self.modules: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(COLUMNS, 0.0))
        self.programs: dict[str, dict[str, list[float]]] = defaultdict(dict)
        """program -> module -> [compiles, hits, compile_s] in that module's tests."""

    def start(self) -> None:
        """Listen to jax's events from here on (the first test of this process: a controller that runs no
        test never imports jax)."""
        if self.meter is None:
            import jax

            self.meter = Meter()
            jax.monitoring.register_event_duration_secs_listener(self.meter.on_duration)
            jax.monitoring.register_event_listener(self.meter.on_event)

    def stop(self) -> None:
        if self.meter is not None:
            import jax

            jax.monitoring.unregister_event_duration_listener(self.meter.on_duration)
            jax.monitoring.unregister_event_listener(self.meter.on_event)
            self.meter = None

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        self.start()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo) -> Any:
        outcome = yield
        if self.meter is not None:
            sums, programs = self.meter.take()
            outcome.get_result().user_properties.extend([(KEY, sums), (PROGRAMS_KEY, programs)])

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.worker:
            return  # an xdist worker's figures travel on the report; the controller sums them
        module = report.nodeid.split("::")[0]
        row = self.modules[module]
        row["test_s"] += report.duration
        for key, sums in report.user_properties:
            if key == KEY:
                for column, value in sums.items():
                    row[column] += value
            elif key == PROGRAMS_KEY:
                for name, figures in sums.items():
                    here = self.programs[name].setdefault(module, [0, 0, 0.0])
                    here[:] = [a + b for a, b in zip(here, figures)]

    def rows(self) -> list[dict[str, Any]]:
        """Each module's figures, the slowest first."""
        rows = [{"module": module, **row} for module, row in self.modules.items()]
        return sorted(rows, key=lambda r: -r["test_s"])

    def program_rows(self) -> list[dict[str, Any]]:
        """Each program's figures and the module that spent the most of its compile seconds, the costliest
        first."""
        rows = [
            {
                "program": name,
                **{column: sum(f[i] for f in by_module.values()) for i, column in enumerate(PROGRAM_COLUMNS)},
                "top_module": max(by_module, key=lambda module: by_module[module][2]),
            }
            for name, by_module in self.programs.items()
        ]
        return sorted(rows, key=lambda r: -r["compile_s"])

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        rows = self.rows()
        if not rows:  # an xdist worker's are always empty (pytest_runtest_logreport)
            return
        total = {c: sum(r[c] for r in rows) for c in COLUMNS}
        write = terminalreporter.write_line
        terminalreporter.section("suite profile (benchmarks/suite_profile.py): seconds per test module")
        write(
            f"{'test s':>8} {'cpu s':>8} {'child cpu s':>11} {'compiles':>8} {'hits':>6} {'compile s':>9} "
            f"{'trace s':>8} {'lower s':>8}  module"
        )
        for r in [*rows[:40], {"module": f"all {len(rows)} modules", **total}]:
            write(
                f"{r['test_s']:8.1f} {r['cpu_s']:8.1f} {r['child_cpu_s']:11.1f} {int(r['compiles']):8d} "
                f"{int(r['hits']):6d} {r['compile_s']:9.1f} "
                f"{r['trace_s']:8.1f} {r['lower_s']:8.1f}  {r['module']}"
            )
        programs = self.program_rows()
        write("")
        write(f"{'compiles':>8} {'hits':>6} {'compile s':>9}  program (the module that compiled it most)")
        for r in programs[:PROGRAMS_SHOWN]:
            write(
                f"{int(r['compiles']):8d} {int(r['hits']):6d} {r['compile_s']:9.1f}  {r['program']} ({r['top_module']})"
            )
        if self.json_path:
            data = {"modules": rows, "total": total, "programs": programs}
            Path(self.json_path).write_text(json.dumps(data, indent=1) + "\n")
            write(f"suite profile written to {self.json_path}")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--suite-profile-json", default=None, help="also write the suite profile's rows to this file")


def pytest_configure(config: pytest.Config) -> None:
    profile = Profile(config.getoption("--suite-profile-json"), worker=hasattr(config, "workerinput"))
    config.pluginmanager.register(profile, "suite_profile_meter")


def pytest_unconfigure(config: pytest.Config) -> None:
    profile = config.pluginmanager.get_plugin("suite_profile_meter")
    if isinstance(profile, Profile):
        profile.stop()
