"""torch_ref, the PyTorch reference loop: its own contracts (parity with jaxloop is parity_tests' job).

Tolerances: every comparison here is exact (==, bitwise), because each one compares a computation with
itself (resume), a copy (weights, record order) or a float64 formula that the code evaluates the same
way (schedule); where a test allows slack it says why.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from jaxloop.config.cli import NonFiniteError
from jaxloop.config.run import (
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    DistributedConfig,
    LogConfig,
    MemoryConfig,
    ModelConfig,
    OptimConfig,
    preset,
    to_dict,
)
from jaxloop.config.schedules import WarmupCosineConfig
from jaxloop.data.sources import ArrayRecords, Splits, load_splits, record_order
from torch_ref.checkpoint import CheckpointManager, best_step, kept_steps
from torch_ref.data import ReplayBatchSampler, make_train_loader, micro_batch
from torch_ref.models import export_jax_params, load_jax_params, make_model
from torch_ref.optim import clip_gradients, param_groups
from torch_ref.schedule import lr_at, lr_table
from torch_ref.state import create_torch_state, state_digest
from torch_ref.step import train_update
from torch_ref.train import main, run

# torch's DataLoader forks its workers, and this test process also holds jax's threads (from other test
# modules); the workers never touch jax (torch_ref alone never imports it), so the warning is moot here.
pytestmark = [pytest.mark.torch, pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")]

ROOT = Path(__file__).resolve().parents[1]
QUIET = LogConfig(progress="off", report=False, tensorboard=False)
DETERMINISTIC_KEYS = (
    "kind",
    "step",
    "lr",
    "loss",
    "grad_norm",
    "skipped",
    "updated",
    "loss_scale",
    "val_loss",
    "val_acc",
)


def _debug(run_dir, **changes) -> Config:
    return replace(preset("debug"), run_dir=str(run_dir), log=QUIET, **changes)


def _text_cfg(run_dir, text_path, **changes) -> Config:
    """A tiny character GPT with dropout (so resume must restore torch's RNG) on a small text file."""
    return replace(
        preset("shakespeare"),
        run_dir=str(run_dir),
        steps=12,
        batch_size=16,
        eval_every=4,
        log_every=1,
        optim=replace(
            preset("shakespeare").optim,
            lr_schedule=replace(preset("shakespeare").optim.lr_schedule, warmup_steps=3),
            accum_steps=3,
        ),
        model=ModelConfig(kind="gpt", context=16, d_model=16, n_layers=1, n_heads=2, dropout=0.1),
        data=DataConfig(source="text", path=str(text_path), val_fraction=0.2),
        checkpoint=CheckpointConfig(every=5),
        log=QUIET,
        **changes,
    )


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "tiny.txt"
    words = "the quick brown fox jumps over the lazy dog while five boxing wizards jump quickly ".split()
    rng = np.random.default_rng(0)
    path.write_text(" ".join(rng.choice(words, size=110)) + "\n")  # ~600 characters
    return path


def _deterministic(records: list[dict]) -> list[dict]:
    return [{k: r[k] for k in DETERMINISTIC_KEYS if k in r} for r in records]


# ----------------------------------------------------------------------------- schedule


def _closed_form(cfg: Config, u: int) -> float:
    """torch_ref's own float64 rate (the schedule is checked against the suite's one oracle in
    parity_tests/test_learning_rate.py; here LambdaLR must hand it to the optimizer unchanged)."""
    return lr_at(cfg, u)


SCHEDULES = [
    dict(
        steps=50,
        optim=OptimConfig(lr_schedule=WarmupCosineConfig(init_lr=0.0, end_lr=3e-5, warmup_steps=7), peak_lr=3e-3),
    ),
    dict(
        steps=40,
        optim=OptimConfig(lr_schedule=WarmupCosineConfig(init_lr=1e-3, end_lr=1e-4, warmup_steps=0), peak_lr=0.1234),
    ),
    dict(
        steps=9,
        optim=OptimConfig(lr_schedule=WarmupCosineConfig(init_lr=1e-5, end_lr=2e-5, warmup_steps=9), peak_lr=7e-4),
    ),
    dict(
        steps=333,
        optim=OptimConfig(lr_schedule=WarmupCosineConfig(init_lr=0.3, end_lr=0.1, warmup_steps=100), peak_lr=0.7071),
    ),
]


@pytest.mark.parametrize("changes", SCHEDULES, ids=["warmup7", "no-warmup", "warmup=steps", "odd-values"])
def test_lambda_lr_rate_of_every_update_equals_the_float64_closed_form(changes):
    # Exact (==): the optimizer's base lr is 1.0 and the lambda returns the rate itself, so LambdaLR's
    # product base * factor is the closed form bit for bit. 20 updates past `steps` check the hold at
    # end_lr (CosineAnnealingLR would climb back).
    cfg = replace(Config(), **changes)
    rates = lr_table(cfg, cfg.steps + 20)
    expected = [_closed_form(cfg, u) for u in range(cfg.steps + 20)]
    assert rates == expected
    assert rates[cfg.steps :] == [cfg.optim.lr_schedule.end_lr] * 20
    if cfg.optim.lr_schedule.warmup_steps < cfg.steps:
        assert rates[cfg.optim.lr_schedule.warmup_steps] == cfg.optim.peak_lr


# ----------------------------------------------------------------------------- checkpoint rotation


def test_rotation_keeps_the_hand_computed_steps_for_a_known_metric_sequence(tmp_path):
    cfg = _debug(tmp_path, checkpoint=CheckpointConfig(every=1, keep_last=2, keep_best=1, keep_every=5))
    saved = list(range(1, 11))
    # Evaluations at even updates only; 4 and 8 tie for the best val_loss.
    metrics = {
        2: {"val_loss": 0.5},
        4: {"val_loss": 0.3},
        6: {"val_loss": 0.4},
        8: {"val_loss": 0.3},
        10: {"val_loss": 0.9},
    }
    # By hand: newest two {9, 10}; best one {8} (a tie keeps the newer, as Orbax's stable sort does);
    # every 5th {5, 10}.
    assert kept_steps(saved, metrics, cfg) == [5, 8, 9, 10]
    max_cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, best_metric="val_acc", best_mode="max", keep_best=2))
    accs = {2: {"val_acc": 0.9}, 4: {"val_acc": 0.7}, 6: {"val_acc": 0.95}, 8: {"val_acc": 0.2}}
    # Newest two {9, 10}; best two by val_acc {6, 2}; every 5th {5, 10}.
    assert kept_steps(saved, accs, max_cfg) == [2, 5, 6, 9, 10]

    manager = CheckpointManager(cfg, tmp_path)  # the files on disk follow the same rule
    weights = {"model": {"w": torch.ones(2)}}
    for step in saved:
        manager.save(step, {"step": step, **weights}, metrics.get(step))
    on_disk = sorted(int(p.name[5:13]) for p in (tmp_path / "checkpoints").glob("step_*.pt"))
    assert on_disk == [5, 8, 9, 10]
    assert manager.best_step() == 8 == best_step([(s, metrics.get(s)) for s in on_disk], cfg)


def test_damaged_newest_checkpoint_falls_back_to_the_previous_with_a_warning(tmp_path):
    cfg = _debug(tmp_path, checkpoint=CheckpointConfig(keep_last=3))
    manager = CheckpointManager(cfg, tmp_path)
    for step in (5, 10, 15):
        manager.save(step, {"step": step, "model": {"w": torch.full((3,), float(step))}})
    newest = tmp_path / "checkpoints" / "step_00000015.pt"
    newest.write_bytes(newest.read_bytes()[:-40])  # a torn write
    with pytest.warns(UserWarning, match=r"checkpoint at update 15 is damaged \(.*truncated"):
        step, payload = CheckpointManager(cfg, tmp_path).restore_latest()
    assert step == 10 and torch.equal(payload["model"]["w"], torch.full((3,), 10.0))
    assert list((tmp_path / "checkpoints_damaged").iterdir()), "the damaged file is moved aside"


# ----------------------------------------------------------------------------- data order


@pytest.mark.parametrize("workers", [0, 2])
def test_sampler_replays_jaxloop_record_order_from_a_mid_epoch_position(workers):
    cfg = replace(preset("debug"), data=replace(preset("debug").data, workers=workers))
    splits = load_splits(cfg)
    per_epoch = splits.num_train // cfg.batch_size  # 1437 // 32 = 44: start 40 is mid-epoch 0
    start, count = 40, 10  # ... and the 10 micro-batches run into epoch 1
    assert start < per_epoch < start + count
    expected = record_order(cfg, splits.num_train, start, count)
    sampler = ReplayBatchSampler(cfg, splits.num_train, start=start, stop=start + count)
    assert [list(b) for b in sampler] == expected.tolist()
    loader = make_train_loader(cfg, splits, position=start, stop=start + count)
    batches = list(loader)
    assert len(batches) == count
    for (x, y), indices in zip(batches, expected):
        records = splits.train.get(indices)
        assert np.array_equal(x.numpy(), records["x"]) and np.array_equal(y.numpy(), records["y"])


# ----------------------------------------------------------------------------- weight transfer


MODELS = {
    "mlp": lambda: preset("debug"),
    "gpt-tied": lambda: replace(
        preset("shakespeare"),
        model=replace(preset("shakespeare").model, context=8, d_model=16, n_layers=2, n_heads=2, tie_embeddings=True),
    ),
    "gpt-untied": lambda: replace(
        preset("shakespeare"),
        model=replace(preset("shakespeare").model, context=8, d_model=16, n_layers=2, n_heads=2, tie_embeddings=False),
    ),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_weights_round_trip_jax_to_torch_to_jax_exactly(name):
    import jax

    from jaxloop.model.builtin import init_params
    from jaxloop.model.builtin import make_model as make_flax_model

    cfg = MODELS[name]()
    classes = 11
    example = np.zeros((1, 64), np.float32) if cfg.model.kind == "mlp" else np.zeros((1, cfg.model.context), np.int32)
    flax_params = jax.device_get(
        init_params(make_flax_model(cfg.model, classes, cfg.precision), jax.random.PRNGKey(3), example)
    )
    model = make_model(cfg, classes, example)
    load_jax_params(model, flax_params)
    back = export_jax_params(model)
    # Same tree (keys, nesting), same dtypes, same bits.
    assert jax.tree.structure(back) == jax.tree.structure(jax.tree.map(np.asarray, dict(flax_params)))
    for a, b in zip(jax.tree.leaves(flax_params), jax.tree.leaves(back)):
        a = np.asarray(a)
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    # And torch -> jax -> torch: a fresh model loaded from the export holds the same tensors.
    again = make_model(cfg, classes, example)
    load_jax_params(again, back)
    for (n, p), (_, q) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(p, q), n


def test_the_gpt_checkpoints_its_blocks_exactly_under_memory_remat_blocks():
    """torch_ref reads memory.remat (model.remat is gone): blocks recomputes each block in the backward pass,
    any other plan does not (torch_ref has no policy around the loss). Mutant (GPT built with remat=False): fails."""
    cfg = replace(
        preset("shakespeare"), model=replace(preset("shakespeare").model, context=8, d_model=16, n_layers=2, n_heads=2)
    )
    example = np.zeros((1, 8), np.int32)
    for remat, expected in (("blocks", True), ("none", False), ("full", False)):
        assert make_model(replace(cfg, memory=MemoryConfig(remat=remat)), 11, example).remat is expected


def test_weight_decay_groups_hold_matrices_and_embeddings_only():
    cfg = MODELS["gpt-tied"]()
    model = make_model(cfg, 11, np.zeros((1, 8), np.int32))
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {names[id(p)] for p in decay["params"]} == {n for n, p in model.named_parameters() if p.dim() >= 2}
    assert all(names[id(p)].endswith(("bias", "ln1.weight", "ln2.weight", "ln_f.weight")) for p in no_decay["params"])


# ----------------------------------------------------------------------------- clipping


def test_optax_clip_mode_is_optax_arithmetic_and_torch_mode_adds_1e_6():
    # Exact: mode "optax" must compute (g / norm) * clip, the expression optax.clip_by_global_norm uses;
    # mode "torch" multiplies by clip / (norm + 1e-6) (clip_grad_norm_). Below the threshold optax leaves
    # gradients untouched.
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(4, 3, generator=gen), torch.randn(3, generator=gen)]

    def params_with(gs):
        ps = [torch.nn.Parameter(torch.zeros_like(g)) for g in gs]
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        return ps

    ps = params_with(grads)
    norm = clip_gradients(ps, 0.5, "optax")
    assert norm.item() > 0.5
    for p, g in zip(ps, grads):
        assert torch.equal(p.grad, (g / norm) * 0.5)
    ps = params_with(grads)
    torch_norm = clip_gradients(ps, 0.5, "torch")
    for p, g in zip(ps, grads):
        assert torch.equal(p.grad, g * torch.clamp(0.5 / (torch_norm + 1e-6), max=1.0))
    ps = params_with(grads)
    clip_gradients(ps, 100.0, "optax")
    assert all(torch.equal(p.grad, g) for p, g in zip(ps, grads))


# ----------------------------------------------------------------------------- non-finite policy


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_nan_micro_batch_skips_the_whole_update_and_is_counted(precision):
    cfg = replace(preset("debug"), precision=precision, optim=replace(preset("debug").optim, accum_steps=2))
    splits = load_splits(cfg)
    state = create_torch_state(cfg, splits)
    train_update(state, [micro_batch(cfg, splits, 0), micro_batch(cfg, splits, 1)])  # one good update
    before = state_digest(state)
    params = [p.detach().clone() for p in state.model.parameters()]
    lr, scale = state.optimizer.param_groups[0]["lr"], state.scaler.get_scale()

    x, y = micro_batch(cfg, splits, 2)
    x[0, 0] = float("nan")  # poisons the first micro-batch of the window; the second is clean
    metrics = train_update(state, [(x, y), micro_batch(cfg, splits, 3)])
    assert not metrics["updated"] and math.isnan(metrics["loss"])
    assert (state.skipped, state.bad_streak, state.step, state.position) == (1, 1, 1, 4)
    assert state_digest(state) == before, "params and AdamW state (step count included) are untouched"
    assert all(torch.equal(p, q) for p, q in zip(state.model.parameters(), params))
    assert state.optimizer.param_groups[0]["lr"] == lr and state.scheduler.last_epoch == 1
    assert all(p.grad is None for p in state.model.parameters()), "the poisoned gradients are discarded"
    if precision == "fp16":
        assert state.scaler.get_scale() == scale * 0.5, "GradScaler halves the scale on the skipped update"

    metrics = train_update(state, [micro_batch(cfg, splits, 4), micro_batch(cfg, splits, 5)])
    assert metrics["updated"] and metrics["lr"] == lr, "the next update uses the skipped update's rate"
    assert (state.skipped, state.bad_streak, state.step) == (1, 0, 2)


def test_max_bad_steps_consecutive_skips_stop_the_run_naming_the_update(tmp_path):
    cfg = _debug(tmp_path, max_bad_steps=3)
    good = load_splits(cfg)
    x = np.array(good.train.get(np.arange(good.num_train))["x"])
    x[:, 5] = np.nan  # every training record is poisoned
    poisoned = Splits(
        source="digits",
        train=ArrayRecords(x, good.train.get(np.arange(good.num_train))["y"]),
        val=good.val,
        num_classes=good.num_classes,
        example_x=good.example_x,
    )
    with pytest.raises(NonFiniteError, match=r"3 consecutive updates were skipped .*update 1 tried 3 times"):
        run(cfg, splits=poisoned)
    assert not list((tmp_path / "checkpoints").glob("step_*.pt")), "a non-finite run saves nothing"


# ----------------------------------------------------------------------------- resume


@pytest.fixture(scope="module")
def references(tmp_path_factory, text_file):
    """The uninterrupted runs the resumed ones must reproduce bit for bit."""
    out = {}
    for name in ("mlp", "gpt"):
        run_dir = tmp_path_factory.mktemp(f"uninterrupted-{name}")
        cfg = _resume_cfg(name, run_dir, text_file)
        result = run(cfg)
        out[name] = (cfg, _deterministic(result.records), result.summary["state_digest"])
    return out


def _resume_cfg(name: str, run_dir, text_file) -> Config:
    if name == "mlp":
        # digits: 44 micro-batches per epoch; 20 updates x 3 micro-batches cross into epoch 1 at update 15.
        return _debug(
            run_dir, optim=replace(preset("debug").optim, accum_steps=3), checkpoint=CheckpointConfig(every=5)
        )
    # tiny text: 29 micro-batches of 16 windows per epoch; 12 updates x 3 cross into epoch 1 at update 10.
    return _text_cfg(run_dir, text_file)


@pytest.mark.parametrize(
    "name,stop,save_on_stop",
    [("mlp", 13, True), ("mlp", 13, False), ("gpt", 7, True)],
    ids=["mlp-sigterm-at-13", "mlp-killed-at-13", "gpt-dropout-sigterm-at-7"],
)
def test_resume_mid_epoch_is_bit_identical_to_the_uninterrupted_run(references, tmp_path, name, stop, save_on_stop):
    # Interrupted at an update that is not a multiple of checkpoint.every (5), mid-epoch (mlp: micro-batch
    # 39 of 44; gpt: 21 of 29). save_on_stop=True saves update `stop` as SIGTERM does; False stands for
    # a kill, so the run resumes from update 10 and recomputes 11..13. The gpt run has dropout, so the
    # checkpoint must carry torch's RNG state; it resumes with 1 loader worker instead of 0.
    cfg_ref, ref_records, ref_digest = references[name]
    cfg = replace(cfg_ref, run_dir=str(tmp_path))
    first = run(cfg, stop_after=stop, save_on_stop=save_on_stop)
    assert first.summary["stop_reason"] == "stop_after" and first.state.step == stop
    on_disk = sorted(int(p.name[5:13]) for p in (tmp_path / "checkpoints").glob("step_*.pt"))
    assert on_disk[-1] == (stop if save_on_stop else stop - stop % 5)
    if name == "gpt":
        cfg = replace(cfg, data=replace(cfg.data, workers=1))
    resumed = run(cfg)
    assert _deterministic(resumed.records) == ref_records, "every logged loss, lr and norm, bit for bit"
    assert resumed.summary["state_digest"] == ref_digest
    assert resumed.summary["final_step"] == cfg.steps


# ----------------------------------------------------------------------------- CLI


def test_cli_runs_the_debug_preset_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch_ref.train",
            "--preset",
            "debug",
            "--run_dir",
            str(run_dir),
            "--log.progress",
            "off",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    cfg = replace(preset("debug"), run_dir=str(run_dir), log=replace(preset("debug").log, progress="off"))
    assert json.loads((run_dir / "config.json").read_text()) == to_dict(cfg)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, 21))  # log_every=1
    assert [r["lr"] for r in train] == [_closed_form(cfg, u) for u in range(20)], "lr = schedule(step - 1)"
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["skipped"] == 0 for r in train)
    assert [r["step"] for r in evals] == [10, 20] and all(0 <= r["val_acc"] <= 1 for r in evals)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_step"] == 20 and summary["skipped_updates"] == 0
    assert summary["final"] == {k: evals[-1][k] for k in ("val_loss", "val_acc")}
    assert summary["best"]["step"] in (10, 20) and len(summary["state_digest"]) == 64
    assert summary["wall_time_s"] > 0 and summary["updates_per_s"] > 0
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000010.pt", "step_00000020.pt"]
    assert train[-1]["loss"] < train[0]["loss"], "it learns"


BAD = [
    (["--optim.peak_lr", "-1"], "optim.peak_lr=-1.0"),
    (["--no_such_flag", "1"], "--no_such_flag"),
    (["--precision", "fp8"], "'fp8'"),
    (["--clip", "sideways"], "--clip='sideways'"),
]


@pytest.mark.parametrize("argv,expected", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_flag_gives_one_line_and_exit_2_and_writes_nothing(argv, expected, tmp_path, capsys):
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        sys.exit(main([*argv, "--run_dir", str(run_dir)]))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("torch_ref.train: error: ") and expected in err, err
    assert not run_dir.exists()


def test_bad_flag_in_a_real_process_exits_2_with_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "torch_ref.train", "--steps", "0", "--run_dir", str(tmp_path / "r")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "steps=0" in proc.stderr and proc.stdout == ""


# ----------------------------------------------------------------------------- no jax


def test_several_processes_are_refused(tmp_path):
    # torch_ref is the single-process reference; a multi-process config is bad input for it, not ignored.
    cfg = _debug(tmp_path / "run", distributed=DistributedConfig(num_processes=2, process_id=0, coordinator="h:1"))
    with pytest.raises(ConfigError, match="distributed.num_processes"):
        run(cfg)
    assert not (tmp_path / "run").exists()


def test_torch_ref_runs_without_importing_jax(tmp_path):
    # torch_ref shares only the jax-free modules (SHARED in tests/test_layout.py) with jaxloop: with every import of jax, jaxlib,
    # flax, optax, orbax or grain failing, it still trains for two updates.
    script = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("jax", "jaxlib", "flax", "optax", "orbax", "grain"):
            raise ImportError("torch_ref imported " + name)
sys.meta_path.insert(0, Block())
from dataclasses import replace
from jaxloop.config.run import preset
import torch_ref.train
optim = preset("debug").optim
result = torch_ref.train.run(replace(preset("debug"), steps=2,
                                     optim=replace(optim, lr_schedule=replace(optim.lr_schedule, warmup_steps=1)),
                                     run_dir={str(tmp_path / "run")!r}))
assert result.summary["final_step"] == 2
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_torch_ref_holds_its_run_dir_as_jaxloop_does(tmp_path):
    """One run per run_dir in both loops (jaxloop.rundir.lock): a run_dir held by another run is refused, naming
    the holder, before anything is written. Mutant (torch_ref.run without its RunLock): trains, seen failing."""
    from jaxloop.rundir.lock import RunDirInUse, RunLock
    from torch_ref.train import run

    cfg = replace(preset("debug"), run_dir=str(tmp_path), steps=2, log=LogConfig(progress="off", report=False))
    with RunLock(tmp_path):
        with pytest.raises(RunDirInUse, match="held by pid"):
            run(cfg, device="cpu")
    assert not (tmp_path / "config.json").exists()
    assert run(cfg, device="cpu").summary["final_step"] == 2, "free again once released"


def _torch_ref_main(capsys, *argv: str) -> tuple[int, str]:
    """torch_ref.train's main in this process (the exit status it returns, its stderr): the run directory, not the
    process, is under test (test_bad_flag_in_a_real_process_exits_2_with_one_line covers the process)."""
    status = main(["--log.progress", "off", "--log.no-tensorboard", *argv])
    return status, capsys.readouterr().err


def test_a_torch_ref_run_from_before_the_marker_resumes_by_the_evidence_of_its_checkpoints(tmp_path, capsys):
    # issue 43.2: a run directory is torch_ref's by evidence it wrote it: a checkpoint file whose header names
    # torch_ref's format, beside a config.json torch_ref reads. An older run (no marker), interrupted (no
    # summary.json), resumes; the same folder with the header's format edited is refused, byte-identical.
    # Mutant seen failing: RunDir.earlier_run without _torch_ref_run (refused as 'holds other files', exit 2)
    run_dir = tmp_path / "r"
    first = _torch_ref_main(
        capsys, "--preset", "debug", "--steps", "20", "--checkpoint.every", "10", "--run_dir", str(run_dir)
    )
    assert first[0] == 0, first[1]
    (run_dir / ".jaxloop-run").unlink()
    (run_dir / "summary.json").unlink()
    (run_dir / "checkpoints" / "step_00000020.pt").unlink()  # stopped after update 10's save
    forged = tmp_path / "forged"
    shutil.copytree(run_dir, forged)

    again = _torch_ref_main(capsys, "--run_dir", str(run_dir))
    assert again[0] == 0, again[1]
    assert [json.loads(line)["step"] for line in (run_dir / "resumes.jsonl").read_text().splitlines()] == [10]
    assert json.loads((run_dir / "summary.json").read_text())["final_step"] == 20

    checkpoint = forged / "checkpoints" / "step_00000010.pt"
    checkpoint.write_bytes(checkpoint.read_bytes().replace(b"torch_ref-checkpoint-1", b"someone-elses-file-1", 1))
    before = {p: p.read_bytes() for p in sorted(forged.rglob("*")) if p.is_file()}
    refused = _torch_ref_main(capsys, "--run_dir", str(forged))
    assert refused[0] == 2 and "holds other files: checkpoints, config.json, metrics.jsonl" in refused[1]
    assert {p: p.read_bytes() for p in sorted(forged.rglob("*")) if p.is_file()} == before
