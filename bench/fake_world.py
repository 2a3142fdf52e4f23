"""One GPU standing in for one rank of a large world (the `gpu` and `gpu-scale` benches): PyTorch's
fake process group (`backend="fake"`, `FakeStore`) makes this process rank 0 of `world` ranks
whose collectives return at once without moving data, so the device holds exactly what one rank of
the real world would, and computes what it would; only the communication's time is missing (and the
losses mean nothing: a fake all-gather leaves its output as it found it).

Each job runs in its own process (its own allocator and peak): `run_job` starts
`python -m MODULE --worker JOB` and reads the one result line the worker prints (`report`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from bench import bench_env
from bench.common import write_json
from shardwise.dist import DistContext

if TYPE_CHECKING:
    from shardwise.config.schema import Config
    from shardwise.planner.candidates import Candidate
    from shardwise.trainer import Trainer

RESULT = "FAKE-WORLD-RESULT "  # the line a job prints its measurements on


def rank_zero_of(world: int, node: int | None = None) -> DistContext:
    """This process as rank 0 of a fake world of `world` ranks, on the GPU if there is one (else the
    CPU: a harness check), `node` ranks to a node (what hsdp shards over; torchrun's LOCAL_WORLD_SIZE).
    A world of 1 is a real group (NCCL, or Gloo on the CPU): its collectives run, so its losses are
    single's, where a fake all-gather or reduce-scatter would leave garbage even alone."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ["LOCAL_WORLD_SIZE"] = str(node or world)
    if world == 1:
        backend, store = ("nccl" if device.type == "cuda" else "gloo"), dist.HashStore()
    else:
        backend, store = "fake", FakeStore()
    dist.init_process_group(backend, store=store, rank=0, world_size=world)
    return DistContext(0, world, 0, device, backend)


def planned_candidate(cfg: Config, world: int) -> Candidate | None:
    """The planner's candidate for what `cfg` runs on one rank of `world`: its strategy, mesh (its
    context and expert parallel too), precision, recomputation, micro-batch and pipeline schedule;
    None for FSDP2, which the planner does not model (it predicts ours)."""
    from shardwise.planner.candidates import Candidate

    p = cfg.parallel
    if p.strategy == "fsdp-native":
        return None
    dp, pp, tp = p.mesh_shape(world)
    pipelined = pp > 1 or p.strategy == "pipeline"
    return Candidate(p.strategy, dp, pp, tp, p.precision, p.recompute, cfg.train.micro_batch,
                     p.pipeline.micro_batches if pipelined else 1, p.pipeline.schedule if pipelined else None,
                     shard=cfg.launch.nproc if p.strategy == "hsdp" else None, cp=p.cp,
                     cp_mode=p.cp_mode if p.cp > 1 else None, ep=p.ep)


def median_step_and_losses(trainer: Trainer, steps: int, warmup: int) -> tuple[float, list[float]]:
    """`steps` training steps, each timed to the device's end: the median of those after the first
    `warmup` (the allocator's first requests, the optimizer's state made at the first step, a
    compiled block's first call), and every step's loss."""
    seconds, losses = [], []
    for step in range(steps):
        started = time.perf_counter()
        losses.append(trainer.run_step(step))
        if trainer.ctx.device.type == "cuda":
            torch.cuda.synchronize(trainer.ctx.device)
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds[warmup:] or seconds), losses


def report(result: dict[str, Any]) -> None:
    """A worker's result, for `run_job`; then the fake group is left."""
    print(RESULT + json.dumps(result), flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def run_job(module: str, job: dict[str, Any]) -> dict[str, Any]:
    """`job` run by `module`'s worker in a process of its own; its result beside its settings, or
    `fits: False` and the last line of its error."""
    done = subprocess.run([sys.executable, "-m", module, "--worker", json.dumps(job)], capture_output=True, text=True,
                          env=bench_env())
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode or not lines:
        return {**job, "fits": False, "error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return {**job, **json.loads(lines[-1][len(RESULT):])}


def device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (harness check: no device figures)"


def bench_entry(parser: argparse.ArgumentParser, worker: Callable[[dict[str, Any]], None],
                run: Callable[[argparse.Namespace], dict[str, Any]], format_result: Callable[[dict], str]) -> None:
    """A fake-world bench's main, `parser` holding its own flags: in a job's own process (`--worker
    JOB`, as run_job starts it) the job; else `run` over the parsed flags, its result written to each
    `--json` and printed."""
    parser.add_argument("--json", action="append", default=[], help="write the result here (repeatable)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one job, in its own process
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    result = run(args)
    write_json(result, args.json)
    print(format_result(result), flush=True)
