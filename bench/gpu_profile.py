"""Where a `bench gpu` job's step goes: the job (strategy, world, preset as in bench/gpu.py) warmed
up, then a few steps under torch.profiler. Prints the step's wall time, the busiest operators by
their own host time and by device time, and the host's waits on the device (synchronizations and
device-to-host copies), which keep the host from running ahead of the device, and the
collectives called; writes the tables as JSON.

With `--memory`, what the step's memory peak is made of instead: one step under the profiler's
memory timeline, the bytes live at its peak by what they are (parameters, optimizer state,
activations, gradients, autograd's own, ...) beside the planner's categories. `--scale-job` takes
a `bench gpu-scale` job (Llama-3-8B's shapes as one rank of a fake world) in place of a GPT preset.

    python -m bench.gpu_profile --strategy fsdp --world 1 [--compile] [--json OUT.json]
    python -m bench.gpu_profile --memory --strategy single [--json OUT.json]
    python -m bench.gpu_profile --memory --scale-job fsdp:64:blocks:4096 [--scale-config FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.profiler import ProfilerActivity, profile

from bench import gpu, gpu_scale
from bench.fake_world import planned_candidate, rank_zero_of, report

if TYPE_CHECKING:
    from shardwise.config.schema import Config
    from shardwise.trainer import Trainer

COLLECTIVES = ("c10d::", "nccl:")
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "Memcpy DtoH")


def rows(events: Any, key: str, top: int) -> list[dict[str, Any]]:
    ordered = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:top]
    return [{"name": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
             "device_ms": getattr(e, "self_device_time_total", 0) / 1e3} for e in ordered]


@contextlib.contextmanager
def warmed_up(job: dict[str, Any], scale: bool, warmup: int) -> Iterator[tuple[Config, Trainer, Path]]:
    """`job` (a `bench gpu` job, or with `scale` a `bench gpu-scale` one) as rank 0 of its world,
    after `warmup` steps: its config, its trainer and its run directory, removed on leaving."""
    from shardwise.trainer import Trainer

    with tempfile.TemporaryDirectory() as out:
        cfg = (gpu_scale if scale else gpu).job_config(job, out)
        trainer = Trainer(cfg, rank_zero_of(job["world"], node=cfg.launch.nproc))
        for step in range(warmup):
            trainer.run_step(step)
        yield cfg, trainer, Path(out)


def activities(trainer: Trainer) -> list[ProfilerActivity]:
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.ctx.device.type == "cuda" else [])


def profile_job(strategy: str, world: int, preset: str, micro_batch: int, steps: int,
                compile_blocks: bool = False) -> dict[str, Any]:
    job = {"strategy": strategy, "world": world, "preset": preset, "micro_batch": micro_batch, "steps": 3 + steps,
           "compile": compile_blocks}
    with warmed_up(job, scale=False, warmup=3) as (_, trainer, _):
        cuda = trainer.ctx.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=activities(trainer)) as prof:
            started = time.perf_counter()
            for step in range(3, 3 + steps):
                trainer.run_step(step)
            if cuda:
                torch.cuda.synchronize()
            step_s = (time.perf_counter() - started) / steps
    events = prof.key_averages()
    every = rows(events, "count", len(events))
    sort_device = "self_device_time_total" if cuda else "self_cpu_time_total"
    return {"strategy": strategy, "world": world, "preset": preset, "micro_batch": micro_batch, "steps": steps,
            "compile": compile_blocks, "step_s": step_s, "by_host": rows(events, "self_cpu_time_total", 25),
            "by_device": rows(events, sort_device, 25),
            "waits": [r for r in every if any(w in r["name"] for w in WAITS)],
            "collectives": [r for r in every if r["name"].startswith(COLLECTIVES)]}


def memory_at_peak(job: dict[str, Any], scale: bool) -> dict[str, Any]:
    """One step of `job` (a `bench gpu` job, or with `scale` a `bench gpu-scale` one) after two,
    under the profiler's memory timeline: the bytes live at the step's peak by category, beside
    the planner's prediction (no margin) and, on a GPU, the allocator's peak."""
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX

    from shardwise.planner.memory_model import predict_memory

    names = ["unknown" if c is None else c.name.lower() for c in _CATEGORY_TO_INDEX]
    with warmed_up({**job, "steps": 3}, scale, warmup=2) as (cfg, trainer, out):
        device = trainer.ctx.device
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        with profile(activities=activities(trainer), profile_memory=True, record_shapes=True, with_stack=True) as prof:
            trainer.run_step(2)
        timeline = out / "timeline.json"
        prof.export_memory_timeline(str(timeline), device=f"{device.type}:0" if cuda else "cpu")
        _, sizes = json.loads(timeline.read_text())
    at_peak = max(sizes, key=sum)[1:]  # the first column is always 0
    candidate = planned_candidate(cfg, job["world"])
    planned = predict_memory(candidate, cfg, margin=0.0)[0].as_dict() if candidate is not None else None
    return {**job, "peak": sum(at_peak), "at_peak": dict(zip(names, at_peak, strict=True)), "predicted": planned,
            "max_allocated": torch.cuda.max_memory_allocated(device) if cuda else None,
            "counted_activations": trainer.activation_bytes}


def worker(job: dict[str, Any]) -> None:
    """`job`'s memory profile (a gpu-scale job where it names a sequence length, else a gpu one),
    printed and reported as bench.fake_world's jobs report theirs."""
    result = memory_at_peak(job, scale="seq_len" in job)
    print_memory(result)
    report(result)


def print_memory(result: dict[str, Any]) -> None:
    gib = 2**30
    label = result.get("preset") or result.get("config")
    print(f"{result['strategy']} world {result['world']} ({label}): the step's peak {result['peak'] / gib:.3f} GiB"
          + (f", the allocator's {result['max_allocated'] / gib:.3f}" if result["max_allocated"] else ""))
    print("  live at the peak: " + ", ".join(f"{k} {v / gib:.3f}" for k, v in result["at_peak"].items() if v))
    if result["predicted"]:
        print("  the planner:      " + ", ".join(f"{k} {v / gib:.3f}" for k, v in result["predicted"].items() if v))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--preset", default="gpt2-124m")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="each block compiled (train.compile)")
    parser.add_argument("--memory", action="store_true", help="what the step's memory peak is made of")
    parser.add_argument("--scale-job", help="a gpu-scale job, STRATEGY:WORLD:RECOMPUTE:SEQ (with --memory)")
    parser.add_argument("--scale-config", default="configs/llama-3-8b.toml", help="the gpu-scale job's model")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.memory:
        if args.scale_job:
            strategy, world, recompute, seq_len = args.scale_job.split(":")
            job = {"strategy": strategy, "world": int(world), "recompute": recompute, "seq_len": int(seq_len),
                   "config": args.scale_config}
        else:
            job = {"strategy": args.strategy, "world": args.world, "preset": args.preset,
                   "micro_batch": args.micro_batch}
        result = memory_at_peak(job, scale=bool(args.scale_job))
        print_memory(result)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return
    result = profile_job(args.strategy, args.world, args.preset, args.micro_batch, args.steps, args.compile)
    label = args.strategy + (", compiled" if args.compile else "")
    print(f"{label} world {args.world}: {result['step_s'] * 1e3:.1f} ms a step (under the profiler)")
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
