"""`shardwise bench fsdp`: our `fsdp` (ZeRO-3) against PyTorch's FSDP2 (`fsdp-native`), with
`ddp-native` beside them for scale, in one 2-rank world, A B C A B C.

Reports the median step time of each, the ratio ours / FSDP2 and ours / DDP, per-rank bytes by
category for each (after a step, counted from the tensors), and ours' all-gather +
reduce-scatter bus bandwidth per step.

If DeepSpeed is installed (`pip install -e '.[bench]'`), its ZeRO stages 1, 2 and 3 join the
rotation as a second anchor: same model, seed, batches, AdamW and clipping, through
`deepspeed.initialize` on the same process group.
"""

from __future__ import annotations

import logging
import platform
import statistics
from typing import Any

import torch

from shardwise.bench.common import StepFn, alternate, bench_main, build_trainers
from shardwise.dist import DistContext, seed_everything
from shardwise.models import build_model, loss_fn
from shardwise.trainer import Trainer

STRATEGIES = ["fsdp", "fsdp-native", "ddp-native"]


def deepspeed_steps(like: Trainer) -> dict[str, StepFn] | str:
    """A step function per DeepSpeed ZeRO stage, each engine trained like `like`; or why not."""
    try:
        import deepspeed
    except ImportError:
        return "not installed (pip install -e '.[bench]')"
    deepspeed.utils.logger.setLevel(logging.WARNING)
    cfg, ctx = like.cfg, like.ctx
    t = cfg.train
    steps = {}
    for stage in (1, 2, 3):
        seed_everything(t.seed)
        model = build_model(cfg.model)
        groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": t.weight_decay},
                  {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
        engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config={
            "train_micro_batch_size_per_gpu": t.micro_batch,
            "gradient_accumulation_steps": cfg.grad_accum(ctx.world_size),
            "gradient_clipping": t.grad_clip,
            "optimizer": {"type": "AdamW", "params": {"lr": t.lr, "betas": [t.beta1, t.beta2], "torch_adam": True}},
            "zero_optimization": {"stage": stage},
        })

        def step(k: int, engine: Any = engine) -> None:
            indices = like.sampler.micro_batches(k, ctx.rank, ctx.world_size, t.micro_batch)
            for inputs, targets in like.micro_batches(like.train_set, indices):
                engine.backward(loss_fn(engine(inputs), targets))
                engine.step()

        steps[f"deepspeed-zero{stage}"] = step
    return steps


def run(ctx: DistContext, steps: int, rounds: int, micro_batch: int) -> dict[str, Any] | None:
    trainers = build_trainers(ctx, STRATEGIES, steps, micro_batch)
    steps_of = {name: trainer.run_step for name, trainer in trainers.items()}
    deepspeed = deepspeed_steps(trainers["fsdp"])
    if isinstance(deepspeed, dict):
        steps_of |= deepspeed
    times = alternate(steps_of, steps, rounds)
    ours = trainers["fsdp"].strategy
    moved_before = ours.bytes_moved
    trainers["fsdp"].train_step(10_000).item()  # one more step, to count what it moves
    moved_per_step = ours.bytes_moved - moved_before
    trainers["fsdp"].optimizer.zero_grad(set_to_none=True)
    memory = {}
    for name, trainer in trainers.items():
        trainer.train_step(10_001).item()  # memory is read with gradients alive, as in the trainer
        memory[name] = trainer.strategy.memory(trainer.activation_bytes).as_dict()
        trainer.optimizer.zero_grad(set_to_none=True)
    if not ctx.is_main:
        return None
    median = {name: statistics.median(t) for name, t in times.items()}
    cfg = trainers["fsdp"].cfg
    n_params = sum(p.numel() for p in trainers["ddp-native"].strategy.module.parameters())
    return {
        "bench": "fsdp",
        "model": f"gpt {cfg.model.preset}: {cfg.model.n_layer} layers, width {cfg.model.d_model}, "
                 f"seq {cfg.model.seq_len}, {n_params:,} parameters",
        "world_size": ctx.world_size,
        "micro_batch_per_rank": micro_batch,
        "threads_per_rank": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {ctx.backend}, torch {torch.__version__}",
        "steps_each": len(times["fsdp"]),
        "ours": {"step_time_s": median["fsdp"], "step_times_s": times["fsdp"], "memory": memory["fsdp"],
                 "collective_bytes_per_step": moved_per_step,
                 "collective_gb_per_s": moved_per_step / median["fsdp"] / 1e9},
        "native": {"step_time_s": median["fsdp-native"], "step_times_s": times["fsdp-native"],
                   "memory": memory["fsdp-native"]},
        "ddp_native": {"step_time_s": median["ddp-native"], "step_times_s": times["ddp-native"],
                       "memory": memory["ddp-native"]},
        "ratio": median["fsdp"] / median["fsdp-native"],
        "ratio_vs_ddp": median["fsdp"] / median["ddp-native"],
        "native_ratio_vs_ddp": median["fsdp-native"] / median["ddp-native"],
        "deepspeed": deepspeed if isinstance(deepspeed, str) else {
            name: {"step_time_s": median[name], "step_times_s": times[name],
                   "ratio_ours_vs": median["fsdp"] / median[name], "ratio_vs_ddp": median[name] / median["ddp-native"]}
            for name in deepspeed
        },
    }


def format_result(result: dict[str, Any]) -> str:
    def row(label: str, entry: dict[str, Any]) -> str:
        m = entry["memory"]
        held = (m["params"] + m["grads"] + m["optimizer"]) / 2**20
        return (f"  {label:<24} median step {entry['step_time_s'] * 1000:8.1f} ms   params+grads+optimizer "
                f"{held:6.1f} MiB (params {m['params'] / 2**20:.1f}, grads {m['grads'] / 2**20:.1f}, "
                f"optimizer {m['optimizer'] / 2**20:.1f})")

    deepspeed = result["deepspeed"]
    if isinstance(deepspeed, str):
        anchor = [f"  deepspeed: {deepspeed}"]
    else:
        anchor = [f"  {name:<24} median step {entry['step_time_s'] * 1000:8.1f} ms   /DDP "
                  f"{entry['ratio_vs_ddp']:.3f}   ours/it {entry['ratio_ours_vs']:.3f}"
                  for name, entry in deepspeed.items()]
    return "\n".join([
        f"fsdp bench: {result['model']}, {result['world_size']} ranks x micro-batch "
        f"{result['micro_batch_per_rank']}, {result['steps_each']} steps each, alternating",
        row("ours (fsdp)", result["ours"]),
        row("native (fsdp-native)", result["native"]),
        row("ddp-native (for scale)", result["ddp_native"]),
        f"  ratio ours/FSDP2 {result['ratio']:.3f}   ours/DDP {result['ratio_vs_ddp']:.3f}   "
        f"FSDP2/DDP {result['native_ratio_vs_ddp']:.3f}",
        f"  ours moves {result['ours']['collective_bytes_per_step'] / 2**20:.1f} MiB per step in all-gathers and "
        f"reduce-scatters ({result['ours']['collective_gb_per_s']:.2f} GB/s over the step)",
        *anchor,
    ])


if __name__ == "__main__":
    bench_main("fsdp", run, format_result)
