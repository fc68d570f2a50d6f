"""Training, not only inference: the gradient, update and trajectory checks each catch what the checks
before them cannot see (a port that differs only in its backward pass, an optimizer that differs, a port
that agrees on the example batch only), and name the tensor.

The small MLP port agrees with torch in every check (the first test); each later test changes one thing
and shows which rows fail.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxloop.parity import compare, training

pytestmark = pytest.mark.torch


def torch_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


class Mlp(nn.Module):
    stop_bias_gradient: bool = False

    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(8)(x))
        kernel = self.param("kernel", nn.initializers.zeros, (8, 3))
        bias = self.param("bias", nn.initializers.zeros, (3,))
        if self.stop_bias_gradient:  # the same forward pass; no gradient reaches the bias
            bias = jax.lax.stop_gradient(bias)
        return h @ kernel + bias


def torch_loss(m, b):
    return ((m(b["x"]) - b["y"]) ** 2).mean()


def flax_loss(m, b, train):
    return jnp.mean((m(b["x"]) - b["y"]) ** 2), {}


def first_rows_only(m, b, train):
    """A port that averages over the first 4 records only: the same as torch's on a 4-record batch."""
    return jnp.mean((m(b["x"][:4]) - b["y"][:4]) ** 2), {}


def batch(i, n=4):
    rng = np.random.default_rng(i)
    return {"x": rng.normal(size=(n, 5)).astype(np.float32), "y": rng.normal(size=(n, 3)).astype(np.float32)}


def failed(report):
    return {r.check.split(":")[0] for r in report.failures()}


def run(module=None, loss=flax_loss, **kw):
    return compare(torch_mlp(), module or Mlp(), batch(0), torch_loss, loss, overrides={"kernel": "2.weight", "bias": "2.bias"},
                   **kw)


def test_the_mlp_port_passes_every_check():
    report = run(trajectory=5, batches=lambda u: batch(u, 8))
    report.assert_ok()
    assert report.mapping.entries[-1].layout == "transpose"  # the override's layout follows Linear's convention


def test_a_port_that_differs_only_in_its_backward_pass_fails_the_gradient_check():
    report = run(Mlp(stop_bias_gradient=True), precisions=("fp64",), checks=("forward", "gradients"))
    assert failed(report) == {"gradients, every tensor"}
    (row,) = report.failures()
    assert row.where == "params/bias" and row.measured == 1.0  # the whole gradient missing: relative difference 1


def test_an_optimizer_that_differs_fails_the_update_check(monkeypatch):
    from dataclasses import replace

    original = training.jax_optimizer
    monkeypatch.setattr(training, "jax_optimizer", lambda o, steps, p: original(replace(o, b2=0.99), steps, p))
    report = run(precisions=("fp64",))
    assert failed(report) == {"update x3"}
    assert len(report.failures()) == len(training.update_configs(1.0))


def test_a_port_that_agrees_on_the_example_batch_only_fails_the_trajectory():
    report = run(loss=first_rows_only, precisions=("fp64",), trajectory=3, batches=lambda u: batch(u, 8))
    assert failed(report) == {"trajectory (3 updates)"}


class LinenDropout(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        h = nn.Dropout(0.5, deterministic=not train)(jnp.tanh(nn.Dense(8)(x)))
        return nn.Dense(3)(h)


class NnxDropout(nnx.Module):
    def __init__(self):
        self.a, self.b = nnx.Linear(5, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 3, rngs=nnx.Rngs(1))
        self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(2))

    def __call__(self, x):
        return self.b(self.drop(jnp.tanh(self.a(x))))


@pytest.mark.parametrize("port", [LinenDropout, NnxDropout])
def test_dropout_is_off_in_train_mode_on_both_sides(port):
    torch.manual_seed(0)
    tm = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Dropout(0.5), torch.nn.Linear(8, 3))
    linen = port is LinenDropout
    loss = (lambda m, b, train: flax_loss(lambda x: m(x, train=train), b, train)) if linen else flax_loss
    report = compare(tm, port(), batch(0), torch_loss, loss, precisions=("fp64",), checks=("forward", "gradients"),
                     trajectory=2)
    report.assert_ok()  # masks would differ: with dropout on, train-mode outputs and gradients could not agree
