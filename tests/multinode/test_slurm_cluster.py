"""shardwise under a real Slurm (issue 72): munged, slurmctld and a slurmd on each of 2 namespace
nodes, each with its own hostname (bench/slurm_nodes.py), started once for the module. The script
`shardwise slurm` writes runs by sbatch: on one node under ddp and fsdp (2 tasks), on both under
fsdp and hsdp (the bytes over node 1's link counted) and one task a rank, each step's loss that of
single on the same global batches; a running job requeued by `scontrol requeue` resumes from its
newest checkpoint and ends with the weights of the run that was not interrupted, bit for bit; and
torchft's replica groups, one a node, heal across nodes. Skipped, saying why, without root or
Slurm's packages."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import CONFIGS, read_records, train_in_process
from safetensors.torch import load_file

from bench.slurm_nodes import SlurmCluster, SlurmUnavailable, slurm_unavailable_reason
from shardwise.cli import main
from shardwise.config.load import load_config
from shardwise.dist import worker_name
from shardwise.launch import process_stat

pytestmark = pytest.mark.root  # network namespaces, Slurm's daemons

STEPS = 24
# gpt-tiny on a global batch of 8 in micro-batches of 2: 4 ranks take one each, 2 accumulate 2,
# single 4; a checkpoint every 2 steps (the requeued job resumes from one), steps enough to requeue it
# while it runs
RUN = ["train.global_batch=8", "train.micro_batch=2", "train.eval_every=0", f"train.steps={STEPS}",
       "train.checkpoint_every=2", "train.optimizer=sgd", "train.lr=0.1"]


@pytest.fixture(scope="module")
def slurm():
    reason = slurm_unavailable_reason()
    if reason:
        pytest.skip(f"a Slurm cluster needs root and Slurm's packages: {reason}")
    try:
        cluster = SlurmCluster(2)
        cluster.up()
    except SlurmUnavailable as error:
        pytest.skip(f"Slurm's daemons did not come up here: {error}")
    yield cluster
    cluster.down()


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> list[float]:
    """Single's loss at every step, trained in this process."""
    out = tmp_path_factory.mktemp("single")
    train_in_process(load_config(CONFIGS / "gpt-tiny.toml", [*RUN, "train.checkpoint_every=0", f"run.out={out}"]))
    return [record["loss"] for record in read_records(out)]


def job(slurm: SlurmCluster, out: Path, nodes: int, nproc: int, strategy: str, *flags: str) -> Path:
    """`shardwise slurm` writes the job; sbatch --wait runs it on `nodes` of the cluster."""
    assert main(["slurm", str(CONFIGS / "gpt-tiny.toml"), "--nodes", str(nodes), "--nproc", str(nproc),
                 "--out", str(out), *flags, "--set", f"parallel.strategy={strategy}",
                 *(arg for setting in RUN for arg in ("--set", setting))]) == 0
    return out / "job.sbatch"


def ran(out: Path) -> str:
    return "\n".join(log.read_text() for log in out.glob("slurm-*.out"))


def assert_trained_as_single(out: Path, single: list[float]) -> None:
    got = [record["loss"] for record in read_records(out)]
    assert len(got) == STEPS, ran(out)[-3000:]
    assert got == pytest.approx(single, rel=1e-5)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_written_job_trains_on_one_node_as_single(slurm, single, tmp_path, strategy):
    """ddp: one launcher forking 2 ranks, waited for as a user would, by sbatch --wait (which looks
    at its job every few seconds); fsdp: 2 tasks, each a rank."""
    out = tmp_path / strategy
    if strategy == "ddp":
        slurm.submit(job(slurm, out, 1, 2, strategy), wait=True)
    else:
        slurm.wait(slurm.submit(job(slurm, out, 1, 2, strategy, "--task-per-rank")))
        assert "#SBATCH --ntasks-per-node=2" in (out / "job.sbatch").read_text()
    assert_trained_as_single(out, single)


@pytest.fixture(scope="module")
def two_nodes(slurm, tmp_path_factory) -> dict[str, tuple[Path, int]]:
    """fsdp and hsdp on 2 nodes of 2 ranks, and fsdp one task a rank: each run's directory and the
    bytes node 1 sent and received over its link while it ran."""
    root = tmp_path_factory.mktemp("two-nodes")
    runs = {}
    for name, strategy, flags in (("fsdp", "fsdp", ()), ("hsdp", "hsdp", ()),
                                  ("fsdp-task-per-rank", "fsdp", ("--task-per-rank",))):
        before = slurm.link_bytes(1)
        slurm.wait(slurm.submit(job(slurm, root / name, 2, 2, strategy, *flags)))
        runs[name] = root / name, slurm.link_bytes(1) - before
    return runs


@pytest.mark.parametrize("name", ["fsdp", "hsdp", "fsdp-task-per-rank"])
def test_the_written_job_trains_on_two_nodes_as_single(two_nodes, single, name):
    assert_trained_as_single(two_nodes[name][0], single)


def test_hsdp_sends_less_over_the_link_than_fsdp(two_nodes, capsys):
    """fsdp gathers and scatters every parameter over all 4 ranks, across the link; hsdp shards within
    a node and sends only the shards' all-reduce across: a fraction of fsdp's bytes (ranks a node /
    world of them under a ring, less Slurm's own few kilobytes)."""
    params = sum(t.numel() * t.element_size() for t in load_file(str(two_nodes["fsdp"][0] / "model.safetensors"))
                 .values())
    fsdp, hsdp = two_nodes["fsdp"][1], two_nodes["hsdp"][1]
    with capsys.disabled():
        print(f"\nbytes over node 1's link in {STEPS} steps: fsdp {fsdp:,}, hsdp {hsdp:,} (model {params:,} bytes)")
    assert fsdp > STEPS * params  # at least one full copy of the model crosses each step
    assert hsdp < 0.75 * fsdp


def test_a_requeued_job_resumes_from_its_newest_checkpoint_and_ends_as_if_never_stopped(slurm, two_nodes,
                                                                                       tmp_path):
    out = tmp_path / "requeued"
    job_id = slurm.submit(job(slurm, out, 2, 2, "fsdp"))
    deadline = time.monotonic() + 120
    while not list(out.glob("checkpoints/step-*")):
        assert time.monotonic() < deadline and slurm.state(job_id), ran(out)[-3000:]
        time.sleep(0.05)
    slurm.requeue(job_id)
    slurm.wait(job_id)
    log = ran(out)
    assert "DUE TO JOB REQUEUE" in log and "resumed from" in log, log[-3000:]
    assert [r["step"] for r in read_records(out)][-1] == STEPS
    got, want = (load_file(str(run / "model.safetensors")) for run in (out, two_nodes["fsdp"][0]))
    assert got.keys() == want.keys()
    assert all(torch.equal(got[key], want[key]) for key in want)


INJECTOR = Path(__file__).parents[1] / "faults" / "injector"  # its sitecustomize.py paces steps (its docstring)
GROUP_STEPS = 150


def group_records(out: Path, group: int) -> list[dict]:
    path = out / f"replica-{group}" / "metrics.jsonl"
    lines = (path.read_text() if path.is_file() else "").split("\n")[:-1]  # whole lines: the last may be half
    return [r for r in map(json.loads, lines) if r["event"] == "step"]


def kill_group_worker(slurm: SlurmCluster, group: int) -> None:
    """SIGKILL the worker of `group`'s rank 0 on node `group` (a group a node): among the processes in
    that node's network namespace, not another test's worker of the same name (one pid space)."""
    held = subprocess.run(["ip", "netns", "pids", slurm.network.nodes[group].netns], capture_output=True,
                          text=True).stdout.split()
    pids = [int(pid) for pid in held if (process_stat(pid) or ("",))[0] == worker_name(0, group)]
    assert len(pids) == 1, pids
    os.kill(pids[0], signal.SIGKILL)


def until(condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.skipif(__import__("importlib").util.find_spec("torchft") is None, reason="needs torchft")
def test_replica_groups_one_a_node_heal_across_nodes_and_end_equal(slurm, tmp_path):
    """torchft across nodes: 2 ddp groups of one rank, one a node (each advertises its node's own
    hostname), submitted as `shardwise slurm` writes the job; group 1's worker on node 1 SIGKILLed
    twice: node 1's launcher restarts it each time and it heals from group 0 over HTTP, while group 0
    never restarts; both end with the same weights, bit for bit."""
    out = tmp_path / "groups"
    assert main(["slurm", str(CONFIGS / "gpt-tiny.toml"), "--nodes", "2", "--nproc", "1", "--out", str(out),
                 *(arg for setting in ("parallel.strategy=ddp", "launch.replica_groups=2", "launch.max_restarts=2",
                                       "train.global_batch=12", "train.micro_batch=6", "train.eval_every=0",
                                       "train.optimizer=sgd", f"train.steps={GROUP_STEPS}")
                   for arg in ("--set", setting))]) == 0
    # while a group is missing, the other's steps take 0.1 s more: the run outlasts two restarts
    job_id = slurm.submit(out / "job.sbatch", env={"PYTHONPATH": str(INJECTOR), "SHARDWISE_TEST_PACE": "0.1",
                                                  "RUST_LOG": "error"})
    committed = lambda group: sum(r["committed"] for r in group_records(out, group))  # noqa: E731
    kills = []
    for _ in range(2):
        until(lambda: committed(1) >= (kills[-1] + 10 if kills else 10) or not slurm.state(job_id),
              f"group 1 never got going:\n{ran(out)[-3000:]}")
        assert slurm.state(job_id), f"the job ended before group 1 was killed:\n{ran(out)[-3000:]}"
        kills.append(committed(1))
        kill_group_worker(slurm, 1)
        until(lambda: any(r["healed_at"] and r["healed_at"][-1] >= kills[-1] for r in group_records(out, 1)[-1:]),
              f"group 1 never healed after its kill at step {kills[-1]}:\n{ran(out)[-3000:]}")
    slurm.wait(job_id)
    log = ran(out)
    assert "replica group 1: rank 0 exited with code -9; restarting the group (2 of 2)" in log, log[-3000:]
    assert "replica group 0:" not in log  # group 0 never restarted
    steady = group_records(out, 0)
    assert [r["step"] for r in steady if r["committed"]][-1] == GROUP_STEPS
    assert not any(r["healed_at"] for r in steady)
    got, want = (load_file(str(out / f"replica-{group}" / "model.safetensors")) for group in (1, 0))
    assert got.keys() == want.keys() and all(torch.equal(got[key], want[key]) for key in want)
