"""`hsdp` on 4 ranks as 2 "nodes" of 2 processes (LOCAL_WORLD_SIZE=2, as torchrun would set on 2
nodes; the math needs no namespaces): it trains as one device does, each node holds one whole
replica sharded in 2, and its checkpoints resume bit-identically and consolidate into the model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import CONFIGS, assert_same_training
from distributed import run_ranks
from safetensors.torch import load_file
from test_checkpoint import assert_bit_identical, cfg_for, in_process, straight_and_resumed

from shardwise.checkpoint import consolidate
from shardwise.config import load_config
from shardwise.dist import DistContext
from shardwise.models import build_model
from shardwise.planner.candidates import Candidate
from shardwise.planner.memory import predict_memory
from shardwise.trainer import Trainer

FOUR_RANKS = ("train.micro_batch=2",)  # a global batch of 8 over 4 ranks
# Parameters are compared after 20 steps, as every parity test does: over 40, Adam's normalisation
# lets summation-order noise in attention's query and key gradients reach ~5e-6 in a few weights.
PARITY_STEPS = 20
PLANNED = Candidate("hsdp", 4, 1, 1, "fp32", "none", 2, shard=2)  # what the planner proposes for 2 nodes x 2


def two_nodes_of_two(ctx: DistContext, root: Path) -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    states = straight_and_resumed(ctx, root, "hsdp", *FOUR_RANKS)
    trainer = Trainer(cfg_for(root / "parity", "hsdp", ctx.world_size, *FOUR_RANKS, f"train.steps={PARITY_STEPS}"), ctx)
    trainer.fit()
    shards = torch.cat([shard.detach().reshape(-1) for shard in trainer.strategy.local_parameters()])
    base = cfg_for(root / "planned", "hsdp", ctx.world_size, *FOUR_RANKS)
    planned = Trainer(PLANNED.config(base, ctx.world_size), ctx)
    planned.train_step(0)
    memory = planned.strategy.memory(planned.activation_bytes).as_dict()
    return {**states, "shards": shards, "group_size": trainer.strategy.world, "memory": memory}


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("hsdp")
    ranks = run_ranks(two_nodes_of_two, 4, root)
    in_process(lambda ctx: Trainer(cfg_for(root / "single", "single", 1, *FOUR_RANKS, f"train.steps={PARITY_STEPS}"),
                                   ctx).fit())
    return root, ranks


def test_hsdp_on_2_nodes_of_2_matches_single_device(hsdp):
    root, _ = hsdp
    assert_same_training(root / "parity", root / "single", PARITY_STEPS)


def test_each_node_holds_one_replica_sharded_over_its_own_processes(hsdp):
    _, ranks = hsdp
    assert [rank["group_size"] for rank in ranks] == [2, 2, 2, 2]
    total = sum(p.numel() for p in build_model(load_config(CONFIGS / "gpt-tiny.toml").model).parameters())
    assert total / 2 <= ranks[0]["shards"].numel() < total / 2 + 1024  # a half, plus padding to equal rows
    assert torch.equal(ranks[0]["shards"], ranks[2]["shards"]) and torch.equal(ranks[1]["shards"], ranks[3]["shards"])
    assert not torch.equal(ranks[0]["shards"][:1000], ranks[1]["shards"][:1000])


def test_hsdp_resumes_bit_identically_and_its_checkpoint_consolidates(hsdp, tmp_path):
    root, ranks = hsdp
    assert_bit_identical(root, ranks)
    cfg_for(root / "straight", "hsdp", 4, *FOUR_RANKS).save(root / "straight" / "config.toml")  # as the worker does
    consolidate(root / "straight", tmp_path / "model.safetensors")
    expected = load_file(str(root / "straight" / "model.safetensors"))
    got = load_file(str(tmp_path / "model.safetensors"))
    assert expected.keys() <= got.keys()  # consolidate writes a tied weight under both names, save_model once
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


def test_the_planners_hsdp_memory_is_what_each_rank_holds(hsdp):
    root, ranks = hsdp
    predicted = predict_memory(PLANNED, PLANNED.config(cfg_for(root / "planned", "hsdp", 4, *FOUR_RANKS), 4))[0]
    for rank in ranks:
        for key in ("params", "grads", "optimizer", "activations"):
            assert getattr(predicted, key) == rank["memory"][key], key
