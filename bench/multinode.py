"""`shardwise bench multinode`: ddp, fsdp and hsdp over 2 nodes of 2 processes (network namespaces
on a bridge, bench/netns.py), with the link between the nodes unlimited, at 1 Gbit/s and at 200
Mbit/s (tc tbf, each way), gpt small on synthetic tokens: tokens/s and communication share,
measured, beside the planner's prediction for the same case. Needs root (namespaces).

Communication share, measured: the time a rank spends blocked in communication (inside a
synchronous collective, or in `.wait()` on an asynchronous one, timed by wrapping
torch.distributed's functions in the workers) over its step time, summed over the measured
steps, averaged over ranks. That is what the planner calls exposed communication: what
overlapping with computation did not hide. Predicted: the planner's `exposed_communication_s /
total` on the device profile `bench hardware` measures in the same world first, its compute
scaled by the host's cores over the ranks (2 nodes x 2 processes share 2 cores here; real nodes
would each have their own), with the link's rate as the inter-node bandwidth (per rank in the
planner, which assumes a NIC per GPU: here a node's ranks share one link, which a ring over all
ranks crosses with one flow each way, hsdp's shard all-reduces with one flow per process);
unlimited, the veth is a memory copy like loopback, so the intra-node bandwidth.

    python -m bench.multinode [--steps N] [--strategies S,..] [--rates R,..] [--preset P] [--quick-profile]
                              [--json FILE]  # as root
The same module is each rank (`worker`), started on every node by netns.run_job.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# What a rank needs is imported here, not in `worker`: each node's ranks are forked from a server
# that imported this module, so a node imports it once, not once a rank.
import torch.distributed as dist

from bench.common import bench_config, write_json
from bench.hardware import measure_profile
from bench.netns import Cluster, LinkRate, parse_rate, run_job, unavailable_reason
from shardwise.dist import init_distributed, leave_process, shutdown_distributed
from shardwise.planner import DeviceProfile
from shardwise.planner.candidates import Candidate
from shardwise.planner.timing import predict_step_time
from shardwise.trainer import Trainer

RATES = (None, "1gbit", "200mbit")
STRATEGIES = ("ddp", "fsdp", "hsdp")
NODES, NPROC = 2, 2
WARMUP_STEPS = 2
# What the ranks call to communicate, wrapped to time how long they block in it.
COLLECTIVES = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_gather_into_tensor",
               "reduce_scatter_tensor", "broadcast", "all_gather", "barrier", "send", "recv")


# --- in each rank ----------------------------------------------------------------------------

class BlockedClock:
    """Seconds this process has spent blocked in communication since the last reset."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def timed(self, call: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(call)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            result = call(*args, **kwargs)
            self.seconds += time.perf_counter() - started
            return TimedWork(result, self) if kwargs.get("async_op") and result is not None else result

        return wrapper


class TimedWork:
    """An asynchronous collective's handle whose wait() is timed."""

    def __init__(self, work: Any, clock: BlockedClock) -> None:
        self._work, self._clock = work, clock

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._clock.seconds += time.perf_counter() - started

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def instrument() -> BlockedClock:
    clock = BlockedClock()
    for name in COLLECTIVES:
        setattr(dist, name, clock.timed(getattr(dist, name)))
    return clock


def case_config(strategy: str, world: int, preset: str, micro_batch: int, steps: int) -> Any:
    return bench_config(strategy, world, micro_batch, steps, f"model.preset={preset}")


def worker(args: argparse.Namespace) -> None:
    """The machine measured as a device profile; then every strategy built once, and at each rate
    (set by the host when rank 0 asks for it) each strategy in turn runs WARMUP_STEPS + args.steps
    steps, timed."""
    ctx = init_distributed("gloo", timeout_s=900, threads_per_rank=1)
    profile = measure_profile(ctx, quick=args.quick_profile)
    clock = instrument()
    strategies, rates = args.strategies.split(","), args.rates.split(",")
    total = len(rates) * (WARMUP_STEPS + args.steps)
    trainers = {name: Trainer(case_config(name, ctx.world_size, args.preset, args.micro_batch, total), ctx)
                for name in strategies}
    link = LinkRate(ctx, Path(args.handshake))
    timings: dict[str, dict[str, list[float]]] = {}
    for index, rate in enumerate(rates):
        link.set(None if rate == "unlimited" else rate)
        for name, trainer in trainers.items():
            steps, blocked = [], []
            for k in range(index * (WARMUP_STEPS + args.steps), (index + 1) * (WARMUP_STEPS + args.steps)):
                ctx.barrier()
                clock.seconds = 0.0
                started = time.perf_counter()
                trainer.train_step(k).item()  # .item() waits for the step to finish
                trainer.optimizer.zero_grad(set_to_none=True)
                steps.append(time.perf_counter() - started)
                blocked.append(clock.seconds)
            timings[f"{name}@{rate}"] = {"step_times_s": steps[WARMUP_STEPS:], "blocked_s": blocked[WARMUP_STEPS:]}
    every = ctx.all_gather_object(timings)
    if ctx.is_main:
        (Path(args.handshake) / "result.json").write_text(json.dumps({"profile": profile, "ranks": every}))
    shutdown_distributed()
    leave_process()


# --- on the host -----------------------------------------------------------------------------

def predict(profile: dict[str, Any], strategy: str, rate: str | None, preset: str, micro_batch: int,
            nproc: int) -> dict[str, float]:
    """The planner's step time and communication for the case, on the measured profile with the link's rate."""
    world = NODES * nproc
    # bench hardware scaled the profile's compute for a node's nproc ranks sharing the cores; here
    # every node's ranks share this host's (a worker runs one thread).
    cores = len(os.sched_getaffinity(0))
    measured = DeviceProfile(**profile).computing_for(min(1.0, cores / world) / min(1.0, cores / nproc))
    link = measured.intra_node_bandwidth if rate is None else parse_rate(rate)
    # The planner's inter-node bandwidth is per rank (a NIC per GPU); here a node's ranks share one
    # link. A ring over all ranks crosses it with one flow each way; hsdp's all-reduces, one per
    # shard, cross it all at once.
    per_rank = link / nproc if strategy == "hsdp" else link
    device = dataclasses.replace(measured, inter_node_bandwidth=per_rank, gpus_per_node=nproc)
    candidate = Candidate(strategy, world, 1, 1, "fp32", "none", micro_batch,
                          shard=nproc if strategy == "hsdp" else None)
    step = predict_step_time(candidate, case_config(strategy, world, preset, micro_batch, 1), device, world)
    return {"step_time_s": step.total, "communication_s": step.communication_s,
            "exposed_communication_s": step.exposed_communication_s,
            "communication_share": step.exposed_communication_s / step.total}


def summarise(ranks: list[dict[str, list[float]]], cfg: Any) -> dict[str, Any]:
    """A case's step time (median), tokens/s and communication share (blocked / step time, summed
    over the steps, averaged over ranks)."""
    step = statistics.median(ranks[0]["step_times_s"])
    return {"step_time_s": step, "tokens_per_s": cfg.train.global_batch * cfg.model.seq_len / step,
            "communication_s": statistics.mean(statistics.median(r["blocked_s"]) for r in ranks),
            "communication_share": statistics.mean(sum(r["blocked_s"]) / sum(r["step_times_s"]) for r in ranks),
            "step_times_s": ranks[0]["step_times_s"]}


def run_bench(steps: int, strategies: tuple[str, ...] = STRATEGIES, rates: tuple[str | None, ...] = RATES,
              preset: str = "small", micro_batch: int = 4, nproc: int = NPROC,
              quick_profile: bool = False) -> dict[str, Any]:
    """Every strategy at every rate, in one job on a cluster of NODES nodes."""
    names = ["unlimited" if rate is None else rate for rate in rates]
    with Cluster(NODES) as cluster:
        result = run_job(cluster, nproc, "bench.multinode",
                        ["worker", "--strategies", ",".join(strategies), "--rates", ",".join(names),
                         "--steps", str(steps), "--preset", preset, "--micro-batch", str(micro_batch),
                         *(["--quick-profile"] if quick_profile else [])])
    timings = {case: [rank[case] for rank in result["ranks"]] for case in result["ranks"][0]}
    cases = []
    for rate in rates:
        for strategy in strategies:
            cfg = case_config(strategy, NODES * nproc, preset, micro_batch, 1)
            cases.append({"strategy": strategy, "rate": rate or "unlimited",
                          "measured": summarise(timings[f"{strategy}@{rate or 'unlimited'}"], cfg),
                          "predicted": predict(result["profile"], strategy, rate, preset, micro_batch, nproc)})
    return {"bench": "multinode", "nodes": NODES, "nproc_per_node": nproc, "model": f"gpt {preset}",
            "micro_batch": micro_batch, "global_batch": micro_batch * NODES * nproc, "steps": steps,
            "device_profile": result["profile"],
            "inter_node_bandwidth": "the link's rate (hsdp: / processes per node); unlimited: the intra-node figure",
            "cases": cases}


def format_result(result: dict[str, Any]) -> str:
    lines = [f"{result['model']}, {result['nodes']} nodes x {result['nproc_per_node']} processes, global batch "
             f"{result['global_batch']}, {result['steps']} steps each",
             f"{'strategy':8} {'link':>9} {'tokens/s':>9} {'step s':>7} {'comm share':>10}   "
             f"{'predicted step s':>16} {'comm share':>10}"]
    for case in result["cases"]:
        m, p = case["measured"], case["predicted"]
        lines.append(f"{case['strategy']:8} {case['rate']:>9} {m['tokens_per_s']:9.0f} {m['step_time_s']:7.3f} "
                     f"{m['communication_share']:10.2f}   {p['step_time_s']:16.3f} {p['communication_share']:10.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.multinode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", nargs="?", default="host", choices=("host", "worker"))
    parser.add_argument("--steps", type=int, default=6, help="measured steps per case (after 2 warm-up steps)")
    parser.add_argument("--json", action="append", default=[], help="write the result here (repeatable)")
    parser.add_argument("--strategies", help=f"comma-separated (default {','.join(STRATEGIES)})")
    parser.add_argument("--rates", help="the link's rates, comma-separated, tc's syntax or `unlimited` (default "
                        "unlimited,1gbit,200mbit)")
    parser.add_argument("--handshake", help=argparse.SUPPRESS)
    parser.add_argument("--preset", default="small", help="the GPT preset the cases train")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--quick-profile", action="store_true", help="measure the device profile once over small "
                        "buffers, not as the best of several (a check that it runs: its predictions rough)")
    args = parser.parse_args(argv)
    if args.role == "worker":
        worker(args)
    else:
        reason = unavailable_reason()
        if reason:
            print(f"shardwise bench multinode: it makes its nodes as network namespaces, and {reason}",
                  file=sys.stderr)
            return 2
        strategies = tuple(args.strategies.split(",")) if args.strategies else STRATEGIES
        rates = tuple(None if r == "unlimited" else r for r in args.rates.split(",")) if args.rates else RATES
        result = run_bench(args.steps, strategies, rates, args.preset, args.micro_batch,
                           quick_profile=args.quick_profile)
        write_json(result, args.json)
        print(format_result(result), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
