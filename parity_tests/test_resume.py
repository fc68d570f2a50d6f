"""Resume: a run interrupted at update k and resumed ends where the uninterrupted run ends.

The real loops (jaxloop.train.run, torch_ref.train.run) on the digits MLP in float64: 40 updates of 2
micro-batches, checkpoints every 10, interrupted at k = 13 (mid-epoch, between checkpoints), 22 (the
epoch boundary) and 30 (on a checkpoint, mid-epoch); see conftest.resume_runs. Within a framework the
resumed run is compared bit for bit (state digest, every logged number); across frameworks as in
test_trajectory (relative, 1e-10 in float64).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from parity_tests.harness import RESUME_AT, curve_rel_diff, data_position, jax_checkpoint, records, tree_rel_diff
from torch_ref.checkpoint import CheckpointManager
from torch_ref.models import export_jax_params

LOGGED = ("step", "loss", "lr", "grad_norm", "skipped")


def _logged(run_dir) -> list[tuple]:
    return [tuple(r[k] for k in LOGGED) for r in records(run_dir)]


def _losses(run_dir) -> np.ndarray:
    rows = records(run_dir)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), "one record per update"
    return np.array([r["loss"] for r in rows])


def _jax_final_params(resume_runs, cfg):
    step, state, _ = jax_checkpoint(cfg, resume_runs["splits"])
    assert step == cfg.steps
    return jax.tree.map(np.asarray, state.params)


def test_jaxloop_resumed_runs_are_bit_identical_to_the_uninterrupted_run(resume_runs, parity):
    cfg, summary = resume_runs["jax"]
    differing = 0
    for k in RESUME_AT:
        rcfg, rsummary = resume_runs[("jax", k)]
        differing += rsummary["state_digest"] != summary["state_digest"]
        differing += _logged(rcfg.run_dir) != _logged(cfg.run_dir)
    parity.check(
        f"resume jaxloop (k = {', '.join(map(str, RESUME_AT))}): resumed runs differing from uninterrupted "
        "(state digest, logged numbers)",
        differing,
        0,
        "bit-identical: the same computation on the same data",
    )


def test_torch_ref_resumed_runs_are_bit_identical_to_the_uninterrupted_run(resume_runs, parity):
    cfg, result = resume_runs["torch"]
    differing = 0
    for k in RESUME_AT:
        rcfg, rresult = resume_runs[("torch", k)]
        differing += rresult.summary["state_digest"] != result.summary["state_digest"]
        differing += _logged(rcfg.run_dir) != _logged(cfg.run_dir)
    parity.check(
        f"resume torch_ref (k = {', '.join(map(str, RESUME_AT))}): resumed runs differing from uninterrupted "
        "(state digest, logged numbers)",
        differing,
        0,
        "bit-identical: the same computation on the same data",
    )


def test_resumed_trajectories_agree_across_frameworks_as_tightly_as_uninterrupted_ones(resume_runs, parity):
    jcfg, _ = resume_runs["jax"]
    tcfg, tresult = resume_runs["torch"]
    base_loss = curve_rel_diff(_losses(jcfg.run_dir), _losses(tcfg.run_dir))
    base_params = tree_rel_diff(_jax_final_params(resume_runs, jcfg), export_jax_params(tresult.state.model))[0]
    worst_loss, worst_params = 0.0, 0.0
    for k in RESUME_AT:
        rj, _ = resume_runs[("jax", k)]
        rt, rresult = resume_runs[("torch", k)]
        worst_loss = max(worst_loss, curve_rel_diff(_losses(rj.run_dir), _losses(rt.run_dir)))
        worst_params = max(
            worst_params, tree_rel_diff(_jax_final_params(resume_runs, rj), export_jax_params(rresult.state.model))[0]
        )
    parity.check(
        "resume fp64: uninterrupted runs, jaxloop vs torch_ref, loss of every update",
        base_loss,
        1e-10,
        "as test_trajectory fp64",
    )
    parity.check(
        "resume fp64: resumed runs, jaxloop vs torch_ref, loss of every update",
        worst_loss,
        1e-10,
        "as test_trajectory fp64",
    )
    parity.check(
        "resume fp64: resumed runs, jaxloop vs torch_ref, final params", worst_params, 1e-10, "as test_trajectory fp64"
    )
    parity.check(
        "resume fp64: |resumed cross-framework difference - uninterrupted one|",
        max(abs(worst_loss - base_loss), abs(worst_params - base_params)),
        0.0,
        "each resumed run is bit-identical to its uninterrupted run, so the gap is the same number",
    )


def test_both_resume_at_the_same_update_with_the_same_rate_and_data_position(resume_runs, parity):
    cfg = resume_runs["cfg"]
    K = cfg.optim.accum_steps
    base: Path = resume_runs["base"]
    jcfg, _ = resume_runs["jax"]
    reference = {r["step"]: r for r in records(jcfg.run_dir)}
    mismatches, worst_lr = 0, 0.0
    from dataclasses import replace

    for k in RESUME_AT:
        jstep, _, jdata = jax_checkpoint(
            replace(cfg, run_dir=str(base / f"jax_{k}_interrupted")), resume_runs["splits"]
        )
        tstep, payload = CheckpointManager(cfg, base / f"torch_{k}_interrupted").restore_latest()
        mismatches += (jstep, data_position(jdata)) != (k, K * k)
        mismatches += (tstep, payload["step"], payload["position"]) != (k, k, K * k)
        rj, _ = resume_runs[("jax", k)]
        rt, _ = resume_runs[("torch", k)]
        resumed = [
            json.loads(line)["step"]
            for name in ("jax", "torch")
            for line in (base / f"{name}_{k}" / "resumes.jsonl").read_text().splitlines()
        ]
        mismatches += resumed != [k, k]
        first_j = next(r for r in records(rj.run_dir) if r["step"] == k + 1)
        first_t = next(r for r in records(rt.run_dir) if r["step"] == k + 1)
        worst_lr = max(
            worst_lr,
            abs(first_j["lr"] - first_t["lr"]) / first_t["lr"],
            abs(first_j["lr"] - reference[k + 1]["lr"]) / reference[k + 1]["lr"],
        )
    parity.check(
        "resume: interrupted runs whose checkpoint/resume is not at update k with data position K*k (both)",
        mismatches,
        0,
        "both save the update they finished and the micro-batches consumed",
    )
    parity.check(
        "resume: rate of the first resumed update, jaxloop vs torch_ref vs uninterrupted, relative",
        worst_lr,
        1e-13,
        "the float64 schedule at update k (test_learning_rate)",
    )
