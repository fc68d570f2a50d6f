"""Trajectories: the same initial weights (drawn by jax, transferred to torch), the same batches, 300 updates.

Each preset's model, small: the digits MLP (64-32-32-10, batch 32, the digits preset's optimizer) and a
character GPT (context 16, width 32, 2 blocks, batch 8, the shakespeare preset's optimizer) on the first
60k characters of Tiny Shakespeare. Losses are compared update by update (curve_rel_diff), parameters
after 300 updates tensor by tensor (tree_rel_diff, key biases aside: see the key-bias test).
"""

from __future__ import annotations

from dataclasses import replace

import jax
import numpy as np
import pytest
import torch

from jaxloop.config.run import preset
from jaxloop.data.sources import MicroBatchGather, load_splits
from jaxloop.model.builtin import make_model
from jaxloop.update import step as update_step
from jaxloop.update.optimizer import skip_nonfinite_windows
from jaxloop.update.step import cross_entropy_loss
from parity_tests.harness import (
    QUIET,
    curve_rel_diff,
    flat_params,
    gpt_cfg,
    host,
    jax_mode,
    jax_run,
    jax_state,
    mlp_cfg,
    model,
    torch_run,
    torch_threads,
    tree_rel_diff,
    ulps_of_value,
)
from torch_ref.models import export_jax_params
from torch_ref.state import create_torch_state as torch_state
from torch_ref.step import cross_entropy_loss as torch_loss
from torch_ref.step import forward, train_update

train_step = jax.jit(update_step.train_step, donate_argnums=0)  # as the loop builds it

UPDATES = 300
SNAP = 25


def _pair(cfg, splits, init=None):
    """jaxloop's run (from `init`, or from the weights it draws), then torch_ref's from jaxloop's initial
    weights (on one thread: harness.torch_threads)."""
    j = jax_run(cfg, splits, UPDATES, snapshot_every=SNAP, init_params=init)
    with torch_threads(1):
        t = torch_run(cfg, splits, j.init, UPDATES, snapshot_every=SNAP)
    return j, t


def _record(parity, key, j, t):
    updates = sorted(j.snapshots)
    parity.add_series(
        key,
        update=np.arange(1, UPDATES + 1),
        jax_loss=j.losses,
        torch_loss=t.losses,
        jax_lr=j.lrs,
        torch_lr=t.lrs,
        loss_rel_diff=np.abs(j.losses - t.losses) / np.abs(t.losses),
        snapshot_update=updates,
        param_rel_diff=[tree_rel_diff(j.snapshots[u], t.snapshots[u])[0] for u in updates],
    )


def _drawn_as_fp32(name, runs):
    """The fp32 run's initial weights for the other runs: the bf16 and tanh runs draw the very same ones
    (float32 params, the same rng; compared bit for bit), and the fp64 run starts from them as float64
    (exactly representable, as menu.py's combinations start): no model init is compiled again."""
    return runs["fp32"][0].init if name != "fp32" else None


@pytest.fixture(scope="module")
def mlp(parity):
    cfg = mlp_cfg()
    splits = load_splits(cfg)
    runs = {}
    for name, c in (
        ("fp32", cfg),
        ("fp64", replace(cfg, precision="fp64")),
        ("bf16", replace(cfg, precision="bf16")),
        ("tanh_fp32", model(cfg, activation="tanh")),
    ):
        runs[name] = _pair(c, splits, _drawn_as_fp32(name, runs))
        _record(parity, f"mlp_{name}", *runs[name])
    return cfg, splits, runs


@pytest.fixture(scope="module")
def gpt(parity, shakespeare_slice):
    cfg = gpt_cfg(shakespeare_slice)
    splits = load_splits(cfg)
    runs = {}
    for name in ("fp32", "fp64", "bf16"):
        runs[name] = _pair(replace(cfg, precision=name), splits, _drawn_as_fp32(name, runs))
        _record(parity, f"gpt_{name}", *runs[name])
    return cfg, splits, runs


def _qkv_biases(tree):
    return [
        (path, leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
        if jax.tree_util.keystr(path).endswith("['qkv']['bias']")
    ]


# ----------------------------------------------------------------------------- float64


@pytest.mark.parametrize("preset", ["mlp", "gpt"])
def test_float64_losses_and_params_agree_to_1e10(preset, request, parity):
    _, _, runs = request.getfixturevalue(preset)
    j, t = runs["fp64"]
    parity.check(
        f"trajectory fp64 {preset}: loss of every update (300), relative",
        curve_rel_diff(j.losses, t.losses),
        1e-10,
        "the same float64 computation in another operation order: rounding ~1e-16 per update",
    )
    parity.check(
        f"trajectory fp64 {preset}: params after 300 updates, relative",
        tree_rel_diff(j.params, t.params)[0],
        1e-10,
        "same",
    )
    parity.check(
        f"trajectory fp64 {preset}: lr metric of train_step vs torch param_group lr, relative",
        curve_rel_diff(j.lrs, t.lrs),
        1e-13,
        "the float64 schedule (test_learning_rate)",
    )


# ----------------------------------------------------------------------------- float32


@pytest.mark.parametrize("preset,name", [("mlp", "fp32"), ("mlp", "tanh_fp32"), ("gpt", "fp32")])
def test_float32_smooth_activation_losses_and_params_agree_to_1e5(preset, name, request, parity):
    # Each update adds a few float32 roundings (~1e-7 relative) that differ between XLA and torch
    # (summation order in matmuls, GELU/tanh, log-softmax, Adam); the loss and the weights integrate
    # them over 300 updates. Smooth activations keep that accumulation gradual.
    _, _, runs = request.getfixturevalue(preset)
    j, t = runs[name]
    act = "tanh" if name.startswith("tanh") else "gelu"
    parity.check(
        f"trajectory fp32 {preset} ({act}): loss of every update (300), relative",
        curve_rel_diff(j.losses, t.losses),
        1e-5,
        "float32 rounding accumulated over 300 updates",
    )
    parity.check(
        f"trajectory fp32 {preset} ({act}): params after 300 updates, relative",
        tree_rel_diff(j.params, t.params)[0],
        1e-5,
        "same",
    )
    parity.check(
        f"trajectory fp32 {preset} ({act}): lr metric vs torch lr, float32 ulps of the rate",
        float(np.max(ulps_of_value(j.lrs, t.lrs))),
        0.5,
        "jaxloop's float32 rate is the float64 rate rounded once (test_learning_rate)",
    )


def stock_optax_adamw(cfg):
    """optax by default: chain(clip_by_global_norm, optax.adamw(schedule, b1, b2, eps, weight_decay, mask))
    averaged over K micro-batches (skip_nonfinite_windows, as the loop's), optax's own bias corrections (jaxloop's
    schedule: test_learning_rate checks it)."""
    import optax

    from jaxloop.update.optimizer import decay_mask
    from jaxloop.update.schedules import make_schedule

    o = cfg.optim
    adamw = optax.adamw(
        make_schedule(cfg.optim, cfg.steps),
        b1=o.optimizer.b1,
        b2=o.optimizer.b2,
        eps=o.optimizer.eps,
        weight_decay=o.optimizer.weight_decay,
        mask=decay_mask,
    )
    return skip_nonfinite_windows(optax.chain(optax.clip_by_global_norm(o.clip_norm), adamw), o.accum_steps)


def _stock_run(cfg, splits, init):
    """jaxloop's train_step with stock optax.adamw in place of jaxloop's optimizer, 300 updates."""
    with jax_mode(cfg.precision):
        state = jax_state(cfg, splits, init)
        tx = stock_optax_adamw(cfg)
        state = state.replace(tx=tx, opt_state=tx.init(state.params))
        gather = MicroBatchGather(splits.train, cfg.seed, cfg.batch_size)
        losses = []
        for u in range(UPDATES):
            state, m = train_step(state, gather(u))
            losses.append(float(m["loss"]))
        return np.asarray(losses), host(state.params)


def test_stock_optax_adamw_agrees_with_torch_adamw_in_float64_over_a_trajectory(mlp, parity):
    """The libraries by default: optax.adamw (not jaxloop's exact-bias-correction variant) under jaxloop's
    step, against torch.optim.AdamW under torch_ref, 300 updates of the MLP in float64: the same algebra,
    so the float64 bound. Mutant caught (run, seen to fail): optax.adamw with eps_root=eps (eps inside the
    square root): the loss 8.7e-3 apart."""
    cfg, splits, runs = mlp
    _, t = runs["fp64"]
    losses, params = _stock_run(replace(cfg, precision="fp64"), splits, runs["fp64"][0].init)
    parity.check(
        "trajectory fp64 mlp, stock optax.adamw vs torch AdamW: loss of every update (300), relative",
        curve_rel_diff(losses, t.losses),
        1e-10,
        "as jaxloop's fp64 trajectory: the same AdamW in float64",
    )
    parity.check(
        "trajectory fp64 mlp, stock optax.adamw vs torch AdamW: params after 300 updates, relative",
        tree_rel_diff(params, t.params)[0],
        1e-10,
        "same",
    )


def test_float32_drift_of_stock_optax_adamw_is_measured(mlp, parity):
    """The float32 MLP trajectory with stock optax.adamw (its float32 bias corrections: jaxloop before its
    fix in jaxloop.update.optimizer) against torch, beside jaxloop's: recorded for the report, and it must be the larger."""
    cfg, splits, runs = mlp
    j, t = runs["fp32"]
    losses, params = _stock_run(cfg, splits, j.init)
    before, after = curve_rel_diff(losses, t.losses), curve_rel_diff(j.losses, t.losses)
    parity.note("fp32 mlp loss difference with optax's own bias correction (before the fix)", before)
    parity.note("fp32 mlp loss difference with jaxloop's exact bias correction", after)
    parity.note("fp32 mlp params difference, stock optax.adamw vs torch", tree_rel_diff(params, t.params)[0])
    parity.note("fp32 mlp params difference, jaxloop vs torch", tree_rel_diff(j.params, t.params)[0])
    assert before > after


def test_fp32_state_under_x64_stays_float32_but_its_schedule_and_bias_corrections_do_not(mlp, parity):
    """Why the suite turns x64 off for float32: with x64 on, a precision=fp32 state is float32 leaf for
    leaf, but the schedule and the Adam bias corrections are evaluated in float64 (the counts are
    promoted to the default float) before being rounded to float32: a computation no float32 jaxloop
    run performs, and a different trajectory."""
    cfg, splits, runs = mlp
    init = runs["fp32"][0].init
    gather = MicroBatchGather(splits.train, cfg.seed, cfg.batch_size)
    with jax.enable_x64(True):
        state = jax_state(cfg, splits, init)
        kinds = {str(leaf.dtype) for leaf in jax.tree.leaves(state)}
        text = str(jax.make_jaxpr(train_step)(state, gather(0)))
    assert kinds <= {"float32", "int32", "uint32", "bool"}, kinds
    assert "f64[]" in text, "float64 scalars in the float32 step under x64"
    x64_run = jax_run(cfg, splits, 50, init_params=init, x64=True)
    true_run = jax_run(cfg, splits, 50, init_params=init, x64=False)
    differ = tree_rel_diff(x64_run.params, true_run.params)[0]
    assert differ > 0, "x64 changes a float32 run"
    parity.check(
        "x64 finding: fp32 jaxloop with x64 on vs off, params after 50 updates (they differ)",
        differ,
        1e-5,
        "float64 vs float32 rounding of the rate and of 1 - b^t, a few float32 ulps per update",
    )


# ----------------------------------------------------------------------------- the key bias


def test_attention_key_bias_is_a_null_direction_that_adam_turns_into_noise(gpt, parity):
    """softmax(q.(k + b_k)) = softmax(q.k + q.b_k) with q.b_k the same for every key of a query, so the
    loss does not depend on b_k: its gradient is 0 up to rounding, and Adam, which divides by the
    gradient's own size, turns that rounding into steps of ~lr in a random direction. The two
    frameworks' key biases therefore wander apart while everything the model computes agrees. The
    parameter comparisons leave the key third of qkv biases out (harness.without_key_bias)."""
    cfg, splits, runs = gpt
    j, t = runs["fp32"]
    batch = MicroBatchGather(splits.train, cfg.seed, cfg.batch_size)(0)
    c = cfg.model.d_model
    # the model's two programs (the logits, the gradient) in jax; the float64 bookkeeping around them (the
    # params as float64, the shifted key biases, the largest change, the slices) on the host, where an eager
    # jnp op would compile once per shape
    params = jax.tree.map(lambda v: np.asarray(v, np.float64), j.params)
    with jax_mode("fp64"):
        m = make_model(cfg.model, splits.num_classes, cfg.precision)
        apply = jax.jit(lambda p, x: m.apply({"params": p}, x))
        logits = host(apply(params, batch["x"]))

        def shift(path, p):
            if not jax.tree_util.keystr(path).endswith("['qkv']['bias']"):
                return p
            p = p.copy()
            p[c : 2 * c] += 0.5
            return p

        shifted = jax.tree_util.tree_map_with_path(shift, params)
        moved = float(np.max(np.abs(host(apply(shifted, batch["x"])) - logits)))
        bound = lambda p: lambda x, train=False: m.apply({"params": p}, x, train=train)  # noqa: E731
        grads = host(jax.jit(jax.grad(lambda p: cross_entropy_loss(bound(p), batch, False)[0]))(params))
        gk = [g[c : 2 * c] for path, g in _qkv_biases(grads)]
        gq = [g[:c] for path, g in _qkv_biases(grads)]
    tstate = torch_state(replace(cfg, precision="fp64"), splits, init_params=t.params)
    x, y = torch.from_numpy(np.array(batch["x"])), torch.from_numpy(np.array(batch["y"]))
    torch_loss(forward(tstate, x), y)[0].backward()
    tk = [blk.attn.qkv.bias.grad[c : 2 * c].numpy() for blk in tstate.model.blocks]
    tq = [blk.attn.qkv.bias.grad[:c].numpy() for blk in tstate.model.blocks]
    ratio = max(
        max(np.linalg.norm(k) / np.linalg.norm(q) for k, q in zip(gk, gq)),
        max(np.linalg.norm(k) / np.linalg.norm(q) for k, q in zip(tk, tq)),
    )
    flat_j, flat_t = flat_params(j.params), flat_params(t.params)
    key_gap = max(
        np.linalg.norm(flat_j[k][c : 2 * c] - flat_t[k][c : 2 * c]) / np.linalg.norm(flat_t[k][c : 2 * c])
        for k in flat_j
        if k.endswith("attn/qkv/bias")
    )
    assert key_gap > 100 * tree_rel_diff(j.params, t.params)[0], (
        f"the fp32 key biases wander apart ({key_gap:.1e}) far beyond the other parameters"
    )
    parity.check(
        "key bias: logits change when every key bias moves by 0.5 (fp64)",
        moved,
        1e-12,
        "softmax is invariant to a per-query constant; only rounding remains",
    )
    parity.check(
        "key bias: |grad of key bias| / |grad of query bias| (fp64, both frameworks)",
        ratio,
        1e-10,
        "the exact gradient is 0; float64 rounding leaves ~1e-16 of the gradients' size",
    )


# ----------------------------------------------------------------------------- ReLU


def _relu_lockstep(cfg, splits, updates, init):
    """Both frameworks side by side from `init`; per update, every hidden pre-activation of that update's
    batch in each, and the (update, layer, record, unit) where one is active and the other not."""
    gather = MicroBatchGather(splits.train, cfg.seed, cfg.batch_size)
    m = make_model(cfg.model, splits.num_classes, cfg.precision)
    flips, diffs = [], []
    with jax_mode(cfg.precision), torch_threads(1):
        state = jax_state(cfg, splits, init)
        tstate = torch_state(cfg, splits, init_params=host(state.params))
        intermediates = jax.jit(lambda p, x: m.apply({"params": p}, x, capture_intermediates=True)[1]["intermediates"])
        dtype = torch.float64 if cfg.precision == "fp64" else torch.float32
        for u in range(updates):
            batch = gather(u)
            inter = intermediates(state.params, batch["x"])
            x, y = torch.from_numpy(np.array(batch["x"])), torch.from_numpy(np.array(batch["y"]))
            with torch.no_grad():
                h = x.to(dtype)
                for i, layer in enumerate(tstate.model.hidden):
                    zt = layer(h).numpy()
                    zj = np.asarray(inter[f"hidden_{i}"]["__call__"][0])
                    scale = float(np.sqrt(np.mean(zt.astype(np.float64) ** 2)))
                    for r, k in zip(*np.nonzero((zt > 0) != (zj > 0))):
                        flips.append(
                            dict(
                                update=u,
                                layer=i,
                                record=int(r),
                                unit=int(k),
                                jax=float(zj[r, k]),
                                torch=float(zt[r, k]),
                                scale=scale,
                            )
                        )
                    h = torch.relu(layer(h))
            state, _ = train_step(state, batch)
            train_update(tstate, [(x, y)], clip="optax")
            if (u + 1) % 10 == 0:
                diffs.append((u + 1, tree_rel_diff(host(state.params), export_jax_params(tstate.model))[0]))
    return flips, diffs


@pytest.fixture(scope="module")
def relu():
    cfg = model(mlp_cfg(batch_size=64), activation="relu", hidden=(128, 128))  # the digits preset's own sizes
    splits = load_splits(cfg)
    with jax_mode("fp32"):  # drawn once, float32 (exactly representable in float64): one model init compiled
        init = host(jax_state(cfg, splits).params)
    return {p: _relu_lockstep(replace(cfg, precision=p), splits, UPDATES, init) for p in ("fp32", "fp64")}


def test_relu_units_flip_in_one_framework_only_at_rounding_level_pre_activations(relu, parity):
    """ReLU's derivative jumps at 0: where a pre-activation is within the two frameworks' float32
    difference of 0, one of them counts the unit active and the other not, and that record's gradient
    through the unit (its whole upstream gradient) is in one update and not in the other. Found here by
    running both side by side and comparing the sign of every hidden pre-activation of every batch.
    In float64 the frameworks' difference is ~1e-16, and no unit flips."""
    flips32, diffs32 = relu["fp32"]
    flips64, diffs64 = relu["fp64"]
    assert flips32, "float32: at least one unit is active in one framework only (the mechanism shown)"
    closest = max(abs(f["torch"] - f["jax"]) / f["scale"] for f in flips32)
    first = flips32[0]["update"]
    before = max([d for u, d in diffs32 if u <= first] or [0.0])
    after = diffs32[-1][1]
    parity.check(
        f"ReLU fp32: |z_jax - z_torch| / rms(z) at the {len(flips32)} flipped unit(s) (first at update {first})",
        closest,
        1e-5,
        "a unit can flip only where the two float32 values straddle 0",
    )
    parity.check(
        f"ReLU fp32: params after 300 updates (drift; {before:.1e} before the first flip)",
        after,
        1e-3,
        "one record's gradient through one unit in one update: bounded by ~lr/batch, not amplified",
    )
    parity.check(
        "ReLU fp64: units flipped in one framework only (300 updates)",
        len(flips64),
        0,
        "float64 differences (~1e-16) do not straddle 0",
    )
    parity.check(
        "ReLU fp64: params after 300 updates, relative",
        diffs64[-1][1],
        1e-10,
        "no flips: the float64 agreement of the smooth activations",
    )


# ----------------------------------------------------------------------------- bf16

PRESET_UPDATES = 4


@pytest.fixture(scope="module")
def gpt_preset_cfg(shakespeare_slice):
    """The shakespeare preset's GPT (context 128, width 128, 4 blocks of 4 heads, tied head) at the preset's
    peak rate (warmup 0; batch 8 instead of 32, to keep the suite short) on the Tiny Shakespeare slice."""
    base = preset("shakespeare")
    return replace(
        base,
        log=QUIET,
        batch_size=8,
        steps=100,
        data=replace(base.data, path=str(shakespeare_slice)),
        optim=replace(base.optim, lr_schedule=replace(base.optim.lr_schedule, warmup_steps=0)),
    )


@pytest.fixture(scope="module")
def gpt_preset_bf16(gpt_preset_cfg):
    """gpt_preset_cfg's GPT for PRESET_UPDATES updates: jaxloop fp32, bf16 (autocast-like) and bf16_full (whole
    model), torch_ref fp32 and bf16 (torch.autocast), all from jaxloop's fp32 initial weights."""
    cfg = gpt_preset_cfg
    splits = load_splits(cfg)
    j32 = jax_run(cfg, splits, PRESET_UPDATES)
    runs = {"jax fp32": j32}
    for name in ("bf16", "bf16_full"):
        runs[f"jax {name}"] = jax_run(replace(cfg, precision=name), splits, PRESET_UPDATES, init_params=j32.init)
    with torch_threads(1):
        runs["torch fp32"] = torch_run(cfg, splits, j32.init, PRESET_UPDATES)
        runs["torch bf16"] = torch_run(replace(cfg, precision="bf16"), splits, j32.init, PRESET_UPDATES)
    return runs


def _bf16_gaps(runs, jax_name):
    """(loss gaps: jax own, torch own, cross), (params gaps: the same): loss by the RMS over the updates of
    the relative difference, params by tree_rel_diff after the last update."""
    rel = lambda a, b: np.abs(a - b) / np.abs(b)  # noqa: E731
    rms = lambda v: float(np.sqrt(np.mean(v**2)))  # noqa: E731
    jb, tb, jf, tf = runs[jax_name], runs["torch bf16"], runs["jax fp32"], runs["torch fp32"]
    loss = (rms(rel(jb.losses, jf.losses)), rms(rel(tb.losses, tf.losses)), rms(rel(jb.losses, tb.losses)))
    params = (
        tree_rel_diff(jb.params, jf.params)[0],
        tree_rel_diff(tb.params, tf.params)[0],
        tree_rel_diff(jb.params, tb.params)[0],
    )
    return loss, params


def _block_outputs(cfg, splits, params, inputs, precision):
    """jaxloop's GPT blocks under `precision` (the policy's casts, jaxloop.model.interface's bind), block i on
    inputs[i] with its own params: one compiled block for all of them (they share their shapes)."""
    from jaxloop.model.builtin import Block
    from jaxloop.model.interface import LinenModel
    from jaxloop.model.precision import get_policy, pinned_matmuls

    block = Block(*make_model(cfg.model, splits.num_classes, precision).block_args())
    policy = get_policy(precision)

    @jax.jit
    def forward(p, x):
        with pinned_matmuls():  # as jaxloop's steps trace
            return LinenModel(module=block).bind(p, {}, False, None, policy)[0](x, False)

    with jax_mode(precision):
        return [np.asarray(forward(params[f"block_{i}"], x)) for i, x in enumerate(inputs)]


def _torch_blocks(cfg, splits, params, precision, x=None, inputs=None):
    """torch_ref's GPT under `precision` (torch.autocast for bf16), eval mode: with `x` (token ids) its whole
    forward pass, returning (each block's input, each block's output); with `inputs`, block i on inputs[i]."""
    from torch_ref.state import create_torch_state

    module = create_torch_state(replace(cfg, precision=precision), splits, init_params=params, device="cpu").model
    module.eval()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
    seen_in, seen_out = [], []

    def seen(_, args, out):  # a forward hook: returning None leaves the block's output as it is
        seen_in.append(args[0].float().numpy())
        seen_out.append(out.float().numpy())

    with torch.no_grad(), autocast:
        if inputs is not None:
            return None, [module.blocks[i](torch.from_numpy(a)).float().numpy() for i, a in enumerate(inputs)]
        for b in module.blocks:
            b.register_forward_hook(seen)
        module(torch.from_numpy(np.asarray(x)).long())
    return seen_in, seen_out


def test_bf16_autocast_like_blocks_are_a_quarter_of_each_frameworks_own_bf16_gap_apart(
    gpt_preset_cfg, gpt_preset_bf16, parity
):
    """jaxloop's bf16 (matmuls in bf16 with float32 accumulation, LayerNorm/softmax/residual in float32)
    against torch_ref's torch.autocast, block by block on the preset GPT at its initial weights: each block
    of both frameworks gets the same input (the one it sees in torch's autocast forward pass of 8 windows
    of the slice), and each framework's bf16 block departs from its own fp32 block on that input by bf16
    rounding (own gap). The two bf16 blocks must be at most a quarter of the smaller own gap apart (RMS over
    the block's 8 x 128 x 128 outputs; the worst block): the same ops rounded at the same places, so only
    float32-level differences (accumulation order) move a bf16 rounding. Measured on a 2-core AMD EPYC
    (AVX2, no AVX-512): 0.06-0.15 of the own gap over seeds 0-2 (worst block).
    Mutants caught (run, seen to fail): jaxloop's bf16 policy made whole-model bf16 (bf16_full's casts, jaxloop's
    bf16 before) at 1.40 of the own gap (block 3); attention dividing the bf16 scores by a bf16 sqrt(d) in bf16
    (torch divides in float32) at 0.64 (block 0).
    Why blocks and not the training losses: the losses of the first PRESET_UPDATES updates (a batch mean
    each) hold too few roundings to bound; their cross / own ratio, kept as a note, measured 0.23-0.87 over
    seeds 0-5 on that CPU for this policy and 1.08-3.31 for bf16_full (and 0.15 once on another CPU)."""
    splits = load_splits(gpt_preset_cfg)
    init = gpt_preset_bf16["jax fp32"].init
    x = splits.train.get(np.random.default_rng(0).permutation(len(splits.train))[:8])["x"]
    with torch_threads(1):
        inputs, torch_bf16 = _torch_blocks(gpt_preset_cfg, splits, init, "bf16", x=x)
        _, torch_fp32 = _torch_blocks(gpt_preset_cfg, splits, init, "fp32", inputs=inputs)
    jax_bf16 = _block_outputs(gpt_preset_cfg, splits, init, inputs, "bf16")
    jax_fp32 = _block_outputs(gpt_preset_cfg, splits, init, inputs, "fp32")
    rms = lambda a: float(np.sqrt(np.mean(np.square(a, dtype=np.float64))))  # noqa: E731
    ratios = [
        rms(jb - tb) / min(rms(jb - jf), rms(tb - tf))
        for jb, tb, jf, tf in zip(jax_bf16, torch_bf16, jax_fp32, torch_fp32)
    ]
    worst = int(np.argmax(ratios))
    parity.check(
        f"bf16 preset GPT blocks: output on the same input, jaxloop bf16 vs torch autocast, RMS / min own gap "
        f"(worst of {len(ratios)}: block {worst}; bound 0.25)",
        ratios[worst],
        0.25,
        "the same per-op casts: only float32-level differences move a bf16 rounding",
    )
    (lj, lt, lc), (pj, pt, pc) = _bf16_gaps(gpt_preset_bf16, "jax bf16")
    parity.note("bf16 preset GPT: loss cross / min own gap (autocast-like)", lc / min(lj, lt))
    parity.note("bf16 preset GPT: params cross / min own gap (autocast-like)", pc / min(pj, pt))
    parity.note("bf16 preset GPT: params own gap jax", pj)
    parity.note("bf16 preset GPT: params own gap torch", pt)
    parity.note("bf16 preset GPT: params cross gap", pc)


def test_bf16_full_whole_model_policy_gap_is_measured(gpt_preset_bf16, parity):
    """jaxloop's bf16_full (the whole model in bf16: LayerNorm, softmax inputs and the residual stream too)
    against torch autocast: its cross-framework gap is of the order of the own gaps, not a fraction of them
    (measured; this is the mutant the autocast-like check above rejects)."""
    (lj, lt, lc), (pj, pt, pc) = _bf16_gaps(gpt_preset_bf16, "jax bf16_full")
    parity.note("bf16_full preset GPT: loss cross / min own gap (whole model)", lc / min(lj, lt))
    parity.note("bf16_full preset GPT: params cross / min own gap (whole model)", pc / min(pj, pt))
    parity.check(
        "bf16_full finding: 0.25 / (params cross gap / min own gap) for the whole-model policy "
        "(> 1 would mean it passes the autocast bound)",
        0.25 * min(pj, pt) / pc,
        1.0,
        "whole-model bf16 rounds the residual stream and LayerNorm too: not torch.autocast",
        kind="finding",
    )


@pytest.mark.parametrize("preset_name", ["mlp", "gpt"])
def test_bf16_300_update_gap_across_frameworks_is_at_most_twice_each_frameworks_own_gap(preset_name, request, parity):
    """The small models over 300 updates in bf16 (autocast-like in jaxloop, torch.autocast): the updates
    compound the rounding noise, so over a whole run the two bf16 runs are compared with the own gaps by
    RMS over the 300 updates, at most twice the smaller (bf16 differences are noise that changes sign
    and size from update to update)."""
    _, _, runs = request.getfixturevalue(preset_name)
    (jb, tb), (jf, tf) = runs["bf16"], runs["fp32"]
    rel = lambda a, b: np.abs(a - b) / np.abs(b)  # noqa: E731
    rms = lambda v: float(np.sqrt(np.mean(v**2)))  # noqa: E731
    gap_j, gap_t, cross = rel(jb.losses, jf.losses), rel(tb.losses, tf.losses), rel(jb.losses, tb.losses)
    parity.note(f"bf16 {preset_name} 300 updates: loss RMS cross / min own", rms(cross) / min(rms(gap_j), rms(gap_t)))
    parity.check(
        f"trajectory bf16 {preset_name}: loss RMS over 300 updates, jax vs torch (bound: 2 x min own bf16-fp32 gap;"
        f" gaps {rms(gap_j):.1e}, {rms(gap_t):.1e})",
        rms(cross),
        2 * min(rms(gap_j), rms(gap_t)),
        "each framework's bf16 noise compounds over the run",
    )
