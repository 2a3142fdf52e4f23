"""Model parallel, ours: `pipeline` (GPipe, 1F1B), `model-parallel`, `tensor`, and their compositions
with data parallel on a dp x pp x tp mesh, on real Gloo ranks, held to parity with `single` on the
same global batch; plus what the schedules hold in memory and run in which order."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from helpers import (
    CONFIGS,
    SGD,
    assert_matches_single,
    assert_same_training,
    gpt_tiny,
    losses,
    read_records,
    train_in_process,
    train_runs,
)

from bench.pipeline import one_micro_batch_bytes
from shardwise.config.load import load_config
from shardwise.dist import DistContext
from shardwise.models import build_model
from shardwise.parallel.pipeline.stages import balanced_split
from shardwise.parallel.tensor_group import TensorShard
from shardwise.trainer import Trainer

STEPS = 10


def cfg_for(out: Path, strategy: str, nproc: int, *overrides: str):
    """gpt-tiny (2 blocks, 2 heads) on Shakespeare, a global batch of 8, clipping at 0.5 (active)."""
    return gpt_tiny(out, strategy, nproc, "train.micro_batch=8", *SGD, "train.grad_clip=0.5", *overrides, steps=STEPS)


@pytest.fixture(scope="module")
def singles(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("single")
    train_in_process(cfg_for(root / "single", "single", 1))
    train_in_process(cfg_for(root / "single-unclipped", "single", 1, "train.grad_clip=0"))
    return root


def test_clipping_is_active_in_these_runs(singles):
    clipped, unclipped = losses(singles / "single"), losses(singles / "single-unclipped")
    assert clipped[0] == unclipped[0] and abs(clipped[-1] - unclipped[-1]) > 1e-3


# --- 2 ranks: pipeline stages (pp = 2) or tensor shards (tp = 2) ----------------------------------

TWO_RANK_RUNS = {
    "gpipe-m1": ("pipeline", "parallel.pipeline.schedule=gpipe", "parallel.pipeline.micro_batches=1"),
    "gpipe-m4": ("pipeline", "parallel.pipeline.schedule=gpipe", "parallel.pipeline.micro_batches=4"),
    "1f1b-m1": ("pipeline", "parallel.pipeline.schedule=1f1b", "parallel.pipeline.micro_batches=1"),
    "1f1b-m4": ("pipeline", "parallel.pipeline.schedule=1f1b", "parallel.pipeline.micro_batches=4"),
    # two pipeline runs of 2 micro-batches each, gradients accumulated between them
    "1f1b-m2-accum2": ("pipeline", "train.micro_batch=4", "parallel.pipeline.micro_batches=2"),
    "model-parallel": ("model-parallel",),
    "tensor": ("tensor",),
}


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mp2")
    run_ranks(train_runs, 2, root, TWO_RANK_RUNS, cfg_for)
    return root


@pytest.mark.parametrize("run", TWO_RANK_RUNS)
def test_matches_single_device_over_10_steps_on_2_ranks(two_rank_runs, singles, run):
    assert_matches_single(two_rank_runs / run, singles / "single", STEPS)


def plain_parameter_counts() -> dict[str, int]:
    model = build_model(cfg_for(Path("unused"), "single", 1).model)
    return {
        "tok_emb": model.tok_emb.weight.numel(),  # also the head: the two are tied
        "pos_emb": model.pos_emb.weight.numel(),
        "block": sum(p.numel() for p in model.blocks[0].parameters()),
        "block matrices": sum(p.numel() for p in model.blocks[0].parameters() if p.dim() == 2),
        "final norm": sum(p.numel() for p in model.ln_f.parameters()),
        "total": sum(p.numel() for p in model.parameters()),
    }


def test_each_stage_holds_only_its_own_parameters(two_rank_runs):
    c = plain_parameter_counts()
    per_rank = [m["params"] for m in read_records(two_rank_runs / "1f1b-m4")[-1]["memory_by_rank"]]
    # stage 0: embeddings and block 0; stage 1: block 1, the final norm and its copy of the tied head
    assert per_rank == [4 * (c["tok_emb"] + c["pos_emb"] + c["block"]),
                        4 * (c["block"] + c["final norm"] + c["tok_emb"])]


def test_tensor_ranks_each_hold_half_of_every_block_matrix(two_rank_runs):
    c = plain_parameter_counts()
    per_rank = [m["params"] for m in read_records(two_rank_runs / "tensor")[-1]["memory_by_rank"]]
    matrices = 2 * c["block matrices"]  # 2 blocks: qkv, proj, up, down, split over 2 ranks
    assert per_rank == [4 * (c["total"] - matrices + matrices // 2)] * 2


# --- what the schedules hold and run ------------------------------------------------------------

def schedule_behaviour(ctx: DistContext, root: Path) -> dict:
    """For each schedule and M, on this rank's stage: the most bytes of saved activations held at
    once in a step, the bytes one micro-batch's forward saves, and the order of the step's work."""
    out = {}
    for schedule in ("gpipe", "1f1b"):
        for m in (4, 8):
            trainer = Trainer(cfg_for(root / f"{schedule}-{m}", "pipeline", 2, f"parallel.pipeline.schedule={schedule}",
                                      f"parallel.pipeline.micro_batches={m}"), ctx)
            trainer.train_step(0)  # the trainer counts activations in its first step
            order = [f"{kind}{i}" for kind, i, _, _, _ in trainer.strategy.timeline]
            out[schedule, m] = {"peak": trainer.activation_bytes, "one": one_micro_batch_bytes(trainer, 8 // m),
                                "order": order}
    for points, expected_blocks in (([1], [(0, 1), (1, 4)]), (None, [(0, 2), (2, 4)])):
        cfg = cfg_for(root / "split", "pipeline", 2, "model.n_layer=4")
        cfg.parallel.pipeline.split_points = points
        out["split", str(points)] = (Trainer(cfg, ctx).strategy.stage_blocks, expected_blocks)
    return out


@pytest.fixture(scope="module")
def behaviour(tmp_path_factory) -> list[dict]:
    return run_ranks(schedule_behaviour, 2, tmp_path_factory.mktemp("schedules"))


@pytest.mark.parametrize("m", [4, 8])
def test_gpipe_holds_all_m_micro_batches_and_1f1b_at_most_p_minus_stage(behaviour, m):
    for stage, r in enumerate(behaviour):
        gpipe, one_f_one_b = r["gpipe", m], r["1f1b", m]
        assert gpipe["one"] > 0
        assert gpipe["peak"] == m * gpipe["one"]  # every micro-batch's saved tensors, live at once
        assert one_f_one_b["peak"] == (2 - stage) * one_f_one_b["one"]  # P = 2 on stage 0, 1 on the last


def test_schedules_run_forwards_and_backwards_in_their_order(behaviour):
    stage0, stage1 = behaviour
    assert stage0["gpipe", 4]["order"] == stage1["gpipe", 4]["order"] == [
        "F0", "F1", "F2", "F3", "BW0", "BW1", "BW2", "BW3"]
    assert stage0["1f1b", 4]["order"] == ["F0", "F1", "BW0", "F2", "BW1", "F3", "BW2", "BW3"]  # one warm-up forward
    assert stage1["1f1b", 4]["order"] == ["F0", "BW0", "F1", "BW1", "F2", "BW2", "F3", "BW3"]


def test_stages_split_at_the_given_points_or_balanced_by_parameters(behaviour):
    for key in (("split", "[1]"), ("split", "None")):
        got, expected = behaviour[0][key]
        assert got == expected


def test_balanced_split_minimises_the_largest_stage():
    assert balanced_split([10, 1, 1, 1, 1, 10], 2) == [3]
    assert balanced_split([10, 1, 1, 1, 1, 10], 3) == [1, 5]
    assert balanced_split([1, 1, 1, 1], 4) == [1, 2, 3]
    assert balanced_split([1, 1, 1, 5], 2) == [3]


def test_tensor_shards_take_the_same_heads_of_q_k_and_v():
    qkv = torch.arange(12.0).repeat_interleave(2).view(12, 2)  # rows: q 0-3, k 4-7, v 8-11
    shard = TensorShard(dim=0, parts=3)
    mine = shard.take(qkv, rank=1, size=2)
    assert mine[:, 0].tolist() == [2, 3, 6, 7, 10, 11]  # second half of q, of k and of v
    assert torch.equal(shard.join([shard.take(qkv, r, 2) for r in range(2)]), qkv)


# --- 3 stages: a middle stage receives from both sides -------------------------------------------

def three_stage_runs(ctx: DistContext, root: Path) -> dict:
    """GPipe and 1F1B over 3 stages of one block each, trained; each stage's peak saved activations
    and one micro-batch's."""
    out = {}
    for schedule in ("gpipe", "1f1b"):
        trainer = Trainer(cfg_for(root / schedule, "pipeline", 3, "model.n_layer=3",
                                  f"parallel.pipeline.schedule={schedule}"),
                          ctx)
        trainer.fit()
        out[schedule] = {"peak": trainer.activation_bytes, "one": one_micro_batch_bytes(trainer, 2)}
    return out


def test_3_stages_match_single_and_1f1b_holds_p_minus_stage_micro_batches(tmp_path):
    peaks = run_ranks(three_stage_runs, 3, tmp_path)
    train_in_process(cfg_for(tmp_path / "single", "single", 1, "model.n_layer=3"))
    for schedule in ("gpipe", "1f1b"):
        assert_matches_single(tmp_path / schedule, tmp_path / "single", STEPS)
    for stage, r in enumerate(peaks):  # M = 4 micro-batches of 2
        assert r["gpipe"]["peak"] == 4 * r["gpipe"]["one"]
        assert r["1f1b"]["peak"] == (3 - stage) * r["1f1b"]["one"]


# --- compositions on a device mesh --------------------------------------------------------------

FOUR_RANK_RUNS = {
    "dp2-pp2": ("pipeline", "parallel.dp=2", "train.micro_batch=4", "parallel.pipeline.micro_batches=2"),
    "dp2-pp2-gpipe-accum2": ("pipeline", "parallel.dp=2", "train.micro_batch=2", "parallel.pipeline.micro_batches=2",
                             "parallel.pipeline.schedule=gpipe"),
    "dp2-tp2": ("tensor", "parallel.dp=2", "train.micro_batch=4"),
    "pp2-tp2": ("pipeline", "parallel.tp=2"),
}


@pytest.fixture(scope="module")
def four_rank_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mp4")
    run_ranks(train_runs, 4, root, FOUR_RANK_RUNS, cfg_for)
    return root


@pytest.mark.parametrize("run", FOUR_RANK_RUNS)
def test_compositions_match_single_device_over_10_steps_on_4_ranks(four_rank_runs, singles, run):
    assert_matches_single(four_rank_runs / run, singles / "single", STEPS)


def test_cli_pipeline_on_2_processes_is_2_stages_and_matches_single(tmp_path):
    """`shardwise train --strategy pipeline --nproc 2` through torchrun: 2 stages by default (1F1B,
    M = 4, two pipeline runs accumulated per step), the same training as one device, and its weights
    file the whole plain model."""
    import subprocess
    import sys

    from helpers import REPO

    out = tmp_path / "pipeline"
    sgd = [arg for setting in SGD for arg in ("--set", setting)]
    result = subprocess.run(
        [sys.executable, "-m", "shardwise.cli", "train", str(CONFIGS / "gpt-tiny.toml"), "--strategy", "pipeline",
         "--nproc", "2", "--steps", "10", "--out", str(out), *sgd],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    train_in_process(load_config(CONFIGS / "gpt-tiny.toml", ["train.steps=10", f"run.out={tmp_path / 'single'}", *SGD]))
    assert_same_training(out, tmp_path / "single", steps=10)
    assert len(read_records(out)[0]["memory_by_rank"]) == 2
