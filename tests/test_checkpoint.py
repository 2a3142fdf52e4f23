"""Checkpoints: resume bit-identically, reshard across strategies and world sizes, survive
corruption, refuse another model's state and crafted pickles."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from conftest import CONFIGS, losses, read_records
from distributed import run_ranks
from safetensors.torch import load_file

from shardwise.checkpoint import CheckpointError, checkpoint_dir
from shardwise.config import load_config
from shardwise.dist import DistContext, init_distributed
from shardwise.memory import local_tensor
from shardwise.trainer import Trainer

STEPS, SAVED_AT, CRASH_AT = 40, 20, 25


def cfg_for(out: Path, strategy: str, world: int, *overrides: str):
    return load_config(CONFIGS / "gpt-tiny.toml", [
        f"run.out={out}", f"train.steps={STEPS}", "train.global_batch=8", "train.micro_batch=4",
        "train.eval_every=0", f"train.checkpoint_every={SAVED_AT}", f"parallel.strategy={strategy}",
        f"launch.nproc={world}", *overrides])


class Crash(RuntimeError):
    pass


def crash_at(trainer: Trainer, step: int) -> Trainer:
    """Make the trainer fail when it reaches `step`, as a killed run would."""
    original = trainer.train_step

    def train_step(k: int) -> torch.Tensor:
        if k == step:
            raise Crash(f"crashed at step {k}")
        return original(k)

    trainer.train_step = train_step
    return trainer


def optimizer_tensors(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: local_tensor(v).clone() for k, v in trainer.strategy.state_dict()["optimizer"].items()}


def straight_and_resumed(ctx: DistContext, root: Path, strategy: str, *overrides: str) -> dict:
    """40 steps in one go, and 20 (saved) + a crash at 25 + resume to 40; this rank's optimizer
    state at the end of each."""
    straight = Trainer(cfg_for(root / "straight", strategy, ctx.world_size, *overrides), ctx)
    straight.fit()
    with pytest.raises(Crash):
        crash_at(Trainer(cfg_for(root / "resumed", strategy, ctx.world_size, *overrides), ctx), CRASH_AT).fit()
    resumed = Trainer(cfg_for(root / "resumed", strategy, ctx.world_size, "run.resume=true", *overrides), ctx)
    resumed.fit()
    return {"straight": optimizer_tensors(straight), "resumed": optimizer_tensors(resumed)}


def assert_bit_identical(root: Path, optimizer_states: list[dict]) -> None:
    assert losses(root / "resumed") == losses(root / "straight")  # the same 40 losses, exactly
    assert [r["step"] for r in read_records(root / "resumed")] == list(range(1, STEPS + 1))
    weights, expected = load_file(str(root / "resumed" / "model.safetensors")), load_file(
        str(root / "straight" / "model.safetensors"))
    for key in expected:
        assert torch.equal(weights[key], expected[key]), key
    for state in optimizer_states:
        assert state["resumed"].keys() == state["straight"].keys() and state["straight"]
        for key in state["straight"]:
            assert torch.equal(state["resumed"][key], state["straight"][key]), key


def in_process(fn, *args):
    threads = torch.get_num_threads()
    try:
        return fn(init_distributed(threads_per_rank=1), *args)
    finally:
        torch.set_num_threads(threads)


def test_single_resumes_bit_identically(tmp_path):
    assert_bit_identical(tmp_path, [in_process(straight_and_resumed, tmp_path, "single")])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_resume_is_bit_identical_on_2_ranks(tmp_path, strategy):
    assert_bit_identical(tmp_path, run_ranks(straight_and_resumed, 2, tmp_path, strategy))
