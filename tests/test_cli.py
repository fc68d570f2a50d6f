"""Bad input: one clear line on stderr naming the field, the value and what is allowed; exit 2; nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxloop.config.cli import parse_config
from jaxloop.config.run import Config, to_dict

# (argv, text the one-line message must contain)
BAD_FLAGS = [
    (["--optim.peak_lr", "0"], "optim.peak_lr=0.0"),
    (["--optim.peak_lr", "-1e-3"], "optim.peak_lr=-0.001"),
    (["--steps", "0"], "steps=0"),
    (["--batch_size", "-4"], "batch_size=-4"),
    (["--optim.warmup_steps", "600"], "optim.warmup_steps=600"),
    (["--optim.end_lr", "1.0"], "optim.end_lr=1.0"),
    (["--optim.accum_steps", "0"], "optim.accum_steps=0"),
    (["--preset", "imagenet"], "preset='imagenet'"),
    (["--precision", "fp8"], "'fp8'"),
    (["--no_such_flag", "1"], "--no_such_flag"),
    (["--steps", "ten"], "--steps"),
    (["--optim.b1", "1.5"], "optim.b1=1.5"),
    (["--optim.eps", "1e-50"], "optim.eps=1e-50"),  # 0 in float32: Adam's 0 / (0 + 0) would be NaN
    (["--model.n_heads", "3", "--preset", "shakespeare", "--data.path", __file__], "model.n_heads=3"),
    (["--data.val_fraction", "0"], "data.val_fraction=0.0"),
    (["--preset", "shakespeare"], "data.path=''"),
    (["--preset", "shakespeare", "--data.path", "/no/such/file.txt"], "data.path='/no/such/file.txt'"),
    (["--data.source", "npz", "--data.path", "/"], "data.path='/'"),
    (["--checkpoint.best_metric", "ema_val_loss"], "checkpoint.best_metric='ema_val_loss'"),
    (["--run_dir", "/etc/hostname/run"], "run_dir='/etc/hostname/run'"),
    (["--log.price_per_hour", "-1"], "log.price_per_hour=-1.0"),
    (["--distributed.num_processes", "2"], "distributed.coordinator=''"),
    (
        ["--distributed.num_processes", "2", "--distributed.process_id", "2", "--distributed.coordinator", "h:1"],
        "distributed.process_id=2",
    ),
    (["--seed", "99999999999999999999"], "seed=99999999999999999999 is not allowed: an integer in [0, 2**63 - 1"),
    (["--steps", "99999999999999999999"], "steps=99999999999999999999 is not allowed: an integer in [1, 10000000]"),
    (
        ["--steps", "3000000000"],
        (
            "steps=3000000000 is not allowed: an integer in [1, 10000000] (the learning-rate schedule is "
            "tabulated before the first update: about 60 MiB and a few seconds of start-up per million updates)"
        ),
    ),
]


@pytest.mark.parametrize("argv,expected", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_flag_gives_one_line_exit_2_and_writes_nothing(argv, expected, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    from jaxloop.train import main

    assert _exit_code(main, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("jaxloop.train: error: ") and expected in err[0], err[0]
    assert list(tmp_path.iterdir()) == [], "nothing is created on bad input"


def _npz(path: Path, **arrays) -> None:
    """An .npz of 100 records of 4 features and labels 0..3, with `arrays` replacing or adding some."""
    import numpy as np

    rng = np.random.default_rng(0)
    base = {"x": rng.normal(size=(100, 4)).astype(np.float32), "y": rng.integers(0, 4, 100)}
    np.savez(path, **{**base, **{k: v(base) if callable(v) else v for k, v in arrays.items()}})


def _label(y, i, value):
    y = y.copy()
    y[i] = value
    return y


def _resumable(tmp_path: Path, damage) -> list[str]:
    """A run_dir as an interrupted run leaves it (its marker, config.json, metrics.jsonl, a checkpoint), then
    `damage(run_dir)`; the arguments that resume it (run from tmp_path)."""
    from jaxloop.rundir.rules import RunDir

    argv = ["--preset", "debug", "--run_dir", "run"]
    RunDir(parse_config(argv)).start()
    (tmp_path / "run" / "checkpoints" / "10").mkdir(parents=True)
    (tmp_path / "run" / "metrics.jsonl").write_text(
        "".join(json.dumps({"kind": "train", "step": s}) + "\n" for s in range(1, 11))
    )
    damage(tmp_path / "run")
    return argv


NPZ = ["--data.source", "npz", "--data.path", "d.npz"]


def _config_not_utf8(d: Path) -> list[str]:
    (d / "bad.yaml").write_bytes(b"steps: 5\n# caf\xe9\n")
    return ["--config", "bad.yaml"]


def _npz_y_column(d: Path) -> list[str]:
    _npz(d / "d.npz", y=lambda b: b["y"][:, None])
    return NPZ


def _npz_x_1d(d: Path) -> list[str]:
    _npz(d / "d.npz", x=lambda b: b["x"][:, 0])
    return NPZ


def _npz_x_3d(d: Path) -> list[str]:
    _npz(d / "d.npz", x=lambda b: b["x"].reshape(100, 2, 2))
    return NPZ


def _npz_label_1000(d: Path) -> list[str]:
    _npz(d / "d.npz", y=lambda b: _label(b["y"], 57, 1000))
    return NPZ


def _npz_class_only_in_val(d: Path) -> list[str]:
    _npz(d / "d.npz", y=lambda b: b["y"] % 3, x_val=lambda b: b["x"][:10], y_val=lambda b: b["y"][:10] % 3 + 1)
    return NPZ


def _users_own_folder(d: Path) -> list[str]:
    (d / "mine").mkdir()
    (d / "mine" / "config.json").write_text("{}")
    (d / "mine" / "summary.json").write_text("{}")
    return ["--run_dir", "mine"]


def _metrics_not_utf8(d: Path) -> list[str]:
    def damage(run: Path) -> None:
        metrics = run / "metrics.jsonl"
        metrics.write_bytes(metrics.read_bytes().replace(b'"step": 3', b'"step": 3, "n\xff": 1'))

    return _resumable(d, damage)


def _config_truncated(d: Path) -> list[str]:
    def damage(run: Path) -> None:
        (run / "config.json").write_bytes((run / "config.json").read_bytes()[:100])

    return _resumable(d, damage)


# (name, make(tmp_path) -> argv (creating the input files), the text or texts the one-line message must hold): bad input
# held in files. Nothing may be written: every file in tmp_path keeps its bytes and no file appears.
BAD_FILES = [
    (
        "config file not UTF-8",
        _config_not_utf8,
        "is not allowed: a UTF-8 text file (byte 0xe9 at offset 14 is not UTF-8)",
    ),
    (
        "npz y of shape (N, 1)",
        _npz_y_column,
        "y of shape (records,), one integer label per record (got shape (100, 1); y.reshape(-1) gives it",
    ),
    (
        "npz x of 1 dimension",
        _npz_x_1d,
        "x of shape (records, features), 2 dimensions (got shape (100,); x[:, None] if each record is one number)",
    ),
    (
        "npz x of 3 dimensions",
        _npz_x_3d,
        "(got shape (100, 2, 2); flatten each record's features: x.reshape(len(x), -1))",
    ),
    (
        "npz label 1000 among classes 0..3",
        _npz_label_1000,
        ("record 46 of the train split (y[57] in ", "d.npz) has label 1000, but no training record has label 4"),
    ),
    (
        "npz class seen only in validation",
        _npz_class_only_in_val,
        ("record 3 of the val split (y_val[3] in ", "d.npz) has label 3, a class seen only in validation"),
    ),
    (
        "run_dir holding the user's own files",
        _users_own_folder,
        (
            "holds other files: config.json, summary.json; a run writes config.json, summary.json, ... there): "
            "choose another --run_dir"
        ),
    ),
    (
        "metrics.jsonl not UTF-8 on resume",
        _metrics_not_utf8,
        "metrics.jsonl line 3: byte 0xff at column 32 is not UTF-8 text; repair or delete that line",
    ),
    ("config.json truncated on resume", _config_truncated, "config.json is damaged: JSONDecodeError"),
]


@pytest.mark.parametrize("make,expected", [b[1:] for b in BAD_FILES], ids=[b[0] for b in BAD_FILES])
def test_bad_input_in_a_file_gives_one_line_exit_2_and_writes_nothing(make, expected, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv = make(tmp_path)
    before = _snapshot(tmp_path)
    from jaxloop.train import main

    assert _exit_code(main, [*argv, "--log.progress", "off"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("jaxloop.train: error: "), err[0]
    assert all(part in err[0] for part in ((expected,) if isinstance(expected, str) else expected)), err[0]
    assert _snapshot(tmp_path) == before, "nothing is written on bad input"


def _snapshot(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


def _exit_code(main, argv) -> int:
    """main's status, whether it returns it or exits with it (parse errors exit before running)."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def test_empty_data_file_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    from jaxloop.train import main

    assert 2 == _exit_code(main, ["--preset", "shakespeare", "--data.path", str(empty)])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.path=" in err[0] and "non-empty" in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt"]


def test_malformed_config_file_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.yaml").write_text("optim: [peak_lr: oops\n")
    (tmp_path / "unknown.json").write_text(json.dumps({"optim": {"peak_lr_typo": 1e-3}}))
    from jaxloop.train import main

    assert 2 == _exit_code(main, ["--config", "bad.yaml"])
    assert 2 == _exit_code(main, ["--config", "unknown.json"])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2
    assert "--config='bad.yaml'" in err[0]
    assert "optim.peak_lr_typo" in err[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml", "unknown.json"]


def test_config_file_sets_fields_and_flags_win(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("preset: debug\nsteps: 7\noptim:\n  peak_lr: 0.004\n  accum_steps: 2\n")
    cfg = parse_config(["--config", str(f), "--steps", "9", "--run_dir", str(tmp_path / "r")])
    assert cfg.preset == "debug" and cfg.batch_size == 32, "the file's preset supplies the other defaults"
    assert cfg.steps == 9 and cfg.optim.peak_lr == 0.004 and cfg.optim.accum_steps == 2


def test_dotted_flags_accept_underscores_and_hyphens(tmp_path):
    a = parse_config(["--optim.peak_lr", "3e-4", "--run_dir", str(tmp_path)])
    b = parse_config(["--optim.peak-lr", "3e-4", "--run-dir", str(tmp_path)])
    assert a == b and a.optim.peak_lr == 3e-4


def test_help_lists_every_field_with_its_doc_and_default():
    # 190 columns: at most two boxes side by side (tyro packs width // 65 columns), ~95 wide, so a field's
    # doc and default stay on one line however many fields the config has
    out = subprocess.run(
        [sys.executable, "-m", "jaxloop.train", "--help"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "190"},
        timeout=120,
    )
    assert out.returncode == 0
    flat = _flatten(to_dict(Config()))
    for key in flat:  # config.json's optim.optimizer.b1 is the flag --optim.b1, its .name --optim.name
        head, _, field = key.rpartition(".")
        if head in ("optim.optimizer", "optim.lr_schedule"):
            key = "optim." + ({"optimizer": "name", "lr_schedule": "schedule"}[head[6:]] if field == "name" else field)
        assert f"--{key}" in out.stdout, f"--{key} missing from --help"
    assert "Learning rate at the end of warmup. (default: 0.003)" in out.stdout


def test_bad_flag_in_a_real_subprocess_exits_2_with_one_line(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "jaxloop.train", "--optim.peak_lr", "0"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["jaxloop.train: error: optim.peak_lr=0.0 is not allowed: a number > 0"]
    assert list(Path(tmp_path).iterdir()) == []


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def test_a_run_saved_before_deterministic_existed_resumes_with_it_either_way():
    # deterministic picks how XLA:GPU chooses kernels, not what the run computes: an older run's config.json
    # (no such field) and a flipped value are no conflict, and the flip is still recorded as a change
    from jaxloop.config.run import changed_fields, resume_conflicts

    older = {k: v for k, v in to_dict(Config()).items() if k != "deterministic"}
    for deterministic in (True, False):
        cfg = Config(deterministic=deterministic)
        assert resume_conflicts(older, cfg) == []
        assert changed_fields(older, cfg) == {"deterministic": [None, deterministic]}
    assert resume_conflicts(older, Config(seed=1)) == ["seed: 0 -> 1"]
