"""`shardwise bench loss`: the cross-entropy computed a chunk of rows at a time
(models/cross_entropy.py) against `F.cross_entropy` on the float32 logits, as the loss was
computed before, in one process, alternating (A B A B).

1. The loss alone, forward and backward, over logits of a few (tokens, vocabulary) shapes in
   bf16 and fp32: the median time of each and, as backward starts, the bytes each holds beyond
   the logits (the chunked loss: the logits' gradient and one float32 chunk; F.cross_entropy: its
   float32 log-softmax and two float32 gradients).
2. Whole training steps of gpt small with a 32,000-token vocabulary under `single`, bf16-mixed,
   the trainer's loss swapped for each in turn: the median step time.
"""

from __future__ import annotations

import platform
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import shardwise.trainer as trainer_module
from bench.common import BenchArgs, StepFn, alternate, bench_config, bench_main
from shardwise.dist import DistContext
from shardwise.models import cross_entropy
from shardwise.models.cross_entropy import IGNORE, cross_entropy_sum
from shardwise.trainer import Trainer

SHAPES = [(4096, 32000), (2048, 128256)]  # (tokens, vocabulary): gpt small's 8 x 512, a Llama-3's sequence


def native_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss as models.loss_fn computed it before the chunked one."""
    return F.cross_entropy(logits.float(), targets, reduction="sum")


def native_loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    flat = targets.reshape(-1)
    return native_sum(logits.reshape(-1, logits.shape[-1]), flat) / (flat != IGNORE).sum().clamp(min=1)


def held_at_backward(tokens: int, vocab: int, dtype: torch.dtype) -> dict[str, int]:
    """Bytes beyond the logits live as each loss's backward starts."""
    gradient = tokens * vocab * torch.empty((), dtype=dtype).element_size()
    rows = min(tokens, cross_entropy.chunk_rows(vocab))
    # F.cross_entropy's float32 copy of bf16 logits is freed after the forward (its cast saves nothing)
    return {"ours": gradient + rows * vocab * 4, "native": 3 * tokens * vocab * 4}


def loss_step(fn: Callable, logits: torch.Tensor, targets: torch.Tensor) -> StepFn:
    """One forward and backward of `fn` over `logits` (a step of bench.common's kind)."""
    return lambda _: fn(logits.detach().requires_grad_(), targets).backward()


def loss_alone(steps: int, rounds: int) -> list[dict[str, Any]]:
    rows = []
    for tokens, vocab in SHAPES:
        for dtype in (torch.bfloat16, torch.float32):
            logits = torch.randn(tokens, vocab).to(dtype)
            targets = torch.randint(0, vocab, (tokens,))
            times = alternate({"ours": loss_step(cross_entropy_sum, logits, targets),
                               "native": loss_step(native_sum, logits, targets)}, steps, rounds)
            ours, native = (statistics.median(times[name]) for name in ("ours", "native"))
            rows.append({"tokens": tokens, "vocab": vocab, "dtype": str(dtype).removeprefix("torch."),
                         "ours_s": ours, "native_s": native, "ours_over_native": ours / native,
                         "held_at_backward": held_at_backward(tokens, vocab, dtype)})
    return rows


def whole_steps(ctx: DistContext, steps: int, rounds: int, micro_batch: int) -> dict[str, Any]:
    cfg = bench_config("single", 1, micro_batch, steps + 2, "model.preset=small", "model.vocab_size=32000",
                       "parallel.precision=bf16-mixed", "data.name=synthetic-tokens")
    trainer = Trainer(cfg, ctx)
    ours = trainer_module.loss_fn

    def step_with(fn: Callable) -> StepFn:
        def step(k: int) -> None:
            trainer_module.loss_fn = fn
            trainer.run_step(k)
        return step

    try:
        times = alternate({"ours": step_with(ours), "native": step_with(native_loss_fn)}, steps, rounds)
    finally:
        trainer_module.loss_fn = ours
    ours_s, native_s = (statistics.median(times[name]) for name in ("ours", "native"))
    return {"model": "gpt small, vocabulary 32000", "micro_batch": micro_batch,
            "tokens": micro_batch * cfg.model.seq_len, "ours_s": ours_s, "native_s": native_s,
            "ours_over_native": ours_s / native_s}


def run(ctx: DistContext, args: BenchArgs) -> dict[str, Any]:
    steps, rounds, micro_batch = args.steps, args.rounds, args.micro_batch
    return {"machine": platform.machine(), "threads": torch.get_num_threads(), "steps": steps,
            "chunk_elements": cross_entropy.CHUNK_ELEMENTS, "loss_alone": loss_alone(steps, rounds),
            "whole_steps": whole_steps(ctx, steps, rounds, micro_batch)}


def format_result(result: dict[str, Any]) -> str:
    mib = 2**20
    lines = [f"{'tokens':>7} {'vocab':>7} {'dtype':>9} {'ours s':>8} {'native s':>9} {'ratio':>6} "
             f"{'held MiB ours':>14} {'native':>7}"]
    for r in result["loss_alone"]:
        held = r["held_at_backward"]
        lines.append(f"{r['tokens']:>7} {r['vocab']:>7} {r['dtype']:>9} {r['ours_s']:>8.3f} {r['native_s']:>9.3f} "
                     f"{r['ours_over_native']:>6.3f} {held['ours'] / mib:>14.0f} {held['native'] / mib:>7.0f}")
    w = result["whole_steps"]
    lines.append(f"whole steps ({w['model']}, micro-batch {w['micro_batch']}): ours {w['ours_s']:.3f} s, "
                 f"native {w['native_s']:.3f} s, ours/native {w['ours_over_native']:.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    bench_main("loss", run, format_result, ranks=1)
