"""python -m jaxloop.parity always ends with its verdict or one line of error (issue 43): a factory raising any
exception, a Port the check cannot run on, bad options, and a process that ends without a verdict (a
factory calling os._exit(0), which a CI gate would otherwise read as a pass). Real launches of the command."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.torch
ROOT = Path(__file__).resolve().parents[1]

PORTS = textwrap.dedent("""
    import numpy as np, torch, jax.numpy as jnp, flax.linen as nn
    from jaxloop.parity import Port

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(jnp.tanh(nn.Dense(6)(x)))

    def torch_net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))

    def tl(m, b):
        return (m(b["x"]) ** 2).mean()

    def fl(m, b, train):
        return jnp.mean(m(b["x"]) ** 2), {}

    X = {"x": np.ones((2, 4), np.float32)}

    def good():
        return Port(torch_net(), Net(), X, tl, fl)

    def hard_exit():
        import os
        os._exit(0)

    def interrupts():
        raise KeyboardInterrupt

    class Odd(BaseException):
        pass

    def base_exception():
        raise Odd("not an Exception")

    def no_batch():
        return Port(torch_net(), Net(), None, tl, fl)

    def vector_loss():
        return Port(torch_net(), Net(), X, lambda m, b: m(b["x"]) ** 2, lambda m, b, train: (m(b["x"]) ** 2, {}))
""")


@pytest.fixture(scope="module")
def ports(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ports") / "ports.py"
    path.write_text(PORTS)
    return path


def _command(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "jaxloop.parity", *argv], capture_output=True, text=True, env=env, timeout=600
    )


# (factory or options, exit status, the one line); mutant seen failing for each: the command before issue 43
# (exit 0 and no output for os._exit(0); 12-21 line tracebacks; --updates -5 and --markdown accepted)
CASES = [
    (
        ["{ports}:hard_exit"],
        2,
        "error: the check ended without its verdict: its process exited with status 0 before main() returned (does the "
        "factory or a model call os._exit?)",
    ),
    (
        ["{ports}:interrupts"],
        130,
        "error: interrupted (a Ctrl-C, or a KeyboardInterrupt the factory or a model raised)",
    ),
    (["{ports}:base_exception"], 2, "error: {ports}:base_exception raised Odd: not an Exception"),
    (
        ["{ports}:no_batch"],
        2,
        "error: the check could not run on the Port {ports}:no_batch returned: AttributeError: "
        "'NoneType' object has no attribute 'items'",
    ),
    (
        ["{ports}:vector_loss"],
        2,
        "error: the check could not run on the Port {ports}:vector_loss returned: ValueError: "
        "only one element tensors can be converted to Python scalars",
    ),
    (["{ports}:good", "--updates", "-5"], 2, "error: --updates=-5 is not allowed: an integer >= 0 (0 = no trajectory)"),
    (
        ["{ports}:good", "--markdown", "{missing}/dir/x.md"],
        2,
        "error: --markdown='{missing}/dir/x.md' is not allowed: a file in an existing, writable directory "
        "({missing}/dir is not a directory)",
    ),
    (
        ["{ports}:good", "--compile_cache", "{ports}"],
        2,
        "error: --compile_cache='{ports}' is not allowed: a directory that can be made and written ([Errno 17] File "
        "exists: '{ports}'; '' turns the cache off)",
    ),
]


PROGRESS = re.compile(r" \(at \d+\.\ds\)$")
"""The end of a progress line of the port check (jaxloop.parity.__main__'s progress)."""


@pytest.mark.parametrize("argv,status,line", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_the_command_ends_in_its_verdict_or_one_line_of_error(ports, tmp_path, argv, status, line):
    names = {"ports": ports, "missing": tmp_path / "missing"}
    out = _command(*[a.format(**names) for a in argv], "--precision", "fp64")
    assert out.returncode == status, out.stderr[-3000:]
    # the check's progress lines ("... (at 2.2s)", announcements of its stages) may come before the error
    errors = [s for s in out.stderr.strip().splitlines() if not PROGRESS.search(s)]
    assert out.stdout == "" and errors == [line.format(**names)], out.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []  # the markdown's directory is not made


def test_a_passing_check_still_ends_in_its_verdict_and_status_0(ports):
    out = _command(f"{ports}:good", "--precision", "fp64", "--updates", "0")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1].endswith("checks within tolerance")


def test_the_check_runs_inside_the_compile_cache_its_flag_names(ports, tmp_path, monkeypatch):
    # A second check of a port loads its compiled programs, as a second training run does (and the tests'
    # children load what the session compiled). mutant seen failing: --compile_cache parsed but not entered
    import importlib

    import jax

    command = importlib.import_module("jaxloop.parity.__main__")
    compare = importlib.import_module("jaxloop.parity.compare")  # the module (jaxloop.parity.compare is a function)

    seen = []

    def check(port, **kwargs):
        seen.append(jax.config.jax_compilation_cache_dir)
        raise RuntimeError("stop here: the check itself is tested elsewhere")

    monkeypatch.setattr(compare, "check", check)
    before = jax.config.jax_compilation_cache_dir
    cache = tmp_path / "cache"
    assert command.main([f"{ports}:good", "--precision", "fp64", "--compile_cache", str(cache)]) == 2
    assert seen == [str(cache.resolve())]
    assert jax.config.jax_compilation_cache_dir == before  # the process's setting is put back
    assert command.main([f"{ports}:good", "--precision", "fp64", "--compile_cache", ""]) == 2
    assert seen[1] == before  # '' leaves the cache as it is: off for a command's own process
