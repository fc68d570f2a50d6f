"""Every optimizer of the menu against torch's own class (Lion: torch_ref's, from its paper).

Per optimizer (parity_tests.menu.OPTIMIZERS, under the default warmup_cosine schedule):
- lockstep: from the same params, the same gradients fed to both (real gradients of the MLP, two of them
  scaled below the clip norm so that clipped and unclipped updates alternate), each of the first
  LOCKSTEP updates in float64: jaxloop's emitted update against torch_ref's p_new - p_old. Variants without
  momentum / centring / lr_decay run here too (cheap: no model compile).
- trajectories (menu.check_combination): 300 updates, K = 1 and 4, float64 and float32.

Mutant caught (run, seen to fail, reverted): jaxloop's dampened_trace dampening the first gradient too
(torch's buffer starts as the undampened first gradient): the lockstep check of `sgd` (dampening 0.1)
fails, every other optimizer passes.
"""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import optax
import pytest

from jaxloop.config.optimizers import AdagradConfig, RMSpropConfig, SGDConfig
from jaxloop.model.precision import get_policy
from jaxloop.update.optimizer import make_optimizer
from jaxloop.update.step import cross_entropy_loss
from parity_tests.harness import host, jax_mode, jax_state, mlp_cfg, set_torch_grads, tree_rel_diff
from parity_tests.menu import (  # noqa: F401
    OPTIMIZERS,
    adamw_warmup_cosine,
    check_combination,
    combination_cfg,
    menu_inputs,
    sweep_runs,
)
from torch_ref.models import export_jax_params
from torch_ref.optim import clip_gradients
from torch_ref.schedule import step_per_update
from torch_ref.state import create_torch_state

LOCKSTEP = 8
"""Updates compared one by one from the same gradients."""
BELOW_CLIP = (2, 5)
"""Lockstep updates whose gradient is scaled to 0.1 of its norm (below the clip norm: not clipped)."""

LOCKSTEP_VARIANTS = {
    **OPTIMIZERS,
    "sgd_plain": dict(optimizer=SGDConfig(weight_decay=1e-2), peak_lr=0.05),
    "sgd_momentum": dict(optimizer=SGDConfig(momentum=0.9, weight_decay=1e-2), peak_lr=0.05),
    "rmsprop_plain": dict(optimizer=RMSpropConfig(weight_decay=1e-2), peak_lr=1e-3),
    "adagrad_plain": dict(optimizer=AdagradConfig(), peak_lr=0.05),
}


@pytest.fixture(scope="module")
def gradients(menu_inputs):
    """LOCKSTEP float64 gradient trees of the MLP at its initial weights, one per micro-batch."""
    splits, init, batches = menu_inputs
    cfg = combination_cfg({}, "fp64")
    with jax_mode("fp64"):
        state = jax_state(cfg, splits, init)

        @jax.jit
        def grad(params, batch):
            def loss(p):
                model, _ = state.model.bind(p, state.model_state, False, None, state.policy)
                return cross_entropy_loss(model, batch, False)[0]

            return jax.grad(loss)(params)

        out = [host(grad(state.params, batches[1][0][i])) for i in range(LOCKSTEP)]
    return [jax.tree.map(lambda g: g * 0.1, g) if i in BELOW_CLIP else g for i, g in enumerate(out)]


def lockstep(changes, splits, init, grads) -> tuple[list, list]:
    """(jaxloop's updates, torch_ref's p_new - p_old) for each gradient, from the same params. No warmup: its
    first rates (0, peak / 50, ...) make steps so small that an ulp of p, which torch's p_new - p_old
    carries, would be 1e-11 of them; the cosine still changes the rate at every update."""
    cfg = combination_cfg({**changes, "lr_schedule": replace(mlp_cfg().optim.lr_schedule, warmup_steps=0)}, "fp64")
    with jax_mode("fp64"):
        tx = make_optimizer(cfg.optim, cfg.steps, get_policy("fp64"))
        params = jax.tree.map(lambda v: jnp.asarray(v, jnp.float64), init)
        state = tx.init(params)
        update = jax.jit(tx.update)
        jax_steps = []
        for g in grads:
            u, state = update(jax.tree.map(jnp.asarray, g), state, params)
            params = optax.apply_updates(params, u)
            jax_steps.append(host(u))
    tstate = create_torch_state(cfg, splits, init_params=init, device="cpu")
    torch_steps = []
    for g in grads:
        before = export_jax_params(tstate.model)
        clip_gradients(set_torch_grads(tstate.model, g), cfg.optim.clip_norm, "optax")
        tstate.optimizer.step()
        step_per_update(tstate.scheduler)
        torch_steps.append(jax.tree.map(lambda a, b: a - b, export_jax_params(tstate.model), before))
    return jax_steps, torch_steps


@pytest.mark.parametrize("name", list(LOCKSTEP_VARIANTS))
def test_each_update_from_the_same_params_and_gradients_agrees(name, menu_inputs, gradients, parity):
    splits, init, _ = menu_inputs
    jax_steps, torch_steps = lockstep(LOCKSTEP_VARIANTS[name], splits, init, gradients)
    worst = max(tree_rel_diff(j, t)[0] for j, t in zip(jax_steps, torch_steps))
    parity.check(
        f"optimizer {name}: each of the first {LOCKSTEP} updates from the same params and gradients "
        "(lockstep, clipped and unclipped), fp64, relative",
        worst,
        1e-12,
        "the same float64 algebra in another operation order; torch's step read as p_new - p_old, "
        "where an ulp of p is up to ~1e-13 of a step",
    )


@pytest.fixture(scope="module", params=list(OPTIMIZERS))
def optimizer_runs(request, menu_inputs):
    """One optimizer's four trajectories in both loops (adamw: the shared default combination)."""
    return sweep_runs(request, OPTIMIZERS, "adamw", menu_inputs)


def test_trajectories_rates_and_losses_agree(optimizer_runs, parity):
    name, runs = optimizer_runs
    check_combination(parity, f"optimizer {name}", runs)
