"""The GPT-2 small preset, the attention choice, and tokens/s and MFU (docs/language-models.md).

The real preset is built only abstractly (jax.eval_shape: shapes, no values); the runs use a GPT-2-small-shaped
config with tiny dimensions.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from dataclasses import replace

import jax
import numpy as np
import pytest

from jaxloop.config.cli import parse_config
from jaxloop.config.run import ConfigError, ModelConfig, padded_vocab, preset
from jaxloop.model.attention import choose, cudnn_unsupported
from jaxloop.model.builtin import init_params, make_model
from jaxloop.model.flops import Peak, flops_per_token, gpt_params, table_peak

GPT2_VOCAB = 50257


class FakeDevice:
    """What choose() reads of a device."""

    def __init__(self, platform: str, compute_capability: str | None = None):
        self.platform, self.compute_capability = platform, compute_capability


# ----------------------------------------------------------------------------- the preset


def test_gpt2_small_preset_is_gpt2_small_with_nanogpt_optimizer():
    cfg = preset("gpt2-small")
    m, o = cfg.model, cfg.optim
    assert (m.n_layers, m.n_heads, m.d_model, m.context) == (12, 12, 768, 1024)
    assert m.tie_embeddings and m.init == "gpt2" and m.attention == "auto" and cfg.precision == "auto"
    a = o.optimizer
    assert (o.name, o.peak_lr, a.b1, a.b2, a.weight_decay, o.clip_norm, o.schedule) == (
        "adamw",
        6e-4,
        0.9,
        0.95,
        0.1,
        1.0,
        "warmup_cosine",
    )
    assert padded_vocab(m, GPT2_VOCAB) == 50304  # 50257 rounded up to a multiple of 64


def test_gpt2_small_has_124m_parameters_with_padded_vocab_and_tied_embeddings():
    # 50304*768 (tokens, tied head) + 1024*768 (positions) + 12 * 7,087,872 (blocks) + 1536 (ln_f)
    m = preset("gpt2-small").model
    model = make_model(m, GPT2_VOCAB, "fp32")
    shapes = jax.eval_shape(
        lambda k: model.init(k, np.zeros((1, m.context), np.int32))["params"], jax.random.PRNGKey(0)
    )
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    assert total == 124_475_904
    assert gpt_params(m, GPT2_VOCAB)["total"] == total  # the count MFU uses is the model's own
    assert shapes["tok_embed"]["embedding"].shape == (50304, 768) and "head" not in shapes


def test_gpt2_init_scales_the_residual_projections_by_one_over_sqrt_2l():
    # 3 layers (a small init to compile), 4 heads: a scale by the wrong count (heads, layers without the 2) shows
    m = ModelConfig(kind="gpt", context=8, d_model=64, n_layers=3, n_heads=4, init="gpt2")
    params = init_params(make_model(m, 32, "fp32"), jax.random.PRNGKey(0), np.zeros((1, 8), np.int32))
    want = 0.02 / math.sqrt(2 * 3)
    block = params["block_1"]
    # 4096 and 16384 draws: the sample std is within 5% of the true one with overwhelming probability
    assert float(np.std(block["attn"]["proj"]["kernel"])) == pytest.approx(want, rel=0.05)
    assert float(np.std(block["mlp_proj"]["kernel"])) == pytest.approx(want, rel=0.05)
    assert float(np.std(block["attn"]["qkv"]["kernel"])) == pytest.approx(0.02, rel=0.05)  # others stay 0.02


def test_padded_vocab_gives_the_model_more_logits_than_the_data_has_tokens():
    m = ModelConfig(kind="gpt", context=8, d_model=16, n_layers=1, n_heads=2, vocab_multiple=64)
    model = make_model(m, 59, "fp32")
    x = np.zeros((2, 8), np.int32)
    logits = jax.jit(model.apply)({"params": init_params(model, jax.random.PRNGKey(0), x)}, x)
    assert logits.shape == (2, 8, 64)


# ----------------------------------------------------------------------------- attention choice


def test_auto_attention_is_cudnn_only_where_cudnn_runs():
    gpu, hopper = FakeDevice("gpu", "8.0"), FakeDevice("gpu", "9.0")
    assert choose("auto", jax.numpy.bfloat16, 64, 0.0, gpu).implementation == "cudnn"
    assert choose("auto", jax.numpy.float16, 64, 0.0, gpu).implementation == "cudnn"
    assert choose("auto", jax.numpy.float32, 64, 0.0, gpu).implementation == "xla"  # fp32 operands
    assert choose("auto", jax.numpy.bfloat16, 60, 0.0, gpu).implementation == "xla"  # not a multiple of 8
    assert choose("auto", jax.numpy.bfloat16, 192, 0.0, gpu).implementation == "xla"  # > 128 before Hopper
    assert choose("auto", jax.numpy.bfloat16, 192, 0.0, hopper).implementation == "cudnn"  # <= 256 on Hopper
    assert choose("auto", jax.numpy.bfloat16, 64, 0.1, gpu).implementation == "xla"  # attention dropout
    assert choose("auto", jax.numpy.bfloat16, 64, 0.0, FakeDevice("cpu")).implementation == "xla"
    assert choose("xla", jax.numpy.bfloat16, 64, 0.0, gpu).implementation == "xla"


def test_explicit_cudnn_where_it_cannot_run_is_a_config_error_saying_why():
    with pytest.raises(ConfigError, match=r"model.attention='cudnn'.*the device is cpu"):
        choose("cudnn", jax.numpy.bfloat16, 64, 0.0, FakeDevice("cpu"))
    assert "bfloat16 or float16" in cudnn_unsupported(np.float32, 64, 0.0, "gpu", "9.0")


# ----------------------------------------------------------------------------- FLOPs and MFU


def test_flops_per_token_matches_a_hand_worked_tiny_gpt():
    # L=2, d=8, T=4, vocab 10 padded to 16, tied. Per block: ln1+ln2 32, qkv 8*24+24=216, proj 64+8=72,
    # mlp_fc 8*32+32=288, mlp_proj 32*8+8=264 -> 872. Total 16*8 + 4*8 + 2*872 + 16 (ln_f) = 1920; N leaves out
    # the position embedding: 1888. 6N = 11328; attention 12*L*T*d = 12*2*4*8 = 768 -> 12096 FLOPs per token.
    m = ModelConfig(kind="gpt", context=4, d_model=8, n_layers=2, n_heads=2, vocab_multiple=8)
    assert gpt_params(m, 10) == {"total": 1920, "tok_embed": 128, "pos_embed": 32, "matmul": 1888}
    assert flops_per_token(m, 10) == 12096
    untied = replace(m, tie_embeddings=False)  # the head's 128 counts, the lookup table does not
    assert gpt_params(untied, 10)["matmul"] == 1888 and gpt_params(untied, 10)["total"] == 2048


def test_flops_per_token_of_gpt2_small():
    # 6 * (124,475,904 - 786,432) + 12 * 12 * 1024 * 768 = 742,136,832 + 113,246,208
    assert flops_per_token(preset("gpt2-small").model, GPT2_VOCAB) == 855_383_040


def test_mfu_is_model_flops_over_the_devices_summed_peak():
    assert Peak(1e12, 2, "test").mfu(1000.0, 12096.0) == pytest.approx(1000 * 12096 / 2e12, rel=1e-12)


def test_peak_table_knows_the_accelerators_by_their_jax_device_kind():
    assert table_peak("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12  # SXM
    assert table_peak("NVIDIA H100 PCIe", "bf16") == 756e12
    assert table_peak("NVIDIA H200", "bf16_full") == 989.4e12
    assert table_peak("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12  # CUDA cores: jaxloop pins fp32 (no TF32)
    assert table_peak("NVIDIA L4", "fp16") == 121e12
    assert table_peak("NVIDIA L40S", "bf16") is None  # not an L4
    assert table_peak("TPU v5 lite", "bf16") == 197e12 and table_peak("TPU v5", "bf16") == 459e12
    assert table_peak("TPU v4", "fp64") is None


# ----------------------------------------------------------------------------- a run


@pytest.fixture(scope="module")
def tiny_gpt2_run(tmp_path_factory):
    """--preset gpt2-small shrunk: 2 layers of width 32, context 16, 8 updates, on byte-token shards of a
    small text (python -m jaxloop.prepare)."""
    from jaxloop.loop.runner import run
    from jaxloop.prepare import main as prepare

    base = tmp_path_factory.mktemp("lm")
    rng = np.random.default_rng(0)
    words = "to be or not that is the question whether tis nobler in mind suffer slings arrows".split()
    (base / "tiny.txt").write_text("\n".join(" ".join(rng.choice(words, size=8)) for _ in range(150)) + "\n")
    assert prepare([str(base / "tiny.txt"), "--out", str(base / "shards"), "--no_progress"]) == 0
    cfg = parse_config(
        [
            "--preset",
            "gpt2-small",
            "--data.path",
            str(base / "shards"),
            "--run_dir",
            str(base / "run"),
            "--eval_batches",
            "2",
            "--steps",
            "8",
            "--batch_size",
            "8",
            "--eval_every",
            "0",
            "--log_every",
            "2",
            "--optim.warmup_steps",
            "2",
            "--model.context",
            "16",
            "--model.d_model",
            "32",
            "--model.n_layers",
            "2",
            "--model.n_heads",
            "2",
            "--log.no_tensorboard",
            "--compile_cache",
            "",
        ]
    )
    with contextlib.redirect_stderr(io.StringIO()):
        run(cfg)
    return base / "run"


def test_precision_auto_runs_fp32_on_a_cpu_and_the_config_records_it(tiny_gpt2_run):
    assert json.loads((tiny_gpt2_run / "config.json").read_text())["precision"] == "fp32"


def test_metadata_records_the_attention_chosen_and_the_flops_count(tiny_gpt2_run):
    lm = json.loads((tiny_gpt2_run / "metadata.json").read_text())["language_model"]
    assert lm["attention"]["used"] == "xla" and "cpu" in lm["attention"]["why"]
    assert lm["vocab"]["model"] % 64 == 0 and lm["vocab"]["model"] >= lm["vocab"]["data"]
    shrunk = ModelConfig(kind="gpt", context=16, d_model=32, n_layers=2, n_heads=2, vocab_multiple=64)
    assert lm["flops_per_token"] == flops_per_token(shrunk, lm["vocab"]["data"])
    assert lm["peak"]["source"].startswith("measured") and lm["peak"]["flops_per_s"] > 0


def test_every_train_record_has_tokens_per_s_and_its_mfu(tiny_gpt2_run):
    lm = json.loads((tiny_gpt2_run / "metadata.json").read_text())["language_model"]
    train = [json.loads(line) for line in (tiny_gpt2_run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in train if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4, 6, 8]
    for r in train:
        assert r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * 16, rel=1e-12)
        assert r["mfu"] == pytest.approx(
            r["tokens_per_s"] * lm["flops_per_token"] / lm["peak"]["flops_per_s"], rel=1e-12
        )


def test_report_states_mfu_with_its_count_and_peak(tiny_gpt2_run):
    md = (tiny_gpt2_run / "report.md").read_text()
    assert "- MFU: " in md and "6N + 12*L*T*d" in md and "measured" in md
    assert "- attention: xla" in md


def test_sampling_a_padded_vocabulary_draws_only_the_vocabulary_s_ids():
    # a 64-logit model over a 5-character vocabulary: at random init each draw would leave the vocabulary
    # with probability ~59/64 if the padding's logits were drawn from
    from jaxloop.sample import generate

    vocab = tuple("abcde")
    m = ModelConfig(kind="gpt", context=8, d_model=16, n_layers=1, n_heads=2, vocab_multiple=64)
    model = make_model(m, len(vocab), "fp32")
    params = init_params(model, jax.random.PRNGKey(0), np.zeros((1, 8), np.int32))
    text = generate(model, params, vocab, "ab", length=40, temperature=1.0)
    assert len(text) == 40 and set(text) <= set(vocab)


def test_cli_cudnn_attention_on_a_cpu_is_one_line_exit_2_and_nothing_written(tmp_path):
    import os
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxloop.train",
            "--preset",
            "shakespeare",
            "--data.path",
            "tests/data/tinyshakespeare_60k.txt",
            "--model.attention",
            "cudnn",
            "--precision",
            "bf16",
            "--run_dir",
            str(run_dir),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.attention='cudnn' is not allowed" in lines[0] and "cpu" in lines[0], out.stderr
    assert not run_dir.exists()
