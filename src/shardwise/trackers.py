"""External experiment trackers: TensorBoard (run.tensorboard), MLflow ([run.mlflow]) and Weights &
Biases ([run.wandb]). The main rank hands each metrics.jsonl record to the trackers the config asks
for, and each logs the same scalars (`scalars`) at the record's step. MLflow and W&B also log the
resolved config, and at the end OUT/summary.json and OUT/metrics.jsonl as files of the run; the ids
of their runs are kept in OUT/trackers.json, so that a resumed run goes on logging to the same ones.
A tracker's package is imported only when it is asked for (validate.py checks it is installed)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from shardwise.atomic_file import write_whole
from shardwise.config.schema import Config, ConfigError, MlflowConfig, RunConfig, WandbConfig

SUMMARY = "summary.json"
METRICS = "metrics.jsonl"
RUN_IDS = "trackers.json"

# MLflow's stores in a database, by the scheme of their URI (mlflow/store/db/db_types.py): opened
# through SQLAlchemy, their tables made and migrated by alembic.
MLFLOW_DATABASES = ("sqlite", "postgresql", "mysql", "mssql")


def check_trackers(run: RunConfig) -> None:
    """The trackers asked for are installed (looked for, not imported: importing mlflow or wandb
    takes most of a second), and MLflow's store is one MLflow 3 opens; ConfigError if not
    (validate.py asks, before launch)."""
    if run.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("run.tensorboard = true: the tensorboard package is not installed; "
                          "pip install 'shardwise[tensorboard]' (or pip install tensorboard), or leave it off")
    uri = run.mlflow.tracking_uri
    if uri is not None:
        key = f"run.mlflow.tracking_uri = {uri!r}"
        scheme = urlsplit(uri).scheme.partition("+")[0]
        needed = ("mlflow", "sqlalchemy", "alembic") if scheme in MLFLOW_DATABASES else ("mlflow",)
        for package in needed:
            if importlib.util.find_spec(package) is None:
                raise ConfigError(f"{key}: the {package} package is not installed; pip install 'shardwise[mlflow]'")
        directory = scheme == "file" or (scheme == "" and uri != "databricks")  # MLflow's name for its own service
        if directory and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("true", "1"):
            raise ConfigError(f"{key}: a directory, which MLflow 3 opens only with MLFLOW_ALLOW_FILE_STORE=true; "
                              "use a database (sqlite:///mlflow.db) or a tracking server (http://host:5000)")
    if run.wandb.project is not None and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"run.wandb.project = {run.wandb.project!r}: the wandb package is not installed; "
                          "pip install 'shardwise[wandb]'")


# A preference objective's metrics (preference.py), in the records of step, eval (val_) and summary (val_)
REWARDS = ("reward_chosen", "reward_rejected", "reward_accuracy", "reward_margin")


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl record as scalars by tag: a step's loss, lr, step time, throughput, MFU, loss
    scale and a preference objective's rewards where known, and each rank's memory by category in
    MiB; an eval's (or the summary's final) validation loss (and rewards); nothing for a health
    event (a bad step, a straggler)."""
    if record["event"] in ("eval", "summary"):
        return {"val/loss": record["val_loss"], **{f"val/{key}": record[f"val_{key}"] for key in REWARDS
                                                   if record.get(f"val_{key}") is not None}}
    if record["event"] != "step":
        return {}
    keys = ("loss", "lr", "step_time_s", "samples_per_s", "tokens_per_s", "mfu", "loss_scale", *REWARDS)
    values = {f"train/{key}": record[key] for key in keys if record.get(key) is not None}
    for rank, memory in enumerate(record["memory_by_rank"]):
        values.update({f"memory_MiB/rank{rank}/{category}": value / 2**20
                       for category, value in memory.items() if value is not None})
    return values


def record_step(record: dict[str, Any]) -> int:
    """The step a record's scalars belong to: the summary's is the last step's."""
    return record["steps"] if record["event"] == "summary" else record["step"]


def flat_params(table: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config tables as one level of dotted keys (`model.n_layer`, `parallel.pipeline.schedule`)."""
    params = {}
    for key, value in table.items():
        if isinstance(value, dict):
            params.update(flat_params(value, f"{prefix}{key}."))
        else:
            params[f"{prefix}{key}"] = str(value)
    return params


def wandb_mode() -> str:
    """W&B's mode: WANDB_MODE where set; else `online` where credentials are found without asking or
    asking the server (WANDB_API_KEY, the netrc entry `wandb login` writes, wandb's settings), else
    `offline`: the run is kept in OUT/wandb, and `wandb sync` uploads it later."""
    mode = os.environ.get("WANDB_MODE")
    if mode:
        return mode
    from wandb.sdk import wandb_setup
    from wandb.sdk.lib import wbauth

    # How wandb.Api() looks for credentials, without its prompt and its check with the server.
    found = wbauth.authenticate_session(host=wandb_setup.singleton().settings.base_url, source="shardwise",
                                        prompt=False, update_session=False)
    return "online" if found is not None else "offline"


class Tracker(Protocol):
    """What the trainer's records go to, on the main rank."""

    def write(self, record: dict[str, Any]) -> None:
        """Log the record's scalars at its step."""

    def close(self, failed: bool, files: list[Path]) -> None:
        """Log `files` with the run, and end it: as failed where the training raised."""


class TensorBoardTracker:
    """Scalars in an OUT/tensorboard event file, at their step."""

    def __init__(self, log_dir: Path, resumed_at: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard drops what earlier event files in this directory hold from that
        # step on: a resumed run's steps after its checkpoint, or a previous run's in the same OUT.
        self._writer = SummaryWriter(str(log_dir), purge_step=resumed_at + 1, flush_secs=10)

    def write(self, record: dict[str, Any]) -> None:
        for tag, value in scalars(record).items():
            self._writer.add_scalar(tag, value, record_step(record))

    def close(self, failed: bool, files: list[Path]) -> None:
        self._writer.close()


class MlflowTracker:
    """One MLflow run: the config as parameters, the records' scalars as metrics, the report files
    as artifacts. Metrics are logged in one batch a second (`FLUSH_EVERY_S`), and at the end: a
    batch to a SQLite store costs ~3 ms and ~0.07 ms a metric, ~6 ms a step for gpt-tiny's 11 scalars
    logged step by step. (MLflow's own asynchronous logging, a thread of this process, slowed the
    training more than that.)"""

    FLUSH_EVERY_S = 1.0

    def __init__(self, settings: MlflowConfig, params: dict[str, str], name: str, run_id: str | None) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self._client = MlflowClient(settings.tracking_uri)
        if run_id is None:
            experiment = self._client.get_experiment_by_name(settings.experiment)
            experiment_id = experiment.experiment_id if experiment is not None else \
                self._client.create_experiment(settings.experiment)
            run_id = self._client.create_run(experiment_id, run_name=name).info.run_id
            logged = {}
        else:
            logged = self._client.get_run(run_id).data.params
            self._client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        # MLflow never changes a parameter: a resumed run (run.resume, train.steps raised) keeps its first values.
        self._client.log_batch(run_id, params=[Param(key, value) for key, value in params.items() if key not in logged])
        self._metrics: list[Any] = []  # mlflow.entities.Metric, not yet logged
        self._flushed = time.monotonic()

    def write(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        step, timestamp = record_step(record), int(time.time() * 1000)
        self._metrics += [Metric(key, value, timestamp, step) for key, value in scalars(record).items()]
        if time.monotonic() - self._flushed >= self.FLUSH_EVERY_S:
            self._flush()

    def _flush(self) -> None:
        self._client.log_batch(self.run_id, metrics=self._metrics)  # in batches of at most 1000, MLflow's limit
        self._metrics = []
        self._flushed = time.monotonic()

    def close(self, failed: bool, files: list[Path]) -> None:
        try:
            self._flush()
            for path in files:
                self._client.log_artifact(self.run_id, str(path))
        finally:
            self._client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


class WandbTracker:
    """One W&B run, in OUT/wandb: the config, each record's scalars at its step, the report files as
    files of the run."""

    def __init__(self, settings: WandbConfig, config: dict[str, Any], out: Path, run_id: str | None) -> None:
        import wandb

        self._run = wandb.init(project=settings.project, entity=settings.entity, name=out.name, dir=str(out),
                               config=config, mode=wandb_mode(), id=run_id, resume="allow" if run_id else None)
        self.run_id = self._run.id

    def write(self, record: dict[str, Any]) -> None:
        values = scalars(record)
        if values:
            self._run.log(values, step=record_step(record))

    def close(self, failed: bool, files: list[Path]) -> None:
        try:
            for path in files:
                self._run.save(str(path), base_path=str(path.parent), policy="now")
        finally:
            self._run.finish(exit_code=1 if failed else 0)


class Trackers:
    """The trackers the config asks for, opened on the main rank; MLflow's and W&B's runs resumed
    from OUT/trackers.json where `resumed_at` (the run continues) and the stored run was logged to
    the same place."""

    def __init__(self, cfg: Config, out: Path, resumed_at: int) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self._out = out.resolve()
        self._trackers: list[Tracker] = []
        if not resumed_at:  # the ids an earlier run in this directory logged under are not this run's
            (out / RUN_IDS).unlink(missing_ok=True)
        stored = json.loads((out / RUN_IDS).read_text()) if (out / RUN_IDS).is_file() else {}
        run = cfg.run

        def resumed(name: str, settings: MlflowConfig | WandbConfig) -> str | None:
            entry = stored.get(name)
            return entry["run_id"] if entry and entry["settings"] == dataclasses.asdict(settings) else None

        with ExitStack() as opened:  # a tracker that fails to open ends those opened before it
            opened.callback(self._end, True, [])
            if run.tensorboard:
                self._trackers.append(TensorBoardTracker(out / "tensorboard", resumed_at))
            ids = {}
            if run.mlflow.tracking_uri is not None:
                tracker = MlflowTracker(run.mlflow, flat_params(cfg.to_dict()), self._out.name,
                                        resumed("mlflow", run.mlflow))
                self._trackers.append(tracker)
                ids["mlflow"] = {"settings": dataclasses.asdict(run.mlflow), "run_id": tracker.run_id}
            if run.wandb.project is not None:
                tracker = WandbTracker(run.wandb, cfg.to_dict(), self._out, resumed("wandb", run.wandb))
                self._trackers.append(tracker)
                ids["wandb"] = {"settings": dataclasses.asdict(run.wandb), "run_id": tracker.run_id}
            if ids:
                write_whole(out / RUN_IDS, json.dumps(ids, indent=2).encode())
                # The summary.json of an earlier run in this directory is not this run's.
                (out / SUMMARY).unlink(missing_ok=True)
            opened.pop_all()
        self._reports = bool(ids)  # MLflow and W&B log summary.json and metrics.jsonl; TensorBoard does not

    def write(self, record: dict[str, Any]) -> None:
        if record["event"] == "summary" and self._reports:
            write_whole(self._out / SUMMARY, json.dumps(record, indent=2).encode())
        for tracker in self._trackers:
            tracker.write(record)

    def close(self, failed: bool) -> None:
        """End every tracker's run, logging summary.json (where the run got that far) and metrics.jsonl."""
        self._end(failed, [path for path in (self._out / SUMMARY, self._out / METRICS) if path.is_file()])

    def _end(self, failed: bool, files: list[Path]) -> None:
        """End every tracker's run, each even if another's end raised."""
        with ExitStack() as ending:
            for tracker in self._trackers:
                ending.callback(tracker.close, failed, files)
