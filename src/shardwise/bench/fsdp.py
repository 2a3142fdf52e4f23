"""`shardwise bench fsdp`: our `fsdp` (ZeRO-3) against PyTorch's FSDP2 (`fsdp-native`), with
`ddp-native` beside them for scale, in one 2-rank world, A B C A B C.

Reports the median step time of each, the ratio ours / FSDP2 and ours / DDP, per-rank bytes by
category for each (after a step, counted from the tensors), and ours' all-gather +
reduce-scatter bus bandwidth per step.
"""

from __future__ import annotations

import platform
import statistics
from typing import Any

import torch

from shardwise.bench.common import alternate, bench_main
from shardwise.dist import DistContext

STRATEGIES = ["fsdp", "fsdp-native", "ddp-native"]


def run(ctx: DistContext, steps: int, rounds: int, micro_batch: int) -> dict[str, Any] | None:
    trainers, times = alternate(ctx, STRATEGIES, steps, rounds, micro_batch)
    ours = trainers["fsdp"].strategy
    moved_before = ours.bytes_moved
    trainers["fsdp"].train_step(10_000).item()  # one more step, to count what it moves
    moved_per_step = ours.bytes_moved - moved_before
    trainers["fsdp"].optimizer.zero_grad(set_to_none=True)
    memory = {}
    for name, trainer in trainers.items():
        trainer.train_step(10_001).item()  # memory is read with gradients alive, as in the trainer
        memory[name] = trainer.strategy.memory(trainer.activation_bytes).as_dict()
        trainer.optimizer.zero_grad(set_to_none=True)
    if not ctx.is_main:
        return None
    median = {name: statistics.median(t) for name, t in times.items()}
    cfg = trainers["fsdp"].cfg
    n_params = sum(p.numel() for p in trainers["ddp-native"].strategy.module.parameters())
    return {
        "bench": "fsdp",
        "model": f"gpt {cfg.model.preset}: {cfg.model.n_layer} layers, width {cfg.model.d_model}, "
                 f"seq {cfg.model.seq_len}, {n_params:,} parameters",
        "world_size": ctx.world_size,
        "micro_batch_per_rank": micro_batch,
        "threads_per_rank": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {ctx.backend}, torch {torch.__version__}",
        "steps_each": len(times["fsdp"]),
        "ours": {"step_time_s": median["fsdp"], "step_times_s": times["fsdp"], "memory": memory["fsdp"],
                 "collective_bytes_per_step": moved_per_step,
                 "collective_gb_per_s": moved_per_step / median["fsdp"] / 1e9},
        "native": {"step_time_s": median["fsdp-native"], "step_times_s": times["fsdp-native"],
                   "memory": memory["fsdp-native"]},
        "ddp_native": {"step_time_s": median["ddp-native"], "step_times_s": times["ddp-native"],
                       "memory": memory["ddp-native"]},
        "ratio": median["fsdp"] / median["fsdp-native"],
        "ratio_vs_ddp": median["fsdp"] / median["ddp-native"],
        "native_ratio_vs_ddp": median["fsdp-native"] / median["ddp-native"],
    }


def format_result(result: dict[str, Any]) -> str:
    def row(label: str, entry: dict[str, Any]) -> str:
        m = entry["memory"]
        held = (m["params"] + m["grads"] + m["optimizer"]) / 2**20
        return (f"  {label:<24} median step {entry['step_time_s'] * 1000:8.1f} ms   params+grads+optimizer "
                f"{held:6.1f} MiB (params {m['params'] / 2**20:.1f}, grads {m['grads'] / 2**20:.1f}, "
                f"optimizer {m['optimizer'] / 2**20:.1f})")

    return "\n".join([
        f"fsdp bench: {result['model']}, {result['world_size']} ranks x micro-batch "
        f"{result['micro_batch_per_rank']}, {result['steps_each']} steps each, alternating",
        row("ours (fsdp)", result["ours"]),
        row("native (fsdp-native)", result["native"]),
        row("ddp-native (for scale)", result["ddp_native"]),
        f"  ratio ours/FSDP2 {result['ratio']:.3f}   ours/DDP {result['ratio_vs_ddp']:.3f}   "
        f"FSDP2/DDP {result['native_ratio_vs_ddp']:.3f}",
        f"  ours moves {result['ours']['collective_bytes_per_step'] / 2**20:.1f} MiB per step in all-gathers and "
        f"reduce-scatters ({result['ours']['collective_gb_per_s']:.2f} GB/s over the step)",
    ])


if __name__ == "__main__":
    bench_main("fsdp", run, format_result)
