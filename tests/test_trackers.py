"""Experiment trackers (log.trackers: mlflow, wandb): what each logged, read back through the library's own
reader, a resumed run continuing the same tracker run without logging an update twice, the report's files as
artifacts, a quiet exit 0 with no network, and the one line naming the extra when the library is missing.

MLflow is read with MlflowClient(tracking_uri).get_metric_history. wandb 0.31 has no public reader of an offline
run (wandb.Api reads the server; the old wandb.sdk.internal.datastore is gone), so the .wandb file is read as wandb
writes it: a LevelDB-log framing (a 7-byte ":W&B" header, 32 KiB blocks of crc32/length/type chunks) around
records of wandb's own protobuf schema, wandb.proto.wandb_internal_pb2.Record.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from jaxloop.config.errors import ConfigError
from jaxloop.config.run import LogConfig, preset
from jaxloop.observe.logger import RunLogger
from jaxloop.observe.trackers import tracker_dir
from jaxloop.rundir.records import read_records

REPO = Path(__file__).resolve().parents[1]


def mlflow_history(run_dir: Path, key: str) -> list[tuple[int, float]]:
    """(update, value) of each point MLflow holds for `key` in the run's store."""
    from mlflow.tracking import MlflowClient

    state = json.loads((tracker_dir(run_dir) / "state.json").read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{(tracker_dir(run_dir) / 'mlflow.db').resolve()}")
    return sorted((m.step, m.value) for m in client.get_metric_history(state["mlflow"]["run_id"], key))


def wandb_records(path: Path) -> list:
    """The protobuf records of one .wandb file (a run's offline log), in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", "wandb's header"
    block, pos, out, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:  # zero padding to the block's end
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, or LAST of FIRST/MIDDLE/LAST
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def wandb_run_files(run_dir: Path) -> list[Path]:
    """The run's offline .wandb files, one per session, oldest first."""
    return sorted((tracker_dir(run_dir) / "wandb").glob("offline-run-*/run-*.wandb"))


def wandb_history(run_dir: Path, key: str) -> list[tuple[int, float]]:
    """(update, value) of `key` in every history row of the run's sessions."""
    out = []
    for path in wandb_run_files(run_dir):
        for r in wandb_records(path):
            if r.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): i.value_json for i in r.history.item}
                if key in items:
                    out.append((int(r.history.step.num), float(json.loads(items[key]))))
    return sorted(out)


def _log(trackers: tuple[str, ...]) -> LogConfig:
    return replace(preset("debug").log, progress="off", tensorboard=False, trackers=trackers)


@pytest.mark.parametrize("tracker", ["mlflow", "wandb"])
def test_a_resumed_run_continues_the_tracker_run_and_logs_no_update_twice(tmp_path, tracker):
    # A first session logs updates 1..6 (a kill after its checkpoint at 3 loses nothing a tracker logged); the
    # resumed session starts at 3 and logs 4..8: the tracker holds each update once, in one run (one run id).
    history = mlflow_history if tracker == "mlflow" else wandb_history
    logger = RunLogger(tmp_path, _log((tracker,)), start_step=0, total_steps=8, config={"steps": 8})
    for s in range(1, 7):
        logger.train({"step": s, "loss": 10.0 + s})
    logger.eval({"step": 6, "val_loss": 0.5})
    logger.close()
    run_id = json.loads((tracker_dir(tmp_path) / "state.json").read_text())[tracker]["run_id"]
    logger = RunLogger(tmp_path, _log((tracker,)), start_step=3, total_steps=8, config={"steps": 8})
    for s in range(4, 9):
        logger.train({"step": s, "loss": 10.0 + s})
    logger.close()
    assert json.loads((tracker_dir(tmp_path) / "state.json").read_text())[tracker] == {
        "run_id": run_id,
        "logged_through": 8,
    }, "the same run, continued"
    assert history(tmp_path, "train/loss") == [(s, 10.0 + s) for s in range(1, 9)]
    assert history(tmp_path, "eval/val_loss") == [(6, 0.5)]
    assert [r["step"] for r in read_records(tmp_path)] == list(range(1, 9)), "metrics.jsonl as before"


def test_log_mlflow_uri_names_another_store_and_the_artifacts_stay_in_the_run_directory(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)  # MLflow's own default artifact root is ./mlartifacts: none must appear here
    store = f"sqlite:///{tmp_path / 'shared.db'}"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    log = replace(_log(("mlflow",)), mlflow_uri=store)
    logger = RunLogger(run_dir, log, start_step=0, total_steps=2, config={"steps": 2})
    logger.train({"step": 1, "loss": 3.0})
    logger.close()
    (run_dir / "report.md").write_text("# report\n")
    from jaxloop.observe.trackers import report_to_trackers

    report_to_trackers(run_dir, ("mlflow",), "jaxloop", store)
    run_id = json.loads((tracker_dir(run_dir) / "state.json").read_text())["mlflow"]["run_id"]
    client = MlflowClient(tracking_uri=store)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")] == [(1, 3.0)]
    assert not (tracker_dir(run_dir) / "mlflow.db").exists() and not (tmp_path / "mlartifacts").exists()
    assert (tracker_dir(run_dir) / "mlflow-artifacts").is_dir()
    assert [f.path for f in client.list_artifacts(run_id)] == ["report.md"]


def test_wandb_sessions_share_one_run_id(tmp_path):
    logger = RunLogger(tmp_path, _log(("wandb",)), start_step=0, total_steps=4, config={"steps": 4})
    logger.train({"step": 1, "loss": 1.0})
    logger.close()
    logger = RunLogger(tmp_path, _log(("wandb",)), start_step=1, total_steps=4, config={"steps": 4})
    logger.train({"step": 2, "loss": 1.0})
    logger.close()
    ids = {
        r.run.run_id
        for f in wandb_run_files(tmp_path)
        for r in wandb_records(f)
        if r.WhichOneof("record_type") == "run"
    }
    assert len(wandb_run_files(tmp_path)) == 2 and len(ids) == 1


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """`python -m jaxloop.train` with both trackers and the report, as a user runs it, without a network
    (WANDB_BASE_URL at a closed local port: a request would fail or hang, and a run that waited would show)."""
    run_dir = tmp_path_factory.mktemp("trackers") / "debug"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "WANDB_BASE_URL": "http://127.0.0.1:9", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxloop.train",
            "--preset",
            "debug",
            "--run_dir",
            str(run_dir),
            "--steps",
            "6",
            "--eval_every",
            "3",
            "--log.progress",
            "off",
            "--log.report",
            "--log.trackers",
            "mlflow",
            "wandb",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=600,
    )
    return run_dir, proc


def test_the_cli_run_exits_quietly_with_the_config_and_every_metric_in_both_trackers(cli_run):
    from mlflow.tracking import MlflowClient

    run_dir, proc = cli_run
    assert proc.returncode == 0, proc.stderr
    printed = (proc.stdout + proc.stderr).lower()
    assert "wandb" not in printed and "mlflow" not in printed, proc.stdout + proc.stderr
    losses = [(r["step"], r["loss"]) for r in read_records(run_dir) if r["kind"] == "train"]
    assert len(losses) == 6
    # every update's loss, bit for bit (both store float64; metrics.jsonl writes repr)
    assert mlflow_history(run_dir, "train/loss") == losses
    assert wandb_history(run_dir, "train/loss") == losses
    state = json.loads((tracker_dir(run_dir) / "state.json").read_text())
    params = (
        MlflowClient(f"sqlite:///{(tracker_dir(run_dir) / 'mlflow.db').resolve()}")
        .get_run(state["mlflow"]["run_id"])
        .data.params
    )
    assert params["optim.peak_lr"] == "0.01" and params["steps"] == "6"
    updates = {
        u.key: json.loads(u.value_json)
        for r in wandb_records(wandb_run_files(run_dir)[0])
        if r.WhichOneof("record_type") == "run"
        for u in r.run.config.update
    }
    assert updates["optim"]["peak_lr"] == 0.01 and updates["steps"] == 6


def test_the_report_and_its_plots_are_artifacts_of_both_runs(cli_run):
    from mlflow.tracking import MlflowClient

    run_dir, proc = cli_run
    assert proc.returncode == 0, proc.stderr
    expected = {"report.md", "loss.png", "lr.png", "throughput.png"}
    state = json.loads((tracker_dir(run_dir) / "state.json").read_text())
    client = MlflowClient(f"sqlite:///{(tracker_dir(run_dir) / 'mlflow.db').resolve()}")
    assert {f.path for f in client.list_artifacts(state["mlflow"]["run_id"])} == expected
    artifacts = [
        r.artifact
        for f in wandb_run_files(run_dir)
        for r in wandb_records(f)
        if r.WhichOneof("record_type") == "artifact"
    ]
    assert [a.type for a in artifacts] == ["report"]
    assert {c.path for c in artifacts[0].manifest.contents} == expected
    # W&B's own folders (its debug logs, the artifact's staged copies) stay inside the run directory
    staged = [f for f in (tracker_dir(run_dir) / "wandb" / "data" / "artifacts").rglob("*") if f.is_file()]
    assert len(staged) == len(expected), staged


def test_a_missing_tracker_library_is_one_line_naming_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError) as e:
        LogConfig(trackers=("wandb",)).validate()
    assert str(e.value) == (
        "log.trackers='wandb' is not allowed: an installed tracker (wandb is not installed): "
        "pip install 'jaxloop[wandb]'"
    )
    with pytest.raises(ConfigError, match="one of wandb, mlflow"):
        LogConfig(trackers=("neptune",)).validate()


def test_a_cli_resume_continues_both_tracker_runs_from_the_run_directory(cli_run, tmp_path, monkeypatch):
    # The finished 6-update run resumed to 9 updates by the same command with --steps 9 --allow_steps_change
    # (config.json read back), through jaxloop.train's main in this process (the command's exit status; the
    # process's own quiet exit is the cli_run's test):
    # each tracker holds updates 1..9 once, in the run it started (the ids in state.json are unchanged).
    import shutil

    from jaxloop.train import main

    run_dir, proc = cli_run
    assert proc.returncode == 0, proc.stderr
    resumed = tmp_path / "debug"
    shutil.copytree(run_dir, resumed)
    before = json.loads((tracker_dir(resumed) / "state.json").read_text())
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # no network, as for the first run
    status = main(
        [
            "--preset",
            "debug",
            "--run_dir",
            str(resumed),
            "--steps",
            "9",
            "--allow_steps_change",
            "--eval_every",
            "3",
            "--log.progress",
            "off",
            "--log.report",
            "--log.trackers",
            "mlflow",
            "wandb",
        ]
    )
    assert status == 0
    after = json.loads((tracker_dir(resumed) / "state.json").read_text())
    assert {k: v["run_id"] for k, v in after.items()} == {k: v["run_id"] for k, v in before.items()}
    losses = [(r["step"], r["loss"]) for r in read_records(resumed) if r["kind"] == "train"]
    assert [s for s, _ in losses] == list(range(1, 10))
    assert mlflow_history(resumed, "train/loss") == losses
    assert wandb_history(resumed, "train/loss") == losses
