"""--init_from a Hugging Face GPT-2 directory (jaxloop.checkpoint.hf_gpt2, docs/language-models.md#start-from-gpt-2):
the model's shape from config.json, the tensors mapped by the table the port check derives by itself, the
loaded GPT's logits equal to transformers' GPT2LMHeadModel's, a fine-tune that resumes exactly.

Every GPT-2 here is a tiny random one built by transformers and saved with save_pretrained (nothing is
downloaded); its 1-d weights (LayerNorm scales, biases) are moved off their 1/0 start so that the logits
depend on each of them.
"""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from jaxloop.checkpoint import hf_gpt2
from jaxloop.config.run import ConfigError, ModelConfig

pytestmark = pytest.mark.torch

SHAPES = {  # two GPT-2s that differ in every field the checkpoint decides
    "tied": dict(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=256),
    "untied": dict(
        n_layer=3,
        n_head=4,
        n_embd=48,
        n_positions=32,
        vocab_size=256,
        tie_word_embeddings=False,
        activation_function="gelu",
        layer_norm_epsilon=1e-3,
        n_inner=96,
    ),
}


def tiny_gpt2(directory, seed: int = 0, safetensors: bool = True, **config) -> GPT2LMHeadModel:
    """A random GPT-2 of `config` saved in `directory` by save_pretrained (no download). Its matrices are
    drawn at std 0.3 instead of GPT-2's 0.02, so that the MLP's inputs span GELU's bend (where its exact and
    tanh forms differ by up to 1e-3) rather than the near-linear middle."""
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(
        GPT2Config(**{"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "initializer_range": 0.3, **config})
    )
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(directory, safe_serialization=safetensors)
    return model


def loaded(directory) -> tuple[dict, ModelConfig]:
    m = ModelConfig(**hf_gpt2.model_fields(hf_gpt2.read_config(directory), str(directory)))
    return hf_gpt2.to_params(hf_gpt2.read_tensors(directory), m, str(directory)), m


# ----------------------------------------------------------------------------- shape and mapping


def test_the_model_shape_is_the_checkpoints_config():
    # mutant seen failing: layer_norm_epsilon not read (ln_eps stays 1e-5)
    hf = GPT2Config(**SHAPES["untied"]).to_dict()
    fields = hf_gpt2.model_fields(hf)
    assert fields == dict(
        kind="gpt",
        context=32,
        d_model=48,
        n_layers=3,
        n_heads=4,
        mlp_ratio=2,
        vocab_size=256,
        vocab_multiple=1,
        tie_embeddings=False,
        gelu="exact",
        ln_eps=1e-3,
    )


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_table_is_the_mapping_the_port_check_derives_by_itself(tmp_path, shape):
    # the port check (jaxloop.parity.map_weights) pairs transformers' GPT-2 with the built-in GPT from their
    # execution order alone; hf_gpt2.RULES must say the same for every leaf, layout included.
    # mutants seen failing: c_attn's layout "transpose" in RULES; the untied head's layout "as is"
    import jaxloop.parity
    from jaxloop.model.builtin import make_model

    tm = tiny_gpt2(tmp_path, **SHAPES[shape])
    _, m = loaded(tmp_path)
    batch = {"x": hf_gpt2.check_batch(m)}
    mapping = jaxloop.parity.map_weights(tm, make_model(m, m.vocab_size), batch)
    derived = {e.flax.removeprefix("params/"): (e.torch, e.layout) for e in mapping.entries}
    assert derived == {leaf: hf_gpt2.hf_name(leaf) for leaf in hf_gpt2.expected_shapes(m)}


# ----------------------------------------------------------------------------- the loaded model's logits


@pytest.mark.parametrize("precision,tolerance", [("fp64", 1e-10), ("fp32", 1e-5)])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_loaded_logits_equal_transformers_gpt2(tmp_path, shape, precision, tolerance):
    # the tolerances are the load check's (hf_gpt2.CHECK_TOLERANCE): fp64 leaves only summation order (~1e-16
    # measured), fp32 its rounding (~2e-7 measured); max |a - b| / max |b| over a 2 x 16 batch.
    # mutants seen failing: ln_eps not passed to the LayerNorms; gelu=exact computed as tanh; the untied head
    # dropped (tie_embeddings forced true: to_params refuses lm_head.weight)
    tm = tiny_gpt2(tmp_path, **SHAPES[shape]).double() if precision == "fp64" else tiny_gpt2(tmp_path, **SHAPES[shape])
    params, m = loaded(tmp_path)
    tokens = hf_gpt2.check_batch(m, seed=1)
    with torch.no_grad():
        want = tm.eval()(input_ids=torch.as_tensor(tokens)).logits.numpy()
    assert hf_gpt2.rel_diff(hf_gpt2.gpt_logits(params, m, tokens, precision), want) <= tolerance


def test_the_load_check_refuses_a_gpt_that_differs(tmp_path):
    # a checkpoint whose config.json says another eps than its model was trained with is still loaded; the
    # logits check at load is what finds it. mutant seen failing: check_logits returning without comparing
    tiny_gpt2(tmp_path, **SHAPES["tied"])
    params, m = loaded(tmp_path)
    with pytest.raises(ConfigError, match="logits differ from transformers' GPT2LMHeadModel's"):
        hf_gpt2.check_logits(tmp_path, params, replace(m, ln_eps=1e-1))


def test_without_transformers_the_load_check_says_the_logits_were_not_compared(tmp_path, monkeypatch):
    # mutant seen failing: the ImportError not caught (the run stops where torch or transformers is missing)
    tiny_gpt2(tmp_path, **SHAPES["tied"])
    params, m = loaded(tmp_path)
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)  # `import transformers` raises ImportError
    assert hf_gpt2.check_logits(tmp_path, params, m) == (
        "every tensor mapped with the GPT's shapes; logits not compared with transformers' GPT2LMHeadModel "
        "(torch and transformers are not both installed)"
    )


def test_pytorch_model_bin_reads_as_safetensors_does(tmp_path):
    tiny_gpt2(tmp_path / "st", **SHAPES["tied"])
    tiny_gpt2(tmp_path / "bin", safetensors=False, **SHAPES["tied"])
    assert (tmp_path / "bin" / hf_gpt2.TORCH_FILE).is_file()
    # (the .bin keeps the tied head's copy, lm_head.weight, which save_pretrained's safetensors leaves out)
    a, b = (hf_gpt2.from_params(loaded(tmp_path / d)[0]) for d in ("st", "bin"))
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


class Payload:
    """An object no state_dict holds: torch.load(weights_only=True) must refuse to unpickle it."""


def test_pytorch_model_bin_is_read_without_unpickling_objects(tmp_path):
    # mutant seen failing: torch.load(..., weights_only=False) (the object unpickles, no error)
    (tmp_path / "config.json").write_text(json.dumps(GPT2Config(**SHAPES["tied"]).to_dict()))
    torch.save({"wte.weight": torch.zeros(2), "x": Payload()}, tmp_path / hf_gpt2.TORCH_FILE)
    with pytest.raises(ConfigError, match=r"weights_only=True\) refused it"):
        hf_gpt2.read_tensors(tmp_path)


def test_a_gpt2_variant_the_builtin_gpt_lacks_is_refused_by_name(tmp_path):
    # mutant seen failing: the scale_attn_by_inverse_layer_idx check removed
    hf = GPT2Config(**SHAPES["tied"], scale_attn_by_inverse_layer_idx=True).to_dict()
    with pytest.raises(ConfigError, match="scale_attn_by_inverse_layer_idx=True"):
        hf_gpt2.model_fields(hf, str(tmp_path))


# ----------------------------------------------------------------------------- the command line


def test_the_finetune_preset_is_nanogpts_finetune_shakespeare():
    # nanoGPT's config/finetune_shakespeare.py: 20 iterations of 32 sequences (batch 1 x accumulation 32 there),
    # learning rate 3e-5 not decayed, eval every 5 over 40 batches; its train.py's AdamW betas (0.9, 0.95), decay
    # 0.1, clip 1.0. mutant seen failing: the preset left on warmup-cosine
    from jaxloop.config.run import preset

    cfg = preset("gpt2-finetune")
    o, a = cfg.optim, cfg.optim.optimizer
    assert (cfg.steps, cfg.batch_size * cfg.optim.accum_steps, cfg.eval_every, cfg.eval_batches) == (20, 32, 5, 40)
    assert (o.name, o.schedule, o.peak_lr, o.lr_schedule.warmup_steps) == ("adamw", "constant", 3e-5, 0)
    assert (a.b1, a.b2, a.weight_decay, o.clip_norm) == (0.9, 0.95, 0.1, 1.0)
    assert cfg.data.source == "tokens" and cfg.model.kind == "gpt" and cfg.model.dropout == 0.0


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Byte-token shards (vocabulary 256) of a small text (python -m jaxloop.prepare)."""
    from jaxloop.prepare import main as prepare

    base = tmp_path_factory.mktemp("hf_shards")
    rng = np.random.default_rng(0)
    words = "to be or not that is the question whether tis nobler in mind suffer slings arrows".split()
    (base / "tiny.txt").write_text("\n".join(" ".join(rng.choice(words, size=8)) for _ in range(150)) + "\n")
    assert prepare([str(base / "tiny.txt"), "--out", str(base / "shards"), "--no_progress"]) == 0
    return base / "shards"


def finetune_args(hf_dir, shards, run_dir, *more: str) -> list[str]:
    """--preset gpt2-finetune from a tiny GPT-2, shrunk to seconds on a CPU (context 32: the first 32 positions)."""
    return [
        "--preset",
        "gpt2-finetune",
        "--init_from",
        str(hf_dir),
        "--data.path",
        str(shards),
        "--run_dir",
        str(run_dir),
        "--batch_size",
        "4",
        "--optim.accum_steps",
        "1",
        "--steps",
        "6",
        "--eval_every",
        "3",
        "--eval_batches",
        "1",
        "--optim.peak_lr",
        "1e-3",
        "--updates_per_call",
        "1",
        "--log.no_tensorboard",
        "--log.progress",
        "plain",
        "--compile_cache",
        "",
        "--checkpoint.every",
        "3",
        *more,
    ]


def train(argv: list[str]) -> tuple[int, str]:
    from jaxloop.train import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:  # bad flags: one line, exit 2
            code = e.code
    return code, err.getvalue()


@pytest.fixture(scope="module")
def negligible_lr_run(tmp_path_factory, shards):
    """The untied GPT-2 fine-tuned for one update at lr 1e-30: (its directory, the run's, the run's stderr). The
    shape test and the bit-for-bit test read this one run (one fine-tune, not one each)."""
    base = tmp_path_factory.mktemp("negligible_lr")
    tiny_gpt2(base / "gpt2", **SHAPES["untied"])
    code, err = train(finetune_args(base / "gpt2", shards, base / "run", "--steps", "1", "--optim.peak_lr", "1e-30"))
    assert code == 0, err
    return base / "gpt2", base / "run", err


def test_finetune_takes_the_checkpoints_shape_and_says_the_logits_check_ran(negligible_lr_run):
    # mutant seen failing: shaped_by_init_from not called in run() (the preset's 12 x 768 GPT: a shape error)
    _, run, err = negligible_lr_run
    model = json.loads((run / "config.json").read_text())["model"]
    assert (
        model["n_layers"],
        model["n_heads"],
        model["d_model"],
        model["context"],
        model["vocab_size"],
        model["tie_embeddings"],
        model["gelu"],
        model["ln_eps"],
        model["mlp_ratio"],
    ) == (3, 4, 48, 32, 256, False, "exact", 1e-3, 2)
    assert "logits equal transformers' GPT2LMHeadModel's on a fixed batch" in err and "(fp32: " in err


def test_a_finetune_at_a_negligible_lr_keeps_the_gpt2s_tensors_bit_for_bit(negligible_lr_run, tmp_path):
    # HF -> jaxloop (--init_from) -> HF (jaxloop.export): one update at lr 1e-30 (AdamW's step is about lr, far
    # below the rounding unit of every weight, none of which is 0) leaves every tensor's bits as they were.
    # mutant seen failing: the loaded params not put into the state (the seeded init exported)
    from jaxloop.export import export

    gpt2, run, _ = negligible_lr_run
    before = hf_gpt2.read_tensors(gpt2)
    after = hf_gpt2.read_tensors(export(run, "last", tmp_path / "out"))
    assert sorted(after) == sorted(before)
    assert all(np.array_equal(after[k], before[k]) for k in before)


def test_a_shape_flag_other_than_the_checkpoints_is_one_line_exit_2(tmp_path, shards):
    # mutant seen failing: with_checkpoint_shape replacing the fields without comparing (the flag ignored)
    tiny_gpt2(tmp_path / "gpt2", **SHAPES["tied"])
    code, err = train(finetune_args(tmp_path / "gpt2", shards, tmp_path / "run", "--model.n_layers", "5"))
    assert code == 2
    assert err.strip().splitlines() == [
        f"jaxloop.train: error: model.n_layers=5 is not allowed: the value of the Hugging Face checkpoint --init_from "
        f"names (2 in {tmp_path / 'gpt2' / 'config.json'}), or left out"
    ]
    assert not (tmp_path / "run").exists()


def test_a_killed_finetune_resumes_exactly(tmp_path, shards, monkeypatch):
    # a fine-tune stopped by SIGTERM after update 1 and resumed by name (`--run_dir DIR` alone: init_from is
    # not applied again, the checkpoint is) ends with the uninterrupted run's state, bit for bit. 3 updates:
    # one before the kill, two after (the uninterrupted run is tests/test_export.py's tied run: the same programs).
    # mutant seen failing: the restored state not used (runner: create_sharded always). (initial_params applied on
    # resume too no longer fails this test on main either: saved_config drops init_from from a resume by name)
    import signal

    from jaxloop.observe.logger import RunLogger

    tiny_gpt2(tmp_path / "gpt2", **SHAPES["tied"])
    assert train(finetune_args(tmp_path / "gpt2", shards, tmp_path / "whole", "--steps", "3"))[0] == 0
    original = RunLogger.train

    def stop_after_1(self, record):
        original(self, record)
        if record["step"] == 1:
            signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(RunLogger, "train", stop_after_1)
    assert train(finetune_args(tmp_path / "gpt2", shards, tmp_path / "cut", "--steps", "3"))[0] == 143
    monkeypatch.setattr(RunLogger, "train", original)
    code, err = train(["--run_dir", str(tmp_path / "cut")])
    assert code == 0, err
    assert "resuming from update 2" in err, err
    whole = json.loads((tmp_path / "whole" / "summary.json").read_text())
    cut = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert cut["final_step"] == whole["final_step"] == 3
    assert cut["state_digest"] == whole["state_digest"]
