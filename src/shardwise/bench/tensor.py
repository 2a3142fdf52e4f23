"""`shardwise bench tensor`: our `tensor` (tp = 2) against DTensor's `parallelize_module` with
ColwiseParallel / RowwiseParallel on the same GPT, in one 2-rank world, alternating (A B A B).

Both split attention by heads and the MLP by hidden units, and replicate embeddings, layer norms,
head and loss. For DTensor the attention must compute on its local heads too: each block's
attention becomes the same LocalHeadsAttention ours uses, over a plain qkv Linear whose rows are
reordered so that ColwiseParallel's contiguous row shard r holds heads r's q, k and v; then the
plan is applied. Same seed, same batches, same AdamW; neither clips (clipping mixed DTensor and
plain gradients would need code of its own). Reports median step times and their ratio, the
first losses of each (they agree: the same model trains), and parameter bytes per rank.
"""

from __future__ import annotations

import platform
import statistics
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from shardwise.bench.common import StepFn, alternate, bench_config, bench_main
from shardwise.config import validate
from shardwise.dist import DistContext, seed_everything
from shardwise.memory import storage_bytes
from shardwise.models import build_model, loss_fn
from shardwise.strategies.tensor import LocalHeadsAttention, TensorShard
from shardwise.trainer import Trainer, optimizer_factory


def dtensor_model(trainer: Trainer) -> nn.Module:
    """The GPT `trainer` trains (same seed), tensor-parallel through parallelize_module."""
    cfg, ctx = trainer.cfg, trainer.ctx
    seed_everything(cfg.train.seed)
    model = build_model(cfg.model).to(ctx.device)
    size = ctx.world_size
    plan = {}
    for i, block in enumerate(model.blocks):
        attn = block.attn
        qkv = nn.Linear(attn.qkv.in_features, attn.qkv.out_features, bias=attn.qkv.bias is not None)
        heads_first = TensorShard(dim=0, parts=3)  # rank r's q, k, v rows, rank after rank
        with torch.no_grad():
            for name, param in attn.qkv.named_parameters():
                getattr(qkv, name).copy_(torch.cat([heads_first.take(param, r, size) for r in range(size)]))
        block.attn = LocalHeadsAttention(qkv, attn.proj, attn.n_head // size)
        plan |= {f"blocks.{i}.attn.qkv": ColwiseParallel(), f"blocks.{i}.attn.proj": RowwiseParallel(),
                 f"blocks.{i}.mlp.up": ColwiseParallel(), f"blocks.{i}.mlp.down": RowwiseParallel()}
    mesh = init_device_mesh(ctx.device.type, (size,), mesh_dim_names=("tp",))
    return parallelize_module(model, mesh, plan)


def dtensor_step(like: Trainer, model: nn.Module, losses: list[float]) -> StepFn:
    optimizer = optimizer_factory(like.cfg.train)(model.parameters())

    def step(k: int) -> None:
        (indices,) = like.sampler.micro_batches(k, 0, 1, like.cfg.train.micro_batch)
        inputs, targets = like.train_set.batch(indices)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())

    return step


def run(ctx: DistContext, steps: int, rounds: int, micro_batch: int) -> dict[str, Any] | None:
    cfg = bench_config("tensor", ctx.world_size, micro_batch, steps * 2)
    cfg.train.global_batch = micro_batch  # one replica: every rank reads the whole batch
    cfg.train.grad_clip = 0.0
    validate(cfg, world_size=ctx.world_size)
    ours = Trainer(cfg, ctx)
    our_losses: list[float] = []

    def ours_step(k: int) -> None:  # the optimizer's lr stays cfg.lr, as the native's does
        our_losses.append(ours.forward_backward(k).item())
        ours.optimizer_step()
        ours.optimizer.zero_grad(set_to_none=True)

    native = dtensor_model(ours)
    native_losses: list[float] = []
    times = alternate({"tensor": ours_step, "dtensor": dtensor_step(ours, native, native_losses)}, steps, rounds)
    median = {name: statistics.median(t) for name, t in times.items()}
    our_bytes = ours.strategy.memory(0).params
    native_bytes = storage_bytes(native.parameters())
    if not ctx.is_main:
        return None
    n_params = sum(p.numel() for p in build_model(cfg.model).parameters())
    return {
        "bench": "tensor",
        "model": f"gpt {cfg.model.preset}: {cfg.model.n_layer} layers, width {cfg.model.d_model}, "
                 f"{cfg.model.n_head} heads, seq {cfg.model.seq_len}, {n_params:,} parameters",
        "tp": ctx.world_size,
        "batch_per_step": micro_batch,
        "threads_per_rank": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {ctx.backend}, torch {torch.__version__}",
        "steps_each": len(times["tensor"]),
        "ours": {"step_time_s": median["tensor"], "step_times_s": times["tensor"], "param_bytes_per_rank": our_bytes,
                 "first_losses": our_losses[:3]},
        "native": {"step_time_s": median["dtensor"], "step_times_s": times["dtensor"],
                   "param_bytes_per_rank": native_bytes, "first_losses": native_losses[:3]},
        "ratio": median["tensor"] / median["dtensor"],
    }


def format_result(result: dict[str, Any]) -> str:
    def row(label: str, entry: dict[str, Any]) -> str:
        first = ", ".join(f"{loss:.5f}" for loss in entry["first_losses"])
        return (f"  {label:<28} median step {entry['step_time_s'] * 1000:8.1f} ms   parameters "
                f"{entry['param_bytes_per_rank'] / 2**20:5.1f} MiB per rank   first losses {first}")

    return "\n".join([
        f"tensor bench: {result['model']}, tp {result['tp']}, batch {result['batch_per_step']} per step, "
        f"{result['steps_each']} steps each, alternating",
        row("ours (tensor)", result["ours"]),
        row("DTensor parallelize_module", result["native"]),
        f"  ratio ours/DTensor {result['ratio']:.3f}",
    ])


if __name__ == "__main__":
    bench_main("tensor", run, format_result)
