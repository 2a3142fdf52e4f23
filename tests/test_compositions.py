"""The sharded strategies on a mesh that splits the model too: `fsdp`, `zero1`, `zero2` and `hsdp`
over tensor parallel (and context parallel beside), and `fsdp`, `zero1` and `zero2` over pipeline
stages (and tensor parallel), shard each rank's part of the model over its data-parallel ranks.
They train as one device does, hold their part of the model state as the planner predicts, and
checkpoint so that another mesh resumes; what cannot compose is refused before any worker starts."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from helpers import (
    SGD,
    Crash,
    assert_same_training,
    assert_states_close,
    crash_at,
    gpt_tiny,
    in_process,
    losses,
    read_records,
    train_in_process,
)
from safetensors.torch import load_file

from shardwise.dist import DistContext
from shardwise.planner.candidates import Candidate
from shardwise.trainer import Trainer

STEPS, SAVED_AT = 10, 5
LLAMA = ("model.name=hf-llama", "model.n_head=4", "model.n_kv_head=2")  # grouped-query attention: 2 heads share k, v
LORA = ("lora.rank=4", "lora.alpha=8", "train.lr=0.5")  # adapters on the frozen model's seven projections
# gpt-moe (8 experts, top-2), balanced by biases: routing counts summed over every rank, so micro-batches of 1
# route as single's of 4 do
MOE = ("model.name=gpt-moe", "model.n_experts=8", "model.top_k=2", "model.d_expert=64", "model.balance=bias",
       "model.balance_rate=0.01")


def cfg_for(out: Path, strategy: str, world: int, *overrides: str):
    """gpt-tiny (2 blocks, 2 heads) on Shakespeare, a global batch of 8, clipping at 0.5 (active)."""
    return gpt_tiny(out, strategy, world, "train.micro_batch=4", *SGD, "train.grad_clip=0.5", *overrides, steps=STEPS)


BF16_RECOMPUTE = ("parallel.precision=bf16-mixed", "parallel.recompute=blocks")
RUNS = {  # on 4 ranks: 2 data-parallel x 2 tensor-parallel
    "fsdp-tp2": ("fsdp", "parallel.tp=2", f"train.checkpoint_every={SAVED_AT}"),
    "zero2-tp2-sp": ("zero2", "parallel.tp=2", "parallel.sequence_parallel=true"),
    "fsdp-tp2-llama": ("fsdp", "parallel.tp=2", *LLAMA),
    "zero1-tp2-bf16-recompute": ("zero1", "parallel.tp=2", *BF16_RECOMPUTE),
    # 2 data-parallel x 2 pipeline stages: the tied embedding and head on two ranks, sharded on each
    "zero2-pp2": ("zero2", "parallel.pp=2", "parallel.pipeline.micro_batches=2"),
    "fsdp-pp2-zbv-llama": ("fsdp", "parallel.pp=2", "parallel.pipeline.micro_batches=2",
                           "parallel.pipeline.schedule=zbv",
                           "model.n_layer=4", *LLAMA),
    # adapters over sharded stages: the frozen units gathered for the schedule, never reduced
    "fsdp-pp2-lora-llama": ("fsdp", "parallel.pp=2", "parallel.pipeline.micro_batches=2", *LLAMA, *LORA,
                            f"train.checkpoint_every={SAVED_AT}"),
}
EIGHT_RANK_RUNS = {
    # 2 "nodes" of 4 processes: each node's 2 x 2 (dp_shard x tp) holds a replica; a global batch of 8 over 4.
    "hsdp-2x2-tp2": ("hsdp", "parallel.tp=2", "train.micro_batch=2"),
    "fsdp-cp2-tp2-recompute": ("fsdp", "parallel.tp=2", "parallel.cp=2", "parallel.recompute=blocks"),
    "fsdp-pp2-tp2": ("fsdp", "parallel.pp=2", "parallel.tp=2", "parallel.pipeline.micro_batches=2",
                     f"train.checkpoint_every={SAVED_AT}"),
    # 2 nodes of (2 x pp 2): each node a replica whose stages are sharded over its 2 dp ranks
    "hsdp-2x2-pp2": ("hsdp", "parallel.pp=2", "parallel.pipeline.micro_batches=2", "train.micro_batch=2"),
    # 2 nodes of 4: each node's experts split over ep 2, each half sharded over the node's 2 ranks holding
    # it; across nodes, the ranks holding the same shard average it with the rest
    "hsdp-2x4-ep2-moe": ("hsdp", "parallel.ep=2", "launch.nproc=4", "train.micro_batch=1", *MOE,
                         f"train.checkpoint_every={SAVED_AT}"),
}
# What the planner is asked about each run (its config is the candidate's).
PLANNED = {
    "fsdp-tp2": Candidate("fsdp", 2, 1, 2, "fp32", "none", 4),
    "zero2-tp2-sp": Candidate("zero2", 2, 1, 2, "fp32", "none", 4),
    "fsdp-tp2-llama": Candidate("fsdp", 2, 1, 2, "fp32", "none", 4),
    "zero1-tp2-bf16-recompute": Candidate("zero1", 2, 1, 2, "bf16-mixed", "blocks", 4),
    "zero2-pp2": Candidate("zero2", 2, 2, 1, "fp32", "none", 4, 2, "1f1b"),
    "fsdp-pp2-zbv-llama": Candidate("fsdp", 2, 2, 1, "fp32", "none", 4, 2, "zbv"),
    "fsdp-pp2-lora-llama": Candidate("fsdp", 2, 2, 1, "fp32", "none", 4, 2, "1f1b"),
    "hsdp-2x2-tp2": Candidate("hsdp", 4, 1, 2, "fp32", "none", 2, shard=2),
    "fsdp-cp2-tp2-recompute": Candidate("fsdp", 2, 1, 2, "fp32", "blocks", 4, cp=2),
    "fsdp-pp2-tp2": Candidate("fsdp", 2, 2, 2, "fp32", "none", 4, 2, "1f1b"),
    "hsdp-2x2-pp2": Candidate("hsdp", 4, 2, 1, "fp32", "none", 2, 2, "1f1b", shard=2),
    "hsdp-2x4-ep2-moe": Candidate("hsdp", 8, 1, 1, "fp32", "none", 1, shard=4, ep=2),
}


def reference(name: str) -> str:
    if "zbv" in name:
        return "single-llama-4-blocks"
    if "lora" in name:
        return "single-lora-llama"
    if "moe" in name:
        return "single-moe"
    return "single-llama" if "llama" in name else "single-bf16" if "bf16" in name else "single"


def train_runs(ctx: DistContext, root: Path, runs: dict[str, tuple[str, ...]]) -> dict[str, dict[str, int]]:
    """Each run; rank by rank, its model state's counted bytes. Processes run as nodes of 4 (hsdp's)."""
    os.environ["LOCAL_WORLD_SIZE"] = "4"
    counted = {}
    for name, (strategy, *overrides) in runs.items():
        trainer = Trainer(cfg_for(root / name, strategy, ctx.world_size, *overrides), ctx)
        trainer.fit()
        memory = trainer.memory()
        counted[name] = {"params": memory.params, "optimizer": memory.optimizer}
    return counted


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, list[dict]]]:
    """Every run's per-rank counts, by run name."""
    root = tmp_path_factory.mktemp("compositions")
    train_in_process(cfg_for(root / "single", "single", 1))
    train_in_process(cfg_for(root / "single-llama", "single", 1, *LLAMA))
    train_in_process(cfg_for(root / "single-bf16", "single", 1, "parallel.precision=bf16-mixed"))
    train_in_process(cfg_for(root / "single-llama-4-blocks", "single", 1, "model.n_layer=4", *LLAMA))
    train_in_process(cfg_for(root / "single-lora-llama", "single", 1, *LLAMA, *LORA))
    train_in_process(cfg_for(root / "single-moe", "single", 1, *MOE))
    counted = {}
    for world, runs in ((4, RUNS), (8, EIGHT_RANK_RUNS)):
        ranks = run_ranks(train_runs, world, root, runs, timeout=600)
        counted.update({name: [rank[name] for rank in ranks] for name in runs})
    return root, counted


@pytest.mark.parametrize("name", [name for name in [*RUNS, *EIGHT_RANK_RUNS] if "bf16" not in name])
def test_sharded_strategies_on_a_mesh_match_single_over_10_steps(runs, name):
    root, _ = runs
    assert_same_training(root / name, root / reference(name), STEPS)


def test_bf16_mixed_with_recomputed_blocks_over_tensor_parallel_trains_as_one_device_does(runs):
    """bf16 rounds differently on split matrices and half batches: the bound the dp, tensor and
    pipeline tests use."""
    root, _ = runs
    name = "zero1-tp2-bf16-recompute"
    worst = max(abs(a - b) / b for a, b in zip(losses(root / name), losses(root / reference(name)), strict=True))
    assert len(losses(root / name)) == STEPS and worst < 5e-4


@pytest.mark.parametrize("name", list(PLANNED))
def test_each_rank_holds_the_model_state_the_planner_predicts(runs, name):
    """Parameters and optimizer state as counted after the last step (its gradients freed), on
    every rank; a pipeline's ranks, stage by stage."""
    from shardwise.planner.memory_model import predict_memory

    _, counted = runs
    candidate = PLANNED[name]
    world = candidate.dp * candidate.pp * candidate.tp * candidate.cp
    strategy, *overrides = {**RUNS, **EIGHT_RANK_RUNS}[name]
    predicted = predict_memory(candidate, candidate.config(cfg_for(Path("."), strategy, world, *overrides), world))
    for rank, held in enumerate(counted[name]):
        stage = predicted[rank // candidate.tp % candidate.pp]  # tp innermost, then pp
        assert (held["params"], held["optimizer"]) == (stage.params, stage.optimizer), rank


def test_fsdp_over_2_x_2_holds_a_quarter_of_the_model_and_its_padding(runs):
    """A rank's parameters are its dim-0 shard (of 2, padded) of what a tensor-parallel rank holds
    (the blocks' matrices split in 2, the rest whole): a little over a quarter of the model."""
    _, counted = runs
    whole = 4 * sum(p.numel() for p in build_gpt().parameters())
    for rank in counted["fsdp-tp2"]:
        assert 0.25 * whole < rank["params"] < 0.3 * whole


def build_gpt():
    from shardwise.models import build_model

    return build_model(cfg_for(Path("."), "single", 1).model)


def resume_under_single(ctx: DistContext, run: Path, out: Path, *overrides: str) -> None:
    """A mesh's checkpoint at step 5, on one process."""
    saved = f"step-{SAVED_AT:08d}"
    shutil.copytree(run / "checkpoints" / saved, out / "checkpoints" / saved)
    (out / "checkpoints" / "latest").write_text(saved)
    Trainer(cfg_for(out, "single", 1, "run.resume=true", *overrides), ctx).fit()


def assert_resumed_as_straight(resumed: Path, straight: Path) -> None:
    """The resumed run's losses and final weights are the straight run's from step 5 on."""
    got, want = losses(resumed), losses(straight)
    assert len(got) == STEPS - SAVED_AT
    for step, (a, b) in enumerate(zip(got, want[SAVED_AT:], strict=True)):
        assert abs(a - b) <= 1e-5 * b, step + SAVED_AT + 1
    weights, expected = (load_file(str(run / "model.safetensors")) for run in (resumed, straight))
    assert_states_close(weights, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["fsdp-tp2", "fsdp-pp2-tp2"])
def test_a_checkpoint_of_a_sharded_mesh_resumes_on_one_process_and_consolidates(runs, name, tmp_path):
    """Resumed from step 5 under single: the straight run's losses and weights. Its last checkpoint
    (step 10) consolidated in one process: the run's final weights, bit for bit (consolidate
    writes a tied weight under each of its names, the final weights once)."""
    from shardwise.checkpoint import consolidate
    from shardwise.dist import init_distributed

    root, _ = runs
    threads = torch.get_num_threads()
    try:
        resume_under_single(init_distributed(threads_per_rank=1), root / name, tmp_path / "resumed")
    finally:
        torch.set_num_threads(threads)
    assert_resumed_as_straight(tmp_path / "resumed", root / name)
    straight = load_file(str(root / name / "model.safetensors"))
    strategy, *overrides = {**RUNS, **EIGHT_RANK_RUNS}[name]
    cfg_for(root / name, strategy, 4, *overrides).save(root / name / "config.toml")  # as `shardwise train` does
    consolidate(root / name, tmp_path / "consolidated.safetensors")
    consolidated = load_file(str(tmp_path / "consolidated.safetensors"))
    assert straight.keys() <= consolidated.keys()  # and the tied head under its own name too
    for key, tensor in consolidated.items():
        assert any(torch.equal(tensor, straight[k]) for k in ([key] if key in straight else straight)), key


def test_an_hsdp_checkpoint_of_experts_resumes_on_one_process(runs, tmp_path):
    """hsdp's experts, split over ep within each node and sharded there, saved at step 5 (each
    piece once, though both nodes hold it), resume under single on one process."""
    root, _ = runs
    in_process(resume_under_single, root / "hsdp-2x4-ep2-moe", tmp_path / "resumed", *MOE)
    assert_resumed_as_straight(tmp_path / "resumed", root / "hsdp-2x4-ep2-moe")


RESHARDED_AT = 7  # steps 6-7 under pipeline x tp, then 8-10 under fsdp x tp again


def test_a_lora_checkpoint_of_sharded_stages_resumes_on_one_process(runs, tmp_path):
    """The adapters and their optimizer state, saved by fsdp over 2 x 2 pipeline ranks at step 5,
    resume under single on one process, onto the frozen Llama it makes again from the seed."""
    root, _ = runs
    in_process(resume_under_single, root / "fsdp-pp2-lora-llama", tmp_path / "resumed", *LLAMA, *LORA)
    assert_resumed_as_straight(tmp_path / "resumed", root / "fsdp-pp2-lora-llama")
    saved = root / "fsdp-pp2-lora-llama" / "checkpoints" / f"step-{SAVED_AT:08d}"
    assert json.loads((saved / "manifest.json").read_text())["lora"]["rank"] == 4


def to_pipeline_and_back(ctx: DistContext, run: Path, out: Path) -> None:
    """fsdp x tp2's checkpoint at step 5 resumed under pipeline pp2 x tp2, which saves at step 7
    and dies; its checkpoint resumed under fsdp x tp2, to the end."""
    saved = f"step-{SAVED_AT:08d}"
    if ctx.is_main:
        shutil.copytree(run / "checkpoints" / saved, out / "checkpoints" / saved)
        (out / "checkpoints" / "latest").write_text(saved)
    ctx.barrier()
    pipeline = Trainer(cfg_for(out, "pipeline", 4, "parallel.tp=2", "parallel.pipeline.micro_batches=2",
                               "run.resume=true",
                               f"train.checkpoint_every={RESHARDED_AT}"), ctx)
    with pytest.raises(Crash):
        crash_at(pipeline, RESHARDED_AT).fit()
    Trainer(cfg_for(out, "fsdp", 4, "parallel.tp=2", "run.resume=true"), ctx).fit()


def test_a_checkpoint_of_fsdp_over_tensor_parallel_reshards_to_a_pipeline_and_back(runs, tmp_path):
    root, _ = runs
    run_ranks(to_pipeline_and_back, 4, root / "fsdp-tp2", tmp_path)
    manifest = json.loads((tmp_path / "checkpoints" / f"step-{RESHARDED_AT:08d}" / "manifest.json").read_text())
    assert manifest["strategy"] == "pipeline"  # what the fsdp run resumed from
    got = {r["step"]: r["loss"] for r in read_records(tmp_path)}  # the later run's, where both wrote one
    want = {r["step"]: r["loss"] for r in read_records(root / "fsdp-tp2")}
    assert sorted(got) == sorted(want)[SAVED_AT:]
    for step, loss in got.items():
        assert abs(loss - want[step]) <= 1e-5 * want[step], step
    resumed, straight = (load_file(str(run / "model.safetensors")) for run in (tmp_path, root / "fsdp-tp2"))
    assert_states_close(resumed, straight, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overrides, message", [
    (("parallel.strategy=hsdp", "parallel.pp=2", "launch.nproc=3"),
     "launch.nproc = 3 must be a multiple of pp x tp x cp"),
    (("parallel.strategy=zero2", "parallel.pp=2", "parallel.sharding.offload=optimizer"), "not over pipeline stages"),
    (("parallel.strategy=fsdp", "parallel.pp=2", "parallel.pipeline.micro_batches=3"),
     "must divide train.micro_batch = 4"),
    (("parallel.strategy=zero1", "parallel.pp=3"), "must equal the world size 4"),
])
def test_a_sharded_pipeline_that_cannot_run_is_refused_before_any_worker_starts(overrides, message):
    from shardwise.config.schema import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        cfg_for(Path("."), "single", 4, *overrides)  # validated as it loads
