"""Elastic node ranges (`--nnodes MIN:MAX`, elastic.py): refused before launch where a size in the
range cannot run the job; and on 3 network-namespace nodes, fsdp goes on over the 2 nodes left (their
world re-formed in the surviving processes) when one node's processes are SIGKILLed, growing back to
3 when the node is started again, or when its link is cut, finishing at 2; on the uninterrupted run's
global batches throughout."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest
from helpers import CONFIGS, SGD, losses, read_records, train_in_process
from nodes import cluster, start_on_nodes, wait_for_step

from shardwise.cli import main
from shardwise.config.load import load_config
from shardwise.config.schema import ConfigError
from shardwise.peer_checkpoints import node_directory
from shardwise.planner.candidates import Candidate
from shardwise.planner.memory_model import predict_memory
from shardwise.planner.search import check_smallest_fits
from shardwise.validate import validate

STEPS = 40
# A slow link (each fsdp step ~0.25 s) keeps the job running while a node is lost and comes back
RATE = "25mbit"
# 12 sequences a step: micro-batches of 2, 2 a replica on 3 nodes, 3 on 2 (one process a node)
BATCH = ("train.global_batch=12", "train.micro_batch=2", "train.eval_every=0")
FLAGS = ("--strategy", "fsdp", "--steps", str(STEPS), "--nnodes", "2:3", "--max-restarts", "3",
         *(a for s in (*SGD, *BATCH, "launch.timeout_s=5", "launch.shutdown_timeout_s=5") for a in ("--set", s)))


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
     r"their agents restart them at the smaller size; give launch.max_restarts >= 1"),
    (("launch.nnodes=2", "launch.min_nnodes=1", "launch.replica_groups=2", *BATCH),
     r"elastic jobs run under torchrun's agent; not with launch.replica_groups = 2"),
    (("launch.nnodes=3", "train.memory_checkpoint_every=4", *BATCH),
     r"train.memory_checkpoint_every = 4: memory checkpoints restore the survivors of a lost node in their own "
     r"processes, an elastic job's: give a node range \(--nnodes MIN:MAX\)"),
    (("launch.nnodes=1", "launch.min_nnodes=1", "train.memory_checkpoint_every=4", *BATCH),
     r"train.memory_checkpoint_every = 4: each rank's copy is kept on another node; launch.min_nnodes = 1 "
     r"\(--nnodes 1:1\) has one at most"),
])
def test_a_range_is_refused_before_launch_naming_the_size_that_cannot_run(overrides, refusal):
    with pytest.raises(ConfigError, match=refusal):
        validate(elastic(*overrides))


def test_a_range_that_every_size_runs_is_accepted():
    validate(elastic("launch.nnodes=3", "launch.min_nnodes=2", "parallel.strategy=fsdp", *BATCH))


def test_a_range_whose_smallest_world_does_not_fit_is_refused_naming_what_a_rank_would_hold():
    """Llama-3-8B under fsdp on nodes of 8 (bf16-mixed, blocks recomputed): 57.0 GiB a rank on 1 node,
    48.8 on 2, as the planner predicts; a 50 GiB device takes the second range, not the first."""
    def llama(fewest: int):
        return load_config(CONFIGS / "llama-3-8b.toml", [
            "parallel.strategy=fsdp", "launch.nproc=8", "launch.nnodes=4", f"launch.min_nnodes={fewest}",
            "launch.max_restarts=1", "parallel.precision=bf16-mixed", "parallel.recompute=blocks",
            "train.micro_batch=1", "train.global_batch=96"])

    with pytest.raises(ConfigError, match=r"--nnodes 1:4\): on 1 node\(s\), a world of 8, a rank would hold 57.02 "
                                          r"GiB \(the planner's prediction\) of the 50.00 GiB it has"):
        check_smallest_fits(llama(1), 50 * 2**30)
    check_smallest_fits(llama(2), 50 * 2**30)


def test_the_cli_reads_a_range_and_refuses_what_is_not_one(capsys):
    assert main(["train", str(CONFIGS / "gpt-tiny.toml"), "--nnodes", "2:x"]) == 2
    assert "--nnodes 2:x: expected a number of nodes, or MIN:MAX for an elastic job" in capsys.readouterr().err
    assert main(["train", str(CONFIGS / "gpt-tiny.toml"), "--nnodes", "2:3", "--strategy", "ddp",
                 *(a for s in BATCH for a in ("--set", s))]) == 2
    assert "give launch.max_restarts >= 1" in capsys.readouterr().err


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[float]:
    """One process's losses on the same global batches."""
    out = tmp_path_factory.mktemp("single")
    train_in_process(load_config(CONFIGS / "gpt-tiny.toml", [*SGD, *BATCH, f"train.steps={STEPS}", f"run.out={out}"]))
    return losses(out)


def steps_written(out: Path) -> int:
    """Step records in metrics.jsonl so far (counted in its text: the last line may be half written)."""
    return (out / "metrics.jsonl").read_text().count('"event": "step"')


# Killed: the others' connections to it reset at once; they go on from the memory checkpoint of step 8
# (no disk checkpoint before it); it is started again, and the world grows back (the agents' restart, at
# a checkpoint on disk). Cut off (its link down, as a pulled cable): no answer, so the others' collective
# fails at launch.timeout_s; they go on from the disk checkpoint of step 8; it never comes back, and the
# two finish the run (their agents not waiting at the end for its agent, gone with its node).
LOSSES = {"killed": {"Connection reset by peer", "Connection closed by peer"}, "cut off": {"Timed out waiting"}}
CHECKPOINTS = {"killed": ("--set", "train.memory_checkpoint_every=4"), "cut off": ("--checkpoint-every", "4")}
RESTORED = {"killed": r"restored step (\d+) from the nodes' memory \(saved by fsdp on 3 rank\(s\)",
            "cut off": r"resumed from .* \(step (\d+), saved by fsdp on 3 rank\(s\); read in"}


@pytest.mark.root  # network namespaces
@pytest.mark.parametrize("lost", LOSSES)
def test_fsdp_goes_on_over_the_nodes_left_on_the_same_batches(uninterrupted, tmp_path, lost):
    out = tmp_path / "run"
    with cluster(3, RATE) as nodes:
        processes = start_on_nodes(nodes, out, *FLAGS, *CHECKPOINTS[lost])
        wait_for_step(processes, out, 10)
        if lost == "killed":
            nodes.kill(2)  # its launcher and its worker, as a crashed node
            shutil.rmtree(node_directory(out, nodes.nodes[2].addr), ignore_errors=True)  # its memory, with it
        else:
            nodes.cut(2)
        lost_at = steps_written(out)
        deadline = time.monotonic() + 120
        # The two nodes left go on at a world of 2 from the newest checkpoint: its steps' records kept,
        # the later ones dropped
        while steps_written(out) >= lost_at:
            assert time.monotonic() < deadline and all(p.poll() is None for p in processes[:2])
            time.sleep(0.1)
        if lost == "killed":  # the two went on with no checkpoint file on disk to open
            assert not list((out / "checkpoints").glob("step-*"))
        running = list(processes[:2])
        if lost == "killed":
            again = nodes.train_argv(2, str(CONFIGS / "gpt-tiny.toml"), 1,
                                     ["--out", str(out), *FLAGS, *CHECKPOINTS[lost]])
            running.append(nodes.popen(2, again, stdout=-1, stderr=-1, text=True))
        results = [p.communicate(timeout=180) for p in running]
    for rank, (process, (_, err)) in enumerate(zip(running, results, strict=True)):
        assert process.returncode == 0, f"node {rank}: {err[-3000:]}"
    # The two left re-formed their world in the processes they were (each says so, and why: the first to
    # fail saw what this way of losing a node makes; the other may have seen the first end its groups),
    # and node 0's then resumed there from a checkpoint of the 3
    reasons = [re.search(rf"rank {rank}: a peer was lost at step \d+ \(([^)]*)\)\nrank {rank}: going on as rank {rank} "
                         r"of 2\n", err) for rank, (_, err) in enumerate(results[:2])]
    assert all(reasons), [err[-3000:] for _, err in results[:2]]
    assert LOSSES[lost] & {reason[1] for reason in reasons}
    # and restored there the state of the newest checkpoint of the 3 before the loss (after step 10), from the
    # memory the three kept (the lost one's copy on node 0) or from disk
    restored = re.search(r"going on as rank 0 of 2\n(.*\n)*" + RESTORED[lost], results[0][1])
    assert restored and int(restored[2]) in (8, 12), results[0][1][-3000:]
    if lost == "killed":
        # Node 2 back: the agents started every worker again, which restored the state the two kept in
        # their memory at the agents' stop (node 2, its memory lost, was sent its part), not the disk's
        assert re.search(r"restored step \d+ from the nodes' memory \(saved by fsdp on 2 rank\(s\)", results[0][1])
        assert not [node.addr for node in nodes.nodes if node_directory(out, node.addr).exists()]  # gone at the end
    steps = read_records(out)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))  # one record a step: redone ones replaced
    assert max(abs(a - b) / b for a, b in zip(losses(out), uninterrupted, strict=True)) <= 1e-5
    assert read_records(out, "summary")[0]["world_size"] == (3 if lost == "killed" else 2)
    if lost == "killed":
        # What the three hold at the end (two generations, their own file and their peer's): the planner's 4
        # copies of a rank's state, and DCP's metadata, which it leaves out (0.14 MB a generation here, with
        # this model's 0.32 MB a rank: its size is the tensors' count, not their bytes)
        cfg = elastic(*SGD, *BATCH, "parallel.strategy=fsdp", "launch.nnodes=3", "launch.min_nnodes=2",
                      "train.memory_checkpoint_every=4")
        predicted = predict_memory(Candidate.of(cfg, 3), cfg, activations=False)[0].staging
        held = [rank["staging"] for rank in steps[-1]["memory_by_rank"]]
        assert all(predicted < bytes_held < 1.3 * predicted for bytes_held in held), (held, predicted)
