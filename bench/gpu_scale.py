"""`shardwise bench gpu-scale` (issues 25 and 36): Llama-3-8B's shapes (configs/llama-3-8b.toml,
random weights) sharded 8, 16 and 64 ways on one GPU, each job one process that is rank 0 of a
world made by PyTorch's fake process group (`backend="fake"`, `FakeStore`): its collectives
return at once without moving data, so one device holds exactly what one rank of the real world
would, and the numbers are that rank's.

Each job: the model built on the meta device and materialised shard by shard by the strategy
(ours `fsdp`, `hsdp` with 8 ranks a node, `fsdp` over tensor parallel 8, and PyTorch's FSDP2 as
`fsdp-native`), bf16-mixed, AdamW, micro-batch 1, recomputation `blocks` or `selective`, a few
steps at a sequence length; measured `torch.cuda.max_memory_allocated` and `memory_reserved`
after setup and over the steps, the strategy's counted bytes, the step time; beside them the
planner's prediction for the same candidate (`predict_memory`, `predict_setup_bytes`). Then the
longest sequence (doubling from 4096) each of ours and FSDP2 trains at world 64.

Losses are meaningless (a fake all-gather leaves its output as it found it); the memory is real.
Without CUDA the jobs run on the CPU (to check the harness; `shardwise bench gpu-scale` refuses):
their device figures are null and only the counted and predicted bytes mean anything.

    shardwise bench gpu-scale [--steps 3]   (or python -m bench.gpu_scale ... [--json FILE])
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from typing import Any

from bench import fake_world
from bench.fake_world import device_name, median_step_and_losses, planned_candidate, rank_zero_of, report
from shardwise.config.load import load_config
from shardwise.config.schema import Config

NODE = 8  # hsdp's ranks per node, and tensor parallel's degree
# (strategy label, world, recompute, sequence): the default jobs (an H100's time for them not measured yet).
DEFAULT_JOBS = [(strategy, world, "blocks", 4096) for world in (8, 16, 64)
                for strategy in ("fsdp", "fsdp-native", "hsdp", "fsdp-tp8")]
DEFAULT_JOBS += [(strategy, 64, "selective", 4096) for strategy in ("fsdp", "fsdp-native")]
DEFAULT_JOBS += [(strategy, 64, "blocks", 8192) for strategy in ("fsdp", "fsdp-native")]
LONGEST_FROM, LONGEST_UP_TO = 4096, 131072


def job_config(job: dict[str, Any], out: str) -> Config:
    """The config of one job: `job["config"]` (Llama-3-8B's by default) trained as one rank of
    `job["world"]` under the job's strategy, recomputation and sequence length."""
    strategy, world = job["strategy"], job["world"]
    mesh, dp = [f"launch.nproc={world}"], world
    if strategy == "fsdp-tp8":
        strategy, mesh, dp = "fsdp", [*mesh, f"parallel.tp={NODE}"], world // NODE
    elif strategy == "hsdp":  # nodes of 8 ranks: hsdp shards over a node's
        mesh = [f"launch.nproc={NODE}", f"launch.nnodes={world // NODE}"]
    return load_config(job["config"], [
        f"parallel.strategy={strategy}", *mesh, "parallel.precision=bf16-mixed",
        f"parallel.recompute={job['recompute']}", f"model.seq_len={job['seq_len']}", "train.optimizer=adamw",
        "train.micro_batch=1", f"train.global_batch={dp}", f"train.steps={job['steps']}", "train.warmup_steps=0",
        "train.eval_every=0", "data.name=synthetic-tokens", f"run.out={out}",
        "train.bad_step=off"])  # a fake group moves no data (bench/gpu.py)


def predicted(cfg: Config, world: int) -> dict[str, int] | None:
    """The planner's bytes for this rank: each category at the steps' peak, and setup's; None for
    FSDP2 (it predicts ours)."""
    from shardwise.planner.memory_model import predict_memory
    from shardwise.planner.model import PlanError
    from shardwise.planner.phases import predict_setup_bytes

    candidate = planned_candidate(cfg, world)
    if candidate is None:
        return None
    try:
        rank = predict_memory(candidate, cfg, margin=0.0)[0]
    except PlanError:
        return None
    return {**rank.as_dict(), "setup": predict_setup_bytes(candidate, cfg)}


def worker(job: dict[str, Any]) -> None:
    """One job: rank 0 of a fake world of `job["world"]`, a few steps, its memory reported."""
    import torch

    from shardwise.trainer import Trainer

    with tempfile.TemporaryDirectory() as out:
        cfg = job_config(job, out)
        ctx = rank_zero_of(job["world"], node=cfg.launch.nproc)
        cuda = ctx.device.type == "cuda"
        result: dict[str, Any] = {"predicted": predicted(cfg, job["world"])}
        try:
            trainer = Trainer(cfg, ctx)
            if cuda:
                result["setup_allocated"] = torch.cuda.max_memory_allocated(ctx.device)
                torch.cuda.reset_peak_memory_stats(ctx.device)
            step_s, _ = median_step_and_losses(trainer, job["steps"], warmup=1)
            result.update(fits=True, step_s=step_s, counted=trainer.memory().as_dict())
            if cuda:
                result.update(max_allocated=torch.cuda.max_memory_allocated(ctx.device),
                              reserved=torch.cuda.memory_reserved(ctx.device))
        except torch.OutOfMemoryError as error:
            result.update(fits=False, error=str(error).splitlines()[0])
    report(result)


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    return fake_world.run_job("bench.gpu_scale", job)


def longest_sequence(strategy: str, world: int, config: str, steps: int) -> dict[str, Any]:
    """The longest sequence, doubling from 4096, that `strategy` trains at `world`."""
    tried = []
    seq_len = LONGEST_FROM
    while seq_len <= LONGEST_UP_TO:
        tried.append(run_job({"strategy": strategy, "world": world, "recompute": "blocks", "seq_len": seq_len,
                              "steps": steps, "config": config}))
        if not tried[-1]["fits"]:
            break
        seq_len *= 2
    fitting = [job["seq_len"] for job in tried if job["fits"]]
    return {"strategy": strategy, "world": world, "longest_seq_len": max(fitting, default=0), "jobs": tried}


def run(steps: int, config: str, jobs: list[tuple[str, int, str, int]], longest: bool) -> dict[str, Any]:
    import torch

    device = device_name()
    results = []
    for strategy, world, recompute, seq_len in jobs:
        print(f"gpu-scale: {strategy} world {world} recompute {recompute} seq {seq_len}", file=sys.stderr, flush=True)
        results.append(run_job({"strategy": strategy, "world": world, "recompute": recompute, "seq_len": seq_len,
                                "steps": steps, "config": config}))
    longest_runs = [longest_sequence(s, 64, config, steps) for s in ("fsdp", "fsdp-native")] if longest else []
    return {"device": device, "torch": torch.__version__, "config": config, "jobs": results, "longest": longest_runs}


def format_result(result: dict[str, Any]) -> str:
    gib = 2**30
    lines = [f"gpu-scale on {result['device']} ({result['config']})",
             f"  {'strategy':<12} {'world':>5} {'recompute':<9} {'seq':>6}  {'allocated':>10} {'reserved':>9} "
             f"{'predicted':>10} {'step s':>7}"]
    for job in result["jobs"]:
        if not job["fits"]:
            lines.append(f"  {job['strategy']:<12} {job['world']:>5} {job['recompute']:<9} {job['seq_len']:>6}  "
                         f"does not fit: {job.get('error', '')}")
            continue
        allocated = f"{job['max_allocated'] / gib:.2f}" if job.get("max_allocated") else "-"
        reserved = f"{job['reserved'] / gib:.2f}" if job.get("reserved") else "-"
        planned = f"{job['predicted']['total'] / gib:.2f}" if job.get("predicted") else "-"
        lines.append(f"  {job['strategy']:<12} {job['world']:>5} {job['recompute']:<9} {job['seq_len']:>6}  "
                     f"{allocated:>10} {reserved:>9} {planned:>10} {job['step_s']:>7.3f}")
    for entry in result["longest"]:
        lines.append(f"  longest sequence at world {entry['world']}, {entry['strategy']}: {entry['longest_seq_len']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_scale")
    parser.add_argument("--steps", type=int, default=3, help="steps each job trains (the first is not timed)")
    parser.add_argument("--config", default="configs/llama-3-8b.toml", help="the model (and data) to shard")
    parser.add_argument("--job", action="append", metavar="STRATEGY:WORLD:RECOMPUTE:SEQ",
                        help="a job to run instead of the default set (repeatable); STRATEGY one of fsdp, "
                        "fsdp-native, hsdp, fsdp-tp8")
    parser.add_argument("--no-longest", action="store_true", help="skip the longest-sequence search at world 64")

    def run_jobs(args: argparse.Namespace) -> dict:
        jobs = DEFAULT_JOBS
        if args.job:
            jobs = [(s, int(w), r, int(n)) for s, w, r, n in (each.split(":") for each in args.job)]
        return run(args.steps, args.config, jobs, not args.no_longest)

    fake_world.bench_entry(parser, worker, run_jobs, format_result)


if __name__ == "__main__":
    main()
