"""Where a port first diverges: every module's first call seen on both sides (torch hooks, Linen's method
interceptor, NNX's wrapped __call__), activations compared in torch's layout, and the first diverging
pair named as "this layer" (its input agrees) or "the code before it" (its input already differs).

Mutants seen failing: `first_divergence` taking the last diverging pair instead of the first (the
localisation test); `align` without the channels-last move (the NHWC test); the NNX wrappers left on
the classes after a capture (the restore test).
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxloop.parity import ModelError
from jaxloop.parity.flaxside import flax_model
from jaxloop.parity.layers import LayerDiff, align, capture_flax, capture_torch, first_divergence
from jaxloop.parity.precision import pinned

pytestmark = pytest.mark.torch


def _diff(torch_name, start, end, out, inp):
    return LayerDiff(torch_name, torch_name.replace(".", "/"), "T", "F", end, start, out, inp)


def test_first_divergence_with_a_clean_input_is_this_layer():
    diffs = [
        _diff("a.x", 1, 0, 1e-16, 0.0),
        _diff("a.y", 2, 1, 1e-3, 1e-16),
        _diff("a.z", 3, 2, 1e-2, 1e-3),
        _diff("a", 0, 3, 1e-2, 0.0),
    ]
    div = first_divergence(diffs, 1e-10)
    assert div.layer.torch == "a.y" and div.clean_input


def test_first_divergence_with_a_dirty_input_is_the_code_since_the_last_clean_output():
    # a.b.fc1 agrees, a.b.fc2's input does not: the code between them, inside a.b
    diffs = [
        _diff("a.b.fc1", 2, 0, 1e-16, 0.0),
        _diff("a.b.fc2", 3, 1, 1e-4, 1e-4),
        _diff("a.b", 1, 2, 1e-4, 0.0),
        _diff("a", 0, 3, 1e-4, 0.0),
    ]
    div = first_divergence(diffs, 1e-10)
    assert (div.layer.torch, div.clean_input, div.previous.torch, div.region) == ("a.b.fc2", False, "a.b.fc1", "a.b")
    assert "the code between them, inside a.b" in div.describe()


def test_no_divergence_within_tolerance_and_nan_diverges():
    assert first_divergence([_diff("a", 0, 0, 1e-11, 0.0)], 1e-10) is None
    assert first_divergence([_diff("a", 0, 0, float("nan"), 0.0)], 1e-10).layer.torch == "a"


def test_channels_last_activations_are_compared_in_torchs_layout():
    t = np.random.default_rng(0).normal(size=(2, 3, 4, 5))
    got = align(t, np.moveaxis(t, 1, -1))
    assert got is not None and np.array_equal(got[1], t)
    square = np.random.default_rng(0).normal(size=(2, 4, 4, 4))  # C = H = W: the closer reading is taken
    assert np.array_equal(align(square, np.moveaxis(square, 1, -1))[1], square)
    assert align(t, t.reshape(2, 60)) is None


class Block(nnx.Module):
    def __init__(self):
        self.fc = nnx.Linear(3, 3, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return jnp.tanh(self.fc(x))


class Net(nnx.Module):
    def __init__(self):
        self.blocks = nnx.List([Block(), Block()])

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _loss(m, b, train):
    return jnp.mean(m(b["x"]) ** 2), {}


def test_nnx_calls_are_seen_by_path_and_the_classes_restored():
    before = (Net.__dict__.get("__call__"), Block.__dict__.get("__call__"), nnx.Linear.__dict__.get("__call__"))
    batch = {"x": np.ones((2, 3), np.float32)}
    with pinned("fp32"):
        fm = flax_model(Net(), _loss, batch)
        cap = capture_flax(fm, _loss, batch, False, "fp32")
    assert [n for n, _ in sorted(cap.calls.items(), key=lambda kv: kv[1].start)] == [
        "",
        "blocks/0",
        "blocks/0/fc",
        "blocks/1",
        "blocks/1/fc",
    ]
    assert cap.calls["blocks/1/fc"].input.shape == (2, 3) and cap.calls[""].output.shape == (2, 3)
    assert (Net.__dict__.get("__call__"), Block.__dict__.get("__call__"), nnx.Linear.__dict__.get("__call__")) == before


class Inner(torch.nn.Module):
    def forward(self, x):
        raise ValueError("inner refuses")


def test_the_module_that_raised_is_the_innermost_one_running():
    tm = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Sequential(Inner()))
    refused = r"torch model rejects the batch: module '1\.0' \(Inner\) raised ValueError: inner refuses"
    with pinned("fp32"), pytest.raises(ModelError, match=refused):
        capture_torch(tm, lambda m, b: m(b["x"]).sum(), {"x": np.ones((2, 3), np.float32)}, False, "fp32")

    class Bad(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3, name="proj")(x.reshape(7, -1))

    refused = r"Flax model rejects the batch: the root module \(Bad\) raised TypeError"
    with pinned("fp32"), pytest.raises(ModelError, match=refused):
        flax_model(Bad(), lambda m, b, train: (m(b["x"]).sum(), {}), {"x": np.ones((2, 3), np.float32)})


class BiaslessDense(nn.Module):
    """Declares a bias and never adds it."""

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.zeros, (x.shape[-1], 3))
        self.param("bias", nn.initializers.zeros, (3,))
        return x @ kernel


class Lossy(nn.Module):
    """A port whose second layer leaves its bias out, or computes in bf16."""

    fault: str

    @nn.compact
    def __call__(self, x):
        x = jnp.tanh(nn.Dense(6)(x))
        return nn.Dense(3, dtype=jnp.bfloat16)(x) if self.fault == "bf16" else BiaslessDense()(x)


@pytest.mark.parametrize(
    "fault, diagnosis",
    [("bias", "the Flax layer does not add its bias"), ("bf16", "the Flax layer computes in bfloat16")],
)
def test_a_bias_left_out_and_a_bf16_layer_are_diagnosed_at_the_layer(fault, diagnosis):
    from jaxloop.parity import compare

    torch.manual_seed(0)
    tm = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    b = {"x": np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)}
    report = compare(tm, Lossy(fault), b, precisions=("fp64",), checks=("forward",))
    div = report.divergences["fp64 eval"]
    assert div.clean_input and div.layer.torch == "2"
    assert diagnosis in " ".join(div.diagnoses)
