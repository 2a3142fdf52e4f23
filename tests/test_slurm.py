"""Slurm's environment (issue 72, its first step): under `srun` with one task a node, `shardwise
train` takes the step's nodes, this node's rank and the rendezvous host from SLURM_* with no flag;
flags win; one task a rank is refused in one line. (A real Slurm runs these in a later step.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import CONFIGS

from shardwise.cli import _train_config, main, parser
from shardwise.config.schema import ConfigError
from shardwise.slurm import expand_hostlist, slurm_launch, tasks_per_node

TWO_NODES = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_STEP_NUM_NODES": "2",
             "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}


@pytest.mark.parametrize("hostlist, hosts", [
    ("node1", ["node1"]),
    ("node[01-03]", ["node01", "node02", "node03"]),
    ("a[1-2,7],b2", ["a1", "a2", "a7", "b2"]),
    ("gpu[09-10]-ib", ["gpu09-ib", "gpu10-ib"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
])
def test_slurms_host_lists_expand_in_order(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


def test_slurms_tasks_per_node_expand():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1] and tasks_per_node("1") == [1]
    with pytest.raises(ConfigError, match="SLURM_STEP_TASKS_PER_NODE = 'x'"):
        tasks_per_node("x")


def test_a_step_of_one_task_a_node_gives_its_nodes_rank_and_rendezvous():
    assert slurm_launch(TWO_NODES) == {"launch.nnodes": 2, "launch.node_rank": 1,
                                       "launch.rdzv_endpoint": "node01:29500"}
    assert slurm_launch({**TWO_NODES, "MASTER_PORT": "29601"})["launch.rdzv_endpoint"] == "node01:29601"
    assert slurm_launch({"SLURM_JOB_ID": "7"}) == {}  # a batch script's own shell is no step
    assert slurm_launch({}) == {}


def test_shardwise_train_reads_the_step_and_its_flags_win(monkeypatch):
    for key, value in TWO_NODES.items():
        monkeypatch.setenv(key, value)
    cfg = _train_config(parser().parse_args(["train", str(CONFIGS / "gpt-tiny.toml"), "--strategy", "ddp",
                                             "--nproc", "2", "--set", "train.micro_batch=4"]))
    assert (cfg.launch.nnodes, cfg.launch.node_rank, cfg.launch.rdzv_endpoint) == (2, 1, "node01:29500")
    assert cfg.world_size == 4
    flagged = _train_config(parser().parse_args(["train", str(CONFIGS / "gpt-tiny.toml"), "--strategy", "ddp",
                                                 "--nproc", "2", "--node-rank", "0",
                                                 "--rdzv-endpoint", "head:29400", "--set", "train.micro_batch=4"]))
    assert (flagged.launch.node_rank, flagged.launch.rdzv_endpoint) == (0, "head:29400")


def test_one_task_a_rank_is_refused_in_one_line(monkeypatch, tmp_path, capsys):
    for key, value in {**TWO_NODES, "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}.items():
        monkeypatch.setenv(key, value)
    code = main(["train", str(CONFIGS / "gpt-tiny.toml"), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "srun with 2 tasks on a node" in err and "--ntasks-per-node=1" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_shardwise_slurm_writes_a_job_that_signals_before_its_limit_requeues_and_resumes(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["slurm", str(CONFIGS / "demo.toml"), "--nodes", "1", "--gpus-per-node", "2", "--out", str(out),
                 "--time", "04:00:00", "--set", "train.steps=10"])
    assert code == 0 and "1 node(s) x 2 rank(s)" in capsys.readouterr().out
    script = (out / "job.sbatch").read_text().splitlines()
    for line in ("#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=2",
                 "#SBATCH --signal=TERM@120", "#SBATCH --requeue", "#SBATCH --time=04:00:00"):
        assert line in script
    srun = script[-1].split()
    assert srun[:2] == ["srun", "--ntasks-per-node=1"] and Path(srun[2]).name == "shardwise" and srun[3] == "train"
    assert Path(srun[2]).is_file()  # this installation's command, which the nodes share
    assert srun[srun.index("--nproc") + 1] == "2" and "--resume" in srun and srun[-2:] == ["--set", "train.steps=10"]


def test_shardwise_slurm_checks_the_config_for_the_jobs_world_before_writing(tmp_path, capsys):
    code = main(["slurm", str(CONFIGS / "gpt-tiny.toml"), "--nodes", "2", "--nproc", "2",
                 "--out", str(tmp_path / "run")])
    assert code == 2 and "world size is 4" in capsys.readouterr().err and not (tmp_path / "run").exists()
