"""`shardwise bench recompute`: what each activation-checkpointing policy saves and costs, on
gpt small in one process, the policies' steps alternating (A B C D A B C D).

For each policy: the bytes saved for backward per block (counted with saved-tensor hooks around
each block's forward, averaged over the blocks) and for the whole step, next to the estimate
(`recompute.estimate_saved_bytes`, the Korthikanti et al. count adapted to our block), and the
median step time relative to `none`.
"""

from __future__ import annotations

import platform
import statistics
from typing import Any

import torch
from torch import nn

from bench.common import BenchArgs, alternate, bench_config, bench_main
from shardwise.dist import DistContext
from shardwise.memory import ActivationCounter
from shardwise.models import loss_fn
from shardwise.recompute import estimate_saved_bytes, saved_in_blocks
from shardwise.trainer import Trainer

POLICIES = ["none", "blocks", "every:2", "selective"]


def saved_bytes_per_block(trainer: Trainer) -> list[int]:
    """Bytes each block's forward saves for backward, on one micro-batch."""
    counters = [ActivationCounter(trainer.model) for _ in trainer.model.blocks]
    handles = []
    for block, counter in zip(trainer.model.blocks, counters, strict=True):
        def start(module: nn.Module, args: object, counter: ActivationCounter = counter) -> None:
            counter.__enter__()

        def stop(module: nn.Module, args: object, output: object, counter: ActivationCounter = counter) -> None:
            counter.__exit__(None, None, None)

        handles += [block.register_forward_pre_hook(start), block.register_forward_hook(stop)]
    indices = trainer.sampler.micro_batches(0, 0, 1, trainer.cfg.train.micro_batch)[0]
    inputs, targets = trainer.train_set.batch(indices)
    loss_fn(trainer.model(inputs), targets).backward()
    trainer.optimizer.zero_grad(set_to_none=True)
    for handle in handles:
        handle.remove()
    return [counter.bytes for counter in counters]


def run(ctx: DistContext, args: BenchArgs) -> dict[str, Any]:
    steps, rounds, micro_batch = args.steps, args.rounds, args.micro_batch
    trainers = {p: Trainer(bench_config("single", 1, micro_batch, steps * 2, f"parallel.recompute={p}",
                                        preset=args.preset), ctx)
                for p in POLICIES}
    per_block = {p: saved_bytes_per_block(t) for p, t in trainers.items()}
    times = alternate({p: t.run_step for p, t in trainers.items()}, steps, rounds)
    m = trainers["none"].cfg.model
    median = {p: statistics.median(t) for p, t in times.items()}
    policies = {}
    for policy, trainer in trainers.items():
        estimate = estimate_saved_bytes(m.n_layer, m.d_model, m.seq_len, m.vocab_size, micro_batch, policy)
        policies[policy] = {
            "step_time_s": median[policy], "step_times_s": times[policy],
            "time_vs_none": median[policy] / median["none"],
            "saved_bytes_per_block": statistics.mean(per_block[policy]),
            "estimated_bytes_per_block":
                4 * micro_batch * m.seq_len * m.d_model * saved_in_blocks(m.n_layer, policy) / m.n_layer,
            "saved_bytes_step": trainer.activation_bytes,
            "estimated_bytes_step": estimate,
            "saved_vs_none": trainer.activation_bytes / trainers["none"].activation_bytes,
        }
    return {
        "bench": "recompute",
        "model": f"gpt {m.preset}: {m.n_layer} layers, width {m.d_model}, {m.n_head} heads, seq {m.seq_len}",
        "micro_batch": micro_batch,
        "threads": torch.get_num_threads(),
        "machine": f"{platform.machine()}, torch {torch.__version__}, fp32",
        "steps_each": len(times["none"]),
        "policies": policies,
        "korthikanti_16bit_bytes_per_block":
            micro_batch * m.seq_len * m.d_model * (34 + 5 * m.n_head * m.seq_len / m.d_model),
    }


def format_result(result: dict[str, Any]) -> str:
    lines = [f"recompute bench: {result['model']}, micro-batch {result['micro_batch']}, fp32, "
             f"{result['steps_each']} steps each, alternating"]
    for policy, r in result["policies"].items():
        lines.append(
            f"  {policy:<10} per block {r['saved_bytes_per_block'] / 2**20:6.2f} MiB (estimate "
            f"{r['estimated_bytes_per_block'] / 2**20:6.2f})   step {r['saved_bytes_step'] / 2**20:7.1f} MiB "
            f"= {r['saved_vs_none']:5.1%} of none   time {r['step_time_s'] * 1000:7.1f} ms "
            f"= {r['time_vs_none']:.2f}x none")
    lines.append(f"  Korthikanti et al. per layer, 16-bit, with dropout and unfused attention: "
                 f"{result['korthikanti_16bit_bytes_per_block'] / 2**20:.2f} MiB")
    return "\n".join(lines)


if __name__ == "__main__":
    bench_main("recompute", run, format_result, ranks=1)
