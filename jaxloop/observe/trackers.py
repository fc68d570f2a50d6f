"""Experiment trackers beside metrics.jsonl and TensorBoard (log.trackers, like HF's report_to): Weights & Biases
and MLflow, both written locally into run_dir/trackers, so that the run never waits on the network.

Each tracker gets the config as hyper-parameters, every scalar of a train, eval or hook record at its update
(under TensorBoard's tags: train/loss, eval/val_loss, throughput/tokens_per_s, ...) and, when the report is
written, report.md and its plots as files of the run. W&B writes an offline run (`wandb sync` uploads it later);
MLflow a sqlite store (or log.mlflow_uri). A resumed run continues the same tracker run: run_dir/trackers/state.json
keeps each tracker's run id and the last update it logged, and records up to that update are not logged again (a
killed run's records after its checkpoint were logged once already; a resumed run recomputes them bit for bit).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jaxloop.rundir.atomic import atomic_write_text

TRACKERS_DIR = "trackers"
"""run_dir/trackers: the trackers' files (W&B's offline runs, MLflow's sqlite store and artifacts, state.json)."""
STATE_EVERY_S = 10.0
"""state.json's last logged update is rewritten at most this often (and at close): a SIGKILLed run may log again
the records of its last seconds."""
MLFLOW_BATCH = 1000
"""The most metrics one MLflow log_batch call takes."""


def tracker_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / TRACKERS_DIR


def numbers(kind: str, record: dict[str, Any]) -> dict[str, float]:
    """{tag: value} of a record's scalars (booleans and text left out), tagged as in TensorBoard."""
    from jaxloop.observe.logger import tb_tag

    return {
        tb_tag(kind, key): float(value)
        for key, value in record.items()
        if key not in ("step", "kind") and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow's flat parameters: {"optim.peak_lr": "0.001", ...}."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flat_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, (list, tuple)) else str(value)
    return out


@contextlib.contextmanager
def quiet_loggers(*names: str) -> Iterator[None]:
    """The named loggers at WARNING for the block (MLflow's INFO lines about creating its tables), put back after."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@contextlib.contextmanager
def scoped_env(values: dict[str, str]) -> Iterator[None]:
    """os.environ with `values` set for the block, put back after (W&B reads its cache and staging folders there)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class MlflowTracker:
    """An MLflow run in a local sqlite store (or log.mlflow_uri): parameters, metrics per update, artifacts."""

    name = "mlflow"

    def __init__(self, run_dir: Path, project: str, uri: str, run_id: str | None, config: dict[str, Any] | None):
        from mlflow.entities import Param  # imported first: the import sets the mlflow logger's level
        from mlflow.tracking import MlflowClient

        with quiet_loggers("mlflow", "alembic"):
            self.uri = uri or f"sqlite:///{(tracker_dir(run_dir) / 'mlflow.db').resolve()}"
            self.client = MlflowClient(tracking_uri=self.uri)
            if run_id is None:
                experiment = self.client.get_experiment_by_name(project)
                # artifacts in run_dir/trackers, unless a server (http, databricks) keeps them where it puts them
                server = uri.startswith(("http://", "https://", "databricks"))
                local = None if server else (tracker_dir(run_dir) / "mlflow-artifacts").resolve().as_uri()
                experiment_id = (
                    experiment.experiment_id
                    if experiment is not None
                    else self.client.create_experiment(project, artifact_location=local)
                )
                run_id = self.client.create_run(experiment_id, run_name=run_dir.resolve().name).info.run_id
            else:
                self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
            if config is not None:  # a resume keeps the values first logged (MLflow's parameters cannot change)
                logged = self.client.get_run(run_id).data.params
                params = [Param(k, v[:6000]) for k, v in flat_params(config).items() if k not in logged]
                for i in range(0, len(params), 100):
                    self.client.log_batch(run_id, params=params[i : i + 100], synchronous=True)
        self._metrics: list[Any] = []

    def logged_through(self) -> int:
        """The last update with a metric in the store (-1: none)."""
        with quiet_loggers("mlflow", "alembic"):
            keys = self.client.get_run(self.run_id).data.metrics
            return max((m.step for k in keys for m in self.client.get_metric_history(self.run_id, k)), default=-1)

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        self._metrics += [Metric(k, v, stamp, step) for k, v in values.items()]

    def flush(self) -> None:
        metrics, self._metrics = self._metrics, []
        with quiet_loggers("mlflow", "alembic"):
            for i in range(0, len(metrics), MLFLOW_BATCH):
                self.client.log_batch(self.run_id, metrics=metrics[i : i + MLFLOW_BATCH], synchronous=True)

    def artifacts(self, files: list[Path], run_dir: Path) -> None:
        with quiet_loggers("mlflow", "alembic"):
            for f in files:
                parent = f.parent.relative_to(run_dir).as_posix()
                self.client.log_artifact(self.run_id, str(f), artifact_path=None if parent == "." else parent)

    def close(self) -> None:
        self.flush()
        with quiet_loggers("mlflow", "alembic"):
            self.client.set_terminated(self.run_id, "FINISHED")


class WandbTracker:
    """A W&B offline run in run_dir/trackers/wandb (no network; `wandb sync` uploads it): config, metrics per
    update, artifacts; quiet (no console capture, no system-metrics thread, no lines at exit)."""

    name = "wandb"

    def __init__(self, run_dir: Path, project: str, run_id: str | None, config: dict[str, Any] | None):
        import wandb

        self.env = self._env(run_dir)
        with scoped_env(self.env):
            self.run = wandb.init(
                project=project,
                name=run_dir.resolve().name,
                id=run_id,
                resume="allow",
                mode="offline",
                dir=str(tracker_dir(run_dir)),
                config=config,
                allow_val_change=True,
                reinit="create_new",
                settings=wandb.Settings(
                    console="off",
                    quiet=True,
                    silent=True,
                    show_info=False,
                    show_warnings=False,
                    x_disable_stats=True,
                    disable_code=True,
                    disable_git=True,
                ),
            )
        self.run_id = self.run.id

    @staticmethod
    def _env(run_dir: Path) -> dict[str, str]:
        """W&B's own folders (debug logs, artifact staging, settings) inside run_dir/trackers/wandb."""
        base = (tracker_dir(run_dir) / "wandb").resolve()
        return {
            "WANDB_MODE": "offline",
            "WANDB_SILENT": "true",
            "WANDB_CACHE_DIR": str(base / "cache"),
            "WANDB_DATA_DIR": str(base / "data"),
            "WANDB_CONFIG_DIR": str(base / "config"),
        }

    def logged_through(self) -> int:
        return -1  # an offline run cannot be asked: state.json's count stands

    def log(self, step: int, values: dict[str, float]) -> None:
        with scoped_env(self.env):
            self.run.log(values, step=step)

    def flush(self) -> None:
        pass  # wandb's service writes the run file as records arrive

    def artifacts(self, files: list[Path], run_dir: Path) -> None:
        import wandb

        with scoped_env(self.env):  # add_file copies the file into the staging folder (WANDB_DATA_DIR)
            artifact = wandb.Artifact(f"report-{self.run_id}", type="report")
            for f in files:
                artifact.add_file(str(f), name=f.relative_to(run_dir).as_posix())
            self.run.log_artifact(artifact)

    def close(self) -> None:
        with scoped_env(self.env):
            self.run.finish()


class Trackers:
    """The run's trackers (log.trackers): opened with the logger, each continuing its run on resume (state.json);
    `log` skips the records a tracker has already (up to its last logged update)."""

    def __init__(
        self, run_dir: str | Path, names: tuple[str, ...], project: str, mlflow_uri: str, config: dict[str, Any] | None
    ):
        self.run_dir = Path(run_dir)
        self.path = tracker_dir(run_dir) / "state.json"
        tracker_dir(run_dir).mkdir(parents=True, exist_ok=True)
        self.state: dict[str, dict[str, Any]] = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.open: list[Any] = []
        self.resumed_through: dict[str, int] = {}  # the last update logged before this session
        for name in names:
            saved = self.state.get(name, {})
            if name == "mlflow":
                tracker: Any = MlflowTracker(self.run_dir, project, mlflow_uri, saved.get("run_id"), config)
            else:
                tracker = WandbTracker(self.run_dir, project, saved.get("run_id"), config)
            self.open.append(tracker)
            through = max(int(saved.get("logged_through", -1)), tracker.logged_through() if saved else -1)
            self.resumed_through[name] = through
            self.state[name] = {"run_id": tracker.run_id, "logged_through": through}
        self._write_state()

    def log(self, kind: str, record: dict[str, Any]) -> None:
        """A record's scalars to each tracker, unless an earlier session logged its update already."""
        step = int(record["step"])
        values = numbers(kind, record)
        for tracker in self.open:
            if values and step > self.resumed_through[tracker.name]:
                tracker.log(step, values)
                self.state[tracker.name]["logged_through"] = max(step, self.state[tracker.name]["logged_through"])

    def flush(self) -> None:
        for tracker in self.open:
            tracker.flush()
        if time.monotonic() - self._written >= STATE_EVERY_S:
            self._write_state()

    def close(self) -> None:
        for tracker in self.open:
            tracker.close()
        self._write_state()
        self.open = []

    def _write_state(self) -> None:
        atomic_write_text(self.path, json.dumps(self.state, indent=1) + "\n")
        self._written = time.monotonic()


def report_to_trackers(run_dir: str | Path, names: tuple[str, ...], project: str, mlflow_uri: str) -> None:
    """report.md and its plots as files of each tracker's run (the run continued by its id, then closed again)."""
    from jaxloop.observe.run_report import PLOTS
    from jaxloop.rundir.layout import RunLayout

    run_dir = Path(run_dir)
    layout = RunLayout(run_dir)
    files = [f for f in (layout.report, *(layout.plot(name) for name in PLOTS)) if f.is_file()]
    if not files or not names:
        return
    trackers = Trackers(run_dir, names, project, mlflow_uri, None)
    for tracker in trackers.open:
        tracker.artifacts(files, run_dir)
    trackers.close()
