"""Where a `bench gpu` job's step goes: the job (strategy, world, preset as in bench/gpu.py) warmed
up, then a few steps under torch.profiler. Prints the step's wall time, the busiest operators by
their own host time and by device time, and the host's waits on the device (synchronizations and
device-to-host copies), which keep the host from running ahead of the device, and the
collectives called; writes the tables as JSON.

    python -m bench.gpu_profile --strategy fsdp --world 1 [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from bench.fake_world import rank_zero_of
from bench.gpu import job_config

COLLECTIVES = ("c10d::", "nccl:")
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "Memcpy DtoH")


def rows(events: Any, key: str, top: int) -> list[dict[str, Any]]:
    ordered = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:top]
    return [{"name": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
             "device_ms": getattr(e, "self_device_time_total", 0) / 1e3} for e in ordered]


def profile_job(strategy: str, world: int, preset: str, micro_batch: int, steps: int) -> dict[str, Any]:
    from shardwise.trainer import Trainer

    job = {"strategy": strategy, "world": world, "preset": preset, "micro_batch": micro_batch, "steps": 3 + steps}
    with tempfile.TemporaryDirectory() as out:
        cfg = job_config(job, out)
        ctx = rank_zero_of(world, node=cfg.launch.nproc)
        cuda = ctx.device.type == "cuda"
        trainer = Trainer(cfg, ctx)
        for step in range(3):
            trainer.run_step(step)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            started = time.perf_counter()
            for step in range(3, 3 + steps):
                trainer.run_step(step)
            if cuda:
                torch.cuda.synchronize()
            step_s = (time.perf_counter() - started) / steps
    events = prof.key_averages()
    sort_device = "self_device_time_total" if cuda else "self_cpu_time_total"
    return {"strategy": strategy, "world": world, "preset": preset, "micro_batch": micro_batch, "steps": steps,
            "step_s": step_s, "by_host": rows(events, "self_cpu_time_total", 25),
            "by_device": rows(events, sort_device, 25),
            "waits": [r for r in rows(events, "count", 10_000) if any(w in r["name"] for w in WAITS)],
            "collectives": [r for r in rows(events, "count", 10_000) if r["name"].startswith(COLLECTIVES)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--preset", default="gpt2-124m")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    result = profile_job(args.strategy, args.world, args.preset, args.micro_batch, args.steps)
    print(f"{args.strategy} world {args.world}: {result['step_s'] * 1e3:.1f} ms a step (under the profiler)")
    for title, key in (("by own host time", "by_host"), ("by device time", "by_device"),
                       ("waits on the device", "waits"), ("collectives", "collectives")):
        print(f"  {title}:")
        for r in result[key][:15]:
            print(f"    {r['name'][:60]:60s} {r['calls']:6d} calls {r['self_cpu_ms']:9.2f} ms host "
                  f"{r['device_ms']:9.2f} ms device")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
