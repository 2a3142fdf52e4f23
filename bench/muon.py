"""`shardwise bench muon`: Muon under our fsdp (each matrix orthogonalized by its owner rank,
parallel/whole_matrices.py) against Muon under our ddp (every rank every matrix whole), against
AdamW under the same fsdp, and against the other way to assemble whole matrices from shards (every
rank all-gathers every matrix and orthogonalizes all of them, keeping its rows: `GatheredMatrices`
below); with DeepSpeed's Muon under ZeRO-2 as a peer where DeepSpeed is installed. gpt small, 2
ranks, every contestant from the same seed on the same batches, alternating step by step.

Reports median step times and their ratios (fsdp Muon / ddp Muon: issue 70's target is at most
1.10), Newton-Schulz's share of fsdp Muon's step (the seconds inside its orthogonalization) and
of the exchange around it, and the bytes each step's collectives move per rank (our sharding's
count: input + output of each collective; our ddp's reducer's: what it sent).

DeepSpeed's engine is given the same model, batches and split (Muon for the blocks' matrices,
AdamW for the rest: its own rule, by parameter name, would give our tied embedding to Muon, so
its tags are set again after its own), torch's Muon coefficients, its default momentum.
"""

from __future__ import annotations

import logging
import os
import platform
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bench.common import BenchArgs, StepFn, alternate, bench_config, bench_main
from shardwise.dist import DistContext, seed_everything
from shardwise.models import build_model, loss_fn
from shardwise.muon import split_for_muon
from shardwise.parallel.comm import all_gather_single
from shardwise.parallel.shard import copy_out
from shardwise.parallel.whole_matrices import LocalMatrices, ShardedMatrices, Use, Value, WholeFunction, WholeMatrices
from shardwise.trainer import Trainer

MUON = ("train.optimizer=muon", "train.lr=0.02", "train.grad_clip=0")
RUNS = {"fsdp-muon": ("fsdp", *MUON), "ddp-muon": ("ddp", *MUON), "fsdp-adamw": ("fsdp", "train.grad_clip=0"),
        "fsdp-muon-gathered": ("fsdp", *MUON)}


class Timed:
    """`matrices`, with the seconds spent in its `apply` (exchange and computation) and in the
    computation alone counted."""

    def __init__(self, matrices: WholeMatrices) -> None:
        self.matrices, self.apply_s, self.compute_s = matrices, 0.0, 0.0

    def whole_of(self, local: nn.Parameter) -> nn.Parameter:
        return self.matrices.whole_of(local)

    def shape_of(self, local: nn.Parameter) -> torch.Size:
        return self.matrices.shape_of(local)

    def apply(self, local: list[nn.Parameter], value: Value, function: WholeFunction, dtype: torch.dtype,
              use: Use) -> None:
        def timed(index: int, whole: torch.Tensor) -> torch.Tensor:
            started = time.perf_counter()
            result = function(index, whole)
            self.compute_s += time.perf_counter() - started
            return result

        started = time.perf_counter()
        self.matrices.apply(local, value, timed, dtype, use)
        self.apply_s += time.perf_counter() - started


class GatheredMatrices(ShardedMatrices):
    """The alternative to an owner a matrix: every rank all-gathers every rank's shards (one
    all-gather of them packed) and computes every whole matrix's result, keeping its own rows."""

    def apply(self, local: list[nn.Parameter], value: Value, function: WholeFunction, dtype: torch.dtype,
              use: Use) -> None:
        over = self.sharding.unit_of(self.whole_of(local[0])).over  # gpt: one dense group
        send = torch.cat([value(index).reshape(-1).to(dtype) for index in range(len(local))])
        gathered = torch.empty(over.world * send.numel(), dtype=dtype)
        all_gather_single(gathered, send, group=over.group)
        self.sharding.bytes_moved += (gathered.numel() + send.numel()) * send.element_size()
        per_rank, offset = gathered.view(over.world, -1), 0
        for index, shard in enumerate(local):
            whole_param = self.whole_of(shard)
            rows, shape = self.sharding.split_of(whole_param)
            whole = torch.empty(whole_param.shape, dtype=dtype)
            copy_out(whole, shape, rows, offset, per_rank)
            padded = torch.zeros(over.world * rows, *shape[1:], dtype=dtype)
            padded[: shape[0]] = function(index, whole).reshape(shape)
            use(index, padded[over.rank * rows : (over.rank + 1) * rows])
            offset += shard.numel()


def our_step(trainer: Trainer, losses: list[float]) -> StepFn:
    def step(k: int) -> None:
        losses.append(trainer.forward_backward(k).item())
        trainer.optimizer_step()
        trainer.optimizer.zero_grad(set_to_none=True)

    return step


def deepspeed_muon(like: Trainer) -> tuple[StepFn, Any] | str:
    """DeepSpeed's Muon under ZeRO-2 trained like `like` (its step, its engine), or why not."""
    try:
        import deepspeed
    except ImportError:
        return "not installed (pip install -e '.[bench]')"
    deepspeed.utils.logger.setLevel(logging.WARNING)
    cfg, t = like.cfg, like.cfg.train
    seed_everything(t.seed)
    model = build_model(cfg.model)
    takes, _ = split_for_muon(model, list(model.named_parameters()), like.strategy.cfg.block, None, False)
    own_flags = deepspeed.set_optimizer_flags

    def our_split(config: Any, tagged: nn.Module) -> None:
        own_flags(config, tagged)
        for param in tagged.parameters():
            param.use_muon = id(param) in takes

    deepspeed.set_optimizer_flags = our_split  # what deepspeed.initialize calls
    try:
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
            "train_micro_batch_size_per_gpu": t.micro_batch,
            "gradient_accumulation_steps": cfg.grad_accum(like.ctx.world_size),
            "optimizer": {"type": "Muon", "params": {"lr": t.lr, "momentum": cfg.train.muon.momentum,
                                                     "weight_decay": t.weight_decay, "ns_method": "standard"}},
            "zero_optimization": {"stage": 2},
        })
    except Exception as error:  # what DeepSpeed raises on a machine it does not run on varies
        return f"deepspeed.initialize failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
    finally:
        deepspeed.set_optimizer_flags = own_flags

    def step(k: int) -> None:
        indices = like.sampler.micro_batches(k, like.ctx.rank, like.ctx.world_size, t.micro_batch)
        for inputs, targets in like.micro_batches(like.train_set, indices):
            engine.backward(loss_fn(engine(inputs), targets))
            engine.step()

    return step, engine


def bytes_moved(trainer: Trainer) -> int:
    """What this rank's collectives have put through so far (input + output)."""
    sharding = getattr(trainer.strategy, "sharding", None)
    return sharding.bytes_moved if sharding is not None else trainer.strategy.bytes_sent


def run(ctx: DistContext, args: BenchArgs) -> dict[str, Any] | None:
    steps, rounds, micro_batch = args.steps, args.rounds, args.micro_batch
    load_before = os.getloadavg()
    trainers = {name: Trainer(bench_config(strategy, ctx.world_size, micro_batch, steps * 2, *overrides,
                                           preset=args.preset), ctx)
                for name, (strategy, *overrides) in RUNS.items()}
    timed = {}
    for name in ("fsdp-muon", "fsdp-muon-gathered"):
        optimizer = trainers[name].optimizer
        sharding = trainers[name].strategy.sharding
        matrices = optimizer.matrices if name == "fsdp-muon" else GatheredMatrices(sharding, LocalMatrices())
        timed[name] = optimizer.matrices = Timed(matrices)
    losses = {name: [] for name in RUNS}
    steps_of = {name: our_step(trainer, losses[name]) for name, trainer in trainers.items()}
    peer = deepspeed_muon(trainers["fsdp-muon"])
    if not isinstance(peer, str):
        steps_of["deepspeed-zero2-muon"] = peer[0]
    moved_before = {name: bytes_moved(trainer) for name, trainer in trainers.items()}
    seconds_before = {name: (t.apply_s, t.compute_s) for name, t in timed.items()}
    times = alternate(steps_of, steps, rounds)
    taken = {name: len(t) + 2 for name, t in times.items()}  # the 2 warm-up steps each
    per_step = {name: (bytes_moved(trainer) - moved_before[name]) // taken[name] for name, trainer in trainers.items()}
    median = {name: statistics.median(t) for name, t in times.items()}
    shares = {name: {"exchange_and_newton_schulz_s": (t.apply_s - seconds_before[name][0]) / taken[name],
                     "newton_schulz_s": (t.compute_s - seconds_before[name][1]) / taken[name]}
              for name, t in timed.items()}
    every = ctx.all_gather_object((per_step, shares))
    load_after = os.getloadavg()
    dist.barrier()
    if not ctx.is_main:
        return None
    cfg = trainers["fsdp-muon"].cfg
    n_params = sum(p.numel() for p in trainers["ddp-muon"].strategy.module.parameters())
    return {
        "bench": "muon",
        "model": f"gpt {cfg.model.preset}: {cfg.model.n_layer} layers, width {cfg.model.d_model}, seq "
                 f"{cfg.model.seq_len}, {n_params:,} parameters; Newton-Schulz in {cfg.train.muon.ns_dtype}",
        "world_size": ctx.world_size,
        "micro_batch_per_rank": micro_batch,
        "threads_per_rank": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {ctx.backend}, torch {torch.__version__}",
        "load_average_1m": [load_before[0], load_after[0]],
        "runs": {name: {"step_time_s": median[name], "step_times_s": times[name],
                        "first_losses": losses[name][:3] if name in losses else None,
                        "collective_bytes_per_step_per_rank": [moved.get(name) for moved, _ in every],
                        **({"per_rank_s": [share[name] for _, share in every]} if name in shares else {})}
                 for name in times},
        "deepspeed": peer if isinstance(peer, str) else "ran",
        "ratio_fsdp_muon_vs_ddp_muon": median["fsdp-muon"] / median["ddp-muon"],
        "ratio_muon_vs_adamw_fsdp": median["fsdp-muon"] / median["fsdp-adamw"],
        "ratio_owner_vs_gathered": median["fsdp-muon"] / median["fsdp-muon-gathered"],
        "newton_schulz_share_of_fsdp_muon_step": shares["fsdp-muon"]["newton_schulz_s"] / median["fsdp-muon"],
        **({"ratio_fsdp_muon_vs_deepspeed": median["fsdp-muon"] / median["deepspeed-zero2-muon"]}
           if "deepspeed-zero2-muon" in median else {}),
    }


def format_result(result: dict[str, Any]) -> str:
    lines = [f"muon bench: {result['model']}; {result['world_size']} ranks, batch {result['micro_batch_per_rank']} "
             f"per rank; load average {result['load_average_1m'][0]:.1f} -> {result['load_average_1m'][1]:.1f}"]
    for name, entry in result["runs"].items():
        moved = entry["collective_bytes_per_step_per_rank"][0]
        extra = ""
        if "per_rank_s" in entry:
            share = entry["per_rank_s"][0]
            extra = (f"   rank 0: exchange + Newton-Schulz {share['exchange_and_newton_schulz_s'] * 1000:6.1f} ms, "
                     f"Newton-Schulz {share['newton_schulz_s'] * 1000:6.1f} ms")
        counted = f"{moved / 2**20:7.2f} MiB moved" if moved is not None else "      (not counted)"
        lines.append(f"  {name:<22} median step {entry['step_time_s'] * 1000:8.1f} ms   rank 0: {counted}{extra}")
    lines.append(f"  fsdp muon / ddp muon {result['ratio_fsdp_muon_vs_ddp_muon']:.3f} (target <= 1.10); muon / adamw "
                 f"{result['ratio_muon_vs_adamw_fsdp']:.3f}; owner / gathered {result['ratio_owner_vs_gathered']:.3f}; "
                 f"Newton-Schulz {result['newton_schulz_share_of_fsdp_muon_step']:.1%} of the fsdp muon step")
    if "ratio_fsdp_muon_vs_deepspeed" in result:
        lines.append(f"  fsdp muon / DeepSpeed ZeRO-2 muon {result['ratio_fsdp_muon_vs_deepspeed']:.3f}")
    else:
        lines.append(f"  DeepSpeed: {result['deepspeed']}")
    return "\n".join(lines)


if __name__ == "__main__":
    bench_main("muon", run, format_result, rounds=6)
