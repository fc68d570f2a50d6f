"""Cross-framework resume: a checkpoint of one loop, converted, is resumed by the other loop.

`python -m parity_tests.convert --from torch|jax SRC DST` (called in-process through its main) on runs of
the digits MLP in float64 interrupted at k = 13 and 30; the other loop then resumes DST with its own real
`run`, and must continue on the trajectory of the source loop's uninterrupted run to the tolerance of
test_trajectory (1e-10 relative in float64).

Each source run starts from its own framework's initial weights (torch->jax: torch_ref's own seeded init,
not jaxloop's), so a loop that ignored the converted checkpoint and trained from its own fresh start
would end elsewhere; and each resumed run must have recorded its resume at update k (resumes.jsonl)
and moved nothing aside (no checkpoints_damaged/). Any warning fails the test (conftest.py): the
damaged-checkpoint fallback warns.

Mutants caught (run, seen to fail, reverted): jaxloop's restore treating every step as damaged (moves it
aside with a warning, retrains from scratch): the warning fails the run; the same without the warning
(restore_latest returns None for the converted run_dir): the run starts afresh and fails when it reaches
the converted step's save (orbax StepAlreadyExistsError); were it to write elsewhere, the missing resume
record and the losses of jaxloop's own init would fail it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import optax
import pytest

from jaxloop.data.sources import load_splits
from jaxloop.loop.runner import run as jax_train
from jaxloop.update.optimizer import SkipWindowsState, find_state
from parity_tests.convert import _adam_and_schedule, jax_state_from_torch, main, torch_state_from_jax
from parity_tests.harness import (
    curve_rel_diff,
    data_position,
    host,
    jax_checkpoint,
    jax_mode,
    mlp_cfg,
    model,
    optim,
    records,
    tree_rel_diff,
)
from torch_ref.checkpoint import CheckpointManager
from torch_ref.data import micro_batch
from torch_ref.models import export_jax_params
from torch_ref.schedule import lr_at
from torch_ref.state import create_torch_state
from torch_ref.step import train_update
from torch_ref.train import run as torch_train

AT = (13, 30)


@pytest.fixture(scope="module")
def converted(resume_runs):
    """torch->jax: torch_ref's runs from its OWN initial weights (uninterrupted, and stopped at k), converted
    at k and resumed by jaxloop. jax->torch: jaxloop's interrupted runs of conftest.resume_runs (from
    jaxloop's init), converted and resumed by torch_ref (whose own init differs)."""
    base, cfg, splits = resume_runs["base"], resume_runs["cfg"], resume_runs["splits"]
    at = lambda name: replace(cfg, run_dir=str(base / name))  # noqa: E731
    own = torch_train(at("torch_own"), clip="optax", device="cpu", splits=splits)
    out = {"torch_own": (at("torch_own"), own)}
    for k in AT:
        src = at(f"torch_own_{k}")
        torch_train(src, clip="optax", stop_after=k, device="cpu", splits=splits)
        dst = base / f"from_torch_{k}"
        assert main(["--from", "torch", src.run_dir, str(dst)]) == 0
        restored = jax_checkpoint(replace(cfg, run_dir=str(dst)), splits)
        jcfg = replace(cfg, run_dir=str(dst))
        out[("torch->jax", k)] = (restored, jcfg, jax_train(jcfg), None)
        dst = base / f"from_jax_{k}"
        assert main(["--from", "jax", str(base / f"jax_{k}_interrupted"), str(dst)]) == 0
        payload = CheckpointManager(cfg, dst).restore_latest()
        tcfg = replace(cfg, run_dir=str(dst))
        result = torch_train(tcfg, clip="optax", device="cpu", splits=splits)
        out[("jax->torch", k)] = (payload, tcfg, result.summary, result)
    return out


def _losses_after(run_dir, k):
    return np.array([r["loss"] for r in records(run_dir) if r["step"] > k])


def test_converted_jax_checkpoint_holds_the_update_schedule_and_data_position(converted, resume_runs, parity):
    K = resume_runs["cfg"].optim.accum_steps
    wrong = 0
    for k in AT:
        (step, state, data), _, _, _ = converted[("torch->jax", k)]
        adam, sched_count = _adam_and_schedule(state.opt_state)
        counts = (
            step,
            int(find_state(state.opt_state, optax.MultiStepsState).gradient_step),
            int(adam.count),
            int(sched_count),
        )
        wrong += counts != (k,) * 4
        wrong += (int(find_state(state.opt_state, optax.MultiStepsState).mini_step), data_position(data)) != (0, K * k)
    parity.check(
        "convert torch->jax: update count, MultiSteps/Adam/schedule counts, mini_step, data position wrong",
        wrong,
        0,
        "AdamW's step and LambdaLR's last_epoch become optax's counts; position carried",
    )


def test_converted_torch_checkpoint_holds_the_update_schedule_and_data_position(converted, resume_runs, parity):
    cfg = resume_runs["cfg"]
    wrong = 0
    for k in AT:
        (step, payload), _, _, _ = converted[("jax->torch", k)]
        steps = {float(s["step"]) for s in payload["optimizer"]["state"].values()}
        lrs = {g["lr"] for g in payload["optimizer"]["param_groups"]}
        wrong += (step, payload["step"], payload["scheduler"]["last_epoch"], steps) != (k, k, k, {float(k)})
        wrong += (lrs != {lr_at(cfg, k)}) + (payload["position"] != cfg.optim.accum_steps * k)
    parity.check(
        "convert jax->torch: update count, AdamW steps, LambdaLR position and lr, data position wrong",
        wrong,
        0,
        "optax's counts become AdamW's step and LambdaLR's last_epoch; position carried",
    )


@pytest.mark.parametrize("direction", ["torch->jax", "jax->torch"])
def test_the_other_loop_resumes_at_k_and_continues_the_source_loops_trajectory(
    direction, converted, resume_runs, parity
):
    cfg = resume_runs["cfg"]
    if direction == "torch->jax":  # the source: torch_ref from its own init
        (scfg, sresult) = converted["torch_own"]
    else:  # the source: jaxloop from its own init (torch_ref's uninterrupted run from the same weights)
        scfg, sresult = resume_runs["torch"][0], resume_runs["torch"][1]
        assert _losses_after(resume_runs["jax"][0].run_dir, 0).size == cfg.steps
    reference_params = export_jax_params(sresult.state.model)
    worst_loss, worst_params, not_resumed = 0.0, 0.0, 0
    for k in AT:
        _, rcfg, _, result = converted[(direction, k)]
        run_dir = Path(rcfg.run_dir)
        resumes = (
            [json.loads(line)["step"] for line in (run_dir / "resumes.jsonl").read_text().splitlines()]
            if (run_dir / "resumes.jsonl").exists()
            else []
        )
        not_resumed += (resumes != [k]) + (run_dir / "checkpoints_damaged").exists()
        losses = _losses_after(rcfg.run_dir, k)
        worst_loss = max(worst_loss, curve_rel_diff(losses, _losses_after(scfg.run_dir, k)))
        if result is None:
            final = host(jax_checkpoint(rcfg, resume_runs["splits"])[1].params)
        else:
            final = export_jax_params(result.state.model)
        worst_params = max(worst_params, tree_rel_diff(final, reference_params)[0])
    parity.check(
        f"convert {direction} (k = 13, 30): converted runs not resumed at k (resumes.jsonl) or with a "
        "checkpoint moved aside",
        not_resumed,
        0,
        "the converted checkpoint is the one restored",
    )
    parity.check(
        f"convert {direction} (k = 13, 30): resumed losses after k vs the source loop's uninterrupted run "
        "(each loop from its own init)",
        worst_loss,
        1e-10,
        "as test_trajectory fp64: the conversion is exact, the rest is rounding",
    )
    parity.check(
        f"convert {direction} (k = 13, 30): final params vs the source loop's uninterrupted run",
        worst_params,
        1e-10,
        "as test_trajectory fp64",
    )


def test_the_frameworks_own_initial_weights_differ(converted, resume_runs, parity):
    """What makes the conversion tests able to fail: a loop that trained from its own fresh start instead
    of the converted checkpoint would end elsewhere (here: torch_ref's run from its own init and its run
    from jaxloop's init end with weights at least 10% apart)."""
    gap = tree_rel_diff(
        export_jax_params(converted["torch_own"][1].state.model), export_jax_params(resume_runs["torch"][1].state.model)
    )[0]
    parity.note("convert: final params of torch_ref from its own init vs from jaxloop's init, relative", gap)
    assert gap > 0.1, f"the two inits end only {gap:.1e} apart"


def _round_trip_change(cfg, splits, original) -> float:
    """Largest change of anything a checkpoint holds after torch_ref -> jaxloop -> torch_ref."""
    with jax_mode(cfg.precision):
        jstate = jax_state_from_torch(cfg, splits, original)
        back = torch_state_from_jax(cfg, splits, jstate, original.position, original.extra.get("best"))
    assert isinstance(find_state(jstate.opt_state, SkipWindowsState).inner_state, optax.MultiStepsState)
    assert (back.step, back.position, back.skipped, back.bad_streak) == (
        original.step,
        original.position,
        original.skipped,
        original.bad_streak,
    )
    assert back.scaler.state_dict() == original.scaler.state_dict(), "the fp16 loss scale and its growth count"
    worst = 0.0
    for p, q in zip(original.model.parameters(), back.model.parameters()):
        worst = max(worst, float((p.detach() - q.detach()).abs().max()))
        a, b = original.optimizer.state[p], back.optimizer.state[q]
        worst = max(
            worst,
            float((a["exp_avg"] - b["exp_avg"]).abs().max()),
            float((a["exp_avg_sq"] - b["exp_avg_sq"]).abs().max()),
            abs(float(a["step"]) - float(b["step"])),
        )
    for e, f in zip(original.ema or [], back.ema or []):
        worst = max(worst, float((e - f).abs().max()))
    return max(
        worst,
        abs(original.optimizer.param_groups[0]["lr"] - back.optimizer.param_groups[0]["lr"]),
        abs(original.scheduler.last_epoch - back.scheduler.last_epoch),
    )


def test_conversion_round_trip_is_exact(resume_runs, parity):
    """torch_ref -> jaxloop -> torch_ref: the fp64 checkpoint at update 13, and an fp16 state with an EMA
    after 3 updates (loss scale, growth count and EMA carried too)."""
    cfg, splits, base = resume_runs["cfg"], resume_runs["splits"], resume_runs["base"]
    _, payload = CheckpointManager(cfg, base / "torch_13_interrupted").restore_latest()
    original = create_torch_state(cfg, splits, device="cpu")
    original.load_state_dict(payload)
    fp16 = optim(model(mlp_cfg(precision="fp16", batch_size=8), hidden=(8,)), ema_decay=0.9)
    fp16_splits = load_splits(fp16)
    scaled = create_torch_state(fp16, fp16_splits, device="cpu")
    for b in range(3):
        train_update(scaled, [micro_batch(fp16, fp16_splits, b)])
    assert scaled.scaler.is_enabled() and scaled.ema is not None
    parity.check(
        "convert: torch -> jax -> torch round trip (fp64 checkpoint; fp16 + EMA state), max |change| of "
        "weights, moments, counts, rate, EMA",
        max(_round_trip_change(cfg, splits, original), _round_trip_change(fp16, fp16_splits, scaled)),
        0.0,
        "a copy (kernels transposed twice), no arithmetic",
    )


def test_gpt_conversion_round_trip_and_fp32_resume(shakespeare_slice, parity):
    """The GPT (tied embedding, qkv, LayerNorm) in float32: jaxloop's state after 3 updates -> torch_ref ->
    jaxloop is a copy (weights, Adam moments, counts), and torch_ref resumed from the converted state
    continues on jaxloop's own trajectory for 20 more updates (test_trajectory's float32 bound)."""
    import jax
    import jax.numpy as jnp

    from jaxloop.update import step as update_step

    train_step = jax.jit(update_step.train_step, donate_argnums=0)  # as the loop builds it
    from parity_tests.harness import gpt_cfg, jax_state

    # test_trajectory's fp32 GPT (gpt_cfg's 300 steps): the very train_step program its run compiles, which the
    # session's compilation cache then holds once; the 23 updates run here lie in the 100-update warmup either way
    cfg = gpt_cfg(shakespeare_slice, precision="fp32")
    splits = load_splits(cfg)
    batches = [micro_batch(cfg, splits, b) for b in range(23)]
    as_jax = lambda b: {"x": jnp.asarray(b[0].numpy()), "y": jnp.asarray(b[1].numpy())}  # noqa: E731
    with jax_mode("fp32"):
        state = jax_state(cfg, splits)
        for b in range(3):
            state, _ = train_step(state, as_jax(batches[b]))
        tstate = torch_state_from_jax(cfg, splits, state, position=3)
        back = jax_state_from_torch(cfg, splits, tstate)
        original = host((state.params, _adam_and_schedule(state.opt_state)[0]))
        copied = host((back.params, _adam_and_schedule(back.opt_state)[0]))
        change = max(
            float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
            for a, b in zip(jax.tree.leaves(original), jax.tree.leaves(copied))
        )
        losses = []
        for b in range(3, 23):
            state, m = train_step(state, as_jax(batches[b]))
            losses.append(float(m["loss"]))
        final = host(state.params)
    tlosses = [train_update(tstate, [batches[b]], clip="optax")["loss"] for b in range(3, 23)]
    parity.check(
        "convert GPT fp32: jax -> torch -> jax round trip, max |change| of weights, Adam moments and counts",
        change,
        0.0,
        "a copy (kernels transposed twice, qkv and the tied embedding as they are)",
    )
    parity.check(
        "convert GPT fp32: torch_ref resumed from the converted update 3, loss of 20 updates vs jaxloop's",
        curve_rel_diff(tlosses, losses),
        1e-5,
        "test_trajectory's float32 bound",
    )
    parity.check(
        "convert GPT fp32: params after the 20 resumed updates, torch_ref vs jaxloop",
        tree_rel_diff(export_jax_params(tstate.model), final)[0],
        1e-5,
        "test_trajectory's float32 bound",
    )
