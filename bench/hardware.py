"""`shardwise bench hardware`: measure this machine as a device profile for `shardwise plan
--device FILE`, on every rank of the current world at once (so ranks share the machine as they
would in training), one thread each:

- dense matmul throughput per compute dtype (fp32, bf16, fp16);
- memory bandwidth (a large copy) and the cost of one small operator recorded by autograd;
- all-reduce, all-gather and reduce-scatter bus bandwidth over the world (ring volumes:
  2(n-1)/n of the buffer for all-reduce, (n-1)/n for the others), a send between two ranks, and
  what a small all-reduce between computations costs (latency and the ranks' skew);
- overlap: how much of an all-reduce hides behind matmuls run while it is in flight.

Rank 0 writes the profile (the median over ranks of each number) as JSON. A quick profile (the
benches that measure one first, in their quick form) runs every measurement once, unwarmed, on
buffers of a MiB: a check that each runs, its numbers rough.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from bench.common import BenchArgs, bench_main
from shardwise.dist import DistContext
from shardwise.parallel.comm import all_gather_single, reduce_scatter_single
from shardwise.planner.devices import DeviceProfile
from shardwise.planner.traces import OpCounter

MATMUL_SIZES = {"fp32": 512, "bf16": 512, "fp16": 128}  # fp16 has no CPU matmul units: small, or it takes minutes
COLLECTIVE_BYTES = 32 * 2**20
COPY_BYTES = 128 * 2**20  # memory bandwidth: far beyond the caches
QUICK_BYTES = 2**20  # a quick profile's buffers, collectives' and copies'


def _seconds(fn: Callable[[], None]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _best_s(fn: Callable[[], None], repeats: int, quick: bool = False) -> float:
    """The fastest of `repeats` runs after one to warm up (allocation, thread pools): on a shared
    machine the others are the neighbours' load. Quick: one run, unwarmed."""
    if quick:
        return _seconds(fn)
    fn()
    return min(_seconds(fn) for _ in range(repeats))


def matmul_flops(dtype: torch.dtype, n: int, quick: bool = False) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / _best_s(lambda: torch.mm(a, b), 7, quick)


def memory_bandwidth(quick: bool = False) -> float:
    source = torch.ones((QUICK_BYTES if quick else COPY_BYTES) // 4)
    target = torch.empty_like(source)
    return 2 * source.numel() * 4 / _best_s(lambda: target.copy_(source), 7, quick)


def op_overhead(quick: bool = False) -> float:
    """What one operator costs beyond its arithmetic in training: forward and backward through a
    deep stack of tiny layers (module calls, autograd nodes, the backward engine), per operator
    of its forward counted as the planner counts them, taking a forward and backward as 3."""
    layers = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()) for _ in range(32)])
    x = torch.ones(2, 8)
    counter = OpCounter()
    with counter:
        layers(x)

    def step() -> None:
        layers(x).sum().backward()

    return _best_s(step, 7, quick) / (3 * counter.ops)


def collective_bandwidths(world: int, quick: bool = False) -> dict[str, float]:
    """Bus bandwidth (bytes/s one rank sends) of each collective over the world."""
    nbytes = QUICK_BYTES if quick else COLLECTIVE_BYTES
    full, shard = torch.ones(nbytes // 4), torch.ones(nbytes // 4 // world)
    timings = {
        "all_reduce": _best_s(lambda: dist.all_reduce(full), 5, quick),
        "all_gather": _best_s(lambda: all_gather_single(full, shard), 5, quick),
        "reduce_scatter": _best_s(lambda: reduce_scatter_single(shard, full), 5, quick),
    }
    factor = {"all_reduce": 2 * (world - 1) / world, "all_gather": (world - 1) / world,
              "reduce_scatter": (world - 1) / world}
    rank = dist.get_rank()

    def ping_pong() -> None:  # ranks 0 and 1, as neighbouring pipeline stages
        if rank < 2:
            (dist.send if rank == 0 else dist.recv)(full, 1 - rank)
            (dist.recv if rank == 0 else dist.send)(full, 1 - rank)

    timings["p2p"] = _best_s(ping_pong, 5, quick) / 2
    factor["p2p"] = 1.0
    return {name: factor[name] * nbytes / seconds for name, seconds in timings.items()}


def latency(world: int, quick: bool = False) -> float:
    """Per ring hop, what a small blocking all-reduce costs between computations of a few
    milliseconds, as tensor parallel and fsdp issue them: the wire's latency and the ranks' skew
    (the first to arrive waits for the other), the median over repeats (quick: one), as training
    meets it."""
    small, a = torch.ones(1024), torch.randn(256, 256)

    def compute() -> None:
        for _ in range(8):
            torch.mm(a, a)

    alone, together = [], []
    compute()
    dist.barrier()
    for _ in range(1 if quick else 30):
        started = time.perf_counter()
        compute()
        alone.append(time.perf_counter() - started)
        started = time.perf_counter()
        compute()
        dist.all_reduce(small)
        together.append(time.perf_counter() - started)
    return max(0.0, statistics.median(together) - statistics.median(alone)) / (2 * (world - 1))


def overlap(quick: bool = False) -> float:
    """Fraction of an all-reduce hidden behind matmuls issued while it runs: 1 means computing
    alongside costs nothing, 0 that the two take as long as one after the other."""
    buffer = torch.ones((QUICK_BYTES if quick else COLLECTIVE_BYTES) // 4)
    a = torch.randn(384, 384)
    communicate = _best_s(lambda: dist.all_reduce(buffer), 3, quick)
    per_matmul = _best_s(lambda: torch.mm(a, a), 5, quick)
    count = max(1, int(communicate / per_matmul))

    def compute() -> None:
        for _ in range(count):
            torch.mm(a, a)

    alone = _best_s(compute, 3, quick)

    def both() -> None:
        work = dist.all_reduce(buffer, async_op=True)
        compute()
        work.wait()

    together = _best_s(both, 3, quick)
    return min(1.0, max(0.0, (alone + communicate - together) / min(alone, communicate)))


def host_memory_per_rank(local_ranks: int) -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // local_ranks


def measure(ctx: DistContext, quick: bool = False) -> dict[str, Any]:
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    flops = {name: matmul_flops(dtypes[name], n, quick) for name, n in MATMUL_SIZES.items()}
    local = {"flops": flops, "memory_bandwidth": memory_bandwidth(quick), "op_overhead_s": op_overhead(quick)}
    if ctx.world_size > 1:
        dist.barrier()
        local |= {"collectives": collective_bandwidths(ctx.world_size, quick),
                  "latency_s": latency(ctx.world_size, quick), "overlap": overlap(quick)}
    return local


def _median_of(values: list[Any]) -> Any:
    if isinstance(values[0], dict):
        return {key: _median_of([v[key] for v in values]) for key in values[0]}
    return statistics.median(values)


def run(ctx: DistContext, args: BenchArgs) -> dict[str, Any] | None:
    """bench_main's entry: the profile takes no steps, rounds or micro-batches."""
    return measure_profile(ctx)


def measure_profile(ctx: DistContext, quick: bool = False) -> dict[str, Any] | None:
    """This machine as a device profile (a DeviceProfile's dict) on rank 0, None on the others;
    quick: every measurement once, on small buffers (a check that it runs, its numbers rough)."""
    every = ctx.all_gather_object(measure(ctx, quick))
    if not ctx.is_main:
        return None
    measured = _median_of(every)
    collectives = measured.get("collectives", {})
    if collectives:  # only ranks 0 and 1 send and receive; the others' p2p timed nothing
        collectives["p2p"] = statistics.median(rank["collectives"]["p2p"] for rank in every[:2])
    bandwidth = collectives.get("all_reduce", measured["memory_bandwidth"])
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world_size))
    share = core_share(local_ranks)
    profile = DeviceProfile(
        name=f"measured-{platform.machine()}-{ctx.world_size}rank", memory_bytes=host_memory_per_rank(local_ranks),
        reserved_bytes=300 * 2**20,  # the Python and torch runtime each rank carries
        matmul_flops=measured["flops"], memory_bandwidth=measured["memory_bandwidth"],
        intra_node_bandwidth=bandwidth, inter_node_bandwidth=bandwidth,
        latency_s=measured.get("latency_s", 0.0), op_overhead_s=measured["op_overhead_s"],
        overlap=measured.get("overlap", 1.0), collective_bandwidth=collectives,
        reduce_scatter_volume=2.0 if ctx.backend == "gloo" else 1.0, gpus_per_node=local_ranks,
        source=f"shardwise bench hardware on {platform.node()}, {ctx.world_size} rank(s), "
               f"{torch.get_num_threads()} thread(s) each; one node, so inter-node is the intra-node figure"
               + (f"; compute x {share:.2f}, the ranks' threads outnumbering the cores" if share < 1 else ""),
    )
    return profile.computing_for(share).to_dict()


def core_share(local_ranks: int) -> float:
    """The share of the time a rank computes when every local rank does at once: below 1 when
    their threads outnumber the cores. (The best-of-N timings above catch a rank alone on a
    core, which training, every rank computing together, does not.)"""
    return min(1.0, len(os.sched_getaffinity(0)) / (local_ranks * torch.get_num_threads()))


def format_result(result: dict[str, Any]) -> str:
    flops = ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in result["matmul_flops"].items())
    collectives = ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in result["collective_bandwidth"].items())
    return (f"{result['name']}: matmul {flops}; memory {result['memory_bandwidth'] / 1e9:.1f} GB/s; "
            f"{result['op_overhead_s'] * 1e6:.1f} us per operator\n"
            f"  collectives (bus bandwidth): {collectives or 'none (one rank)'}; latency "
            f"{result['latency_s'] * 1e6:.0f} us per hop; overlap {result['overlap']:.2f}")


if __name__ == "__main__":
    bench_main("hardware", run, format_result, ranks=int(os.environ.get("WORLD_SIZE", 2)))
