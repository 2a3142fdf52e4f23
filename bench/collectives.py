"""`shardwise bench collectives`: our ring all-reduce against the backend's, and `ddp`'s gradient
compression against plain `ddp`, in one 2-rank world.

1. All-reduce: `ring_all_reduce` and `dist.all_reduce` (both summing fp32, synchronously, on the
   default group) for messages of 1 KiB to 256 MiB, alternating ours / backend's per repeat,
   each after a barrier. Per size: median times, their ratio, and the bus bandwidth of each
   (nccl-tests' 2 (N - 1) / N x bytes / time).
2. Compression, speed: our `ddp` on gpt small (as `bench ddp`) with the backend's all-reduce,
   our ring, fp16, bf16 and PowerSGD (compressing from the first step), alternating in blocks of
   steps; per variant the median step time against plain `ddp`'s and the bytes each rank sends
   per step.
3. Compression, accuracy: each variant trains gpt-tiny on Shakespeare for 200 steps from the
   same seed (PowerSGD also from its first step and at rank 8, to show what its start step and
   rank buy); per variant the final training loss and the validation loss against plain `ddp`'s.

Run under torchrun with 2 ranks: `shardwise bench collectives` does that.
"""

from __future__ import annotations

import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.common import BenchArgs, alternate, bench_config, bench_main
from shardwise.config.load import load_config
from shardwise.dist import DistContext
from shardwise.parallel.comm import bus_bandwidth, ring_all_reduce
from shardwise.trainer import Trainer

SIZES = [4**k * 2**10 for k in range(10)]  # 1 KiB .. 256 MiB
SPEED_VARIANTS: dict[str, tuple[str, ...]] = {
    "ddp": (),
    "ring": ("parallel.ddp.all_reduce=ring",),
    "fp16": ("parallel.ddp.grad_compression=fp16",),
    "bf16": ("parallel.ddp.grad_compression=bf16",),
    "powersgd": ("parallel.ddp.grad_compression=powersgd", "parallel.ddp.powersgd_start_step=0"),
}
ACCURACY_STEPS = 200
# configs/gpt-tiny.toml's settings, which the tests train PowerSGD with too
GPT_TINY = ("model.preset=tiny", "data.name=shakespeare", "train.global_batch=16", "train.micro_batch=8",
            "train.lr=3e-3", "train.min_lr=3e-4", "train.warmup_steps=10", "train.seed=0")
ACCURACY_VARIANTS: dict[str, tuple[str, ...]] = {
    "ddp": (),
    "ring": ("parallel.ddp.all_reduce=ring",),
    "fp16": ("parallel.ddp.grad_compression=fp16",),
    "bf16": ("parallel.ddp.grad_compression=bf16",),
    "powersgd": ("parallel.ddp.grad_compression=powersgd",),
    "powersgd from step 0": ("parallel.ddp.grad_compression=powersgd", "parallel.ddp.powersgd_start_step=0"),
    "powersgd rank 8": ("parallel.ddp.grad_compression=powersgd", "parallel.ddp.powersgd_rank=8"),
}


def repeats_for(nbytes: int) -> int:
    """Enough repeats for a stable median, within about a second per size and side."""
    return max(5, min(50, 2**28 // nbytes))


def all_reduce_times(ctx: DistContext) -> list[dict[str, float]]:
    ops: dict[str, Callable[[torch.Tensor], object]] = {"ours": ring_all_reduce, "backend": dist.all_reduce}
    rows = []
    for nbytes in SIZES:
        # Ones, not random: each all-reduce doubles them, exactly, and 50 doublings stay finite.
        tensors = {name: torch.ones(nbytes // 4) for name in ops}
        times: dict[str, list[float]] = {name: [] for name in ops}
        for _ in range(repeats_for(nbytes)):
            for name, op in ops.items():
                ctx.barrier()
                started = time.perf_counter()
                op(tensors[name])
                times[name].append(time.perf_counter() - started)
        ours, backend = statistics.median(times["ours"]), statistics.median(times["backend"])
        rows.append({
            "bytes": nbytes, "repeats": len(times["ours"]), "ours_s": ours, "backend_s": backend,
            "ratio": ours / backend,
            "ours_bus_gb_per_s": bus_bandwidth(nbytes, ours, ctx.world_size) / 1e9,
            "backend_bus_gb_per_s": bus_bandwidth(nbytes, backend, ctx.world_size) / 1e9,
        })
    return rows


def compression_speed(ctx: DistContext, args: BenchArgs) -> dict[str, Any]:
    steps, rounds, micro_batch = args.steps, args.rounds, args.micro_batch
    trainers = {name: Trainer(bench_config("ddp", ctx.world_size, micro_batch, steps * 2, *overrides,
                                           preset=args.preset), ctx)
                for name, overrides in SPEED_VARIANTS.items()}
    times = alternate({name: trainer.run_step for name, trainer in trainers.items()}, steps, rounds)
    plain = statistics.median(times["ddp"])
    variants = {}
    for name, trainer in trainers.items():
        stepped = 2 + len(times[name])  # alternate() warms each up with 2 steps
        bytes_per_step = trainer.strategy.bytes_sent / stepped
        variants[name] = {
            "step_time_s": statistics.median(times[name]), "step_times_s": times[name],
            "step_time_vs_ddp": statistics.median(times[name]) / plain,
            "bytes_per_step": bytes_per_step,
            "bytes_vs_ddp": bytes_per_step / (trainers["ddp"].strategy.bytes_sent / (2 + len(times["ddp"]))),
        }
    cfg = trainers["ddp"].cfg
    return {
        "model": f"gpt {cfg.model.preset}: {cfg.model.n_layer} layers, width {cfg.model.d_model}, "
                 f"seq {cfg.model.seq_len}, {trainers['ddp'].model.num_params():,} parameters, "
                 f"micro-batch {micro_batch} per rank",
        "steps_each": len(times["ddp"]),
        "variants": variants,
    }


def compression_accuracy(ctx: DistContext) -> dict[str, Any]:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in ACCURACY_VARIANTS.items():
            cfg = load_config(None, [
                *GPT_TINY, f"run.out={Path(tmp) / name.replace(' ', '-')}", f"train.steps={ACCURACY_STEPS}",
                "train.eval_every=0", "run.log_every=1000", "parallel.strategy=ddp",
                f"launch.nproc={ctx.world_size}", *overrides,
            ])
            summary = Trainer(cfg, ctx).fit()
            results[name] = {"final_loss": summary["final_loss"], "val_loss": summary["val_loss"]}
    for result in results.values():
        result["val_loss_vs_ddp"] = result["val_loss"] / results["ddp"]["val_loss"]
    return {"model": "gpt-tiny on shakespeare (configs/gpt-tiny.toml's settings)", "steps": ACCURACY_STEPS,
            "variants": results}


def run(ctx: DistContext, args: BenchArgs) -> dict[str, Any] | None:
    sizes = all_reduce_times(ctx)
    speed = compression_speed(ctx, args)
    accuracy = compression_accuracy(ctx)
    if not ctx.is_main:
        return None
    large = [row["ratio"] for row in sizes if row["bytes"] >= 2**20]
    return {
        "bench": "collectives",
        "world_size": ctx.world_size,
        "threads_per_rank": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {ctx.backend}, torch {torch.__version__}",
        "all_reduce": sizes,
        "ring_vs_backend_from_1_mib": {"worst": max(large), "median": statistics.median(large)},
        "compression_speed": speed,
        "compression_accuracy": accuracy,
    }


def format_result(result: dict[str, Any]) -> str:
    lines = [f"collectives bench: {result['world_size']} ranks, {result['machine']}",
             "  all-reduce (fp32 sum)   ours (ring)         backend          ours/backend"]
    for row in result["all_reduce"]:
        lines.append(f"  {row['bytes'] / 2**10:>9,.0f} KiB  {row['ours_s'] * 1e3:9.3f} ms "
                     f"{row['ours_bus_gb_per_s']:5.2f} GB/s  {row['backend_s'] * 1e3:9.3f} ms "
                     f"{row['backend_bus_gb_per_s']:5.2f} GB/s  {row['ratio']:5.2f}")
    large = result["ring_vs_backend_from_1_mib"]
    lines.append(f"  from 1 MiB: ours/backend worst {large['worst']:.2f}, median {large['median']:.2f}")
    speed = result["compression_speed"]
    lines.append(f"  ddp variants on {speed['model']}, {speed['steps_each']} steps each, A B A B:")
    for name, v in speed["variants"].items():
        lines.append(f"    {name:<9} step {v['step_time_s'] * 1e3:7.1f} ms ({v['step_time_vs_ddp']:.2f}x ddp)  "
                     f"{v['bytes_per_step'] / 2**20:7.2f} MiB sent per step ({v['bytes_vs_ddp']:.3f}x ddp)")
    accuracy = result["compression_accuracy"]
    lines.append(f"  accuracy on {accuracy['model']}, {accuracy['steps']} steps:")
    for name, v in accuracy["variants"].items():
        lines.append(f"    {name:<22} final loss {v['final_loss']:.4f}  val loss {v['val_loss']:.4f} "
                     f"({v['val_loss_vs_ddp'] - 1:+.1%} vs ddp)")
    return "\n".join(lines)


if __name__ == "__main__":
    bench_main("collectives", run, format_result)
