"""Planted port bugs: each is a variant of a shipped example port (a setting changed on the Flax side only,
or a small subclass below), and the port check must catch it, name the layer where it first shows and
say which convention explains it. Float64 forward pass (and train-mode buffers): a convention moves a
layer by 1e-6 or more, float64 rounding by 1e-16.

These tests are the mutants of the examples' passing checks (tests/test_port_examples.py): with the
setting restored, the same ports pass every check.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import flax.linen as nn
import pytest

from jaxloop.parity import MappingError, check

pytestmark = pytest.mark.torch
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "ports"))

import gpt2  # noqa: E402
import resnet  # noqa: E402
import transformer_encoder  # noqa: E402


def forward_check(port):
    return check(port, precisions=("fp64",), checks=("forward",))


def first(report, mode="eval"):
    div = report.divergences[f"fp64 {mode}"]
    return div, " ".join(div.diagnoses)


def test_layer_norm_eps_is_localised_to_the_first_layer_norm():
    report = forward_check(gpt2.make(layer_norm_epsilon=1e-6))  # Flax's default eps; GPT-2's is 1e-5
    div, diagnosis = first(report)
    assert (div.layer.torch, div.layer.flax, div.clean_input) == ("transformer.h.0.ln_1", "h_0/ln_1", True)
    assert "LayerNorm eps: torch 1e-05, Flax epsilon=1e-06" in diagnosis


def test_gelu_tanh_for_erf_is_localised_between_the_mlp_projections():
    report = forward_check(transformer_encoder.make(approximate_gelu=True))  # nn.gelu's default; torch's "gelu" is erf
    div, diagnosis = first(report)
    assert (div.previous.torch, div.layer.torch, div.clean_input) == ("layers.0.linear1", "layers.0.linear2", False)
    assert (div.previous.flax, div.layer.flax, div.region) == ("blocks/0/mlp_in", "blocks/0/mlp_out", "layers.0")
    assert "torch applies GELU, exact (erf), Flax GELU, tanh approximation" in diagnosis


def test_batch_norm_momentum_in_torchs_convention_is_found_in_the_running_statistics():
    report = forward_check(resnet.make(bn_momentum=0.1))  # torch's 0.1 written as Flax's momentum
    assert report.divergences == {}  # the forward pass uses batch statistics: only the buffers differ
    (row,) = [r for r in report.rows if r.check.startswith("buffers")]
    assert not row.passed and row.where.startswith("batch_stats/") and row.where.endswith("/normalization/mean")
    (note,) = [n for n in report.notes if "buffers of torch" in n]
    assert "resnet.embedder.embedder.normalization" in note and "pass momentum=0.9 to the Flax BatchNorm" in note


@pytest.mark.parametrize("precision", ["fp64", "fp32"])
def test_flax_batch_norms_biased_running_variance_is_diagnosed(precision):
    # flax.linen.BatchNorm: biased batch variance; in float32 too, where n/(n-1) (n = 512) moves the running
    # variance by 2e-4 of a tenth, within float32's CLOSE: the closer of the two recomputed updates decides
    report = check(resnet.make(batch_norm="flax"), precisions=(precision,), checks=("forward",))
    (row,) = [r for r in report.rows if r.check.startswith("buffers")]
    assert not row.passed and row.where.endswith("/var")
    (note,) = [n for n in report.notes if "buffers of torch" in n]
    assert "torch updates it with the unbiased batch variance, Flax with the biased one" in note


def test_same_padding_of_a_strided_conv_is_localised_to_the_stem_conv():
    report = forward_check(resnet.make(conv_padding="SAME"))
    div, diagnosis = first(report)
    assert (div.layer.torch, div.clean_input) == ("resnet.embedder.embedder.convolution", True)
    assert "torch pads [(3, 3), (3, 3)]" in diagnosis and "Flax padding='SAME' pads [(2, 3), (2, 3)]" in diagnosis


class TransposedDense(nn.Dense):
    """A projection that applies its kernel transposed (x @ kernel.T), as a port that transposes Conv1D's
    (in, out) weight like a Linear's would."""

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.zeros, (x.shape[-1], self.features))
        return x @ kernel.T + self.param("bias", nn.initializers.zeros, (self.features,))


class TransposedAttention(gpt2.Attention):
    proj = TransposedDense


class TransposedBlock(gpt2.Block):
    attention = TransposedAttention


class TransposedGPT2(gpt2.GPT2LMHead):
    block = TransposedBlock


def test_a_transposed_kernel_is_localised_to_the_attention_output_projection():
    port = gpt2.make()
    port.flax_module = TransposedGPT2(port.flax_module.s)
    div, diagnosis = first(forward_check(port))
    assert (div.layer.torch, div.layer.flax, div.clean_input) == (
        "transformer.h.0.attn.c_proj",
        "h_0/attn/c_proj",
        True,
    )
    assert "applies its kernel transposed (x @ kernel.T)" in diagnosis


def test_a_dropped_bias_is_a_mapping_error_naming_the_layer():
    with pytest.raises(MappingError) as e:
        forward_check(gpt2.make(use_bias=False))
    msg = str(e.value)
    assert (
        "torch transformer.h.0.attn.c_proj.bias (32,) (Conv1D) has no Flax counterpart; the Flax module "
        "h_0/attn/c_proj it maps to has {'kernel': (32, 32)}, no bias (built with use_bias=False?"
    ) in msg


def test_unscaled_attention_is_localised_between_the_fused_and_output_projections():
    report = forward_check(gpt2.make(scale_attn_weights=False))
    div, diagnosis = first(report)
    assert (div.previous.torch, div.layer.torch, div.region) == (
        "transformer.h.0.attn.c_attn",
        "transformer.h.0.attn.c_proj",
        "transformer.h.0.attn",
    )
    assert "attention: scores scaled by 1/sqrt(head_dim=8) in torch, by 1 (unscaled) in Flax" in diagnosis


def test_attention_scaled_by_the_width_is_localised_to_torchs_multihead_attention():
    report = forward_check(transformer_encoder.make(attention_scale=transformer_encoder.WIDTH**-0.5))
    div, diagnosis = first(report)
    assert (div.layer.torch, div.layer.flax, div.clean_input) == ("layers.0.self_attn", "blocks/0/attn", True)
    assert "scores scaled by 1/sqrt(head_dim=8) in torch, by 1/sqrt(width=32) in Flax" in diagnosis
