"""`shardwise bench ddp`: our `ddp` against PyTorch's `ddp-native`, in one 2-rank world.

Both are built from the same seed and trained on the same synthetic batches, alternating in
blocks of steps (A B A B ...) so that the machine's drift hits both alike; medians are reported.
Also measured, in the same world:
- overlap, on a 2-sample batch where communication is a large share: the all-reduce of all
  gradient bytes done alone (the whole of it); for ours, the time backward's final callback
  waits for buckets still in flight (hidden = 1 - wait / whole); for both, forward + backward
  with sync minus without (`no_sync`): what syncing costs in all, CPU contention included;
- scaling: `single` on rank 0 (rank 1 waits at a barrier) at the same per-rank batch, against
  `ddp` on both ranks: efficiency = ddp tokens/s / (2 x single tokens/s).

Run under torchrun with 2 ranks: `shardwise bench ddp` does that.
"""

from __future__ import annotations

import platform
import statistics
import time
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from bench.common import BenchArgs, alternate, bench_config, bench_main, build_trainers, timed_steps
from shardwise.dist import DistContext
from shardwise.models import loss_fn
from shardwise.trainer import Trainer


def backward_timings(trainer: Trainer, samples: int, repeats: int) -> dict[str, float]:
    """Medians of forward + backward with and without gradient sync (`no_sync`), interleaved so
    drift hits both, on a small batch so communication is a large share; and, for our ddp, the
    time backward's final callback spent blocked on buckets still in flight."""
    indices = trainer.sampler.rank_indices(0, trainer.ctx.rank, trainer.ctx.world_size)[:samples]
    inputs, targets = trainer.train_set.batch(indices)
    times: dict[bool, list[float]] = {True: [], False: []}
    waits = []
    for _ in range(repeats):
        for sync in (True, False):
            trainer.ctx.barrier()
            started = time.perf_counter()
            with nullcontext() if sync else trainer.strategy.no_sync():
                trainer.strategy.backward(loss_fn(trainer.model(inputs), targets))
            times[sync].append(time.perf_counter() - started)
            trainer.optimizer.zero_grad(set_to_none=True)
            if sync and hasattr(trainer.strategy, "last_wait_s"):
                waits.append(trainer.strategy.last_wait_s)
    result = {"with_sync_s": statistics.median(times[True]), "without_sync_s": statistics.median(times[False])}
    result["exposed_s"] = result["with_sync_s"] - result["without_sync_s"]
    if waits:
        result["wait_after_backward_s"] = statistics.median(waits)
    return result


def all_reduce_seconds(trainer: Trainer, bucket_bytes: int, repeats: int) -> float:
    """Median time to all-reduce all gradient bytes in bucket-sized pieces, nothing else running."""
    numel = sum(p.numel() for p in trainer.strategy.local_parameters())
    pieces = torch.zeros(numel).split(max(1, bucket_bytes // 4))
    times = []
    for _ in range(repeats):
        trainer.ctx.barrier()
        started = time.perf_counter()
        works = [dist.all_reduce(piece, op=dist.ReduceOp.AVG, async_op=True) for piece in pieces]
        for work in works:
            work.wait()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def run(ctx: DistContext, args: BenchArgs) -> dict[str, Any] | None:
    steps, rounds, micro_batch = args.steps, args.rounds, args.micro_batch
    trainers = build_trainers(ctx, ["ddp", "ddp-native"], steps, micro_batch, preset=args.preset)
    times = alternate({name: trainer.run_step for name, trainer in trainers.items()}, steps, rounds)
    per_round = max(1, steps // rounds)

    bucket_bytes = int(trainers["ddp"].cfg.parallel.ddp.bucket_mb * 2**20)
    comm = all_reduce_seconds(trainers["ddp"], bucket_bytes, repeats=5)
    overlap = {name: backward_timings(trainer, samples=2, repeats=10) for name, trainer in trainers.items()}

    single_times = None
    if ctx.is_main:
        single = Trainer(bench_config("single", 1, micro_batch, steps, preset=args.preset),
                         DistContext(0, 1, 0, ctx.device, "gloo"))
        timed_steps(single.run_step, 0, 2)
        single_times = timed_steps(single.run_step, 2, per_round * 2)
    ctx.barrier()  # rank 1 waits here while rank 0 runs single alone
    if not ctx.is_main:
        return None

    cfg = trainers["ddp"].cfg
    tokens_per_rank = micro_batch * cfg.model.seq_len
    ours, native = statistics.median(times["ddp"]), statistics.median(times["ddp-native"])
    single_step = statistics.median(single_times)
    ddp_tokens_per_s = tokens_per_rank * ctx.world_size / ours
    single_tokens_per_s = tokens_per_rank / single_step
    return {
        "bench": "ddp",
        "model": f"gpt {cfg.model.preset}: {cfg.model.n_layer} layers, width {cfg.model.d_model}, "
                 f"seq {cfg.model.seq_len}, {trainers['ddp'].model.num_params():,} parameters",
        "world_size": ctx.world_size,
        "micro_batch_per_rank": micro_batch,
        "threads_per_rank": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {ctx.backend}, torch {torch.__version__}",
        "steps_each": len(times["ddp"]),
        "ours": {"step_time_s": ours, "step_times_s": times["ddp"], "backward": overlap["ddp"],
                 # what the final callback did not have to wait for
                 "hidden_comm_fraction": max(0.0, 1 - overlap["ddp"]["wait_after_backward_s"] / comm)},
        "native": {"step_time_s": native, "step_times_s": times["ddp-native"], "backward": overlap["ddp-native"]},
        "ratio": ours / native,
        "all_reduce_alone_s": comm,
        "scaling": {
            "single_step_time_s": single_step,
            "single_tokens_per_s": single_tokens_per_s,
            "ddp_tokens_per_s": ddp_tokens_per_s,
            "efficiency": ddp_tokens_per_s / (ctx.world_size * single_tokens_per_s),
        },
    }


def format_result(result: dict[str, Any]) -> str:
    s = result["scaling"]
    ours, native = result["ours"]["backward"], result["native"]["backward"]
    return "\n".join([
        f"ddp bench: {result['model']}, {result['world_size']} ranks x micro-batch "
        f"{result['micro_batch_per_rank']}, {result['steps_each']} steps each, A B A B",
        f"  ours   (ddp)        median step {result['ours']['step_time_s'] * 1000:8.1f} ms",
        f"  native (ddp-native) median step {result['native']['step_time_s'] * 1000:8.1f} ms",
        f"  ratio ours/native   {result['ratio']:.3f}",
        f"  overlap (2-sample batch): all-reduce alone {result['all_reduce_alone_s'] * 1000:.1f} ms; ours waits "
        f"{ours['wait_after_backward_s'] * 1000:.1f} ms after backward -> {result['ours']['hidden_comm_fraction']:.0%} "
        f"hidden; sync adds {ours['exposed_s'] * 1000:.1f} ms (ours) vs {native['exposed_s'] * 1000:.1f} ms (native)",
        f"  scaling: {s['ddp_tokens_per_s']:,.0f} tok/s on 2 ranks vs {s['single_tokens_per_s']:,.0f} on 1 "
        f"-> {s['efficiency']:.2f} of linear",
    ])


if __name__ == "__main__":
    bench_main("ddp", run, format_result)
