"""The port check's report: a table row per check (measured, tolerance, why, pass/fail), as text, markdown
and plots; `assert_ok()` as a one-line test that names what failed and where the port first diverges.
"""

from __future__ import annotations

import flax.linen as nn
import numpy as np
import pytest
import torch

from jaxloop.parity import compare

pytestmark = pytest.mark.torch


class Port(nn.Module):
    eps: float = 1e-5

    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.LayerNorm(epsilon=self.eps)(nn.Dense(8)(x)))


def _check(eps, **kw):
    torch.manual_seed(0)
    tm = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))
    b = {"x": np.random.default_rng(0).normal(size=(6, 3)).astype(np.float32)}
    return compare(tm, Port(eps=eps), b, precisions=("fp64",), **kw)


def test_markdown_and_plots(tmp_path):
    report = _check(1e-5, trajectory=2, checks=("forward",))
    md = report.write_markdown(tmp_path / "port.md").read_text()
    assert "| check | precision | measured | tolerance | ok | worst at | why this tolerance |" in md
    assert "| forward (eval): model output | fp64 |" in md and "## Weight mapping" in md
    pngs = report.plot(tmp_path / "plots")
    assert [p.name for p in pngs] == ["layers.png", "trajectory.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    report.assert_ok()


def test_assert_ok_names_the_failed_checks_and_the_first_divergence():
    report = _check(1e-6, checks=("forward",))  # Flax's default eps where torch's is 1e-5
    with pytest.raises(AssertionError) as e:
        report.assert_ok()
    msg = str(e.value)
    assert "forward (eval): model output (fp64)" in msg
    assert "first divergence: torch 1 (LayerNorm) / Flax LayerNorm_0 (LayerNorm)" in msg
    assert "LayerNorm eps: torch 1e-05, Flax epsilon=1e-06" in msg
