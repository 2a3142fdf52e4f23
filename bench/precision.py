"""`shardwise bench precision`: step time of each precision on gpt small in one process,
alternating (A B C A B C), with the bytes each holds for parameters, gradients, optimizer state
and saved activations. fp16-mixed is left out: CPUs have no fast fp16 matmul (about 20x slower
than fp32 here), so its time would measure the CPU, not the method.
"""

from __future__ import annotations

import platform
import statistics
from typing import Any

import torch

from bench.common import BenchArgs, alternate, bench_config, bench_main
from shardwise.dist import DistContext
from shardwise.trainer import Trainer

PRECISIONS = ["fp32", "bf16-mixed", "bf16-true"]


def run(ctx: DistContext, args: BenchArgs) -> dict[str, Any]:
    steps, rounds, micro_batch = args.steps, args.rounds, args.micro_batch
    trainers = {p: Trainer(bench_config("single", 1, micro_batch, steps * 2, f"parallel.precision={p}",
                                        preset=args.preset), ctx)
                for p in PRECISIONS}
    times = alternate({p: t.run_step for p, t in trainers.items()}, steps, rounds)
    median = {p: statistics.median(t) for p, t in times.items()}
    results = {}
    for precision, trainer in trainers.items():
        trainer.train_step(10_000)  # memory is read with gradients alive, as in the trainer
        results[precision] = {"step_time_s": median[precision], "step_times_s": times[precision],
                              "time_vs_fp32": median[precision] / median["fp32"],
                              "memory": trainer.strategy.memory(trainer.activation_bytes).as_dict()}
    m = trainers["fp32"].cfg.model
    return {
        "bench": "precision",
        "model": f"gpt {m.preset}: {m.n_layer} layers, width {m.d_model}, seq {m.seq_len}",
        "micro_batch": micro_batch,
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()}, torch {torch.__version__}",
        "steps_each": len(times["fp32"]),
        "precisions": results,
    }


def format_result(result: dict[str, Any]) -> str:
    lines = [f"precision bench: {result['model']}, micro-batch {result['micro_batch']}, "
             f"{result['steps_each']} steps each, alternating"]
    for precision, r in result["precisions"].items():
        mem = r["memory"]
        lines.append(
            f"  {precision:<11} median step {r['step_time_s'] * 1000:7.1f} ms = {r['time_vs_fp32']:.2f}x fp32   "
            f"params {mem['params'] / 2**20:5.1f} MiB, grads {mem['grads'] / 2**20:5.1f}, optimizer "
            f"{mem['optimizer'] / 2**20:5.1f}, saved activations {mem['activations'] / 2**20:6.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    bench_main("precision", run, format_result, ranks=1)
