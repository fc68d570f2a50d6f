"""The shipped example ports pass every check of the port check, in float64 and float32: ports of models
nobody here wrote the torch side of (transformers' GPT-2 and ResNet, torch's own nn.TransformerEncoder).

Every row states its own tolerance and reason (jaxloop.parity.tolerances); the trajectory runs 3
updates here (the command's default is 100; docs/porting.md lists what 100 measure). The planted
bugs of tests/test_port_planted.py are these ports' mutants.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from jaxloop.parity import check, training

pytestmark = pytest.mark.torch
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the models are built from configs
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "ports"))

EXAMPLES = ["gpt2", "resnet", "transformer_encoder"]


@pytest.fixture(scope="module", params=EXAMPLES)
def report(request):
    module = __import__(request.param)
    return check(module.make(), trajectory=3)


def test_every_check_passes_in_float64_and_float32(report):
    report.assert_ok()
    assert {r.precision for r in report.rows} == {"fp64", "fp32"}
    kinds = {r.check.split(":")[0].split(" (")[0] for r in report.rows}
    assert {"forward", "gradients, every tensor", "update x3", "trajectory"} <= kinds, kinds


def test_every_layer_is_compared_in_both_modes(report):
    for key, diffs in report.layers.items():
        assert len(diffs) >= 10, key  # the layers paired, each within the forward tolerance
    assert set(report.layers) == {"fp64 eval", "fp64 train", "fp32 eval", "fp32 train"}


def test_clipping_acts_in_the_configs_that_clip(report):
    rows = [r for r in report.rows if r.check.startswith("update")]
    clipping = [r for r in rows if "no clip" not in r.check]
    assert len(rows) == 2 * len(training.update_configs(1.0)) and len(clipping) == len(rows) - 2
    assert all(r.reason.endswith("; clipping acted") for r in clipping)
