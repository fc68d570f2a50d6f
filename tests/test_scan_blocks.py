"""GPT(scan_blocks=True): the blocks as one lax.scan, with the same parameters and the same numbers."""

from __future__ import annotations

import jax
import numpy as np

from loopcore.config import Config, DataConfig, ModelConfig
from jaxloop.models import init_params, make_model
from jaxloop.step import cross_entropy_loss


def test_scan_blocks_same_params_logits_and_grads():
    remat = True  # the scan body under jax.checkpoint: the other branch (remat=False) is the plain body
    cfg = Config(preset="shakespeare", data=DataConfig(source="text", path="unused"),
                 model=ModelConfig(kind="gpt", context=8, d_model=16, n_layers=3, n_heads=2, remat=remat))
    x = np.random.default_rng(0).integers(0, 11, (4, 8)).astype(np.int32)
    unrolled, scanned = make_model(cfg, 11, scan_blocks=False), make_model(cfg, 11, scan_blocks=True)
    params = init_params(unrolled, jax.random.PRNGKey(0), x[:1])
    again = init_params(scanned, jax.random.PRNGKey(0), x[:1])
    # the same tree: names (block_0 ...), shapes and initial values, so torch_ref's name map holds
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(again)
    jax.tree.map(np.testing.assert_array_equal, params, again)
    batch = {"x": x, "y": x}
    for m in (unrolled, scanned):
        assert m.apply({"params": params}, x).shape == (4, 8, 11)
    np.testing.assert_allclose(scanned.apply({"params": params}, x), unrolled.apply({"params": params}, x),
                               rtol=1e-5, atol=1e-6)
    def grad(m):
        bound = lambda p: lambda x, train=False: m.apply({"params": p}, x, train=train)  # noqa: E731
        return jax.grad(lambda p: cross_entropy_loss(bound(p), batch, False)[0])(params)

    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), grad(scanned), grad(unrolled))


def test_scan_blocks_dropout_runs_and_is_deterministic():
    cfg = Config(preset="shakespeare", data=DataConfig(source="text", path="unused"),
                 model=ModelConfig(kind="gpt", context=8, d_model=16, n_layers=2, n_heads=2, dropout=0.5))
    x = np.zeros((2, 8), np.int32)
    m = make_model(cfg, 5, scan_blocks=True)
    params = init_params(m, jax.random.PRNGKey(0), x[:1])
    run = lambda k: m.apply({"params": params}, x, train=True, rngs={"dropout": jax.random.PRNGKey(k)})  # noqa: E731
    np.testing.assert_array_equal(run(1), run(1))
    assert not np.allclose(run(1), run(2))
