"""The sharded strategies on a mesh that splits the model too: `fsdp`, `zero1` and `zero2` over
tensor parallel shard each tensor-parallel shard over the data-parallel ranks. They train as one
device does, hold their part of the model state, and checkpoint so that another mesh resumes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import CONFIGS, SGD, assert_same_training, losses, train_in_process
from distributed import run_ranks
from safetensors.torch import load_file

from shardwise.config import load_config
from shardwise.dist import DistContext
from shardwise.trainer import Trainer

STEPS, SAVED_AT = 10, 5
LLAMA = ("model.name=hf-llama", "model.n_head=4", "model.n_kv_head=2")  # grouped-query attention: 2 heads share k, v


def cfg_for(out: Path, strategy: str, world: int, *overrides: str):
    """gpt-tiny (2 blocks, 2 heads) on Shakespeare, a global batch of 8, clipping at 0.5 (active)."""
    return load_config(CONFIGS / "gpt-tiny.toml", [
        f"run.out={out}", f"train.steps={STEPS}", "train.global_batch=8", "train.micro_batch=4",
        "train.eval_every=0", *SGD, "train.grad_clip=0.5", f"parallel.strategy={strategy}",
        f"launch.nproc={world}", *overrides])


RUNS = {  # on 4 ranks: 2 data-parallel x 2 tensor-parallel
    "fsdp-tp2": ("fsdp", "parallel.tp=2", f"train.checkpoint_every={SAVED_AT}"),
    "zero2-tp2-sp": ("zero2", "parallel.tp=2", "parallel.sequence_parallel=true"),
    "fsdp-tp2-llama": ("fsdp", "parallel.tp=2", *LLAMA),
}


def train_runs(ctx: DistContext, root: Path) -> dict[str, dict[str, int]]:
    """Each run; rank by rank, its model state's counted bytes."""
    counted = {}
    for name, (strategy, *overrides) in RUNS.items():
        trainer = Trainer(cfg_for(root / name, strategy, ctx.world_size, *overrides), ctx)
        trainer.fit()
        memory = trainer.memory()
        counted[name] = {"params": memory.params, "optimizer": memory.optimizer}
    return counted


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("compositions")
    train_in_process(cfg_for(root / "single", "single", 1))
    train_in_process(cfg_for(root / "single-llama", "single", 1, *LLAMA))
    return root, run_ranks(train_runs, 4, root)


@pytest.mark.parametrize("name", list(RUNS))
def test_sharded_strategies_over_tensor_parallel_match_single_over_10_steps(runs, name):
    root, _ = runs
    assert_same_training(root / name, root / ("single-llama" if "llama" in name else "single"), STEPS)


def test_each_rank_holds_its_data_parallel_shard_of_its_tensor_parallel_part_as_the_planner_predicts(runs):
    """fsdp over 2 x 2: a rank's parameters are its dim-0 shard (of 2, padded) of what a tensor-parallel
    rank holds (the blocks' matrices split in 2, the rest whole), a little over a quarter of the model."""
    from shardwise.planner.candidates import Candidate
    from shardwise.planner.memory import predict_memory

    _, counted = runs
    cfg = cfg_for(Path("."), "fsdp", 4, "parallel.tp=2")
    predicted = predict_memory(Candidate("fsdp", 2, 1, 2, "fp32", "none", 4), cfg)[0]
    whole = 4 * sum(p.numel() for p in build_gpt().parameters())
    assert 0.25 * whole < predicted.params < 0.3 * whole
    for rank in counted:
        assert rank["fsdp-tp2"]["params"] == predicted.params
        assert rank["fsdp-tp2"]["optimizer"] == predicted.optimizer  # SGD's momentum


def build_gpt():
    from shardwise.models import build_model

    return build_model(cfg_for(Path("."), "single", 1).model)


def resume_under_single(ctx: DistContext, run: Path, out: Path) -> None:
    """The fsdp x tp checkpoint at step 5, on one process."""
    saved = f"step-{SAVED_AT:08d}"
    shutil.copytree(run / "checkpoints" / saved, out / "checkpoints" / saved)
    (out / "checkpoints" / "latest").write_text(saved)
    Trainer(cfg_for(out, "single", 1, "run.resume=true"), ctx).fit()


def test_a_checkpoint_of_fsdp_over_tensor_parallel_resumes_on_one_process(runs, tmp_path):
    from shardwise.dist import init_distributed

    root, _ = runs
    threads = torch.get_num_threads()
    try:
        resume_under_single(init_distributed(threads_per_rank=1), root / "fsdp-tp2", tmp_path / "resumed")
    finally:
        torch.set_num_threads(threads)
    got, want = losses(tmp_path / "resumed"), losses(root / "fsdp-tp2")
    assert len(got) == STEPS - SAVED_AT
    for step, (a, b) in enumerate(zip(got, want[SAVED_AT:], strict=True)):
        assert abs(a - b) <= 1e-5 * b, step + SAVED_AT + 1
    resumed, straight = (load_file(str(run / "model.safetensors")) for run in (tmp_path / "resumed", root / "fsdp-tp2"))
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=1e-5, atol=1e-6, msg=key)
