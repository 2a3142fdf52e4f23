"""`shardwise bench tensor`: our `tensor` (tp = 2) against DTensor's `parallelize_module` with
ColwiseParallel / RowwiseParallel, on shardwise's GPT and on a transformers Llama with
grouped-query attention, in one 2-rank world, all four alternating step by step (A B C D A B C D:
12 rounds of one step by default, so the shared machine's load drifts over all alike).

Both sides split every layer the model family's parallel plan names (models/plans.py): DTensor's
plan is made from ours, ColwiseParallel for its column-parallel layers and RowwiseParallel for its
row-parallel ones, and both replicate embeddings, norms, head and loss. A layer computing q, k and
v at once (the GPT's qkv) has its rows reordered for DTensor so that ColwiseParallel's contiguous
row shard r holds rank r's heads of q, k and v, as ours does; attention counts its heads from its
layers' outputs on both sides. Same seed, same batches, same AdamW; neither clips (clipping mixed
DTensor and plain gradients would need code of its own). Reports per model the median step times
and their ratio, the first losses of each (they agree: the same model trains), parameter bytes
per rank, and the machine's load average before and after.
"""

from __future__ import annotations

import os
import platform
import statistics
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from bench.common import BenchArgs, StepFn, alternate, bench_config, bench_main
from shardwise.config.schema import Config
from shardwise.dist import DistContext
from shardwise.materialise import Materialiser, init_context
from shardwise.memory import storage_bytes
from shardwise.models import build_model, loss_fn
from shardwise.models.plans import locate
from shardwise.parallel.tensor_group import TensorShard
from shardwise.trainer import Trainer, optimizer_factory
from shardwise.validate import validate

# The Llama: gpt small's sizes with 2 key/value heads for its 6 heads.
MODELS = {"gpt": (), "llama": ("model.name=hf-llama", "model.n_kv_head=2")}


def dtensor_plan(model: nn.Module, size: int) -> dict[str, ParallelStyle]:
    """DTensor's layout of our plan's layers, by full name; fused column layers' rows reordered in
    place so that a contiguous row shard holds each part's rows of one rank."""
    located = locate(model)
    names = {module: name for name, module in model.named_modules()}
    plan: dict[str, ParallelStyle] = {}
    for block in located.blocks:
        for region in located.plan.regions:
            module = block.get_submodule(region.module)
            for column in region.columns:
                layer = module.get_submodule(column.name)
                if column.parts > 1:
                    by_rank = TensorShard(dim=0, parts=column.parts)  # rank r's rows of each part, rank after rank
                    with torch.no_grad():
                        for param in layer.parameters():
                            param.copy_(torch.cat([by_rank.take(param, r, size) for r in range(size)]))
                plan[names[layer]] = ColwiseParallel()
            plan[names[module.get_submodule(region.row)]] = RowwiseParallel()
    return plan


def initial_model(cfg: Config, device: torch.device) -> nn.Module:
    """The model `cfg` names with the initial values the trainer gives it (built on meta, each
    tensor initialised from train.seed and its name: materialise.py), whole on `device`."""
    with init_context():
        model = build_model(cfg.model)
    Materialiser(model, None, cfg.train.seed).materialise_all(device, None)
    return model


def dtensor_model(cfg: Config, ctx: DistContext) -> nn.Module:
    """The model `cfg` names (the trainer's initial values), split through parallelize_module."""
    model = initial_model(cfg, ctx.device)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("tp",))
    return parallelize_module(model, mesh, dtensor_plan(model, ctx.world_size))


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


def our_step(trainer: Trainer, losses: list[float]) -> StepFn:
    def step(k: int) -> None:  # the optimizer's lr stays cfg.lr, as the native's does
        losses.append(trainer.forward_backward(k).item())
        trainer.optimizer_step()
        trainer.optimizer.zero_grad(set_to_none=True)

    return step


def describe(cfg: Config) -> str:
    m = cfg.model
    n_params = sum(p.numel() for p in build_model(m).parameters())
    return (f"{m.name} {m.preset}: {m.n_layer} layers, width {m.d_model}, {m.n_head} heads, {m.n_kv_head} key/value "
            f"heads, seq {m.seq_len}, {n_params:,} parameters")


def run(ctx: DistContext, args: BenchArgs) -> dict[str, Any] | None:
    steps, rounds, micro_batch = args.steps, args.rounds, args.micro_batch
    load_before = os.getloadavg()
    trainers, natives, losses, steps_of = {}, {}, {}, {}
    for model, overrides in MODELS.items():
        cfg = bench_config("tensor", ctx.world_size, micro_batch, steps * 2, *overrides, preset=args.preset)
        cfg.train.global_batch = micro_batch  # one replica: every rank reads the whole batch
        cfg.train.grad_clip = 0.0
        validate(cfg, world_size=ctx.world_size)
        trainers[model] = Trainer(cfg, ctx)
        natives[model] = dtensor_model(cfg, ctx)
        losses[model] = {"ours": [], "native": []}
        steps_of[f"{model}-tensor"] = our_step(trainers[model], losses[model]["ours"])
        steps_of[f"{model}-dtensor"] = dtensor_step(trainers[model], natives[model], losses[model]["native"])
    times = alternate(steps_of, steps, rounds)
    median = {name: statistics.median(t) for name, t in times.items()}
    param_bytes = {model: (trainers[model].strategy.memory(0).params, storage_bytes(natives[model].parameters()))
                   for model in MODELS}
    if not ctx.is_main:
        return None
    rows = {}
    for model in MODELS:
        ours, native = f"{model}-tensor", f"{model}-dtensor"
        rows[model] = {
            "model": describe(trainers[model].cfg),
            "ours": {"step_time_s": median[ours], "step_times_s": times[ours],
                     "param_bytes_per_rank": param_bytes[model][0], "first_losses": losses[model]["ours"][:3]},
            "native": {"step_time_s": median[native], "step_times_s": times[native],
                       "param_bytes_per_rank": param_bytes[model][1], "first_losses": losses[model]["native"][:3]},
            "ratio": median[ours] / median[native],
        }
    return {
        "bench": "tensor",
        "tp": ctx.world_size,
        "batch_per_step": micro_batch,
        "threads_per_rank": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {ctx.backend}, torch {torch.__version__}",
        "load_average_before_after": [load_before[0], os.getloadavg()[0]],
        "steps_each": len(times["gpt-tensor"]),
        "rounds": rounds,
        **rows,
    }


def format_result(result: dict[str, Any]) -> str:
    def row(label: str, entry: dict[str, Any]) -> str:
        first = ", ".join(f"{loss:.5f}" for loss in entry["first_losses"])
        return (f"    {label:<28} median step {entry['step_time_s'] * 1000:8.1f} ms   parameters "
                f"{entry['param_bytes_per_rank'] / 2**20:5.1f} MiB per rank   first losses {first}")

    lines = [f"tensor bench: tp {result['tp']}, batch {result['batch_per_step']} per step, "
             f"{result['steps_each']} steps each, alternating; load average "
             f"{result['load_average_before_after'][0]:.1f} -> {result['load_average_before_after'][1]:.1f}"]
    for model in MODELS:
        entry = result[model]
        lines += [f"  {entry['model']}", row("ours (tensor)", entry["ours"]),
                  row("DTensor parallelize_module", entry["native"]), f"    ratio ours/DTensor {entry['ratio']:.3f}"]
    return "\n".join(lines)


if __name__ == "__main__":
    bench_main("tensor", run, format_result, rounds=12)
