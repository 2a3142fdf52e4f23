"""Training across nodes that are separate network stacks (namespaces on a bridge), through
`shardwise train --nnodes N --node-rank R --node-addr ADDR`: the same losses and weights as one
process, and the gradients really cross the links."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import CONFIGS, assert_same_training, read_records, train_in_process
from nodes import TINY, bytes_sent, cluster, train_on_nodes

from shardwise.bench.netns import Cluster
from shardwise.config import load_config
from shardwise.models import build_model

STEPS = 8
TINY_CONFIG = load_config(CONFIGS / "gpt-tiny.toml")
PARAM_BYTES = 4 * sum(p.numel() for p in build_model(TINY_CONFIG.model).parameters())  # fp32, the tied head once


@pytest.fixture(scope="module")
def two_nodes() -> Cluster:
    with cluster(2) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("single")
    overrides = [text for text in TINY if text != "--set"]
    train_in_process(load_config(CONFIGS / "gpt-tiny.toml", [*overrides, f"train.steps={STEPS}", f"run.out={out}"]))
    return out


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_2_nodes_train_as_one_process_does(two_nodes, single, tmp_path, strategy):
    sent_before = bytes_sent(two_nodes, 1)
    train_on_nodes(two_nodes, tmp_path, "--strategy", strategy, "--steps", str(STEPS))
    assert_same_training(tmp_path, single, STEPS)
    assert read_records(tmp_path, "summary")[0]["world_size"] == 2
    # Each step node 1 sends its half of the gradients' all-reduce (fsdp: reduce-scatter and 2 gathers).
    assert bytes_sent(two_nodes, 1) - sent_before > STEPS * PARAM_BYTES / 2


def test_dp_x_pp_over_2_nodes_of_2_processes_trains_as_one_process_does(two_nodes, single, tmp_path):
    # dp is the mesh's outer dimension: each node holds one replica's 2 stages, replicas average across nodes.
    train_on_nodes(two_nodes, tmp_path, "--strategy", "pipeline", "--dp", "2", "--pp", "2", "--steps", str(STEPS),
                   "--set", "parallel.micro_batches=2", nproc=2)
    assert_same_training(tmp_path, single, STEPS)


def test_hsdp_over_2_nodes_of_2_processes_trains_as_one_process_does(two_nodes, single, tmp_path):
    sent_before = bytes_sent(two_nodes, 1)
    train_on_nodes(two_nodes, tmp_path, "--strategy", "hsdp", "--steps", str(STEPS), "--set", "train.micro_batch=2",
                   nproc=2)
    assert_same_training(tmp_path, single, STEPS)
    # Across the link go only the gradient shards' all-reduce: per step each of node 1's 2 ranks sends
    # its half of a half of the gradients, far less than fsdp's gathers of the whole model.
    sent = bytes_sent(two_nodes, 1) - sent_before
    assert STEPS * PARAM_BYTES / 2 < sent < STEPS * PARAM_BYTES * 1.5
