"""`python -m jaxloop.parity PATH.py:FACTORY`: the table on a shipped example, and bad input answered with
one clear message and exit status 2 (a missing file or factory, weights that do not map, a batch a model
rejects, naming the module that raised, torch missing). `import jaxloop` never imports torch.

Mutants seen failing: the command returning 1 instead of 2 for a MappingError; ModelError naming the
outermost module instead of the innermost one running (the stack's first entry).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from docs_blocks import runnable

from jaxloop.parity import training
from jaxloop.parity.__main__ import main

pytestmark = pytest.mark.torch
ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}


def test_command_prints_the_mapping_and_the_table_of_a_shipped_example(doc_run):
    page = ROOT / "docs" / "porting.md"
    (command,) = runnable(page, "bash", torch=True)  # the doc's block, run as tests/docs_blocks.py runs it
    assert command.body.startswith("python -m jaxloop.parity examples/ports/transformer_encoder.py:make")
    proc = doc_run(page, "bash", torch=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (out,) = proc.outputs
    assert re.search(r"\nlayers\.0\.self_attn\.in_proj_weight +blocks/0/attn/qkv/kernel +transpose +order\n", out)
    assert re.search(r"\ngradients, every tensor +fp64 +\S+ +1\.00e-09 +yes ", out) and "why this tolerance" in out
    assert "trajectory" not in out
    n = 8 + len(
        training.update_configs(1.0)
    )  # output, loss and every layer in eval and train, gradients (every tensor,
    # whole tree); an update row per config
    assert out.strip().endswith(f"vs a Flax NNX port: {n} of {n} checks within tolerance")


def test_import_jaxloop_does_not_import_torch():
    code = "import sys, jaxloop, jaxloop.parity; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], env=ENV, check=True, timeout=300)


PORTS = textwrap.dedent("""
    import numpy as np, torch, jax.numpy as jnp, flax.linen as nn
    from jaxloop.parity import Port

    class Net(nn.Module):
        width: int = 6
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(jnp.tanh(nn.Dense(self.width)(x)))

    def tl(m, b):
        return (m(b["x"]) ** 2).mean()

    def fl(m, b, train):
        return jnp.mean(m(b["x"]) ** 2), {}

    def torch_net(inputs=4):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(inputs, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))

    X = {"x": np.ones((2, 4), np.float32)}

    def good():
        return Port(torch_net(), Net(), X, tl, fl)

    def wrong_width():
        return Port(torch_net(), Net(width=5), X, tl, fl)

    def torch_rejects():
        return Port(torch_net(inputs=7), Net(), X, tl, fl)

    class Reshaping(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(6)(x)
            return nn.Dense(3)(jnp.tanh(h).reshape(5, -1))

    def flax_rejects():
        return Port(torch_net(), Reshaping(), X, tl, fl)

    def as_tuple():
        return torch_net(), Net(), X, tl, fl

    def swapped():
        return Port(Net(), torch_net(), X, tl, fl)

    def exits():
        import sys
        sys.exit(0)
""")


@pytest.fixture()
def ports(tmp_path):
    path = tmp_path / "ports.py"
    path.write_text(PORTS)
    return path


def _main(capsys, *argv):
    code = main(list(argv) + ["--precision", "fp64", "--updates", "0"])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_missing_file_exits_2(tmp_path, capsys):
    code, _, err = _main(capsys, f"{tmp_path}/nope.py:make")
    assert code == 2 and err.strip() == f"error: no such file: {tmp_path}/nope.py"


def test_a_missing_factory_exits_2_naming_the_functions_there(ports, capsys):
    code, _, err = _main(capsys, f"{ports}:make")
    assert (
        code == 2
        and (
            "has no function 'make'; functions it defines: ['as_tuple', 'exits', 'fl', 'flax_rejects', "
            "'good', 'swapped', 'tl', 'torch_net', 'torch_rejects', 'wrong_width']"
        )
        in err
    )


def test_weights_that_do_not_map_exit_2_naming_the_parameter_and_the_candidates(ports, capsys):
    code, _, err = _main(capsys, f"{ports}:wrong_width")
    assert code == 2
    assert "error: the weights do not map:" in err
    assert "torch 0.weight (6, 4) (Linear) has no Flax counterpart" in err and "candidates" in err


def test_a_batch_torch_rejects_exits_2_naming_the_module(ports, capsys):
    code, _, err = _main(capsys, f"{ports}:torch_rejects")
    assert code == 2 and "error: the torch model rejects the batch: module '0' (Linear) raised RuntimeError" in err


def test_a_batch_flax_rejects_exits_2_naming_the_module(ports, capsys):
    code, _, err = _main(capsys, f"{ports}:flax_rejects")
    assert code == 2 and "error: the Flax model rejects the batch: the root module" in err and "reshape" in err


EXPECTED = "expected a jaxloop.parity.Port(torch_module, flax_module, batch, torch_loss, flax_loss)"


@pytest.mark.parametrize(
    "factory, says",
    [
        ("as_tuple", "returned a tuple; " + EXPECTED),
        (
            "swapped",
            "returned a Port with torch and Flax swapped (torch_module is a Flax Net, flax_module a torch "
            "Sequential); " + EXPECTED,
        ),
        ("exits", "called sys.exit(0) instead of returning a jaxloop.parity.Port("),
    ],
)
def test_a_factory_returning_something_else_exits_2_in_one_line_naming_what_was_expected(ports, capsys, factory, says):
    code, out, err = _main(capsys, f"{ports}:{factory}")  # not 1 (a failed check) nor a silent 0
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and says in err, err


def test_without_torch_the_command_says_how_to_install_it(ports, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    code, _, err = _main(capsys, f"{ports}:good")
    assert code == 2 and "pip install torch" in err and "pip install -e '.[test]'" in err


def test_without_torch_compare_says_how_to_install_it(monkeypatch):
    from jaxloop.parity import TorchMissing, compare

    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(TorchMissing, match="pip install torch"):
        compare(None, None, {})


def test_the_command_says_on_stderr_what_it_is_checking_while_it_runs(ports, capsys):
    # a check of minutes is not silent: each stage and every tenth of the trajectory, with when it began (no
    # timing asserted); stdout stays the report. mutant seen failing: main() without progress=
    code = main([f"{ports}:good", "--precision", "fp64", "--updates", "10"])
    out, err = capsys.readouterr()
    assert code == 0, out
    said = [line.rsplit(" (at ", 1)[0] for line in err.splitlines()]
    configs = len(training.update_configs(1.0))
    assert said == [
        f"{ports}:good: torch and the Port loaded",
        "[fp64] the forward pass, layer by layer (eval and train mode)...",
        "[fp64] the gradients...",
        f"[fp64] the optimizers: {configs} configs x 3 updates...",
        "[fp64] the trajectory: 10 updates on each side...",
        *(f"[fp64] the trajectory: update {u}/10" for u in range(1, 10)),
        "checked",
    ], err
    assert "[fp64]" not in out
