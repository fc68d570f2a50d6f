"""jaxloop.runtime.determinism: the run asks XLA for deterministic GPU kernels, once, before jax starts a backend,
and leaves a user's own XLA_FLAGS choice alone."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import jax
import pytest

from jaxloop.runtime.determinism import names_flag, request_deterministic_ops


def test_before_jax_starts_the_flag_is_added_and_the_cpu_backend_accepts_it():
    # a fresh process: XLA reads XLA_FLAGS when the first backend starts (an unknown flag would abort it);
    # a user's other flags are kept, ours is appended
    code = (
        "import os, jax; from jaxloop.runtime.determinism import request_deterministic_ops as r; "
        "print(r(), os.environ['XLA_FLAGS'], float(jax.numpy.ones(2).sum()))"
    )
    other = "--xla_gpu_exclude_nondeterministic_ops=true"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"XLA_FLAGS": other}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", other, "--xla_gpu_deterministic_ops=true", "2.0"]


def test_asking_whether_jax_started_a_backend_starts_none_and_changes_no_setting():
    # a fresh process: False before jax's first use (and the probed setting as it was), True after; jax's
    # own rule answers (jax_num_cpu_devices may change only before a backend starts). Mutant seen failing:
    # the probe's put-back removed (jax_num_cpu_devices left at 1)
    code = (
        "import jax; from jaxloop.runtime.determinism import backend_started as b; "
        "before = jax.config.jax_num_cpu_devices; first = b(); "
        "print(first, b(), jax.config.jax_num_cpu_devices == before); jax.devices(); print(b())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False", "True", "True"]


@pytest.mark.parametrize(
    "flags, named",
    [
        ("--xla_gpu_deterministic_ops=false", True),
        ("--xla_cpu_enable_fast_math=false   --xla_gpu_deterministic_ops", True),
        ("--xla_gpu_exclude_nondeterministic_ops=true", False),  # another flag
        ("--xla_dump_to=/tmp/--xla_gpu_deterministic_ops=true", False),  # a value that holds the name
    ],
)
def test_the_flag_is_recognised_by_its_whole_name(flags: str, named: bool):
    assert names_flag(flags) is named


@pytest.mark.parametrize(
    "flags", ["--xla_gpu_deterministic_ops=false", "--xla_cpu_enable_fast_math=false --xla_gpu_deterministic_ops"]
)
def test_a_users_own_setting_stands(monkeypatch: pytest.MonkeyPatch, flags: str):
    # as if jax had not started: only the user's own flag can then stop the request
    monkeypatch.setattr("jaxloop.runtime.determinism.backend_started", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", flags)
    assert request_deterministic_ops() is False
    assert os.environ["XLA_FLAGS"] == flags


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="on a GPU this warns, by design")
def test_after_jax_started_nothing_is_claimed_and_a_cpu_run_is_not_warned(monkeypatch: pytest.MonkeyPatch):
    jax.devices()  # this process's backend is started
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # CPU: nothing to warn about (the CPU backend is deterministic)
        assert request_deterministic_ops() is False
    assert "XLA_FLAGS" not in os.environ
