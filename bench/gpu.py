"""`shardwise bench gpu` (issues 24 and 35): one GPU's measured ceilings, then gpt-2-124m training
(sequence 1024, bf16-mixed, AdamW) under every data-parallel strategy at world 1 and, as rank
0 of PyTorch's fake process group (bench/fake_world.py), at worlds 8 and 64: what the sharding
machinery costs on the host and in copies when communication is free.

- Ceilings: the best of a few bf16 matmuls of 8192 x 8192 (TFLOP/s) and of a 1 GiB device copy
  (GB/s, read plus write).
- World 1 (a real group of one, NCCL): `single` eager and compiled per block (`train.compile`), `ddp`,
  `zero2`, `fsdp`, `fsdp-native`: each step's loss against single's, tokens/s, MFU over the measured
  matmul ceiling and over the datasheet's bf16 peak (H100, H200: planner/devices.py; none for
  another device), `torch.cuda.max_memory_allocated`, and the planner's predicted peak.
- Fake worlds 8 and 64: `fsdp`, `zero2`, `hsdp` (nodes of 8) and `pipeline` (4 stages, 4
  micro-batches) on the same per-rank batch as `single`: step time against single's, peak against
  the planner's.

Each job is its own process. Without CUDA the jobs run on the CPU as a harness check (`shardwise
bench gpu` refuses): no device figures.

    shardwise bench gpu [--steps 10]   (or python -m bench.gpu ... [--worlds 1,8] [--preset tiny] [--json FILE])
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from typing import Any

import torch

from bench import fake_world
from bench.fake_world import device_name, median_step_and_losses, planned_candidate, rank_zero_of, report
from shardwise.config.load import load_config
from shardwise.config.schema import Config

WORLD_ONE = ("single", "ddp", "zero2", "fsdp", "fsdp-native")
WORLDS = (1, 8, 64)  # 1: WORLD_ONE's strategies on the one GPU; more: SHARDED's on a fake world
SHARDED = ("fsdp", "zero2", "hsdp", "pipeline")
NODE, STAGES = 8, 4  # hsdp's ranks per node; the pipeline's stages (and micro-batches per run)
DATASHEET_BF16 = {"H100": "h100-sxm", "H200": "h200"}  # device name contains -> planner preset


def job_config(job: dict[str, Any], out: str) -> Config:
    strategy, world, mb = job["strategy"], job["world"], job["micro_batch"]
    mesh, dp = [f"launch.nproc={world}"], world
    if strategy == "hsdp":
        mesh = [f"launch.nproc={NODE}", f"launch.nnodes={world // NODE}"]
    elif strategy == "pipeline":
        dp = world // STAGES
        mesh = [*mesh, f"parallel.dp={dp}", f"parallel.pp={STAGES}", f"parallel.pipeline.micro_batches={STAGES}"]
    return load_config(None, [
        f"model.preset={job['preset']}", "data.name=synthetic-tokens", f"parallel.strategy={strategy}", *mesh,
        "parallel.precision=bf16-mixed", "train.optimizer=adamw", f"train.micro_batch={mb}",
        f"train.global_batch={dp * mb}", f"train.compile={str(job.get('compile', False)).lower()}",
        f"train.steps={job['steps']}", "train.warmup_steps=0", "train.eval_every=0", f"run.out={out}",
        # A fake group moves no data: what its collectives leave is whatever the memory held, which
        # the bad-step check (health.py) would read as another rank's verdict.
        "train.bad_step=off"])


def predicted_peak(cfg: Config, world: int) -> int | None:
    """The planner's bytes for the busiest rank (no margin); None for FSDP2 (it predicts ours)."""
    from shardwise.planner.memory_model import predict_memory

    candidate = planned_candidate(cfg, world)
    return None if candidate is None else max(rank.total for rank in predict_memory(candidate, cfg, margin=0.0))


def worker(job: dict[str, Any]) -> None:
    from shardwise.trainer import Trainer

    with tempfile.TemporaryDirectory() as out:
        cfg = job_config(job, out)
        ctx = rank_zero_of(job["world"], node=cfg.launch.nproc)
        cuda = ctx.device.type == "cuda"
        trainer = Trainer(cfg, ctx)
        step_s, losses = median_step_and_losses(trainer, job["steps"], warmup=2)
        samples = cfg.train.micro_batch  # a replica's, each step (a pipeline's over its stages)
        stages = cfg.parallel.pp if cfg.parallel.strategy == "pipeline" else 1  # a stage computes its share
        result = {"step_s": step_s, "tokens_per_s": samples * cfg.model.seq_len / step_s,
                  "flops_per_s": (trainer.flops_per_sample or 0) * samples / stages / step_s,
                  "predicted_peak": predicted_peak(cfg, job["world"]),
                  "max_allocated": torch.cuda.max_memory_allocated(ctx.device) if cuda else None,
                  "losses": losses}
        if trainer.strategy.compiler is not None:
            result["compile"] = trainer.strategy.compiler.as_dict()
    report(result)


def ceilings(cuda: bool) -> dict[str, float]:
    """The device's bf16 matmul throughput and copy bandwidth, best of a few runs."""
    device = "cuda" if cuda else "cpu"
    n, copy_bytes = (8192, 2**30) if cuda else (256, 2**24)
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    source = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)

    def best(fn: Any) -> float:
        fn()
        times = []
        for _ in range(5):
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        return min(times)

    return {"matmul_bf16_flops": 2 * n**3 / best(lambda: a @ b),
            "copy_bytes_per_s": 2 * copy_bytes / best(lambda: target.copy_(source))}


def datasheet_bf16(name: str) -> float | None:
    from shardwise.planner.devices import load_profile

    preset = next((p for key, p in DATASHEET_BF16.items() if key in name), None)
    return load_profile(preset).matmul_flops["bf16"] if preset else None


def run(steps: int, preset: str, micro_batch: int, worlds: tuple[int, ...]) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    name = device_name()
    measured = ceilings(cuda)
    peak = datasheet_bf16(name)
    base = {"preset": preset, "micro_batch": micro_batch, "steps": steps}
    # single first (what every job is compared with), then compiled (MFU eager and compiled), then the rest
    jobs = [{**base, "strategy": "single", "world": 1}]
    if 1 in worlds:
        jobs.append({**base, "strategy": "single", "world": 1, "compile": True})
        jobs += [{**base, "strategy": s, "world": 1} for s in WORLD_ONE if s != "single"]
    jobs += [{**base, "strategy": s, "world": w} for w in worlds if w > 1 for s in SHARDED]
    results = []
    for job in jobs:
        print(f"gpu: {job['strategy']} world {job['world']}", file=sys.stderr, flush=True)
        results.append(fake_world.run_job("bench.gpu", job))
    single = next((r for r in results if r["strategy"] == "single" and not r.get("compile") and "step_s" in r), None)
    for r in results:
        if "step_s" not in r:
            continue
        r["mfu_measured"] = r["flops_per_s"] / measured["matmul_bf16_flops"]
        r["mfu_datasheet"] = r["flops_per_s"] / peak if peak else None
        if single is not None:
            r["step_vs_single"] = r["step_s"] / single["step_s"]
            if r["world"] == 1:  # a real world of one: the same losses as single's (a fake world's mean nothing)
                r["loss_vs_single"] = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], single["losses"],
                                                                              strict=True))
    return {"device": name, "torch": torch.__version__, "ceilings": measured, "datasheet_bf16_flops": peak,
            "jobs": results}


def format_result(result: dict[str, Any]) -> str:
    c = result["ceilings"]
    datasheet = (result["datasheet_bf16_flops"] or 0) / 1e12
    lines = [f"gpu bench on {result['device']}: bf16 matmul {c['matmul_bf16_flops'] / 1e12:.1f} TFLOP/s measured "
             f"({datasheet:.0f} datasheet), copy {c['copy_bytes_per_s'] / 1e9:.0f} GB/s",
             f"  {'strategy':<15} {'world':>5} {'tokens/s':>10} {'MFU meas.':>9} {'vs single':>9} {'GiB':>7} "
             f"{'pred.':>7} {'loss diff':>9}"]
    for r in result["jobs"]:
        label = r["strategy"] + ("+compile" if r.get("compile") else "")
        if "step_s" not in r:
            lines.append(f"  {label:<15} {r['world']:>5}  failed: {r.get('error', '')}")
            continue
        gib = f"{r['max_allocated'] / 2**30:.2f}" if r["max_allocated"] else "-"
        pred = f"{r['predicted_peak'] / 2**30:.2f}" if r["predicted_peak"] else "-"
        loss = f"{r['loss_vs_single']:.1e}" if "loss_vs_single" in r else "-"
        lines.append(f"  {label:<15} {r['world']:>5} {r['tokens_per_s']:>10.0f} {r['mfu_measured']:>9.1%} "
                     f"{r.get('step_vs_single', 0):>9.3f} {gib:>7} {pred:>7} {loss:>9}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu")
    parser.add_argument("--steps", type=int, default=10, help="steps per job (the first 2 not timed)")
    parser.add_argument("--preset", default="gpt2-124m", help="the GPT preset to train (at least 4 blocks: the "
                        "pipeline's stages)")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--worlds", default=",".join(map(str, WORLDS)), help="world sizes, comma-separated: 1 times "
                        "every strategy on the GPU alone, a larger one the sharded ones as rank 0 of a fake world "
                        "(single, the reference, always runs)")
    fake_world.bench_entry(parser, worker, lambda args: run(args.steps, args.preset, args.micro_batch, tuple(
        int(w) for w in args.worlds.split(",") if w)), format_result)


if __name__ == "__main__":
    main()
