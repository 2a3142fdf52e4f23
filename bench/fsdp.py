"""`shardwise bench fsdp`: our sharded data parallel (`zero1`, `zero2`, `fsdp`) in bf16-mixed
against PyTorch's FSDP2 (`fsdp-native`) and, where installed, DeepSpeed's ZeRO stages 1, 2 and 3,
with `ddp-native` beside them for scale, in one 2-rank world, all alternating step by step
(A B C ... A B C ...).

Reports each one's median step time; ours / DeepSpeed stage by stage, ours / FSDP2 and ours /
DDP; model-state bytes per rank; and what ours' all-gathers (and reduce-scatters) move per step.
Then, untimed, the model state of ours (`zero1`, `zero2`, `fsdp`, `ddp`) and of DeepSpeed's
stages in fp32, and what ours' all-gathers move there.

DeepSpeed trains the same model from the same seed on the same batches with the same AdamW and
clipping, through `deepspeed.initialize` on the same process group, its bf16 mode (the whole
model in bf16, fp32 master partitions) standing for bf16-mixed.

Model state (parameters, gradients, optimizer state) is counted where each holds the most of
it, between the end of backward and the optimizer step. Ours: `Strategy.memory` after a step,
before the gradients are dropped, as the trainer counts it (our gradients are final when
backward returns). DeepSpeed's: every tensor reachable from its engine, each storage once
(`held_bytes`), at its most over the end of each backward and each moment its torch optimizer is
about to step (it steps one parameter group at a time, and frees a group's gradients on the
way); its gradient-reduction buckets (attributes named `ipg`, sized by `reduce_bucket_size`) are
communication buffers, reported apart. The same walk over our strategy, at the same moments, is
reported beside ours as a check of the count.

`make bench` installs DeepSpeed (`pip install -e '.[bench]'`, torch pinned).
"""

from __future__ import annotations

import gc
import logging
import os
import platform
import statistics
import sys
from typing import Any

import torch

from bench.common import BenchArgs, StepFn, alternate, bench_main, build_trainers
from shardwise.dist import DistContext, seed_everything
from shardwise.memory import local_tensor, storage_key
from shardwise.models import build_model, loss_fn
from shardwise.trainer import Trainer

PRECISION = "bf16-mixed"
OURS = {1: "zero1", 2: "zero2", 3: "fsdp"}  # ZeRO stage -> ours
STRATEGIES = [*OURS.values(), "fsdp-native", "ddp-native"]
MODEL_STATE = ("params", "grads", "optimizer")
# Objects whose attributes the walk follows: DeepSpeed's engine and optimizers, torch's optimizers
# and modules, our strategies. (Not process groups, meshes or loggers.)
WALKED = ("deepspeed", "torch.optim", "torch.nn", "shardwise")


def held_bytes(root: object, buffers: str = "ipg") -> dict[str, int]:
    """Bytes of the distinct storages of every tensor (and parameter gradient) reachable from
    `root` through containers and the attributes of objects of the WALKED packages: `buffers`,
    those reached only through attributes whose name contains `buffers`; `model_state`, the rest."""
    only_buffers: dict[int, tuple[int, bool]] = {}
    visited: set[int] = set()
    stack: list[tuple[object, bool]] = [(root, False)]
    while stack:
        obj, in_buffer = stack.pop()
        if id(obj) in visited:
            continue
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = local_tensor(obj).untyped_storage()
            if obj.device.type != "meta":
                nbytes, was_buffer = only_buffers.get(storage_key(storage), (storage.nbytes(), True))
                only_buffers[storage_key(storage)] = (nbytes, was_buffer and in_buffer)
            if obj.grad is not None:
                stack.append((obj.grad, in_buffer))
        elif isinstance(obj, dict):
            stack += [(item, in_buffer) for pair in obj.items() for item in pair]
        elif isinstance(obj, (list, tuple, set)):
            stack += [(item, in_buffer) for item in obj]
        elif type(obj).__module__.startswith(WALKED) and hasattr(obj, "__dict__"):
            stack += [(value, in_buffer or buffers in name) for name, value in vars(obj).items()]
    return {"model_state": sum(n for n, is_buffer in only_buffers.values() if not is_buffer),
            "buffers": sum(n for n, is_buffer in only_buffers.values() if is_buffer)}


class PeakWalk:
    """The most `held_bytes(root)` counted at any of the moments `note` is called at (and, while
    `watching(optimizer)`, each time the optimizer is about to step: DeepSpeed steps one parameter
    group at a time, freeing each group's fp32 gradients before the next)."""

    def __init__(self, root: object) -> None:
        self.root = root
        self.peak = {"model_state": 0, "buffers": 0}

    def note(self) -> None:
        held = held_bytes(self.root)
        if held["model_state"] > self.peak["model_state"]:
            self.peak = held

    def watching(self, optimizer: torch.optim.Optimizer) -> Any:
        return optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.note())


class DeepSpeedRun:
    """One DeepSpeed ZeRO stage trained like `like`: the same model, seed, batches, AdamW and clipping."""

    def __init__(self, like: Trainer, stage: int, bf16: bool) -> None:
        import deepspeed

        cfg, t = like.cfg, like.cfg.train
        self.like = like
        seed_everything(t.seed)
        model = build_model(cfg.model)
        groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": t.weight_decay},
                  {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config={
            "train_micro_batch_size_per_gpu": t.micro_batch,
            "gradient_accumulation_steps": cfg.grad_accum(like.ctx.world_size),
            "gradient_clipping": t.grad_clip,
            "optimizer": {"type": "AdamW", "params": {"lr": t.lr, "betas": [t.beta1, t.beta2], "torch_adam": True}},
            "zero_optimization": {"stage": stage},
            "bf16": {"enabled": bf16},
        })

    def step(self, k: int, walk: PeakWalk | None = None) -> None:
        """Training step k; with `walk`, noting what the engine holds after each backward."""
        like, t = self.like, self.like.cfg.train
        indices = like.sampler.micro_batches(k, like.ctx.rank, like.ctx.world_size, t.micro_batch)
        for inputs, targets in like.micro_batches(like.train_set, indices):
            self.engine.backward(loss_fn(self.engine(inputs), targets))
            if walk:
                walk.note()
            self.engine.step()

    def model_state(self, k: int) -> dict[str, int]:
        """What the engine holds at its most in step k: after backward, or as its optimizer steps."""
        walk = PeakWalk(self.engine)
        handle = walk.watching(self.engine.basic_optimizer)
        try:
            self.step(k, walk)
        finally:
            handle.remove()
        return walk.peak


def import_deepspeed() -> Any:
    """DeepSpeed (ImportError where it is not installed), imported without MLflow: its autotuner,
    unused here, imports MLflow where installed, 1 s of a rank's CPU, six times the rest of its
    import. With None in MLflow's place in sys.modules, `import mlflow` raises ImportError, which
    DeepSpeed takes as MLflow not installed."""
    hide_mlflow = "mlflow" not in sys.modules
    if hide_mlflow:
        sys.modules["mlflow"] = None
    try:
        import deepspeed
    finally:
        if hide_mlflow:
            del sys.modules["mlflow"]
    return deepspeed


def deepspeed_runs(like: Trainer, bf16: bool) -> dict[int, DeepSpeedRun] | str:
    """A DeepSpeedRun per ZeRO stage; or why there are none."""
    try:
        deepspeed = import_deepspeed()
    except ImportError:
        return "not installed (pip install -e '.[bench]')"
    deepspeed.utils.logger.setLevel(logging.WARNING)
    return {stage: DeepSpeedRun(like, stage, bf16) for stage in OURS}


def ours_at_step(trainer: Trainer, k: int) -> dict[str, Any]:
    """Our strategy's memory after step k, gradients alive (as the trainer counts it); the walk's
    most over the strategy after backward and as the optimizer steps, as a check; and (the sharded
    strategies) what their all-gathers and all their collectives moved in the step."""
    strategy = trainer.strategy
    sharding = getattr(strategy, "sharding", None)  # ours that shard
    moved, gathered = (sharding.bytes_moved, sharding.bytes_gathered) if sharding is not None else (None, None)
    walk = PeakWalk(strategy)
    handle = walk.watching(trainer.optimizer)
    try:
        trainer.forward_backward(k)
        walk.note()
        trainer.optimizer_step()
    finally:
        handle.remove()
    memory = strategy.memory(trainer.activation_bytes).as_dict()
    trainer.optimizer.zero_grad(set_to_none=True)
    result = {"memory": memory, "model_state": sum(memory[key] for key in MODEL_STATE), "walked": walk.peak}
    if gathered is not None:
        result["all_gather_bytes_per_step"] = strategy.sharding.bytes_gathered - gathered
        result["collective_bytes_per_step"] = strategy.sharding.bytes_moved - moved
    return result


def run(ctx: DistContext, args: BenchArgs) -> dict[str, Any] | None:
    steps, rounds, micro_batch = args.steps, args.rounds, args.micro_batch
    load_before = os.getloadavg()
    # What the imports made (half a million objects) lives as long as the process: frozen, the
    # collection between the bf16 and the fp32 runs scans only what came after.
    gc.freeze()
    trainers = build_trainers(ctx, STRATEGIES, steps, micro_batch, f"parallel.precision={PRECISION}",
                              preset=args.preset)
    steps_of: dict[str, StepFn] = {name: trainer.run_step for name, trainer in trainers.items()}
    deepspeed = deepspeed_runs(trainers["zero1"], bf16=True)
    if isinstance(deepspeed, dict):
        steps_of |= {f"deepspeed-zero{stage}": ds.step for stage, ds in deepspeed.items()}
    times = alternate(steps_of, steps, rounds)
    counted = {name: ours_at_step(trainer, 10_000) for name, trainer in trainers.items()}
    if isinstance(deepspeed, dict):
        counted |= {f"deepspeed-zero{stage}": ds.model_state(10_000) for stage, ds in deepspeed.items()}
    n_params = sum(p.numel() for p in trainers["ddp-native"].strategy.module.parameters())
    description = model_description(trainers["zero1"], n_params)
    del trainers, steps_of, deepspeed
    gc.collect()
    fp32 = fp32_model_state(ctx, micro_batch, args.preset)
    load_after = os.getloadavg()
    if not ctx.is_main:
        return None
    median = {name: statistics.median(t) for name, t in times.items()}
    entries = {name: {"step_time_s": median[name], "step_times_s": times[name], **counted[name]} for name in times}
    result = {
        "bench": "fsdp",
        "model": description,
        "precision": PRECISION,
        "world_size": ctx.world_size,
        "micro_batch_per_rank": micro_batch,
        "threads_per_rank": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {ctx.backend}, torch {torch.__version__}",
        "load_average_1m": [load_before[0], load_after[0]],
        "steps_each": len(times["fsdp"]),
        "rounds": rounds,
        "runs": entries,
        "ratio_vs_fsdp_native": median["fsdp"] / median["fsdp-native"],
        "ratio_vs_ddp_native": {name: median[name] / median["ddp-native"] for name in median if name != "ddp-native"},
        "fp32": fp32,
        # what zero1/zero2 all-gather per step against fp32 (which is what they sent in any precision before
        # they kept their whole parameters in the compute dtype)
        "all_gather_vs_fp32": {name: entries[name]["all_gather_bytes_per_step"]
                               / fp32[name]["all_gather_bytes_per_step"] for name in OURS.values()},
    }
    if "deepspeed-zero1" in median:
        result["vs_deepspeed"] = {
            ours: {"step_time_ratio": median[ours] / median[f"deepspeed-zero{stage}"],
                   "model_state_ratio": counted[ours]["model_state"] / counted[f"deepspeed-zero{stage}"]["model_state"]}
            for stage, ours in OURS.items()}
    else:
        result["deepspeed"] = "not installed (pip install -e '.[bench]')"
    return result


def model_description(trainer: Trainer, n_params: int) -> str:
    m = trainer.cfg.model
    return f"gpt {m.preset}: {m.n_layer} layers, width {m.d_model}, seq {m.seq_len}, {n_params:,} parameters"


def fp32_model_state(ctx: DistContext, micro_batch: int, preset: str) -> dict[str, Any]:
    """Model state per rank in fp32 (and ours' all-gather bytes per step), untimed: ours after a
    step, DeepSpeed's at its optimizer step."""
    trainers = build_trainers(ctx, ["zero1", "zero2", "fsdp", "ddp"], 2, micro_batch, "parallel.precision=fp32",
                              preset=preset)
    for trainer in trainers.values():
        trainer.run_step(0)  # the optimizer state exists from the first step on
    out = {name: ours_at_step(trainer, 1) for name, trainer in trainers.items()}
    deepspeed = deepspeed_runs(trainers["zero1"], bf16=False)
    if isinstance(deepspeed, dict):
        for stage, ds in deepspeed.items():
            ds.step(0)
            out[f"deepspeed-zero{stage}"] = ds.model_state(1)
    return {name: _model_state_only(entry) for name, entry in out.items()}


def _model_state_only(entry: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in entry.items() if key != "memory"} | (
        {"by_category": {key: entry["memory"][key] for key in MODEL_STATE}} if "memory" in entry else {})


def format_result(result: dict[str, Any]) -> str:
    def mib(nbytes: int) -> str:
        return f"{nbytes / 2**20:6.1f} MiB"

    lines = [f"fsdp bench: {result['model']}, {result['precision']}, {result['world_size']} ranks x micro-batch "
             f"{result['micro_batch_per_rank']}, {result['steps_each']} steps each, alternating; load average "
             f"{result['load_average_1m'][0]:.1f} -> {result['load_average_1m'][1]:.1f}"]
    for name, entry in result["runs"].items():
        gathers = entry.get("all_gather_bytes_per_step")
        lines.append(f"  {name:<18} median step {entry['step_time_s'] * 1000:8.1f} ms   model state "
                     f"{mib(entry['model_state'])} per rank" + (f"   all-gathers {mib(gathers)} per step"
                                                                 if gathers is not None else ""))
    lines.append(f"  ours fsdp / FSDP2 {result['ratio_vs_fsdp_native']:.3f}")
    if "vs_deepspeed" in result:
        lines += [f"  {ours} / DeepSpeed ZeRO-{stage}: step time {r['step_time_ratio']:.3f}, model state "
                  f"{r['model_state_ratio']:.3f}" for stage, (ours, r) in enumerate(result["vs_deepspeed"].items(), 1)]
    else:
        lines.append(f"  deepspeed: {result['deepspeed']}")
    lines.append("  all-gather bytes per step / fp32's: " + ", ".join(
        f"{name} {ratio:.3f}" for name, ratio in result["all_gather_vs_fp32"].items()))
    lines.append("  fp32 model state per rank: " + ", ".join(
        f"{name} {mib(entry['model_state']).strip()}" for name, entry in result["fp32"].items()))
    return "\n".join(lines)


if __name__ == "__main__":
    # Eight variants: one step each per round (A B C ... A B C ...), so a round lasts seconds, not a
    # minute, and the shared machine's load hits them all alike.
    bench_main("fsdp", run, format_result, rounds=12)
