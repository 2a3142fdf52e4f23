"""Slurm's environment (issue 72): under `srun` with one task a node, `shardwise train` takes the
step's nodes, this node's rank and the rendezvous host from SLURM_* with no flag, and flags win;
with several tasks a node each task is a rank, what it cannot do refused in one line. `shardwise
slurm` writes the sbatch script, either way, and from a plan. (tests/multinode/test_slurm_cluster.py runs
them under a real Slurm.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import CONFIGS

from shardwise.cli import _train_config, main, parser
from shardwise.config.schema import ConfigError
from shardwise.slurm import expand_hostlist, rank_environment, slurm_launch, tasks_per_node

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


PER_RANK = {**TWO_NODES, "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3",
            "SLURM_LOCALID": "1"}


def test_a_step_of_several_tasks_a_node_makes_each_task_a_rank():
    assert slurm_launch(PER_RANK)["launch.nproc"] == 2 and "launch.nproc" not in slurm_launch(TWO_NODES)
    assert rank_environment(PER_RANK) == {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                                          "MASTER_ADDR": "node01", "MASTER_PORT": "29500"}
    assert rank_environment(TWO_NODES) is None and rank_environment({}) is None
    with pytest.raises(ConfigError, match="tasks per node '2,1'"):
        slurm_launch({**PER_RANK, "SLURM_STEP_TASKS_PER_NODE": "2,1"})


ONE_NODE = {**PER_RANK, "SLURM_STEP_NODELIST": "node01", "SLURM_STEP_NUM_NODES": "1", "SLURM_NODEID": "0",
            "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"}


@pytest.mark.parametrize("environ, flags, words", [
    (PER_RANK, ["--nproc", "4"], "--nproc 4: srun started 2 tasks on this node"),
    (PER_RANK, ["--max-restarts", "1"], "Slurm requeues the job"),
    (ONE_NODE, ["--replica-groups", "2"], "launch.replica_groups = 2"),
    (ONE_NODE, ["--strategy", "param-server"], "parallel.strategy = 'param-server'"),
])
def test_what_one_process_a_rank_cannot_do_is_refused_in_one_line(monkeypatch, tmp_path, capsys, environ, flags,
                                                                  words):
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    code = main(["train", str(CONFIGS / "gpt-tiny.toml"), "--strategy", "ddp", "--out", str(tmp_path / "run"),
                 "--set", "train.micro_batch=4", *flags])
    err = capsys.readouterr().err
    assert code == 2 and words in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def test_shardwise_slurm_writes_a_job_that_signals_before_its_limit_requeues_and_resumes(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["slurm", str(CONFIGS / "demo.toml"), "--nodes", "1", "--gpus-per-node", "2", "--out", str(out),
                 "--time", "04:00:00", "--set", "train.steps=10"])
    assert code == 0 and "1 node(s) x 2 rank(s), a launcher a node" in capsys.readouterr().out
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


def test_shardwise_slurm_with_a_task_a_rank_starts_every_rank_under_srun(tmp_path):
    out = tmp_path / "run"
    assert main(["slurm", str(CONFIGS / "gpt-tiny.toml"), "--nodes", "2", "--nproc", "2", "--task-per-rank",
                 "--out", str(out), "--set", "train.micro_batch=4", "--set", "parallel.strategy=ddp"]) == 0
    script = (out / "job.sbatch").read_text().splitlines()
    assert "#SBATCH --ntasks-per-node=2" in script
    srun = script[-1].split()
    assert srun[:3] == ["srun", "--kill-on-bad-exit=1", "--ntasks-per-node=2"] and "--nproc" not in srun


def plan_json(tmp_path, *flags: str) -> str:
    path = tmp_path / "plan.json"
    assert main(["plan", str(CONFIGS / "gpt-tiny.toml"), "--top", "2", "--json", str(path), *flags]) == 0
    return str(path)


def test_shardwise_slurm_from_a_plan_trains_its_recommendation_on_its_nodes(tmp_path, capsys):
    plan = plan_json(tmp_path, "--nodes", "2", "--gpus-per-node", "2", "--device", "h100-sxm")
    import json

    best = json.loads((tmp_path / "plan.json").read_text())["recommended"]
    out = tmp_path / "run"
    assert main(["slurm", str(CONFIGS / "gpt-tiny.toml"), "--from-plan", plan, "--out", str(out),
                 "--set", "train.steps=5"]) == 0
    script = (out / "job.sbatch").read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --gpus-per-node=2" in script
    srun = script.splitlines()[-1].split()
    settings = [srun[i + 1] for i, word in enumerate(srun) if word == "--set"]
    assert f"parallel.strategy={best['strategy']}" in settings and f"parallel.precision={best['precision']}" in \
        settings and f"train.micro_batch={best['micro_batch']}" in settings and settings[-1] == "train.steps=5"
    capsys.readouterr()
    # what disagrees with the plan is refused in one line, and nothing is written
    for flags, words in ((["--nodes", "3"], "--nodes 3: the plan"),
                         (["--set", "train.global_batch=32"], "planned for train.global_batch = 16")):
        code = main(["slurm", str(CONFIGS / "gpt-tiny.toml"), "--from-plan", plan, "--out", str(tmp_path / "no"),
                     *flags])
        err = capsys.readouterr().err
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "no").exists()


def test_a_candidates_settings_train_what_configure_makes_of_it():
    """Candidate.settings (the --set lines a plan's script trains with) and Candidate.configure (what
    the planner predicted) set the same parallel and train sections, for every candidate of a plan."""
    from shardwise.config.load import load_config
    from shardwise.planner.candidates import enumerate_candidates

    moe = ["model.name=gpt-moe", "train.micro_batch=4", "parallel.strategy=ddp"]
    world = {"launch.nproc": 2, "launch.nnodes": 2}
    base = load_config(CONFIGS / "gpt-tiny.toml", moe, world)
    candidates, _ = enumerate_candidates(base, 4, nodes=2)
    assert {c.strategy for c in candidates} >= {"hsdp", "pipeline", "tensor", "fsdp"} and any(c.ep > 1 for c in
                                                                                             candidates)
    for candidate in candidates:
        want = candidate.configure(base)
        got = load_config(CONFIGS / "gpt-tiny.toml", [*moe, *candidate.settings()], world)
        assert (got.parallel, got.train) == (want.parallel, want.train), candidate.label


def test_replica_groups_across_nodes_are_one_a_node_each_group_a_world_of_its_own(capsys):
    """--replica-groups across --nnodes: a group a node (tests/multinode/test_slurm_cluster.py runs them)."""
    pytest.importorskip("torchft")
    args = ["train", str(CONFIGS / "gpt-tiny.toml"), "--strategy", "ddp", "--nproc", "2", "--nnodes", "2",
            "--node-rank", "1", "--rdzv-endpoint", "node0:29500", "--set", "train.micro_batch=2"]
    cfg = _train_config(parser().parse_args([*args, "--replica-groups", "2"]))
    assert cfg.world_size == 2 and cfg.launch.replica_groups == 2  # a group's 2 ranks; 2 groups x 2 x 2 = 8
    assert main([*args, "--replica-groups", "3", "--out", "unused"]) == 2
    err = capsys.readouterr().err
    assert "launch.replica_groups = 3 on launch.nnodes = 2 nodes" in err and len(err.strip().splitlines()) == 1
