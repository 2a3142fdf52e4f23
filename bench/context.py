"""`shardwise bench context`: context parallel on this machine's 4 ranks, against sequence length.

1. The machine is measured (`bench hardware`'s measurements on these 4 ranks, as the planner's
   device profile).
2. For each sequence length, five runs of the same work (4 sequences per step on 4 ranks, one
   sequence per forward): cp 1 (ddp over 4 replicas), and cp 2 and cp 4 in both modes (ring,
   all-to-all), their steps alternating (A B C D E A B C D E). For each: the activation bytes a
   rank saves (the trainer's counter) and the median step time, the planner's prediction of each
   beside it.
3. Ring attention's balance: at cp 4 on the longest sequence, the time each rank's blocks take
   (forward and backward), each rank's computed alone in turn, rounds alternating, medians; for
   the head-tail layout ring attention uses, and for contiguous chunks.
4. The longest sequence one rank can train on this machine at cp 1 and at cp 4, for the GPT
   (whose learned position embedding, its gradient and optimizer state grow with the sequence on
   every rank) and for a Llama of the same sizes (RoPE: nothing of the model grows): the longest
   the planner predicts to fit a rank's memory (the profile's share of this host's). The
   predicted activations are the counted ones at every measured length and the bytes per token
   constant over them, so the prediction extends a line the measurements lie on. A step at that
   length is not run: attention's work grows with its square, and on 2 cores it would take hours.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from typing import Any

import torch

from bench.common import BenchArgs, bench_main
from bench.hardware import measure_profile
from shardwise.config.load import load_config
from shardwise.config.schema import Config
from shardwise.dist import DistContext
from shardwise.measure import measure_candidates
from shardwise.parallel.context import SequenceLayout, ring_attention
from shardwise.parallel.context.ring import RehearsalRing
from shardwise.planner.candidates import Candidate
from shardwise.planner.devices import DeviceProfile
from shardwise.planner.memory_model import predict_memory
from shardwise.planner.timing import predict_step_time

RANKS = 4
SEQ_LENS = (512, 1024, 2048, 4096)
# 4 blocks of width 128 and 8 heads (all-to-all at cp 4 gives each rank 2): attention dominates
# the work from about 1k tokens, as in long-context training.
MODEL = ["model.preset=small", "model.n_layer=4", "model.d_model=128", "model.n_head=8", "model.d_ff=512"]
LONGEST_STEP = 512  # the longest-sequence search's resolution, in tokens


def candidates() -> list[Candidate]:
    """cp 1, 2 and 4 over the 4 ranks, one sequence per forward: the replicas are 4 / cp."""
    plain = Candidate("ddp", RANKS, 1, 1, "fp32", "none", 1)
    return [plain] + [dataclasses.replace(plain, dp=RANKS // cp, cp=cp, cp_mode=mode)
                      for mode in ("ring", "all-to-all") for cp in (2, 4)]


def base_config(seq_len: int, steps: int, model: str = "gpt") -> Config:
    return load_config(None, [*MODEL, f"model.name={model}", f"model.seq_len={seq_len}", "data.name=synthetic-tokens",
                              "run.out=unused",
                              "train.warmup_steps=0", f"train.steps={steps + 2}", "train.micro_batch=1",
                              f"train.global_batch={RANKS}", "parallel.strategy=ddp", f"launch.nproc={RANKS}"])


def against_length(ctx: DistContext, device: DeviceProfile | None, steps: int) -> list[dict[str, Any]]:
    rows = []
    for seq_len in SEQ_LENS:
        base = base_config(seq_len, steps)
        for measured in measure_candidates(ctx, base, candidates(), steps):
            candidate = Candidate(**measured["candidate"])
            cfg = candidate.config(base, ctx.world_size)
            counted = max(rank["activations"] for rank in measured["memory_by_rank"])
            predicted = predict_memory(candidate, cfg)[0].activations
            rows.append({
                "seq_len": seq_len, "cp": candidate.cp, "mode": candidate.cp_mode or "-", "label": candidate.label,
                "activation_bytes": counted, "predicted_activation_bytes": predicted,
                "activation_bytes_per_token": counted / (seq_len / candidate.cp),
                "step_s": measured["measured_step_s"], "step_times_s": measured["step_times_s"],
                "predicted_step_s": predict_step_time(candidate, cfg, device, ctx.world_size).total if device else None,
                "tokens_per_s": RANKS * seq_len / measured["measured_step_s"],
            })
    for row in rows:
        plain = next(r for r in rows if r["seq_len"] == row["seq_len"] and r["cp"] == 1)
        row["activations_vs_cp1_over_cp"] = row["activation_bytes"] / (plain["activation_bytes"] / row["cp"])
        row["time_vs_cp1"] = row["step_s"] / plain["step_s"]
    return rows


def rank_attention_times(seq_len: int, rounds: int) -> dict[str, Any]:
    """Each rank's ring attention blocks at cp 4 (forward and backward) timed alone, ranks in
    turn, `rounds` times; the median per rank, for the head-tail and the contiguous layout."""
    heads = 8
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq_len, 128 // heads, generator=generator) for _ in range(3))
    layouts = {"head-tail": SequenceLayout.head_tail(seq_len, RANKS),
               "contiguous": SequenceLayout.contiguous(seq_len, RANKS)}
    times: dict[str, list[list[float]]] = {name: [[] for _ in range(RANKS)] for name in layouts}
    for _ in range(rounds):
        for name, layout in layouts.items():
            for rank in range(RANKS):
                ring = RehearsalRing(layout, rank)
                local = [layout.shard(t, rank, dim=2).requires_grad_() for t in (q, k, v)]
                out = ring_attention(*local, ring)
                out.backward(torch.ones_like(out))
                times[name][rank].append(ring.stats.compute_s)
    result = {}
    for name, per_rank in times.items():
        medians = [statistics.median(t) for t in per_rank]
        mean = statistics.mean(medians)
        result[name] = {"rank_s": medians, "slowest_vs_mean": max(medians) / mean}
    return result


def longest_sequence(model: str, cp: int, mode: str | None, device: DeviceProfile) -> int:
    """The longest sequence (a multiple of LONGEST_STEP) whose predicted bytes per rank fit the
    profile's memory, one sequence per forward on each of the 4 / cp replicas."""
    candidate = Candidate("ddp", RANKS // cp, 1, 1, "fp32", "none", 1, cp=cp, cp_mode=mode)

    def fits(units: int) -> bool:
        cfg = candidate.config(base_config(units * LONGEST_STEP, 1, model), RANKS)
        return predict_memory(candidate, cfg)[0].total <= device.memory_bytes - device.reserved_bytes

    low, high = 1, 2
    while fits(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low * LONGEST_STEP


def run(ctx: DistContext, args: BenchArgs) -> dict[str, Any] | None:
    steps, rounds = args.steps, args.rounds
    profile = ctx.all_gather_object(measure_profile(ctx))[0]
    device = DeviceProfile(**profile)
    load_before = os.getloadavg()
    started = time.perf_counter()
    rows = against_length(ctx, device, steps)
    balance = rank_attention_times(SEQ_LENS[-1], rounds) if ctx.is_main else None
    ctx.barrier()
    if not ctx.is_main:
        return None
    longest = {}
    for model in ("gpt", "hf-llama"):
        cp1, cp4 = (longest_sequence(model, cp, mode, device) for cp, mode in ((1, None), (4, "ring")))
        longest[model] = {"cp1": cp1, "cp4": cp4, "ratio": cp4 / cp1}
    return {
        "bench": "context",
        "model": f"gpt, {' '.join(MODEL)}, fp32, one sequence per forward, 4 sequences per step on {RANKS} ranks",
        "machine": f"{os.cpu_count()} cores shared by {RANKS} ranks of 1 thread, torch {torch.__version__}",
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "seconds": time.perf_counter() - started,
        "steps_each": steps,
        "device": profile,
        "runs": rows,
        "ring_balance_cp4": {"seq_len": SEQ_LENS[-1], "rounds": rounds, **balance},
        "longest_sequence": {"memory_per_rank_bytes": device.memory_bytes - device.reserved_bytes, **longest},
    }


def format_result(result: dict[str, Any]) -> str:
    load = result["load_average"]
    lines = [f"context bench: {result['model']}; load average {load['before'][0]:.1f} -> {load['after'][0]:.1f}",
             f"  {'seq':>5} {'cp':>2} {'mode':<10} {'activations':>11} {'predicted':>10} {'x cp1/cp':>8} "
             f"{'step ms':>8} {'predicted':>9} {'x cp1':>6}"]
    for row in result["runs"]:
        predicted = row["predicted_step_s"]
        lines.append(
            f"  {row['seq_len']:>5} {row['cp']:>2} {row['mode']:<10} {row['activation_bytes'] / 2**20:>8.2f} MiB "
            f"{row['predicted_activation_bytes'] / 2**20:>6.2f} MiB {row['activations_vs_cp1_over_cp']:>8.3f} "
            f"{row['step_s'] * 1000:>8.0f} {predicted * 1000 if predicted else float('nan'):>9.0f} "
            f"{row['time_vs_cp1']:>6.2f}")
    balance = result["ring_balance_cp4"]
    for name in ("head-tail", "contiguous"):
        ranks = ", ".join(f"{t * 1000:.0f}" for t in balance[name]["rank_s"])
        lines.append(f"  ring attention per rank at cp 4, {balance['seq_len']} tokens, {name}: {ranks} ms; "
                     f"slowest / mean {balance[name]['slowest_vs_mean']:.3f}")
    longest = result["longest_sequence"]
    for model in ("gpt", "hf-llama"):
        gib = longest["memory_per_rank_bytes"] / 2**30
        lines.append(f"  longest sequence in {gib:.2f} GiB per rank, {model}: cp 1 {longest[model]['cp1']:,} tokens, "
                     f"cp 4 (ring) {longest[model]['cp4']:,} ({longest[model]['ratio']:.2f}x)")
    return "\n".join(lines)


if __name__ == "__main__":
    bench_main("context", run, format_result, ranks=RANKS, rounds=7)
