"""The port check's weight mapping: a torch state_dict onto Flax variables by structure and shape, with the
known layout conventions, and back (jaxloop.parity.weights / transfer).

A convention is proven numerically: the mapped Flax model computes torch's forward pass to float64
rounding (`_forward_agrees`: every layer's output within 1e-10 relative). Mutants seen failing: the
conv layout "OIHW->HWIO" as (*k, O, I) (conv test), ConvTranspose's flip dropped (both ConvTranspose
tests), Linear's weight not transposed (a square layer: the Linear test), tied copies not written back
by to_torch (round-trip test), MappingError's candidates left out (unmatched test).
"""

from __future__ import annotations

import os

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import jaxloop
from jaxloop.parity import MappingError, compare, flax_leaves, flax_variables, load_into_torch, map_weights
from jaxloop.parity.weights import LAYOUTS

pytestmark = pytest.mark.torch
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _mse_torch(model, b):
    return ((model(b["x"]) - b["y"]) ** 2).mean()


def _mse_flax(model, b, train):
    return jnp.mean((model(b["x"]) - b["y"]) ** 2), {}


def _forward_agrees(tm, fm, batch, torch_loss=_mse_torch, flax_loss=_mse_flax, **kw):
    """The eval-mode rows of a float64 forward-only check (every paired layer within 1e-10: float64 rounding)."""
    report = compare(tm, fm, batch, torch_loss, flax_loss, precisions=("fp64",), checks=("forward",), **kw)
    rows = [r for r in report.rows if r.check.startswith("forward (eval)")]
    assert rows and all(r.passed for r in rows), report.text()
    return report


def _batch(x_shape, y_shape, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=x_shape).astype(np.float32), "y": rng.normal(size=y_shape).astype(np.float32)}


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(6)(x)
        return nn.Dense(6)(jnp.tanh(h))


def test_linear_weight_out_in_becomes_kernel_in_out():
    torch.manual_seed(0)
    tm = torch.nn.Sequential(
        torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6)
    )  # square: shape alone cannot tell
    report = _forward_agrees(tm, Mlp(), _batch((5, 6), (5, 6)))
    assert {e.layout for e in report.mapping.entries if e.flax.endswith("kernel")} == {"transpose"}


class ConvNet(nn.Module):
    @nn.compact
    def __call__(self, x):  # NHWC
        x = nn.relu(nn.Conv(4, (3, 3), padding=((1, 1), (1, 1)))(x))
        return nn.Conv(5, (3, 2), strides=(2, 2), padding=((1, 1), (0, 0)))(x)


def _nhwc(loss):
    return lambda model, b, train: loss(
        lambda x: jnp.transpose(model(jnp.transpose(x, (0, 2, 3, 1))), (0, 3, 1, 2)), b, train
    )


def test_conv_weight_oihw_becomes_kernel_hwio():
    torch.manual_seed(0)
    tm = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(4, 5, (3, 2), stride=2, padding=(1, 0))
    )
    report = _forward_agrees(tm, ConvNet(), _batch((2, 3, 8, 8), (2, 5, 4, 4)), flax_loss=_nhwc(_mse_flax))
    assert {e.layout for e in report.mapping.entries if e.flax.endswith("kernel")} == {"OIHW->HWIO"}


@pytest.mark.parametrize("transpose_kernel", [False, True])
def test_conv_transpose_weight_maps_for_either_flax_convention(transpose_kernel):
    # in == out channels: only the Flax module's transpose_kernel tells the two layouts apart
    class Up(nn.Module):
        @nn.compact
        def __call__(self, x):
            k, p, op = 3, 1, 1  # torch's padding p, output_padding op -> Flax pads (k - 1 - p, k - 1 - p + op)
            return nn.ConvTranspose(
                4, (k, k), strides=(2, 2), padding=((k - 1 - p, k - 1 - p + op),) * 2, transpose_kernel=transpose_kernel
            )(x)

    torch.manual_seed(0)
    tm = torch.nn.ConvTranspose2d(4, 4, 3, stride=2, padding=1, output_padding=1)
    report = _forward_agrees(tm, Up(), _batch((2, 4, 5, 5), (2, 4, 10, 10)), flax_loss=_nhwc(_mse_flax))
    want = "OIHW->HWIO" if transpose_kernel else "IOHW->HWIO flipped"
    assert [e.layout for e in report.mapping.entries if e.flax.endswith("kernel")] == [want]


class NormNet(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5)(x)
        return nn.LayerNorm(epsilon=1e-5)(x)


def test_norm_weights_become_scale_and_running_statistics_batch_stats():
    torch.manual_seed(0)
    tm = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.LayerNorm(8))
    with torch.no_grad():
        tm[1].running_mean.normal_()
        tm[1].running_var.uniform_(0.5, 2.0)
        tm[1].weight.uniform_(0.5, 1.5)
    report = _forward_agrees(
        tm,
        NormNet(),
        _batch((6, 4), (6, 8)),
        flax_loss=lambda m, b, train: _mse_flax(lambda x: m(x, train=train), b, train),
    )
    names = {e.torch: e.flax for e in report.mapping.entries}
    assert names["1.weight"] == "params/BatchNorm_0/scale" and names["2.weight"] == "params/LayerNorm_0/scale"
    assert (
        names["1.running_mean"] == "batch_stats/BatchNorm_0/mean"
        and names["1.running_var"] == "batch_stats/BatchNorm_0/var"
    )
    assert report.mapping.dropped == ["1.num_batches_tracked"]


class TiedLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, tokens):
        return self.head(torch.tanh(self.emb(tokens)))


class TiedPort(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        emb = nn.Embed(11, 6)
        return emb.attend(jnp.tanh(emb(tokens)))


class UntiedPort(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        return nn.Dense(11, use_bias=False)(jnp.tanh(nn.Embed(11, 6)(tokens)))


def _tokens():
    rng = np.random.default_rng(0)
    return {"x": rng.integers(0, 11, (3, 5)), "y": rng.normal(size=(3, 5, 11)).astype(np.float32)}


def test_embedding_maps_to_embedding_and_a_tied_head_maps_once():
    torch.manual_seed(0)
    report = _forward_agrees(TiedLM(), TiedPort(), _tokens())
    assert [(e.torch, e.flax) for e in report.mapping.entries] == [("emb.weight", "params/Embed_0/embedding")]
    assert report.mapping.tied == {"head.weight": "emb.weight"} and not report.mapping.notes


def test_an_untied_port_of_tied_weights_maps_both_and_says_so():
    torch.manual_seed(0)
    report = _forward_agrees(TiedLM(), UntiedPort(), _tokens())
    assert {e.flax: (e.torch, e.layout) for e in report.mapping.entries} == {
        "params/Embed_0/embedding": ("emb.weight", "as is"),
        "params/Dense_0/kernel": ("head.weight", "transpose"),
    }
    assert "untied" not in report.mapping.notes[0] and "separate leaves" in report.mapping.notes[0]


def test_unmatched_weights_are_an_error_naming_them_and_the_candidates():
    torch.manual_seed(0)
    tm = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 6))
    with pytest.raises(MappingError) as e:
        compare(tm, Mlp(), _batch((5, 6), (5, 6)), _mse_torch, _mse_flax, precisions=("fp64",), checks=("forward",))
    lines = str(e.value).splitlines()
    assert (
        "  torch 0.weight (7, 6) (Linear) has no Flax counterpart; no unmapped Flax leaf has its shape in any layout; "
        "unmapped Flax leaves: ['params/Dense_0/bias (6,)', 'params/Dense_0/kernel (6, 6)', 'params/Dense_1/bias (6,)', "
        "'params/Dense_1/kernel (6, 6)']"
    ) in lines
    assert any(line.startswith("  Flax params/Dense_0/kernel (6, 6) has no torch counterpart; ") for line in lines)


class Bare(torch.nn.Module):
    """A module of the user's own: x @ w with a square bare parameter (the mapper cannot know its layout)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(6, 6))

    def forward(self, x):
        return x @ self.w


class BarePort(nn.Module):
    """Bare's port: x @ w, x @ w.T (the weight stored the other way round), or a port that computes
    something else (tanh), under which no layout reproduces torch's output."""

    form: str = "as is"

    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.initializers.zeros, (6, 6))
        return {"as is": x @ w, "transpose": x @ w.T, "tanh": jnp.tanh(x @ w)}[self.form]


@pytest.mark.parametrize("form", ["as is", "transpose"])
def test_a_square_weight_takes_the_layout_that_reproduces_the_captured_torch_output(form):
    torch.manual_seed(0)
    report = _forward_agrees(Bare(), BarePort(form), _batch((5, 6), (5, 6)))
    assert [(e.flax, e.layout) for e in report.mapping.entries] == [("params/w", form)]


def test_a_square_weight_no_layout_explains_is_refused_naming_it_until_overridden():
    torch.manual_seed(0)
    b = _batch((5, 6), (5, 6))
    with pytest.raises(
        MappingError,
        match=r"torch w \(6, 6\) \(Bare\) fits Flax params/w \(6, 6\) in more than one "
        r"layout .*will not guess: .*reproduces its output under no layout .*overrides",
    ):
        compare(Bare(), BarePort("tanh"), b, _mse_torch, _mse_flax, precisions=("fp64",), checks=("forward",))
    report = compare(
        Bare(),
        BarePort("tanh"),
        b,
        _mse_torch,
        _mse_flax,
        precisions=("fp64",),
        checks=("forward",),
        overrides={"w": ("w", "as is")},
    )  # "params/" may be left out
    assert [(e.flax, e.how) for e in report.mapping.entries] == [("params/w", "override")]


def test_overrides_by_function_and_rename_rules_take_precedence():
    torch.manual_seed(0)
    tm = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6))
    b = _batch((5, 6), (5, 6))
    report = _forward_agrees(
        tm,
        Mlp(),
        b,
        rename=[(r"2\.(bias)", r"params/Dense_1/\1")],
        overrides={"params/Dense_0/kernel": (lambda sd: sd["0.weight"].T, "0.weight")},
    )
    how = {e.flax: e.how for e in report.mapping.entries}
    assert how["params/Dense_1/bias"] == "rename" and "params/Dense_0/kernel" in report.mapping.custom
    assert how["params/Dense_0/bias"] in ("name", "order")


@pytest.fixture(scope="module")
def examples():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "ports"))
    import gpt2
    import resnet
    import transformer_encoder

    return {"gpt2": gpt2.make(), "resnet": resnet.make(), "transformer_encoder": transformer_encoder.make()}


@pytest.mark.parametrize("name", ["gpt2", "resnet", "transformer_encoder"])
def test_round_trip_torch_to_flax_to_torch_is_exact(examples, name):
    port = examples[name]
    mapping = map_weights(port.torch_module, port.flax_module, port.batch, port.torch_loss, port.flax_loss)
    sd = {k: v.detach().numpy() for k, v in port.torch_module.state_dict().items()}
    back = mapping.to_torch(mapping.to_flax(sd), base={k: sd[k] for k in mapping.dropped})  # num_batches_tracked only
    assert back.keys() == sd.keys()
    for k in sd:
        assert back[k].dtype == sd[k].dtype and np.array_equal(back[k], sd[k]), k  # bit for bit
    layouts = {e.torch_type.split(".")[0]: e.layout for e in mapping.entries if e.flax.endswith("kernel")}
    expected = {
        "gpt2": {"Conv1D": "as is"},
        "resnet": {"Conv2d": "OIHW->HWIO", "Linear": "transpose"},
        "transformer_encoder": {
            "MultiheadAttention": "transpose",
            "NonDynamicallyQuantizableLinear": "transpose",
            "Linear": "transpose",
        },
    }[name]
    assert layouts == expected


def test_layouts_are_exact_inverses():
    rng = np.random.default_rng(0)
    for name, (there, back) in LAYOUTS.items():
        w = rng.normal(size=(2, 3) if name in ("as is", "transpose") else (2, 3, 4, 5))
        assert np.array_equal(back(there(w)), w), name


def test_trained_jaxloop_checkpoint_goes_back_into_the_torch_module(tmp_path):
    """Train in JAX (jaxloop.run on the port), hand the torch model on: the torch module with the trained
    weights computes what the trained Flax model computes (float32: within 1e-6 relative)."""
    from jaxloop.config.run import CheckpointConfig, Config, LogConfig, OptimConfig
    from jaxloop.config.schedules import WarmupCosineConfig

    torch.manual_seed(0)
    tm = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6))
    b = _batch((5, 6), (5, 6))
    mapping = map_weights(tm, Mlp(), b, _mse_torch, _mse_flax)
    rng = np.random.default_rng(1)
    records = [
        {"x": rng.normal(size=6).astype(np.float32), "y": rng.normal(size=6).astype(np.float32)} for _ in range(64)
    ]
    cfg = Config(
        run_dir=str(tmp_path / "run"),
        steps=4,
        batch_size=16,
        eval_every=4,
        log=LogConfig(progress="off", report=False),
        optim=OptimConfig(lr_schedule=WarmupCosineConfig(warmup_steps=0), peak_lr=1e-2),
        checkpoint=CheckpointConfig(every=2),
    )
    jaxloop.run(cfg, jaxloop.Task(Mlp(), _mse_flax, train=records, val=records[:16]))
    trained = jaxloop.load_model(cfg.run_dir, Mlp(), which="latest")
    before = {k: v.clone() for k, v in tm.state_dict().items()}
    load_into_torch(mapping, tm, trained)
    leaves = flax_leaves(trained)
    assert np.array_equal(tm.state_dict()["0.weight"].numpy(), np.asarray(leaves["params/Dense_0/kernel"]).T)
    assert not torch.equal(before["0.weight"], tm.state_dict()["0.weight"])
    x = b["x"]
    flax_out = np.asarray(Mlp().apply(trained, jnp.asarray(x)))
    torch_out = tm(torch.from_numpy(x)).detach().numpy()
    assert np.linalg.norm(flax_out - torch_out) / np.linalg.norm(torch_out) < 1e-6


def test_flax_variables_from_torch_for_linen_and_nnx():
    torch.manual_seed(0)
    tm = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6))
    b = _batch((5, 6), (5, 6))
    variables = flax_variables(map_weights(tm, Mlp(), b, _mse_torch, _mse_flax), tm)
    x = jnp.asarray(b["x"])
    want = tm(torch.from_numpy(b["x"])).detach().numpy()
    assert np.allclose(np.asarray(Mlp().apply(variables, x)), want, rtol=1e-5, atol=1e-6)

    class NnxMlp(nnx.Module):
        def __init__(self):
            self.a, self.b = nnx.Linear(6, 6, rngs=nnx.Rngs(0)), nnx.Linear(6, 6, rngs=nnx.Rngs(1))

        def __call__(self, x):
            return self.b(jnp.tanh(self.a(x)))

    module = NnxMlp()
    flax_variables(map_weights(tm, module, b, _mse_torch, _mse_flax), tm, module)
    assert np.allclose(np.asarray(module(x)), want, rtol=1e-5, atol=1e-6)
