"""jaxloop.determinism: the run asks XLA for deterministic GPU kernels, once, before jax starts a backend,
and leaves a user's own XLA_FLAGS choice alone."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import jax
import pytest

from jaxloop.determinism import request_deterministic_ops


def test_before_jax_starts_the_flag_is_added_and_the_cpu_backend_accepts_it():
    # a fresh process: XLA reads XLA_FLAGS when the first backend starts (an unknown flag would abort it)
    code = ("import os, jax; from jaxloop.determinism import request_deterministic_ops as r; "
            "print(r(), os.environ['XLA_FLAGS'], float(jax.numpy.ones(2).sum()))")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "--xla_cpu_enable_fast_math=false", "--xla_gpu_deterministic_ops=true", "2.0"]


def test_a_users_own_setting_stands(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=false")
    assert request_deterministic_ops() is False
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_deterministic_ops=false"


def test_after_jax_started_nothing_is_claimed_and_a_cpu_run_is_not_warned(monkeypatch: pytest.MonkeyPatch):
    jax.devices()  # this process's backend is started
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # CPU: nothing to warn about (the CPU backend is deterministic)
        assert request_deterministic_ops() is False
    assert "XLA_FLAGS" not in os.environ
