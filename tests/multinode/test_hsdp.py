"""`hsdp` on 4 ranks as 2 "nodes" of 2 processes (LOCAL_WORLD_SIZE=2, as torchrun would set on 2
nodes; the math needs no namespaces): it trains as one device does, each node holds one whole
replica sharded in 2, its checkpoints resume bit-identically and consolidate into the model, and
the planner predicts its bytes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from helpers import (
    CONFIGS,
    SGD,
    Crash,
    assert_bit_identical,
    assert_same_training,
    crash_at,
    gpt_tiny,
    in_process,
    optimizer_tensors,
)
from safetensors.torch import load_file

from shardwise.checkpoint import consolidate
from shardwise.config.load import load_config
from shardwise.dist import DistContext
from shardwise.models import build_model
from shardwise.planner.candidates import Candidate
from shardwise.planner.memory_model import predict_memory
from shardwise.trainer import Trainer

STEPS, SAVE_EVERY, CRASH_AT = 20, 10, 14  # the last checkpoint is the final model
# A global batch of 8 over 4 ranks; checkpoints change no number, so the straight run is the parity run.
RUN = (*SGD, "train.micro_batch=2", f"train.checkpoint_every={SAVE_EVERY}")
def cfg_for(out: Path, strategy: str, world: int, *overrides: str):
    return gpt_tiny(out, strategy, world, *overrides, steps=STEPS)


PLANNED = Candidate("hsdp", 4, 1, 1, "fp32", "none", 2, shard=2)  # what the planner proposes for 2 nodes x 2


def two_nodes_of_two(ctx: DistContext, root: Path) -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    straight = Trainer(cfg_for(root / "straight", "hsdp", ctx.world_size, *RUN), ctx)
    straight.fit()
    with pytest.raises(Crash):
        crash_at(Trainer(cfg_for(root / "resumed", "hsdp", ctx.world_size, *RUN), ctx), CRASH_AT).fit()
    resumed = Trainer(cfg_for(root / "resumed", "hsdp", ctx.world_size, *RUN, "run.resume=true"), ctx)
    resumed.fit()
    shards = torch.cat([shard.detach().reshape(-1) for shard in straight.strategy.local_parameters()])
    planned = Trainer(PLANNED.config(cfg_for(root / "planned", "hsdp", ctx.world_size, *RUN), ctx.world_size), ctx)
    planned.train_step(0)
    return {"straight": optimizer_tensors(straight), "resumed": optimizer_tensors(resumed), "shards": shards,
            "group_size": straight.strategy.sharded.world,
            "memory": planned.strategy.memory(planned.activation_bytes).as_dict()}


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("hsdp")
    ranks = run_ranks(two_nodes_of_two, 4, root)
    in_process(lambda ctx: Trainer(cfg_for(root / "single", "single", 1, *RUN), ctx).fit())
    return root, ranks


def test_hsdp_on_2_nodes_of_2_matches_single_device(hsdp):
    root, _ = hsdp
    assert_same_training(root / "straight", root / "single", STEPS)


def test_each_node_holds_one_replica_sharded_over_its_own_processes(hsdp):
    _, ranks = hsdp
    assert [rank["group_size"] for rank in ranks] == [2, 2, 2, 2]
    total = sum(p.numel() for p in build_model(load_config(CONFIGS / "gpt-tiny.toml").model).parameters())
    assert total / 2 <= ranks[0]["shards"].numel() < total / 2 + 1024  # a half, plus padding to equal rows
    assert torch.equal(ranks[0]["shards"], ranks[2]["shards"]) and torch.equal(ranks[1]["shards"], ranks[3]["shards"])
    assert not torch.equal(ranks[0]["shards"][:1000], ranks[1]["shards"][:1000])


def test_hsdp_resumes_bit_identically_and_its_checkpoint_consolidates(hsdp, tmp_path):
    root, ranks = hsdp
    assert_bit_identical(root, ranks, STEPS)
    expected = load_file(str(root / "straight" / "model.safetensors"))
    cfg_for(root / "straight", "hsdp", 4, *RUN).save(root / "straight" / "config.toml")  # as the worker does
    consolidate(root / "straight", tmp_path / "model.safetensors")
    got = load_file(str(tmp_path / "model.safetensors"))
    assert expected.keys() <= got.keys()  # consolidate writes a tied weight under both names, save_model once
    for key in expected:
        assert torch.equal(got[key], expected[key]), key


def test_the_planners_hsdp_memory_is_what_each_rank_holds(hsdp):
    root, ranks = hsdp
    predicted = predict_memory(PLANNED, PLANNED.config(cfg_for(root / "planned", "hsdp", 4, *RUN), 4))[0]
    for rank in ranks:
        for key in ("params", "grads", "optimizer", "activations"):
            assert getattr(predicted, key) == rank["memory"][key], key
