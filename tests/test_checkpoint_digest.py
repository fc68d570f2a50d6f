"""Every checkpoint is verified on restore: flipped bytes in its array data, moments that decode to huge
values, or an edited data position set the checkpoint aside (checkpoints_damaged/) and the previous one
is used; the run then ends bit-identical to an uninterrupted one. Real `python -m jaxloop.train`
processes against one uninterrupted reference run; the Checkpointer-level cases run in-process."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxloop.checkpoint.digest import UnverifiedCheckpointWarning
from jaxloop.checkpoint.manager import Checkpointer, read_checkpoint
from jaxloop.config.run import Config, ModelConfig, replace, to_dict
from jaxloop.rundir.records import read_records

# The debug preset's MLP: 50 updates, a checkpoint every 10, all five kept.
ARGS = (
    "--preset",
    "debug",
    "--log.progress",
    "off",
    "--log.no-tensorboard",
    "--steps",
    "50",
    "--checkpoint.keep_last",
    "5",
)


def _train(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxloop.train", "--run_dir", str(run_dir), *ARGS, *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_records(run_dir) if r["kind"] == "train"]


def _digest(run_dir: Path) -> str:
    return json.loads((run_dir / "summary.json").read_text())["state_digest"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """One uninterrupted run, copied by each test before it damages the copy."""
    run_dir = tmp_path_factory.mktemp("digest") / "reference"
    done = _train(run_dir)
    assert done.returncode == 0, done.stderr
    return run_dir


def _copy(reference: Path, tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    return run_dir


def _array_data(run_dir: Path, step: int) -> Path:
    """The largest file of a checkpoint's array data (ocdbt's d/: zstd frames without a checksum)."""
    files = (run_dir / "checkpoints" / str(step) / "state" / "ocdbt.process_0" / "d").iterdir()
    return max(files, key=lambda p: p.stat().st_size)


def _flip(path: Path, fraction: float) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * fraction)] ^= 0x40
    path.write_bytes(bytes(data))


def _damaged(stderr: str) -> list[int]:
    return sorted(
        int(line.split("checkpoint at update ")[1].split()[0]) for line in stderr.splitlines() if "is damaged" in line
    )


def test_flipped_bytes_and_an_edited_data_position_are_set_aside_and_the_run_ends_bit_identical(reference, tmp_path):
    # mutants seen failing: verify() not called in restore() (exit 0, another final digest: the flips resumed
    # silently); the data position left out of verify() (update 20 resumed at position 21: other losses)
    run_dir = _copy(reference, tmp_path)
    (run_dir / "summary.json").unlink()  # a run killed after its last save (a finished one is not restored at all)
    for step, fraction in ((50, 0.25), (40, 0.5), (30, 0.75)):  # several offsets of the array data
        _flip(_array_data(run_dir, step), fraction)
    position = run_dir / "checkpoints" / "20" / "data" / "metadata"
    data = json.loads(position.read_text())
    data["loader"]["position"] += 1
    position.write_text(json.dumps(data))

    rerun = _train(run_dir)
    assert rerun.returncode == 0, rerun.stderr
    assert _damaged(rerun.stderr) == [20, 30, 40, 50], rerun.stderr
    assert "the data position does not match the checkpoint's digest" in rerun.stderr
    assert len(list((run_dir / "checkpoints_damaged").iterdir())) == 4, "each is moved aside, not deleted"
    assert "resuming from update 10" in rerun.stderr + rerun.stdout
    assert _digest(run_dir) == _digest(reference), "the final state is the uninterrupted run's, bit for bit"
    assert _losses(run_dir) == _losses(reference)


def _set_moment(step_dir: Path, value: float) -> None:
    """Rewrite a checkpoint's state with one Adam first moment set to `value` (what flipped bytes in the
    moments' frames decoded to in the issue's probe, e.g. 2.0996336e+37), keeping its recorded digest."""
    import orbax.checkpoint as ocp

    from jaxloop.loop.task import builtin_task, run_state
    from jaxloop.rundir.rules import read_config

    cfg = read_config(step_dir.parent.parent)
    target = jax.eval_shape(lambda: run_state(cfg, builtin_task(cfg)))
    with ocp.StandardCheckpointer() as io:
        state = io.restore(step_dir / "state", target)
        mu = state.opt_state.inner_state.inner_opt_state[2].inner_state[0].mu
        kernel = np.array(mu["hidden_0"]["kernel"])
        kernel[0, 0] = value
        mu["hidden_0"]["kernel"] = kernel
        shutil.rmtree(step_dir / "state")
        io.save(step_dir / "state", state)


def test_moments_restored_huge_fall_back_to_the_previous_checkpoint_instead_of_stopping_the_run(reference, tmp_path):
    # Checkpoints 40 and 50 removed: the run was killed after saving 30, 20 updates remain. Read back as saved,
    # the huge moment makes every remaining update non-finite: exit 1 after max_bad_steps=20 skips (mutant
    # seen failing: verify() not called in restore(): "20 consecutive updates were skipped", exit 1).
    run_dir = _copy(reference, tmp_path)
    for step in (40, 50):
        shutil.rmtree(run_dir / "checkpoints" / str(step))
    _set_moment(run_dir / "checkpoints" / "30", 2.0996336e37)

    rerun = _train(run_dir)
    assert rerun.returncode == 0, rerun.stderr
    assert _damaged(rerun.stderr) == [30], rerun.stderr
    assert "opt_state/inner_state/inner_opt_state/2/inner_state/0/mu/hidden_0/kernel does not match" in rerun.stderr
    assert _digest(run_dir) == _digest(reference)
    assert _losses(run_dir) == _losses(reference)


def test_init_from_a_run_of_another_size_is_one_line_exit_2_and_nothing_written(reference, tmp_path, capsys):
    # jaxloop.train's main, in-process as the bad-flag table runs it (tests/test_cli.py)
    # mutant seen failing: check_init_from() not called (a traceback from init_params_from, after config.json)
    from jaxloop.train import main

    run_dir = tmp_path / "wider"
    assert main(["--run_dir", str(run_dir), *ARGS, "--model.hidden", "64", "--init_from", str(reference)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"jaxloop.train: error: init_from={str(reference)!r} is not allowed: a run of this model's shapes; these "
        "params differ: params/hidden_0/bias: (32,) there, (64,) now; params/hidden_0/kernel: (64, 32) there, "
        "(64, 64) now; params/out/kernel: (32, 10) there, (64, 10) now"
    ]
    assert not run_dir.exists(), "nothing is written, not even the run_dir's lock"


# ----------------------------------------------------------------------------- the Checkpointer alone


def _state(cfg: Config):
    from jaxloop.loop.task import create_train_state
    from jaxloop.model.builtin import make_model

    return create_train_state(cfg, make_model(cfg.model, 3, cfg.precision), np.zeros((1, 4), np.float32))


def test_a_non_finite_restored_state_is_damaged_and_the_previous_checkpoint_restores(tmp_path):
    # a state saved non-finite (check_finite=False) carries a matching digest: only the finite check finds it
    # (mutant seen failing: the finite check removed from verify())
    cfg = Config(run_dir=str(tmp_path), model=ModelConfig(hidden=(4,)))
    state = _state(cfg)
    bad = state.replace(params=jax.tree.map(lambda p: p * np.inf, state.params))
    ckpt = Checkpointer(cfg.checkpoint, tmp_path, config=to_dict(cfg))
    try:
        ckpt.save(1, state, {"position": 1})
        ckpt.save(2, bad, {"position": 2}, check_finite=False)
        ckpt.wait()
        with pytest.warns(
            UserWarning,
            match=r"checkpoint at update 2 is damaged \(DamagedCheckpointError: the "
            r"restored state holds NaN or Inf\)",
        ):
            restored = ckpt.restore_latest(_state(replace(cfg, seed=1)))
    finally:
        ckpt.close()
    assert restored.step == 1 and restored.data == {"position": 1}


def test_a_checkpoint_without_a_digest_restores_with_one_warning_that_it_is_unverified(tmp_path):
    # a checkpoint of an older jaxloop (no digest item): restored, not damaged; the warning comes once per run
    # (mutant seen failing: restore() requesting the digest item unconditionally: the old step is damaged)
    cfg = Config(run_dir=str(tmp_path), model=ModelConfig(hidden=(4,)))
    state = _state(cfg)
    ckpt = Checkpointer(cfg.checkpoint, tmp_path, config=to_dict(cfg))
    try:
        ckpt.save(1, state, {"position": 1})
        ckpt.wait()
    finally:
        ckpt.close()
    shutil.rmtree(tmp_path / "checkpoints" / "1" / "digest")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(2):
            read_checkpoint(tmp_path, "latest", cfg)
    unverified = [w for w in caught if issubclass(w.category, UnverifiedCheckpointWarning)]
    assert len(unverified) == 1, [str(w.message) for w in caught]
    assert "carry no digest" in str(unverified[0].message)


def test_reading_a_run_skips_a_checkpoint_that_fails_its_digest(reference, tmp_path):
    # load_model, sampling and --init_from read through read_checkpoint: a newest step whose arrays are not
    # the ones its digest records is skipped, read-only (mutant seen failing: verify() not called in
    # restore(): step 50 returned with step 40's arrays). The arrays are step 40's own, so they decode on
    # every Orbax: a flipped byte may instead break a zstd frame, which jax 0.12's Orbax reports as a read
    # error before any digest is checked.
    run_dir = _copy(reference, tmp_path)
    state_50 = run_dir / "checkpoints" / "50" / "state"
    shutil.rmtree(state_50)
    shutil.copytree(run_dir / "checkpoints" / "40" / "state", state_50)
    with pytest.warns(UserWarning, match=r"checkpoint at update 50 could not be read \(DamagedCheckpointError"):
        step, _, state = read_checkpoint(run_dir, "latest")
    assert step == 40
    assert (run_dir / "checkpoints" / "50").is_dir(), "reading moves nothing"


# ----------------------------------------------------------------------------- what the digest vouches for


def _killed_after(reference: Path, tmp_path: Path, step: int) -> Path:
    """A copy of the reference run as if killed after saving `step`: later checkpoints and the summary gone."""
    run_dir = _copy(reference, tmp_path)
    (run_dir / "summary.json").unlink()
    for later in range(step + 10, 60, 10):
        shutil.rmtree(run_dir / "checkpoints" / str(later))
    return run_dir


def test_a_checkpoint_directory_renamed_to_another_update_is_damaged(reference, tmp_path):
    # The case: checkpoint 20 renamed to 40 resumed "from update 40 ... data position 20" and ended
    # with "-20 updates this time" at 40 of 50 (mutant seen failing: the digest's step not compared with the
    # directory's name in verify(): exit 0, "resuming from update 40", the summary's final_step 40).
    run_dir = _killed_after(reference, tmp_path, 20)
    (run_dir / "checkpoints" / "20").rename(run_dir / "checkpoints" / "40")

    rerun = _train(run_dir)
    assert rerun.returncode == 0, rerun.stderr
    assert _damaged(rerun.stderr) == [40], rerun.stderr
    assert "its digest records update 20, not 40" in rerun.stderr
    assert "resuming from update 10" in rerun.stderr + rerun.stdout
    assert _digest(run_dir) == _digest(reference), "the final state is the uninterrupted run's, bit for bit"
    assert _losses(run_dir) == _losses(reference)


def test_a_digest_naming_an_unknown_algorithm_is_damage_not_a_skipped_check(reference, tmp_path):
    # The case: "algorithm": "sha257" beside other arrays skipped the check without a word and the run
    # ended with another state (mutant seen failing: an unknown algorithm let through to the finite check
    # alone, as before: exit 0, nothing damaged, another final digest).
    run_dir = _killed_after(reference, tmp_path, 50)
    state_50 = run_dir / "checkpoints" / "50" / "state"
    shutil.rmtree(state_50)
    shutil.copytree(run_dir / "checkpoints" / "40" / "state", state_50)  # arrays that are not update 50's
    record = run_dir / "checkpoints" / "50" / "digest" / "metadata"
    digest = json.loads(record.read_text())
    digest["algorithm"] = "sha257"
    record.write_text(json.dumps(digest))

    rerun = _train(run_dir)
    assert rerun.returncode == 0, rerun.stderr
    assert _damaged(rerun.stderr) == [50], rerun.stderr
    assert "its digest record holds an unknown algorithm 'sha257'" in rerun.stderr
    assert _digest(run_dir) == _digest(reference)


def test_a_checkpoint_without_a_digest_whose_updates_go_non_finite_before_the_next_save_falls_back(reference, tmp_path):
    # An older jaxloop's checkpoints (no digest) and a damaged moment in the newest, 30: nothing in its bytes
    # says so, and from update 32 on every update is skipped as non-finite. The streak, met before the run
    # saved another checkpoint, sets it aside and the run
    # resumes from 20 instead of exiting 1 on every rerun (mutant seen failing: the NonFiniteError fallback
    # removed from _run_held: "20 consecutive updates were skipped ...", exit 1, and again on the rerun).
    run_dir = _killed_after(reference, tmp_path, 30)
    for step in (10, 20, 30):
        shutil.rmtree(run_dir / "checkpoints" / str(step) / "digest")
    _set_moment(run_dir / "checkpoints" / "30", 2.0996336e37)

    rerun = _train(run_dir)
    assert rerun.returncode == 0, rerun.stderr
    assert _damaged(rerun.stderr) == [30], rerun.stderr
    assert (
        "without a digest to check its bytes, and the updates from it went non-finite before the next save"
        in rerun.stderr
    )
    assert "resuming from update 20" in rerun.stderr + rerun.stdout
    assert len(list((run_dir / "checkpoints_damaged").iterdir())) == 1, "moved aside, not deleted"
    assert _digest(run_dir) == _digest(reference), "20 restores its saved bytes: the uninterrupted run's end"
    assert _losses(run_dir) == _losses(reference)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_damaged_newest_checkpoint_over_one_of_another_model_is_refused_with_nothing_written(reference, tmp_path):
    # checkpoint 20 damaged, checkpoint 10 another model's (hidden 64): the refusal names the other model and the
    # run folder is byte-identical after it, checkpoint 20 included. Mutants seen failing: restore_latest moving a
    # damaged step aside at once (20 in checkpoints_damaged/ before the refusal), and run_dir's files written
    # before the restore (metadata.json rewritten)
    run_dir = _killed_after(reference, tmp_path, 20)
    other = tmp_path / "other"
    assert _train(other, "--steps", "10", "--model.hidden", "64").returncode == 0
    shutil.rmtree(run_dir / "checkpoints" / "10")
    shutil.copytree(other / "checkpoints" / "10", run_dir / "checkpoints" / "10")
    _flip(_array_data(run_dir, 20), 0.5)
    before = _files(run_dir)

    rerun = _train(run_dir)
    assert rerun.returncode == 2, rerun.stderr
    assert (
        rerun.stderr.strip()
        .splitlines()[-1]
        .startswith(
            f"jaxloop.train: error: run_dir='{run_dir}' is not allowed: checkpoints of the model trained now; the "
            "checkpoint of update 10 holds another: params/hidden_0/bias: (64,) in the run, (32,) now"
        )
    ), rerun.stderr
    assert _files(run_dir) == before, "every file byte-identical, the damaged checkpoint 20 still in place"
