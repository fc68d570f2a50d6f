"""The port check where a true value is zero, where dropout hides in functions, and where a convention
runs inside a module together with a layer: small ports written here, each with the torch original.

- An attention with a separate key bias: the key bias's gradient is zero in exact arithmetic (softmax
  ignores a constant added to every score of a query), so its rounding is all there is of it; measured
  against the whole tree's scale it passes, and a planted gradient bug in it still fails.
- Dropout as functions: torch's F.dropout and scaled_dot_product_attention's dropout_p, Flax's
  dot_product_attention_weights(dropout_rate=...): off on both sides during the check.
- An activation inside a module with a layer (Hugging Face's `intermediate`: dense, then the
  activation); a BatchNorm normalising with the other statistics than torch's in train or eval mode.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxloop.parity import compare
from jaxloop.parity.measures import scaled_diffs, whole_rel_diff

pytestmark = pytest.mark.torch
HEADS, WIDTH = 2, 8


# ----------------------------------------------------------------------------- the measure


def test_a_zero_tensor_is_measured_against_its_share_of_the_trees_norm():
    rng = np.random.default_rng(0)
    b = {"w": rng.normal(size=(16, 16)), "key_bias": np.full(16, 1e-20)}  # the tree's norm ~16; the tensor ~0
    rounding = {"w": b["w"] * (1 + 1e-16), "key_bias": np.full(16, 3e-17)}  # rounding-sized noise on a zero value
    assert scaled_diffs(rounding, b)["key_bias"] < 1e-15  # relative to its own norm it would be 3e3
    planted = {"w": b["w"], "key_bias": np.full(16, 1e-3)}  # a real difference there
    assert scaled_diffs(planted, b)["key_bias"] > 1e-4
    assert whole_rel_diff(planted, b) == pytest.approx(math.sqrt(16 * 1e-6) / math.sqrt(np.sum(b["w"] ** 2)), rel=1e-6)


# ----------------------------------------------------------------------------- a key bias's zero gradient


class TorchAttention(torch.nn.Module):
    """Self-attention with separate q, k, v projections (a key bias, as BERT's and ViT's), F.dropout on the
    weights and SDPA's dropout_p on a second path: both with a plain probability, no Dropout module."""

    def __init__(self, p: float = 0.5):
        super().__init__()
        self.query, self.key, self.value = (torch.nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.out = torch.nn.Linear(WIDTH, WIDTH)
        self.p = p

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, HEADS, -1).transpose(1, 2) for m in (self.query, self.key, self.value))
        w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(WIDTH // HEADS), dim=-1)
        w = torch.nn.functional.dropout(w, p=self.p, training=self.training)
        y = (w @ v) + torch.nn.functional.scaled_dot_product_attention(
            q, k, v, dropout_p=self.p if self.training else 0.0
        )
        return self.out(y.transpose(1, 2).reshape(b, t, WIDTH))


@jax.custom_vjp
def leaky(b):  # an identity whose backward pass adds 1e-2: a gradient bug no forward pass shows
    return b


leaky.defvjp(lambda b: (b, None), lambda _, g: (g + 1e-2,))


class KeyDense(nn.Module):
    """The key projection; `leak` passes its bias through `leaky`."""

    leak: bool = False

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.zeros, (x.shape[-1], WIDTH))
        bias = self.param("bias", nn.initializers.zeros, (WIDTH,))
        return x @ kernel + (leaky(bias) if self.leak else bias)


class FlaxAttention(nn.Module):
    """The port: the same attention with Flax's functional attention dropout (dot_product_attention_weights
    draws its own mask from dropout_rate), twice, as torch's two paths; `leak` plants the gradient bug."""

    p: float = 0.5
    leak: bool = False

    @nn.compact
    def __call__(self, x, train: bool = False):
        b, t, _ = x.shape
        k = KeyDense(self.leak, name="key")(x)
        q, v = nn.Dense(WIDTH, name="query")(x), nn.Dense(WIDTH, name="value")(x)
        q, k, v = (a.reshape(b, t, HEADS, -1) for a in (q, k, v))
        y = 0.0
        for _ in range(2):
            w = nn.dot_product_attention_weights(
                q,
                k,
                dropout_rng=self.make_rng("dropout") if train else None,
                dropout_rate=self.p,
                deterministic=not train,
            )
            y = y + jnp.einsum("bhqk,bkhd->bqhd", w, v)
        return nn.Dense(WIDTH, name="out")(y.reshape(b, t, WIDTH))


def _attention(leak=False, precisions=("fp64", "fp32")):
    torch.manual_seed(0)
    tm = TorchAttention()
    with torch.no_grad():
        for p in tm.parameters():
            if p.dim() == 1:
                p.add_(0.5 * torch.randn_like(p))
    batch = {"x": np.random.default_rng(0).normal(size=(3, 5, WIDTH)).astype(np.float32)}
    return compare(
        tm,
        FlaxAttention(leak=leak),
        batch,
        lambda m, b: (m(b["x"]) ** 2).mean(),
        lambda m, b, train: (jnp.mean(m(b["x"], train=train) ** 2), {}),
        precisions=precisions,
        checks=("forward", "gradients"),
    )


def test_a_key_biases_zero_gradient_passes_in_both_precisions_with_dropout_off_in_functions():
    report = _attention()
    report.assert_ok()  # train mode too: F.dropout, SDPA's dropout_p and Flax's functional dropout are off
    rows = {(r.check, r.precision): r for r in report.rows}
    assert rows[("forward (train): model output", "fp64")].measured < 1e-13


def test_a_planted_gradient_bug_in_the_key_bias_still_fails_there():
    report = _attention(leak=True, precisions=("fp64",))
    failed = {r.check: r for r in report.failures()}
    assert set(failed) == {"gradients, every tensor", "gradients, whole tree"}  # the forward pass agrees
    assert failed["gradients, every tensor"].where == "params/key/bias"


# ----------------------------------------------------------------------------- inside containers


class TorchIntermediate(torch.nn.Module):
    """Hugging Face's `intermediate`: a dense layer, then the activation, in one module."""

    def __init__(self, act):
        super().__init__()
        self.dense = torch.nn.Linear(WIDTH, 16)
        self.act = act

    def forward(self, x):
        return self.act(self.dense(x))


class TorchBlock(torch.nn.Module):
    def __init__(self, act):
        super().__init__()
        self.intermediate = TorchIntermediate(act)
        self.output = torch.nn.Linear(16, WIDTH)

    def forward(self, x):
        return self.output(self.intermediate(x))


class FlaxIntermediate(nn.Module):
    act: str

    @nn.compact
    def __call__(self, x):
        return ACTS[self.act](nn.Dense(16, name="dense")(x))


class FlaxBlock(nn.Module):
    act: str

    @nn.compact
    def __call__(self, x):
        return nn.Dense(WIDTH, name="output")(FlaxIntermediate(self.act, name="intermediate")(x))


ACTS = {
    "gelu_erf": lambda x: nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: nn.gelu(x, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "relu": nn.relu,
    "silu": nn.silu,
}
TORCH_ACTS = {
    "gelu_erf": torch.nn.GELU(),
    "gelu_tanh": torch.nn.GELU(approximate="tanh"),
    "relu": torch.nn.ReLU(),
    "silu": torch.nn.SiLU(),
}
NAMES = {
    "gelu_erf": "GELU, exact (erf)",
    "gelu_tanh": "GELU, tanh approximation",
    "relu": "relu",
    "silu": "SiLU",
    "quick_gelu": "quick GELU (x sigmoid(1.702 x))",
}


@pytest.mark.parametrize("precision", ["fp64", "fp32"])
@pytest.mark.parametrize(
    "torch_act, flax_act",
    [
        ("gelu_erf", "gelu_tanh"),
        ("gelu_tanh", "gelu_erf"),
        ("gelu_erf", "quick_gelu"),
        ("relu", "silu"),
        ("silu", "gelu_erf"),
    ],
)
def test_an_activation_inside_a_module_with_a_layer_is_diagnosed(torch_act, flax_act, precision):
    torch.manual_seed(0)
    batch = {"x": (2 * np.random.default_rng(0).normal(size=(6, WIDTH))).astype(np.float32)}
    report = compare(
        TorchBlock(TORCH_ACTS[torch_act]), FlaxBlock(flax_act), batch, precisions=(precision,), checks=("forward",)
    )
    div = report.divergences[f"{precision} eval"]
    assert (div.layer.torch, div.clean_input) == ("intermediate", True)
    assert f"activation: torch applies {NAMES[torch_act]}, Flax {NAMES[flax_act]}" in " ".join(
        div.diagnoses
    ) and "(inside intermediate, after intermediate.dense)" in " ".join(div.diagnoses), div.describe()


class FlaxBatchNorm(nn.Module):
    """A port whose BatchNorm normalises with the running statistics always (`running`), or with the batch's
    always (updating the running ones while training)."""

    running: bool

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(4, (3, 3), padding=1, name="conv")(jnp.transpose(x, (0, 2, 3, 1)))
        return BatchNorm(self.running, name="bn")(x, train)


class BatchNorm(nn.Module):
    running: bool

    @nn.compact
    def __call__(self, x, train):
        c = x.shape[-1]
        scale, bias = self.param("scale", nn.initializers.ones, (c,)), self.param("bias", nn.initializers.zeros, (c,))
        ra_mean = self.variable("batch_stats", "mean", lambda: jnp.zeros((c,), x.dtype))
        ra_var = self.variable("batch_stats", "var", lambda: jnp.ones((c,), x.dtype))
        if self.running:
            mean, var = ra_mean.value, ra_var.value
        else:
            mean, var = x.mean((0, 1, 2)), x.var((0, 1, 2))
            if train and not self.is_initializing():
                n = x.size // c
                ra_mean.value = 0.9 * ra_mean.value + 0.1 * mean
                ra_var.value = 0.9 * ra_var.value + 0.1 * var * n / (n - 1)
        return (x - mean) / jnp.sqrt(var + 1e-5) * scale + bias


@pytest.mark.parametrize("precision", ["fp64", "fp32"])
@pytest.mark.parametrize(
    "running, mode, says",
    [
        (
            True,
            "train",
            "torch normalised with the batch's statistics (train mode), Flax with its running statistics "
            "(eval mode): the Flax BatchNorm got use_running_average=True while training",
        ),
        (
            False,
            "eval",
            "torch normalised with its running statistics (eval mode), Flax with the batch's statistics "
            "(train mode): the Flax BatchNorm got use_running_average=False in eval mode",
        ),
    ],
)
def test_a_batch_norm_using_the_other_statistics_is_diagnosed_at_the_layer(running, mode, says, precision):
    torch.manual_seed(0)
    tm = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4))
    with torch.no_grad():  # running statistics away from the batch's
        tm[1].running_mean.normal_()
        tm[1].running_var.uniform_(0.5, 2.0)
    batch = {"x": np.random.default_rng(0).normal(size=(4, 3, 6, 6)).astype(np.float32)}
    report = compare(
        tm,
        FlaxBatchNorm(running),
        batch,
        lambda m, b: (m(b["x"]) ** 2).mean(),
        lambda m, b, train: (jnp.mean(m(b["x"], train=train) ** 2), {}),
        precisions=(precision,),
        checks=("forward",),
    )
    div = report.divergences[f"{precision} {mode}"]
    assert (div.layer.torch, div.clean_input) == ("1", True)
    assert says in " ".join(div.diagnoses), div.describe()


# ----------------------------------------------------------------------------- a module computing below the check


class Typed(nn.Module):
    """A port with a `dtype` field passed to its layers, float32 by default (as Hugging Face's Flax modules)."""

    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        return nn.Dense(3, dtype=self.dtype, name="out")(jnp.tanh(nn.Dense(6, dtype=self.dtype, name="hidden")(x)))


def test_a_modules_float32_dtype_field_is_pinned_for_the_float64_check_with_a_note():
    torch.manual_seed(0)
    tm = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    batch = {"x": np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)}
    report = compare(tm, Typed(), batch, precisions=("fp64",), checks=("forward", "gradients"))
    report.assert_ok()  # float32 arithmetic would differ from torch's float64 by ~1e-8
    assert report.notes == [
        "[fp64] Typed computes in float32 (its dtype field (Hugging Face default)); pinned to "
        "dtype=float64 for the fp64 check: the check compares the port, not a precision choice"
    ]
