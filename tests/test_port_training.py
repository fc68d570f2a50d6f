"""Training, not only inference: the gradient, update and trajectory checks each catch what the checks
before them cannot see (a port that differs only in its backward pass, an optimizer that differs, a port
that agrees on the example batch only), and name the tensor.

The small MLP port agrees with torch in every check (the first test); each later test changes one thing
and shows which rows fail.
"""

from __future__ import annotations

from dataclasses import replace

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
    return compare(
        torch_mlp(),
        module or Mlp(),
        batch(0),
        torch_loss,
        loss,
        overrides={"kernel": "2.weight", "bias": "2.bias"},
        **kw,
    )


def test_the_mlp_port_passes_every_check():
    report = run(trajectory=5, batches=lambda u: batch(u, 8))
    report.assert_ok()
    assert report.mapping.entries[-1].layout == "transpose"  # the override's layout follows Linear's convention


def test_a_port_that_differs_only_in_its_backward_pass_fails_the_gradient_check():
    report = run(Mlp(stop_bias_gradient=True), precisions=("fp64",), checks=("forward", "gradients"))
    assert failed(report) == {"gradients, every tensor", "gradients, whole tree"}
    (row,) = [r for r in report.failures() if r.check == "gradients, every tensor"]
    assert row.where == "params/bias" and row.measured == 1.0  # the whole gradient missing: relative difference 1


def update_failures(monkeypatch, **changes):
    """The update rows that fail when jaxloop's side trains with `changes` to each config (torch's unchanged)."""
    from dataclasses import replace

    def changed(o):  # the optimizer or schedule that holds a field takes it; one that does not is unchanged
        parts = {"optimizer": o.optimizer, "lr_schedule": o.lr_schedule}
        return replace(
            o, **{k: replace(p, **{f: v for f, v in changes.items() if f in p.field_names()}) for k, p in parts.items()}
        )

    original = training.jax_optimizer
    monkeypatch.setattr(training, "jax_optimizer", lambda o, steps, p: original(changed(o), steps, p))
    report = run(precisions=("fp64",))
    assert failed(report) == {"update x3"}
    return {without_clip(r.check.removeprefix("update x3: ")) for r in report.failures()}


def without_clip(label):
    """A config's label without its clip norm (half the gradient's norm: the report's, not 1.0's)."""
    return label.split(", clip ")[0]


def configs_where(keep):
    return {without_clip(label) for label, o, _ in training.update_configs(1.0) if keep(o)}


def test_an_optimizer_that_differs_fails_the_update_check_of_each_config_it_enters(monkeypatch):
    # b2 0.99 on jaxloop's side: every Adam config differs (each has another b2); lion's b2 is already 0.99
    assert update_failures(monkeypatch, b2=0.99) == configs_where(lambda o: o.name in ("adamw", "adam"))


def test_a_schedule_that_differs_fails_the_update_check_of_each_schedule_it_enters(monkeypatch):
    # gamma is read by the step, multistep and exponential schedules only
    assert update_failures(monkeypatch, gamma=0.6) == configs_where(
        lambda o: o.schedule in ("step", "multistep", "exponential")
    )


def test_momentum_that_differs_fails_the_sgd_and_rmsprop_configs(monkeypatch):
    # momentum 0.5 instead of each config's own (0 where unset: the plain sgd, rmsprop and Adam ones)
    assert update_failures(monkeypatch, momentum=0.5) == configs_where(lambda o: o.name in ("sgd", "rmsprop"))


def test_the_update_check_covers_every_optimizer_and_every_schedule_but_plateau():
    from jaxloop.config.run import OPTIMIZERS, SCHEDULES, Config, validate

    configs = training.update_configs(1.0)
    assert {o.name for _, o, _ in configs} == set(OPTIMIZERS)
    assert {o.schedule for _, o, _ in configs} == set(SCHEDULES) - {"plateau"}
    for _label, o, steps in configs:  # each a config a jaxloop run accepts
        validate(Config(optim=o, steps=steps), check_paths=False)


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
        # zero-initialised: the check loads torch's weights into every parameter, and NNX's eager default
        # init (a truncated normal per kernel shape) compiled two programs for values never read
        zeros = {"kernel_init": nnx.initializers.zeros_init(), "bias_init": nnx.initializers.zeros_init()}
        self.a, self.b = nnx.Linear(5, 8, rngs=nnx.Rngs(0), **zeros), nnx.Linear(8, 3, rngs=nnx.Rngs(1), **zeros)
        self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(2))

    def __call__(self, x):
        return self.b(self.drop(jnp.tanh(self.a(x))))


@pytest.mark.parametrize("port", [LinenDropout, NnxDropout])
def test_dropout_is_off_in_train_mode_on_both_sides(port):
    torch.manual_seed(0)
    tm = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Dropout(0.5), torch.nn.Linear(8, 3))
    linen = port is LinenDropout
    loss = (lambda m, b, train: flax_loss(lambda x: m(x, train=train), b, train)) if linen else flax_loss
    report = compare(
        tm, port(), batch(0), torch_loss, loss, precisions=("fp64",), checks=("forward", "gradients"), trajectory=2
    )
    report.assert_ok()  # masks would differ: with dropout on, train-mode outputs and gradients could not agree


# ----------------------------------------------------------------------------- the float32 trajectory's bound
# A correct port whose float32 training is chaotic: the loss 2 + sin(300 y) turns a 1-ulp difference in y into a
# different gradient sign within a few updates, so each framework's float32 run departs from its own float64 run
# by 3e-2 to 9e-2 within 30 updates (measured), while float64 still agrees across frameworks to 1e-11. Before,
# a fixed 2.5e-3 cap on that own gap failed this port (as it failed examples/ports/resnet.py at 100 updates).


class SineNet(nn.Module):
    bf16_hidden: bool = False

    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(16)(x))
        if self.bf16_hidden and h.dtype == jnp.float32:  # a half-precision path taken for float32 inputs only
            h = h.astype(jnp.bfloat16).astype(h.dtype)
        return nn.Dense(1)(h)


def _sine_port(freq, flax_module):
    torch.manual_seed(0)
    torch_net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def sine_batch(u):
        return {"x": np.random.default_rng(u).normal(size=(16, 8)).astype(np.float32)}

    return compare(
        torch_net,
        flax_module,
        sine_batch(0),
        lambda m, b: (2 + torch.sin(freq * m(b["x"]))).mean(),
        lambda m, b, train: (jnp.mean(2 + jnp.sin(freq * m(b["x"]))), {}),
        checks=("forward",),
        trajectory=30,
        batches=sine_batch,
    )


def _row(report, name):
    return next(r for r in report.rows if r.precision == "fp32" and r.check.endswith(name))


def test_a_correct_port_with_chaotic_float32_training_passes_the_trajectory():
    # mutant (the former check: a row failing when either framework's own float32-vs-float64 gap exceeds 2.5e-3):
    # this port fails on it
    report = _sine_port(300.0, SineNet())
    own = _row(report, "Flax's own float32-vs-float64 gap")
    assert own.measured > 2.5e-3, "the float32 chaos this test is about was not provoked"
    assert report.ok, report.table()


def test_a_flax_side_whose_float32_run_departs_alone_fails_the_own_gap_row():
    # mutant (the own-gap row's tolerance unbounded): it passes, and so do the float32 trajectory rows, their
    # bound measured from this very gap. torch's own gap is float32 rounding (6e-7 measured); the Flax side's,
    # a bf16 rounding of the hidden layer compounded over 30 updates of 2 + sin(30 y), 1.4e-2
    report = _sine_port(30.0, SineNet(bf16_hidden=True))
    assert not _row(report, "Flax's own float32-vs-float64 gap").passed, report.table()


def test_the_update_check_runs_each_element_as_its_own_leaf_would():
    # training.Groups joins the leaves per (weight decay, dtype) so that the 13 update programs compile
    # faster; every optimizer jaxloop offers is elementwise, so without clipping (its global norm sums the
    # squares in another order) each element's 3 updates are the bits the per-leaf tree gets, weight decay
    # on the kernels only included. Mutant seen failing: a decayed group stored as a vector (decay_mask
    # then skips it: Groups refuses at once).
    params = Mlp().init(jax.random.PRNGKey(0), np.zeros((1, 5), np.float32))
    groups = training.Groups(params)
    assert sorted(groups.members) == ["decay_float32", "no_decay_float32"]
    rng = np.random.default_rng(0)
    grads = [jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params) for _ in range(3)]
    for label, o, steps in training.update_configs(1.0):
        tx = training.jax_optimizer(replace(o, clip_norm=0.0), steps, "fp32")
        trees, grouped = params, groups.pack(params)
        tree_state, grouped_state = tx.init(trees), tx.init(grouped)
        for g in grads:
            u, tree_state = jax.jit(tx.update)(g, tree_state, trees)
            trees = training.apply_updates(trees, u)
            u, grouped_state = jax.jit(tx.update)(groups.pack(g), grouped_state, grouped)
            grouped = training.apply_updates(grouped, u)
        for a, b in zip(jax.tree.leaves(trees), jax.tree.leaves(groups.unpack(grouped))):
            np.testing.assert_array_equal(np.asarray(a), b, err_msg=label)
