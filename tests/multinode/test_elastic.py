"""Elastic node ranges (`--nnodes MIN:MAX`, elastic.py): refused before launch where a size in the
range cannot run the job; and on 3 network-namespace nodes, fsdp goes on over the 2 nodes left when
one node's processes are SIGKILLed (their world re-formed in the surviving processes), grows back to 3
when the node is started again, and trains on the uninterrupted run's global batches throughout."""

from __future__ import annotations

import re
import time

import pytest
from helpers import CONFIGS, SGD, losses, read_records, train_in_process
from nodes import cluster, start_on_nodes, wait_for_step

from shardwise.cli import main
from shardwise.config.load import load_config
from shardwise.config.schema import ConfigError
from shardwise.validate import validate

STEPS = 40
# A slow link (each fsdp step ~0.3 s) keeps the job running while a node is lost and comes back
RATE = "20mbit"
# 12 sequences a step: micro-batches of 2, 2 a replica on 3 nodes, 3 on 2 (one process a node)
BATCH = ("train.global_batch=12", "train.micro_batch=2", "train.eval_every=0")
FLAGS = ("--strategy", "fsdp", "--steps", str(STEPS), "--nnodes", "2:3", "--max-restarts", "3",
         "--checkpoint-every", "4", *(a for s in (*SGD, *BATCH, "launch.timeout_s=5", "launch.shutdown_timeout_s=5")
                                      for a in ("--set", s)))


def elastic(*overrides: str):
    return load_config(CONFIGS / "gpt-tiny.toml", ["launch.max_restarts=1", "launch.nproc=1", "parallel.strategy=ddp",
                                                   *overrides])


@pytest.mark.parametrize(("overrides", "refusal"), [
    (("launch.nnodes=2", "launch.min_nnodes=3"),
     r"launch.min_nnodes = 3 \(--nnodes 3:2\): the fewest nodes must be between 1 and launch.nnodes = 2"),
    (("launch.nnodes=4", "launch.min_nnodes=2", "parallel.strategy=fsdp", "parallel.tp=2"),
     r"--nnodes 2:4\): on 3 node\(s\), a world of 3: .*tp"),
    (("launch.nnodes=3", "launch.min_nnodes=2", "train.global_batch=12", "train.micro_batch=4"),
     r"--nnodes 2:3\): on 2 node\(s\), a world of 2: train.global_batch = 12: must be divisible by world size 2 x "
     r"train.micro_batch 4 = 8"),
    (("launch.nnodes=3", "launch.min_nnodes=2", "launch.max_restarts=0", *BATCH),
     r"a lost node restarts the others' workers at the smaller size; give launch.max_restarts >= 1"),
    (("launch.nnodes=2", "launch.min_nnodes=1", "launch.replica_groups=2", *BATCH),
     r"elastic jobs run under torchrun's agent; not with launch.replica_groups = 2"),
])
def test_a_range_is_refused_before_launch_naming_the_size_that_cannot_run(overrides, refusal):
    with pytest.raises(ConfigError, match=refusal):
        validate(elastic(*overrides))


def test_a_range_that_every_size_runs_is_accepted():
    validate(elastic("launch.nnodes=3", "launch.min_nnodes=2", "parallel.strategy=fsdp", *BATCH))


def test_the_cli_reads_a_range_and_refuses_what_is_not_one(capsys):
    assert main(["train", str(CONFIGS / "gpt-tiny.toml"), "--nnodes", "2:x"]) == 2
    assert "--nnodes 2:x: expected a number of nodes, or MIN:MAX for an elastic job" in capsys.readouterr().err
    assert main(["train", str(CONFIGS / "gpt-tiny.toml"), "--nnodes", "2:3", "--strategy", "ddp",
                 *(a for s in BATCH for a in ("--set", s))]) == 2
    assert "give launch.max_restarts >= 1" in capsys.readouterr().err


@pytest.mark.root  # network namespaces
def test_fsdp_goes_on_over_the_nodes_left_and_grows_back_on_the_same_batches(tmp_path):
    reference = tmp_path / "single"
    train_in_process(load_config(CONFIGS / "gpt-tiny.toml", [*SGD, *BATCH, f"train.steps={STEPS}",
                                                             f"run.out={reference}"]))
    out = tmp_path / "run"
    with cluster(3, RATE) as nodes:
        processes = start_on_nodes(nodes, out, *FLAGS)
        wait_for_step(processes, out, 10)
        nodes.kill(2)  # its launcher and its worker, as a crashed node
        killed_at = len(read_records(out))
        deadline = time.monotonic() + 120
        # The two nodes left restart at a world of 2 from the newest checkpoint and go on past the kill
        while len(read_records(out)) <= killed_at + 2:
            assert time.monotonic() < deadline and all(p.poll() is None for p in processes[:2])
            time.sleep(0.2)
        returned = nodes.popen(2, nodes.train_argv(2, str(CONFIGS / "gpt-tiny.toml"), 1,
                                                   ["--out", str(out), *FLAGS]), stdout=-1, stderr=-1, text=True)
        results = [p.communicate(timeout=180) for p in (*processes[:2], returned)]
    for rank, (process, (_, err)) in enumerate(zip((*processes[:2], returned), results, strict=True)):
        assert process.returncode == 0, f"node {rank}: {err[-3000:]}"
    # The two left re-formed their world in the processes they were: each says so, and node 0's then
    # resumes there from a checkpoint of the 3
    for rank, (_, err) in enumerate(results[:2]):
        assert re.search(rf"rank {rank}: a peer was lost at step \d+; going on as rank {rank} of 2\n", err), err[-3000:]
    assert re.search(r"going on as rank 0 of 2\n(.*\n)*resumed from .* saved by fsdp on 3 rank\(s\)", results[0][1])
    steps = read_records(out)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))  # one record a step: redone ones replaced
    got, want = losses(out), losses(reference)
    assert max(abs(a - b) / b for a, b in zip(got, want, strict=True)) <= 1e-5
    assert read_records(out, "summary")[0]["world_size"] == 3
