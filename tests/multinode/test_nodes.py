"""Training across nodes that are separate network stacks (network namespaces on a bridge):

- ddp and fsdp over 2 nodes of 1 process, hsdp and dp x pp over 2 nodes of 2, started through
  shardwise's launcher with --node-addr, give one process's losses and weights, and their
  communication really crosses the link (its byte counter);
- a node lost mid-run (its link cut, as a pulled cable or a dead switch port would) makes the
  other node's rank fail within the collective timeout, naming the rank it lost; with
  --max-restarts and the link restored, the job resumes from its newest checkpoint and ends
  bit-identical to an uninterrupted run. These go through `shardwise train` itself.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch
from helpers import CONFIGS, SGD, assert_same_training, losses, read_records, train_in_process
from nodes import TINY, cluster, start_on_nodes, train_many_on_nodes, wait_for_step
from safetensors.torch import load_file

from bench.netns import Cluster
from shardwise.config.load import load_config
from shardwise.models import build_model

pytestmark = pytest.mark.root  # network namespaces

STEPS = 20
BATCH = [text for text in TINY if text != "--set"]
PARAM_BYTES = 4 * sum(p.numel() for p in build_model(load_config(CONFIGS / "gpt-tiny.toml").model).parameters())
# Node loss: checkpoints every 4 steps; a 50 Mbit/s link makes each step take ~0.1 s (the gradients'
# 0.48 MB each way) without using CPU, so the cut lands mid-run. Rates do not change the numbers.
TIMEOUT_S = 5
RATE = "50mbit"
# The job of the parity run `ddp` (below), with checkpoints and short timeouts.
FLAGS = ("--strategy", "ddp", "--steps", str(STEPS), "--checkpoint-every", "4", *(a for s in SGD for a in ("--set", s)),
         "--set", f"launch.timeout_s={TIMEOUT_S}", "--set", "launch.shutdown_timeout_s=5")


@pytest.fixture(scope="module")
def two_nodes() -> Cluster:
    with cluster(2) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def runs(two_nodes, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("nodes")
    steps = [*BATCH, *SGD, f"train.steps={STEPS}", "launch.nnodes=2"]
    train_many_on_nodes(two_nodes, [{"out": root / name, "overrides": [*steps, "launch.nproc=1",
                                                                       f"parallel.strategy={name}"]}
                                    for name in ("ddp", "fsdp")], nproc=1)
    train_many_on_nodes(two_nodes, [
        {"out": root / "hsdp", "overrides": [*steps, "launch.nproc=2", "parallel.strategy=hsdp",
                                             "train.micro_batch=2"]},
        # dp is the mesh's outer dimension: each node holds one replica's 2 stages, replicas average across nodes
        {"out": root / "pipeline", "overrides": [*steps, "launch.nproc=2", "parallel.strategy=pipeline",
                                                 "parallel.dp=2", "parallel.pp=2",
                                                 "parallel.pipeline.micro_batches=2"]},
    ], nproc=2)
    train_in_process(load_config(CONFIGS / "gpt-tiny.toml", [*BATCH, *SGD, f"train.steps={STEPS}",
                                                             f"run.out={root / 'single'}"]))
    return root


def sent(run: Path) -> int:
    return int((run / "node1-tx-bytes").read_text())


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_2_nodes_of_1_process_train_as_one_process_does(runs, strategy):
    assert_same_training(runs / strategy, runs / "single", STEPS)
    # Each step node 1 sends its half of the gradients' all-reduce (fsdp: of 2 gathers and a reduce-scatter).
    assert sent(runs / strategy) > STEPS * PARAM_BYTES / 2


def test_dp_x_pp_over_2_nodes_of_2_processes_trains_as_one_process_does(runs):
    assert_same_training(runs / "pipeline", runs / "single", STEPS)


def test_hsdp_over_2_nodes_of_2_processes_trains_as_one_process_does_and_sends_only_gradient_shards(runs):
    assert_same_training(runs / "hsdp", runs / "single", STEPS)
    # Only the gradient shards' all-reduce crosses: each of node 1's 2 ranks sends half of its half of
    # the gradients a step, less than fsdp's 1.5 model's worth (2 gathers and a reduce-scatter).
    assert STEPS * PARAM_BYTES / 2 < sent(runs / "hsdp") < sent(runs / "fsdp") * 0.8


@pytest.fixture
def slow_link(two_nodes) -> Cluster:
    two_nodes.set_rate(RATE)
    try:
        yield two_nodes
    finally:
        two_nodes.set_rate(None)
        two_nodes.restore(1)


def test_a_cut_link_fails_the_surviving_node_within_the_timeout_naming_the_lost_rank(slow_link, tmp_path):
    processes = start_on_nodes(slow_link, tmp_path, *FLAGS)
    wait_for_step(processes, tmp_path, 6)
    slow_link.cut(1)
    cut_at = time.monotonic()
    _, err = processes[0].communicate(timeout=TIMEOUT_S + 60)
    elapsed = time.monotonic() - cut_at
    slow_link.restore(1)
    # The cut-off node's launcher waits on the rendezvous store (node 0's) until torch's read timeout
    # (60 s); once the link is back it finds the job failed and fails too, instead of hanging.
    _, lost_err = processes[1].communicate(timeout=60)
    assert processes[0].returncode == 1, err
    assert elapsed < TIMEOUT_S + 30, f"node 0 took {elapsed:.0f} s to fail after the cut"
    # Gradients' all-reduce most often; on a loaded machine the cut can land in a checkpoint's broadcast,
    # the world's or the background save's own group's
    failure = re.search(r"CollectiveFailure: rank 0: (\w+) #\d+ on group '(\w+)' .*", err)
    assert failure and (failure[1], failure[2]) in {("all_reduce", "default_pg"), ("broadcast", "default_pg"),
                                                    ("broadcast", "async_checkpoints")}, err
    assert f"did not complete within launch.timeout_s = {TIMEOUT_S} s" in failure[0]
    assert "Rank(s) 1 never joined it" in failure[0]
    assert processes[1].returncode != 0, lost_err


@pytest.mark.alone
def test_after_the_link_is_restored_the_job_resumes_bit_identical(slow_link, runs, tmp_path):
    processes = start_on_nodes(slow_link, tmp_path, *FLAGS, "--max-restarts", "1")
    wait_for_step(processes, tmp_path, 10)
    slow_link.cut(1)
    time.sleep(TIMEOUT_S + 2)  # until the collective has timed out on both sides
    slow_link.restore(1)
    for rank, process in enumerate(processes):
        _, err = process.communicate(timeout=180)
        assert process.returncode == 0, f"node {rank}: {err[-3000:]}"
    assert read_records(tmp_path, "summary")[0]["resumed_at"] >= 8  # from a checkpoint, not from the start
    uninterrupted = runs / "ddp"  # the same job's settings; checkpoints and timeouts change no number
    assert losses(tmp_path) == losses(uninterrupted)
    weights = load_file(str(tmp_path / "model.safetensors"))
    expected = load_file(str(uninterrupted / "model.safetensors"))
    for key in expected:
        assert torch.equal(weights[key], expected[key]), key
