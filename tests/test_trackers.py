"""MLflow and Weights & Biases hold what metrics.jsonl holds: real short runs of gpt-tiny (through
the CLI, and one crashed and resumed in this process), read back with each tracker's own client;
and a tracker whose package is missing is refused before launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import CONFIGS, Crash, crash_at, gpt_tiny, in_process, read_records, shardwise

from shardwise.cli import main
from shardwise.config.load import load_config
from shardwise.config.schema import ConfigError
from shardwise.trackers import scalars
from shardwise.trainer import Trainer

TINY = str(CONFIGS / "gpt-tiny.toml")
WANDB = Path(sys.executable).parent / "wandb"


def mlflow_runs(uri: str) -> list:
    """The runs of the experiment `shardwise` in the MLflow store at `uri`."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    return client.search_runs([client.get_experiment_by_name("shardwise").experiment_id])


def test_mlflow_holds_the_metrics_jsonl_numbers_logged_by_the_main_rank_alone(tmp_path):
    from mlflow import MlflowClient

    # Run in tmp_path: the database is ./mlflow.db, and MLflow puts the artifacts in ./mlruns.
    result = shardwise("train", TINY, "--strategy", "ddp", "--nproc", "2", "--steps", "5", "--out", "run",
                       "--set", "run.mlflow.tracking_uri=sqlite:///mlflow.db", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    uri, out = f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "run"
    (run,) = mlflow_runs(uri)  # the main rank's only
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert json.loads((out / "trackers.json").read_text())["mlflow"]["run_id"] == run.info.run_id
    assert run.data.params["model.n_layer"] == "2" and run.data.params["parallel.strategy"] == "ddp"
    assert run.data.params["parallel.pipeline.schedule"] == "1f1b"  # a table within a section: dotted too

    client = MlflowClient(uri)
    steps, (summary,) = read_records(out), read_records(out, "summary")
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], r["loss"]) for r in steps]
    assert set(run.data.metrics) == set(scalars(steps[-1])) | {"val/loss"}  # both ranks' memory, from rank 0
    assert "memory_MiB/rank1/optimizer" in run.data.metrics
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "val/loss")] == [
        (5, summary["val_loss"])]

    assert run.info.artifact_uri.startswith(str(tmp_path / "mlruns"))
    assert {f.path for f in client.list_artifacts(run.info.run_id)} == {"summary.json", "metrics.jsonl"}
    logged = client.download_artifacts(run.info.run_id, "summary.json", str(tmp_path))
    assert json.loads(Path(logged).read_text()) == summary == json.loads((out / "summary.json").read_text())


def wandb_records(run_dir: Path, env: dict[str, str]) -> list[dict]:
    """The records of an offline W&B run, read by wandb's own reader: one JSON object a line."""
    result = subprocess.run([str(WANDB), "leet", "inspect", "--json", str(run_dir)], capture_output=True, text=True,
                            env={**os.environ, **env}, timeout=60)
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_wandb_keeps_an_offline_run_of_the_metrics_jsonl_numbers_and_resumes_it(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    # Offline, and nothing of W&B's outside tmp_path (its settings, cache, staging).
    env = {"WANDB_MODE": "offline", **{f"WANDB_{name}_DIR": str(tmp_path / name.lower())
                                       for name in ("CONFIG", "CACHE", "DATA")}}
    out = tmp_path / "run"
    args = (TINY, "--out", str(out), "--set", "run.wandb.project=shardwise-test", "--set", "train.checkpoint_every=2")
    result = shardwise("train", *args, "--steps", "3", env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    run_id = json.loads((out / "trackers.json").read_text())["wandb"]["run_id"]
    # train.steps raised, from the checkpoint after step 2: step 3 again, and 4 and 5, to the same run.
    result = shardwise("train", *args, "--steps", "5", "--resume", env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads((out / "trackers.json").read_text())["wandb"]["run_id"] == run_id
    first, resumed = sorted((out / "wandb").glob(f"offline-run-*-{run_id}"))

    steps, (summary,) = read_records(out), read_records(out, "summary")
    for run_dir, logged_steps, resuming in ((first, [1, 2, 3], None), (resumed, [3, 4, 5], True)):
        records = wandb_records(run_dir, env)
        (run,) = [r["run"] for r in records if r["type"] == "run"]
        assert (run["run_id"], run["display_name"], run["project"], run.get("resume")) == (
            run_id, "run", "shardwise-test", resuming)
        assert run["config"]["update"]["model"]["n_layer"] == 2
        history = [r["history"] for r in records if r["type"] == "history"]
        assert [(h["step"]["num"], h["item"]["train/loss"]) for h in history] == [
            (r["step"], r["loss"]) for r in steps if r["step"] in logged_steps]
        assert history[-1]["item"].keys() == scalars(steps[-1]).keys() | {"val/loss", "_step", "_runtime", "_timestamp"}
        saved = {file["path"] for r in records if r["type"] == "files" for file in r["files"]["files"]}
        assert {"summary.json", "metrics.jsonl"} <= saved
        assert [r["exit"]["exit_code"] for r in records if r["type"] == "exit"] == [0]
    # The resumed run's end: the summary's validation loss at the last step, and its summary.json.
    assert history[-1]["item"]["val/loss"] == summary["val_loss"]
    assert json.loads((resumed / "files" / "summary.json").read_text()) == summary


def test_a_crashed_run_fails_its_mlflow_run_and_resuming_it_continues_that_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # MLflow's ./mlruns
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"

    def config(*overrides: str):
        return gpt_tiny(tmp_path / "run", "single", 1, f"run.mlflow.tracking_uri={uri}", "train.checkpoint_every=2",
                        *overrides, steps=5)

    with pytest.raises(Crash):
        in_process(lambda ctx: crash_at(Trainer(config(), ctx), 3).fit())  # after step 3, its checkpoint at 2
    (crashed,) = mlflow_runs(uri)
    assert crashed.info.status == "FAILED"
    in_process(lambda ctx: Trainer(config("run.resume=true"), ctx).fit())
    (run,) = mlflow_runs(uri)
    assert run.info.run_id == crashed.info.run_id and run.info.status == "FINISHED"
    assert run.data.params["run.resume"] == "False"  # MLflow keeps a parameter's first value

    from mlflow import MlflowClient

    history = MlflowClient(uri).get_metric_history(run.info.run_id, "train/loss")
    losses = [(r["step"], r["loss"]) for r in read_records(tmp_path / "run")]
    # Step 3 logged again after the resume, with the same loss: shardwise resumes bit for bit.
    assert [(m.step, m.value) for m in history] == sorted(losses + [losses[2]])


@pytest.mark.parametrize("package, setting, key, extra", [
    ("mlflow", "run.mlflow.tracking_uri=sqlite:///mlflow.db", "run.mlflow.tracking_uri = 'sqlite:///mlflow.db'",
     "mlflow"),
    ("sqlalchemy", "run.mlflow.tracking_uri=sqlite:///mlflow.db", "run.mlflow.tracking_uri = 'sqlite:///mlflow.db'",
     "mlflow"),
    ("wandb", "run.wandb.project=shardwise-test", "run.wandb.project = 'shardwise-test'", "wandb"),
])
def test_a_tracker_without_its_package_is_refused_before_launch_in_one_line(tmp_path, monkeypatch, capsys, package,
                                                                           setting, key, extra):
    monkeypatch.setitem(sys.modules, package, None)  # find_spec now finds nothing, as if it were not installed
    out = tmp_path / "run"
    assert main(["train", TINY, "--out", str(out), "--set", setting]) == 2
    assert capsys.readouterr().err == (f"shardwise train: config error: {key}: the {package} package is not "
                                       f"installed; pip install 'shardwise[{extra}]'\n")
    assert not out.exists()


def test_a_directory_store_is_refused_unless_mlflow_is_told_to_open_it(monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(ConfigError, match=r"'\./mlruns': a directory, which MLflow 3 opens only with "
                                          r"MLFLOW_ALLOW_FILE_STORE=true; use a database \(sqlite:///mlflow.db\)"):
        load_config(TINY, ["run.mlflow.tracking_uri=./mlruns"])
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert load_config(TINY, ["run.mlflow.tracking_uri=./mlruns"]).run.mlflow.tracking_uri == "./mlruns"


def test_health_events_are_metrics_jsonl_records_only():
    assert scalars({"event": "straggler", "step": 3, "rank": 1, "seconds": 0.5}) == {}
