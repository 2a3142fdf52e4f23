"""The fsdp bench's count of what an object holds (how DeepSpeed's model state is measured):
every storage once, gradients included, reduction buckets apart; on our strategies it agrees with
`Strategy.memory`."""

from __future__ import annotations

import torch
from distributed import run_ranks
from helpers import CONFIGS
from torch import nn

from bench.fsdp import held_bytes
from shardwise.config.load import load_config
from shardwise.dist import DistContext
from shardwise.trainer import Trainer


def test_held_bytes_counts_each_storage_once_with_gradients_and_buckets_apart():
    holder = nn.Module()
    holder.model = nn.Linear(4, 4)  # 16 + 4 fp32 elements
    holder.optimizer = torch.optim.AdamW(holder.model.parameters())
    holder.model(torch.ones(2, 4)).sum().backward()
    holder.optimizer.step()  # two moments per parameter and a 0-dim fp32 step each
    holder.weight_view = holder.model.weight.detach()[:2]  # the weight's storage again: counted once
    holder.ipg_bucket = torch.zeros(1000, dtype=torch.bfloat16)  # a reduction bucket, by name
    held = held_bytes(holder)
    assert held["model_state"] == 20 * 4 + 20 * 4 + 2 * 20 * 4 + 2 * 4  # params, grads, moments, steps
    assert held["buffers"] == 2000



def walked_and_counted(ctx: DistContext) -> dict[str, tuple[dict[str, int], int]]:
    out = {}
    for strategy in ("zero1", "zero2", "fsdp"):
        cfg = load_config(CONFIGS / "gpt-tiny.toml", [f"parallel.strategy={strategy}", "run.out=unused",
                                                      f"launch.nproc={ctx.world_size}", "parallel.precision=bf16-mixed",
                                                      "train.micro_batch=4", "train.global_batch=8"])
        trainer = Trainer(cfg, ctx)
        trainer.train_step(0)  # gradients alive, as the trainer counts them
        memory = trainer.memory()
        out[strategy] = (held_bytes(trainer.strategy), memory.params + memory.grads + memory.optimizer)
    return out


def test_held_bytes_of_our_strategies_is_their_counted_model_state():
    for rank in run_ranks(walked_and_counted, 2):
        for strategy, (held, counted) in rank.items():
            assert held == {"model_state": counted, "buffers": 0}, strategy
