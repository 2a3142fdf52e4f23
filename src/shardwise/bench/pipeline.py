"""`shardwise bench pipeline`: our pipeline on P = 2 stages, GPipe and 1F1B at M = 1, 2, 4 and 8
micro-batches, our `model-parallel`, and torch.distributed.pipelining's ScheduleGPipe and
Schedule1F1B at M = 4 on the same stages, in one 2-rank world, alternating step by step (A B C ...
A B C: 12 rounds of one step by default).

Each step is one pipeline run over a per-replica batch of `--micro-batch` samples (gpt small,
synthetic tokens). Reported per configuration:
- the median step time (schedule, tied-gradient sum and optimizer step);
- the measured bubble of each stage: 1 - (the stage's forward and backward compute time, from
  its own timestamps) / (the schedule's wall time, from a barrier to its end), median over steps,
  against the theory (P-1)/(M+P-1), which assumes equal stages and free messages;
- the most bytes of saved activations each stage held at once, and that as micro-batches in
  flight (peak / the bytes one micro-batch's forward saves on that stage).
Ours / native step-time ratios are taken at M = 4, per schedule, on gpt small and on a
transformers Llama of the same sizes with grouped-query attention (its row: ours and native
GPipe and 1F1B at M = 4, both on the same `Stage`s, the model with the other stage's layers
removed). Neither side clips gradients (torch.distributed.pipelining has no clipping of its own).
The machine's load average before and after is recorded.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from shardwise.bench.common import StepFn, alternate, bench_config, bench_main
from shardwise.bench.tensor import describe
from shardwise.config import Config, validate
from shardwise.dist import DistContext, seed_everything
from shardwise.memory import ActivationCounter
from shardwise.models import build_model, loss_fn
from shardwise.models.plans import locate
from shardwise.strategies.pipeline import Stage
from shardwise.trainer import Trainer, optimizer_factory

STAGES = 2
MICRO_BATCHES = (1, 2, 4, 8)
NATIVE_AT = 4
NATIVE_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
LLAMA = ("model.name=hf-llama", "model.n_kv_head=2")  # gpt small's sizes, 2 key/value heads for its 6 heads


def pipeline_config(strategy: str, schedule: str, micro_batches: int, micro_batch: int, steps: int,
                    *overrides: str) -> Config:
    cfg = bench_config(strategy, STAGES, micro_batch, steps, *overrides)
    cfg.train.global_batch = micro_batch  # one replica: the whole per-replica batch is one pipeline run
    cfg.train.grad_clip = 0.0
    cfg.parallel.schedule, cfg.parallel.micro_batches = schedule, micro_batches
    validate(cfg, world_size=STAGES)
    return cfg


def batch_of(trainer: Trainer, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s batch, the same on both stages (one replica)."""
    (indices,) = trainer.sampler.micro_batches(step, 0, 1, trainer.cfg.train.micro_batch)
    return trainer.train_set.batch(indices)


def our_step(trainer: Trainer, bubbles: dict[int, float]) -> StepFn:
    """A training step that also notes this stage's measured bubble, by step."""

    def step(k: int) -> None:
        trainer.ctx.barrier()
        started = time.perf_counter()
        trainer.forward_backward(k)
        window = time.perf_counter() - started
        busy = sum(end - start for *_, start, end in trainer.strategy.timeline)
        bubbles[k] = 1 - busy / window
        trainer.optimizer_step()
        trainer.optimizer.zero_grad(set_to_none=True)

    return step


def native_step(like: Trainer, schedule: str, peaks: dict[str, int]) -> StepFn:
    """torch.distributed.pipelining on the same stage as `like`'s (same split, seed and batches),
    the tied embedding/head gradient summed between the stages as ours does, the same AdamW."""
    cfg, ctx, ours = like.cfg, like.ctx, like.strategy
    seed_everything(cfg.train.seed)
    model = build_model(cfg.model)
    located = locate(model)
    first_params = {id(p) for m in located.first.values() for p in m.parameters()}
    tied = [p for m in located.last.values() for p in m.parameters() if id(p) in first_params]
    first, last = ours.pp_rank == 0, ours.pp_rank == STAGES - 1
    module = Stage(located, *ours.stage_blocks[ours.pp_rank], first, last)  # the same stage as ours
    stage = PipelineStage(module, ours.pp_rank, STAGES, ctx.device, group=ours.pp_group)
    # scale_grads (the default) divides by M: the gradient of the mean loss, as ours.
    runner = NATIVE_SCHEDULES[schedule](stage, n_microbatches=NATIVE_AT, loss_fn=loss_fn)
    optimizer = optimizer_factory(cfg.train)(module.parameters())

    def step(k: int) -> None:
        inputs, targets = batch_of(like, k)
        ctx.barrier()
        counter = ActivationCounter(module) if k == 0 else nullcontext()  # k = 0: the first warm-up step
        with counter:
            if first:
                runner.step(inputs)
            else:
                runner.step(target=targets, losses=[], return_outputs=False)
        if isinstance(counter, ActivationCounter):
            peaks[schedule] = counter.bytes
        for param in tied:
            dist.all_reduce(param.grad, group=ours.pp_group)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def one_micro_batch_bytes(trainer: Trainer, micro_batch: int) -> int:
    """Bytes one micro-batch's forward saves on this rank's stages, all of them (the last stage's
    with its loss)."""
    ids = torch.randint(0, trainer.cfg.model.vocab_size, (micro_batch, trainer.cfg.model.seq_len))
    total = 0
    for stage in trainer.strategy.stages.values():
        with ActivationCounter(stage) as one:
            out = stage(ids if stage.first else torch.randn(*ids.shape, trainer.cfg.model.d_model,
                                                            requires_grad=True))
            if stage.last:
                loss_fn(out, ids)
        total += one.bytes
    return total


def gather(ctx: DistContext, value: float) -> list[float]:
    return [float(v) for v in ctx.all_gather_object(value)]


def run(ctx: DistContext, steps: int, rounds: int, micro_batch: int) -> dict[str, Any] | None:
    load_before = os.getloadavg()
    configs = {(schedule, m): ("pipeline", schedule, m) for schedule in NATIVE_SCHEDULES for m in MICRO_BATCHES}
    configs["model-parallel", 1] = ("model-parallel", "gpipe", 1)
    trainers = {key: Trainer(pipeline_config(*spec, micro_batch, steps * 2), ctx) for key, spec in configs.items()}
    bubbles: dict[tuple[str, int], dict[int, float]] = {key: {} for key in trainers}
    steps_of = {f"{s}-{m}": our_step(trainer, bubbles[s, m]) for (s, m), trainer in trainers.items()}
    native_peaks: dict[str, int] = {}
    for schedule in NATIVE_SCHEDULES:
        steps_of[f"native-{schedule}"] = native_step(trainers[schedule, NATIVE_AT], schedule, native_peaks)
    # The Llama row: ours and native at M = 4, per schedule, on the same stages.
    llamas = {schedule: Trainer(pipeline_config("pipeline", schedule, NATIVE_AT, micro_batch, steps * 2, *LLAMA), ctx)
              for schedule in NATIVE_SCHEDULES}
    llama_peaks: dict[str, int] = {}
    for schedule, trainer in llamas.items():
        steps_of[f"llama-{schedule}"] = our_step(trainer, {})
        steps_of[f"llama-native-{schedule}"] = native_step(trainer, schedule, llama_peaks)
    times = alternate(steps_of, steps, rounds)
    median = {name: statistics.median(t) for name, t in times.items()}

    ours: dict[str, dict[str, Any]] = {}
    for (schedule, m), trainer in trainers.items():
        measured = statistics.median(b for k, b in bubbles[schedule, m].items() if k >= 2)  # 0, 1: warm-up
        one = one_micro_batch_bytes(trainer, micro_batch // m)
        ours.setdefault(schedule, {})[str(m)] = {
            "step_time_s": median[f"{schedule}-{m}"],
            "bubble_per_stage": gather(ctx, measured),
            "bubble_theory": (STAGES - 1) / (m + STAGES - 1),
            "peak_activation_bytes_per_stage": gather(ctx, trainer.activation_bytes),
            "micro_batches_in_flight_per_stage": gather(ctx, trainer.activation_bytes / one),
        }
    native = {schedule: {"step_time_s": median[f"native-{schedule}"],
                         "peak_activation_bytes_per_stage": gather(ctx, native_peaks[schedule])}
              for schedule in NATIVE_SCHEDULES}
    llama = {schedule: {"ours_step_time_s": median[f"llama-{schedule}"],
                        "native_step_time_s": median[f"llama-native-{schedule}"],
                        "ours_peak_activation_bytes_per_stage": gather(ctx, llamas[schedule].activation_bytes),
                        "native_peak_activation_bytes_per_stage": gather(ctx, llama_peaks[schedule]),
                        "ratio": median[f"llama-{schedule}"] / median[f"llama-native-{schedule}"]}
             for schedule in NATIVE_SCHEDULES}
    if not ctx.is_main:
        return None
    for entries in ours.values():
        for entry in entries.values():
            entry["bubble_mean"] = sum(entry["bubble_per_stage"]) / STAGES
            entry["bubble_minus_theory"] = entry["bubble_mean"] - entry["bubble_theory"]
    cfg = trainers["gpipe", 1].cfg
    n_params = sum(p.numel() for p in build_model(cfg.model).parameters())
    return {
        "bench": "pipeline",
        "model": f"gpt {cfg.model.preset}: {cfg.model.n_layer} layers, width {cfg.model.d_model}, "
                 f"seq {cfg.model.seq_len}, {n_params:,} parameters",
        "stages": STAGES,
        "blocks_per_stage": [stop - start for start, stop in trainers["gpipe", 1].strategy.stage_blocks],
        "batch_per_step": micro_batch,
        "threads_per_rank": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {ctx.backend}, torch {torch.__version__}",
        "steps_each": len(times["gpipe-1"]),
        "rounds": rounds,
        "ours": {schedule: entries for schedule, entries in ours.items() if schedule != "model-parallel"},
        "model_parallel": ours["model-parallel"]["1"],
        "native_at_m4": native,
        "ratio_ours_vs_native_at_m4": {s: ours[s][str(NATIVE_AT)]["step_time_s"] / native[s]["step_time_s"]
                                       for s in NATIVE_SCHEDULES},
        "llama": {"model": describe(llamas["gpipe"].cfg),
                  "blocks_per_stage": [stop - start for start, stop in llamas["gpipe"].strategy.stage_blocks],
                  "at_m4": llama},
        "load_average_before_after": [load_before[0], os.getloadavg()[0]],
    }


def format_result(result: dict[str, Any]) -> str:
    def row(label: str, entry: dict[str, Any]) -> str:
        bubbles = " ".join(f"{b:.3f}" for b in entry["bubble_per_stage"])
        peaks = " ".join(f"{p / 2**20:6.1f}" for p in entry["peak_activation_bytes_per_stage"])
        flight = " ".join(f"{f:.1f}" for f in entry["micro_batches_in_flight_per_stage"])
        return (f"  {label:<16} {entry['step_time_s'] * 1000:8.1f} ms   bubble {bubbles} (theory "
                f"{entry['bubble_theory']:.3f})   saved activations MiB {peaks}   in flight {flight}")

    lines = [f"pipeline bench: {result['model']}, {result['stages']} stages of {result['blocks_per_stage']} blocks, "
             f"batch {result['batch_per_step']} per step, {result['steps_each']} steps each, alternating",
             "  per stage: measured bubble, peak saved activations, micro-batches in flight"]
    for schedule, entries in result["ours"].items():
        lines += [row(f"{schedule} M={m}", entry) for m, entry in entries.items()]
    lines.append(row("model-parallel", result["model_parallel"]))
    for schedule, entry in result["native_at_m4"].items():
        peaks = " ".join(f"{p / 2**20:6.1f}" for p in entry["peak_activation_bytes_per_stage"])
        lines.append(f"  native {schedule} M=4 {entry['step_time_s'] * 1000:8.1f} ms   saved activations MiB {peaks}"
                     f"   ours/native {result['ratio_ours_vs_native_at_m4'][schedule]:.3f}")
    llama = result["llama"]
    lines.append(f"  {llama['model']}, stages of {llama['blocks_per_stage']} blocks, M=4:")
    for schedule, entry in llama["at_m4"].items():
        lines.append(f"    {schedule:<6} ours {entry['ours_step_time_s'] * 1000:8.1f} ms   native "
                     f"{entry['native_step_time_s'] * 1000:8.1f} ms   ours/native {entry['ratio']:.3f}")
    before, after = result["load_average_before_after"]
    lines.append(f"  load average {before:.1f} -> {after:.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    bench_main("pipeline", run, format_result, rounds=12)
