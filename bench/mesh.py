"""`shardwise bench mesh`: our `fsdp` over tensor parallel (dp 2 x tp 2 on 4 ranks) against
PyTorch's own 2D composition, DTensor's `parallelize_module` over the tp ranks and FSDP2's
`fully_shard` over the dp ranks, on shardwise's GPT and on a transformers Llama with grouped-query
attention, in one 4-rank world, all four alternating step by step (A B C D A B C D: 6 rounds of
two steps by default, so the shared machine's load drifts over all alike).

Both sides split every layer the model family's plan names over tp, as `bench tensor` does (the
native plan is `bench.tensor.dtensor_plan`), and shard every block, then the rest, over dp: ours
each tensor-parallel shard's rows (one packed all-gather and reduce-scatter per block), FSDP2 each
DTensor's local shard along dim 0 (one all-gather and reduce-scatter per block, of its own
packing). Both prefetch the next block's all-gather. Same seed, same batches (each dp rank its half
of the global batch), same AdamW; neither clips. Reports per model the median step times and their
ratio, the first losses of each (the global batch's mean on both: the same model trains), the
parameter and optimizer bytes per rank, and the machine's load average before and after.
"""

from __future__ import annotations

import os
import platform
import statistics
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from bench.common import BenchArgs, StepFn, alternate, bench_config, bench_main
from bench.tensor import MODELS, describe, dtensor_plan, initial_model
from shardwise.config.schema import Config
from shardwise.dist import DistContext
from shardwise.memory import optimizer_state_tensors, storage_bytes
from shardwise.models import loss_fn
from shardwise.models.plans import locate
from shardwise.trainer import Trainer, optimizer_factory
from shardwise.validate import validate

DP, TP = 2, 2


def native_model(cfg: Config, ctx: DistContext, mesh: DeviceMesh) -> nn.Module:
    """The model `cfg` names (the trainer's initial values), split over `mesh`'s tp ranks by
    DTensor, then each block and the root sharded over its dp ranks by FSDP2."""
    model = initial_model(cfg, ctx.device)
    model = parallelize_module(model, mesh["tp"], dtensor_plan(model, TP))
    for block in locate(model).blocks:
        fully_shard(block, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def mean_over_dp(loss: torch.Tensor, mesh: DeviceMesh) -> float:
    """The global batch's mean loss from this dp rank's (each side's steps give their rank's)."""
    mean = loss.detach().clone()
    dist.all_reduce(mean, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
    return mean.item()


def our_step(trainer: Trainer, mesh: DeviceMesh, losses: list[float]) -> StepFn:
    def step(k: int) -> None:  # the optimizer's lr stays cfg.lr, as the native's does
        loss = trainer.forward_backward(k)
        trainer.optimizer_step()
        trainer.optimizer.zero_grad(set_to_none=True)
        losses.append(mean_over_dp(loss, mesh))

    return step


def native_step(like: Trainer, model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh,
                losses: list[float]) -> StepFn:
    """One step of the native 2D model on this dp rank's share of global batch k (the batch our
    trainer reads there); the loss recorded is the global batch's mean."""
    dp_rank = mesh["dp"].get_local_rank()

    def step(k: int) -> None:
        (indices,) = like.sampler.micro_batches(k, dp_rank, DP, like.cfg.train.micro_batch)
        inputs, targets = like.train_set.batch(indices)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(mean_over_dp(loss, mesh))

    return step


def run(ctx: DistContext, args: BenchArgs) -> dict[str, Any] | None:
    steps, rounds, micro_batch = args.steps, args.rounds, args.micro_batch
    load_before = os.getloadavg()
    mesh = init_device_mesh(ctx.device.type, (DP, TP), mesh_dim_names=("dp", "tp"))
    trainers, natives, optimizers, losses, steps_of = {}, {}, {}, {}, {}
    for model, overrides in MODELS.items():
        cfg = bench_config("fsdp", ctx.world_size, micro_batch, steps * 2, f"parallel.tp={TP}", *overrides,
                           preset=args.preset)
        cfg.train.global_batch = micro_batch * DP  # each dp rank one micro-batch a step
        cfg.train.grad_clip = 0.0
        validate(cfg, world_size=ctx.world_size)
        trainers[model] = Trainer(cfg, ctx)
        natives[model] = native_model(cfg, ctx, mesh)
        optimizers[model] = optimizer_factory(cfg.train)(natives[model].parameters())
        losses[model] = {"ours": [], "native": []}
        steps_of[f"{model}-fsdp-tp"] = our_step(trainers[model], mesh, losses[model]["ours"])
        steps_of[f"{model}-fsdp2-dtensor"] = native_step(trainers[model], natives[model], optimizers[model], mesh,
                                                         losses[model]["native"])
    times = alternate(steps_of, steps, rounds)
    median = {name: statistics.median(t) for name, t in times.items()}
    held = {}
    for model in MODELS:
        ours = trainers[model].strategy.memory(0)
        held[model] = ({"params": ours.params, "optimizer": ours.optimizer},
                       {"params": storage_bytes(natives[model].parameters()),  # DTensors: their local shards
                        "optimizer": storage_bytes(optimizer_state_tensors(optimizers[model]))})
    if not ctx.is_main:
        return None
    rows = {}
    for model in MODELS:
        ours, native = f"{model}-fsdp-tp", f"{model}-fsdp2-dtensor"
        rows[model] = {
            "model": describe(trainers[model].cfg),
            "ours": {"step_time_s": median[ours], "step_times_s": times[ours], "bytes_per_rank": held[model][0],
                     "first_losses": losses[model]["ours"][:3]},
            "native": {"step_time_s": median[native], "step_times_s": times[native],
                       "bytes_per_rank": held[model][1], "first_losses": losses[model]["native"][:3]},
            "ratio": median[ours] / median[native],
        }
    return {
        "bench": "mesh",
        "mesh": {"dp": DP, "tp": TP},
        "batch_per_dp_rank": micro_batch,
        "threads_per_rank": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {ctx.backend}, torch {torch.__version__}",
        "load_average_before_after": [load_before[0], os.getloadavg()[0]],
        "steps_each": len(times[f"{next(iter(MODELS))}-fsdp-tp"]),
        "rounds": rounds,
        **rows,
    }


def format_result(result: dict[str, Any]) -> str:
    def row(label: str, entry: dict[str, Any]) -> str:
        first = ", ".join(f"{loss:.5f}" for loss in entry["first_losses"])
        held = entry["bytes_per_rank"]
        return (f"    {label:<30} median step {entry['step_time_s'] * 1000:8.1f} ms   parameters "
                f"{held['params'] / 2**20:5.2f} MiB, optimizer {held['optimizer'] / 2**20:5.2f} MiB per rank   "
                f"first losses {first}")

    lines = [f"mesh bench: fsdp dp {result['mesh']['dp']} x tp {result['mesh']['tp']}, batch "
             f"{result['batch_per_dp_rank']} per dp rank, {result['steps_each']} steps each, alternating; load "
             f"average {result['load_average_before_after'][0]:.1f} -> {result['load_average_before_after'][1]:.1f}"]
    for model in MODELS:
        entry = result[model]
        lines += [f"  {entry['model']}", row("ours (fsdp, parallel.tp = 2)", entry["ours"]),
                  row("FSDP2 fully_shard x DTensor", entry["native"]),
                  f"    ratio ours/native {entry['ratio']:.3f}"]
    return "\n".join(lines)


if __name__ == "__main__":
    bench_main("mesh", run, format_result, ranks=DP * TP, rounds=6)
