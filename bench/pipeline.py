"""`shardwise bench pipeline`: every schedule of ours (gpipe, 1f1b, interleaved-1f1b, zb-h1, zbv,
dualpipev) on P = 2 and 4 stages at M = 4, 8 and 16 micro-batches, each against
torch.distributed.pipelining's schedule of the same name on the same stages (ScheduleGPipe,
Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble for zb-h1, ScheduleZBVZeroBubble,
ScheduleDualPipeV), and our `model-parallel`; one world of P ranks per P (the command is a driver
that launches both), every configuration in turn step by step (A B C ... A B C).

Each step is one pipeline run over a per-replica batch of `--micro-batch` samples (a GPT of 8
blocks, so that 4 ranks hold 2 stages each; synthetic tokens). Reported per configuration:
- the median step time (schedule, tied-gradient sum, optimizer step), ours and native, and their
  ratio;
- the measured bubble of each rank: 1 - (the rank's compute time, the sum of its F, B, W and BW
  actions' durations from their own timestamps) / (the step's pipeline window: from the barrier
  that starts it to the last compute of any rank; one monotonic clock on one machine), median
  over steps; the mean over ranks is the run's bubble, as the simulator defines it;
- the simulator's bubble for the same schedule with each stage's measured median F, B, W (or BW)
  durations and free messages (`predicted`), and with equal stages (`ideal`);
- the most bytes of saved activations each rank held at once, ours and native, and ours as
  micro-batches of the rank's layers in flight (the peak over one micro-batch's forward).
Neither side clips gradients (torch.distributed.pipelining has no clipping of its own). The load
average before and after is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from bench.common import StepFn, alternate, bench_config, write_json
from bench.tensor import describe
from shardwise.config.schema import Config, LaunchConfig
from shardwise.dist import DistContext, init_distributed, leave_process, seed_everything, shutdown_distributed
from shardwise.memory import ActivationCounter
from shardwise.models import build_model, loss_fn
from shardwise.models.plans import locate
from shardwise.parallel.pipeline.schedules import BW, ScheduleError, check_micro_batches, virtual_stages
from shardwise.parallel.pipeline.simulate import Costs, simulate
from shardwise.parallel.pipeline.stages import Stage, separate
from shardwise.trainer import Trainer, optimizer_factory
from shardwise.validate import validate

STAGES = (2, 4)
MICRO_BATCHES = (4, 8, 16)
NATIVE = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B,
          "zb-h1": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}
# 8 blocks: 4 ranks x 2 virtual stages of one block each. Width 256, so that an action (5 to 40 ms
# here) dwarfs the executor's bookkeeping between actions, which the measured bubble counts as idle
# (at width 128, 1 to 10 ms actions put it 0.1 to 0.2 above the simulator's at M = 16); still
# narrow enough for both worlds' ~80 configurations (ours and native) to step 6 times each in
# about 12 minutes on 2 cores.
MODEL = ("model.preset=small", "model.n_layer=8", "model.n_head=4", "model.d_model=256", "model.seq_len=128")
LLAMA = ("model.name=hf-llama", "model.n_kv_head=2")  # the same sizes, 2 key/value heads for its 4 heads
LLAMA_AT = (2, 8)  # P, M: every schedule on the Llama too, there
# torch 2.13's V-shaped schedules stop in their first step on the transformers Llama: on rank 1
# (stages 1 and 2) stage_backward_input's `t.detach_()` raises "Can't detach views in-place", and
# rank 0 loses its peer. Ours runs them (tests/test_pipeline_parity.py).
NATIVE_FAILS_ON_LLAMA = {"zbv": "RuntimeError in stage_backward_input: Can't detach views in-place",
                         "dualpipev": "RuntimeError in stage_backward_input: Can't detach views in-place"}


def pipeline_config(strategy: str, stages: int, schedule: str, micro_batches: int, micro_batch: int,
                    steps: int, *overrides: str) -> Config:
    cfg = bench_config(strategy, stages, micro_batch, steps, *MODEL, *overrides)
    cfg.train.global_batch = micro_batch  # one replica: the whole per-replica batch is one pipeline run
    cfg.train.grad_clip = 0.0
    cfg.parallel.pipeline.schedule, cfg.parallel.pipeline.micro_batches = schedule, micro_batches
    validate(cfg, world_size=stages)
    return cfg


def batch_of(trainer: Trainer, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s batch, the same on every stage (one replica)."""
    (indices,) = trainer.sampler.micro_batches(step, 0, 1, trainer.cfg.train.micro_batch)
    return trainer.train_set.batch(indices)


class OurSteps:
    """Our trainer's steps, noting per step this rank's window start, compute time and last
    compute end, and each (kind, stage)'s durations."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.windows: dict[int, tuple[float, float, float]] = {}
        self.durations: dict[tuple[str, int], list[float]] = defaultdict(list)

    def __call__(self, k: int) -> None:
        trainer = self.trainer
        trainer.ctx.barrier()
        started = time.perf_counter()
        trainer.forward_backward(k)
        timeline = trainer.strategy.timeline
        self.windows[k] = (started, sum(end - start for *_, start, end in timeline), max(end for *_, end in timeline))
        if k >= 2:  # 0, 1: warm-up
            for kind, _, stage, start, end in timeline:
                self.durations[kind, stage].append(end - start)
        trainer.optimizer_step()
        trainer.optimizer.zero_grad(set_to_none=True)

    def bubbles(self, ctx: DistContext) -> list[float]:
        """Per rank, the median over measured steps of its idle share of the step's window."""
        everyone = ctx.all_gather_object(self.windows)
        per_rank: list[list[float]] = [[] for _ in everyone]
        for k in self.windows:
            if k < 2:
                continue
            start = min(w[k][0] for w in everyone)
            window = max(w[k][2] for w in everyone) - start
            for r, w in enumerate(everyone):
                per_rank[r].append(1 - w[k][1] / window)
        return [statistics.median(b) for b in per_rank]

    def predicted_bubble(self, ctx: DistContext) -> float:
        """The simulator's bubble for this schedule with each stage's measured median durations."""
        schedule = self.trainer.strategy.schedule
        medians: dict[tuple[str, int], float] = {}
        for each in ctx.all_gather_object({key: statistics.median(d) for key, d in self.durations.items()}):
            medians.update(each)
        stages = range(schedule.layout.stages)
        if schedule.splits_backward:
            costs = Costs(tuple(medians["F", s] for s in stages), tuple(medians["B", s] for s in stages),
                          tuple(medians["W", s] for s in stages))
        else:  # BW whole: its cost as B's, W free
            costs = Costs(tuple(medians["F", s] for s in stages), tuple(medians[BW, s] for s in stages),
                          (0.0,) * len(stages))
        return simulate(schedule, costs).bubble


def native_step(like: Trainer, schedule: str, peaks: dict[str, int], key: str) -> StepFn:
    """torch.distributed.pipelining on the same stages as `like`'s (same split, layout, seed and
    batches), the tied embedding/head gradient summed between the first and the last stage's ranks
    as ours does, the same AdamW."""
    cfg, ctx, ours = like.cfg, like.ctx, like.strategy
    layout = ours.schedule.layout
    seed_everything(cfg.train.seed)
    located = locate(build_model(cfg.model))
    first_params = {id(p) for m in located.first.values() for p in m.parameters()}
    tied = [p for m in located.last.values() for p in m.parameters() if id(p) in first_params]
    mine = layout.stages_of(ours.pp_rank)
    models = [located, *(separate(located) for _ in mine[1:])]
    modules = {s: Stage(each, *ours.stage_blocks[s], first=s == 0, last=s == layout.stages - 1)
               for s, each in zip(mine, models, strict=True)}
    stages = [PipelineStage(modules[s], s, layout.stages, ctx.device, group=ours.pp_group) for s in mine]
    # scale_grads (the default) divides by M: the gradient of the mean loss, as ours.
    native = NATIVE[schedule]
    runner = native(stages[0] if len(stages) == 1 and native in (ScheduleGPipe, Schedule1F1B) else stages,
                    n_microbatches=ours.micro_batches, loss_fn=loss_fn)
    held = nn.ModuleList(modules.values())
    optimizer = optimizer_factory(cfg.train)(held.parameters())
    holds_first, holds_last = 0 in mine, layout.stages - 1 in mine
    tie_across = layout.rank_of(0) != layout.rank_of(layout.stages - 1)

    def step(k: int) -> None:
        inputs, targets = batch_of(like, k)
        ctx.barrier()
        counter = ActivationCounter(held) if k == 0 else nullcontext()  # k = 0: the first warm-up step
        with counter:
            args = (inputs,) if holds_first else ()
            kwargs: dict[str, Any] = {"target": targets, "losses": []} if holds_last else {}
            runner.step(*args, **kwargs, return_outputs=False)
        if isinstance(counter, ActivationCounter):
            peaks[key] = counter.bytes
        if tie_across:  # every pp rank joins; those without the tied weights add zeros
            for param in tied:
                grad = param.grad if param.grad is not None else torch.zeros_like(param)
                dist.all_reduce(grad, group=ours.pp_group)
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


def runs_on(stages: int, micro_batches: int, schedule: str) -> bool:
    try:
        check_micro_batches(schedule, stages, micro_batches)
    except ScheduleError:
        return False
    return True


def run(ctx: DistContext, steps: int, micro_batch: int) -> dict[str, Any] | None:
    """Every schedule and M on this world's P = world size stages, ours and native alternating."""
    load_before = os.getloadavg()
    p = ctx.world_size
    length = steps * 2 + 2
    # (model, schedule, M) -> trainer
    trainers = {("gpt", s, m): Trainer(pipeline_config("pipeline", p, s, m, micro_batch, length), ctx)
                for s in NATIVE for m in MICRO_BATCHES if runs_on(p, m, s)}
    trainers["gpt", "model-parallel", 1] = Trainer(pipeline_config("model-parallel", p, "gpipe", 1, micro_batch,
                                                                   length), ctx)
    if p == LLAMA_AT[0]:
        trainers |= {("llama", s, LLAMA_AT[1]): Trainer(pipeline_config("pipeline", p, s, LLAMA_AT[1], micro_batch,
                                                                        length, *LLAMA), ctx) for s in NATIVE}
    ours = {key: OurSteps(trainer) for key, trainer in trainers.items()}
    native_peaks: dict[str, int] = {}
    steps_of: dict[str, StepFn] = {}
    for (model, schedule, m), mine in ours.items():
        steps_of[f"{model}-{schedule}-{m}"] = mine
        if schedule in NATIVE and not (model == "llama" and schedule in NATIVE_FAILS_ON_LLAMA):
            name = f"native-{model}-{schedule}-{m}"
            steps_of[name] = native_step(trainers[model, schedule, m], schedule, native_peaks, name)
    times = alternate(steps_of, steps, rounds=steps)
    median = {name: statistics.median(t) for name, t in times.items()}

    results: dict[str, dict[str, dict[str, Any]]] = {}
    for (model, schedule, m), mine in ours.items():
        trainer = trainers[model, schedule, m]
        bubbles = mine.bubbles(ctx)
        entry = {
            "step_time_s": median[f"{model}-{schedule}-{m}"],
            "bubble_per_rank": bubbles,
            "bubble": sum(bubbles) / p,
            "bubble_predicted": mine.predicted_bubble(ctx),
            "bubble_ideal": simulate(trainer.strategy.schedule, Costs.uniform(trainer.strategy.schedule.layout.stages))
            .bubble,
            "peak_activation_bytes_per_rank": [int(b) for b in ctx.all_gather_object(trainer.activation_bytes)],
            # in micro-batches of a rank's layers, as peak_in_flight's docs count them
            "micro_batches_in_flight_per_rank": ctx.all_gather_object(
                trainer.activation_bytes / one_micro_batch_bytes(trainer, micro_batch // m)),
        }
        if model == "llama" and schedule in NATIVE_FAILS_ON_LLAMA:
            entry["native_fails"] = NATIVE_FAILS_ON_LLAMA[schedule]
        elif schedule in NATIVE:
            name = f"native-{model}-{schedule}-{m}"
            entry["native_step_time_s"] = median[name]
            entry["ratio_ours_vs_native"] = entry["step_time_s"] / entry["native_step_time_s"]
            entry["native_peak_activation_bytes_per_rank"] = [int(b) for b in ctx.all_gather_object(native_peaks[name])]
        entry["bubble_minus_predicted"] = entry["bubble"] - entry["bubble_predicted"]
        results.setdefault(model, {}).setdefault(schedule, {})[str(m)] = entry
    if not ctx.is_main:
        return None
    cfg = trainers["gpt", "gpipe", MICRO_BATCHES[0]].cfg
    gpt = results.pop("gpt")
    return {
        "stages": p,
        "model": f"gpt: {cfg.model.n_layer} blocks, width {cfg.model.d_model}, {cfg.model.n_head} heads, "
                 f"seq {cfg.model.seq_len}, {sum(q.numel() for q in build_model(cfg.model).parameters()):,} "
                 "parameters",
        "batch_per_step": micro_batch,
        "threads_per_rank": torch.get_num_threads(),
        "steps_each": len(times[next(iter(times))]),
        "schedules": {s: e for s, e in gpt.items() if s != "model-parallel"},
        "model_parallel": gpt["model-parallel"]["1"],
        **({"llama": {"model": describe(trainers["llama", "gpipe", LLAMA_AT[1]].cfg), "schedules": results["llama"]}}
           if "llama" in results else {}),
        "load_average_before_after": [load_before[0], os.getloadavg()[0]],
    }


def targets(by_p: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, read off the measurements: measured bubble within 0.05 of the
    simulator's (M >= 4), ZB-H1's <= 0.4x 1F1B's, interleaved's <= 1F1B's / V + 0.05, ours / native
    step time <= 1.0."""
    out: dict[str, Any] = {"bubble_within_0.05_of_predicted": {}, "zb_h1_over_1f1b_bubble": {},
                           "interleaved_bubble_minus_1f1b_over_v": {}, "ratio_ours_vs_native": {}}
    for p, result in by_p.items():
        schedules = result["schedules"]
        for schedule, entries in schedules.items():
            for m, e in entries.items():
                key = f"{schedule} P={p} M={m}"
                out["bubble_within_0.05_of_predicted"][key] = abs(e["bubble_minus_predicted"]) <= 0.05
                out["ratio_ours_vs_native"][key] = e["ratio_ours_vs_native"]
        for schedule, entries in result.get("llama", {}).get("schedules", {}).items():
            for m, e in entries.items():
                if "native_fails" not in e:
                        out["ratio_ours_vs_native"][f"llama {schedule} P={p} M={m}"] = e["ratio_ours_vs_native"]
        for m, e in schedules["zb-h1"].items():
            out["zb_h1_over_1f1b_bubble"][f"P={p} M={m}"] = e["bubble"] / schedules["1f1b"][m]["bubble"]
        v = virtual_stages("interleaved-1f1b", None)
        for m, e in schedules["interleaved-1f1b"].items():
            one_f_one_b = schedules["1f1b"][m]["bubble"]
            out["interleaved_bubble_minus_1f1b_over_v"][f"P={p} M={m}"] = e["bubble"] - one_f_one_b / v
    return out


def schedule_rows(schedules: dict[str, dict[str, Any]]) -> list[str]:
    lines = [f"    {'schedule':<18}{'M':>3} {'ours ms':>8} {'native':>8} {'ratio':>6}   bubble measured / predicted / "
             "ideal   peak activations MiB ours | native, per rank   in flight (ours)"]
    for schedule, entries in schedules.items():
        for m, e in entries.items():
            if "native_fails" in e:
                lines.append(f"    {schedule:<18}{m:>3} {e['step_time_s'] * 1e3:8.1f}   native: {e['native_fails']}")
                continue
            ours = " ".join(f"{b / 2**20:.1f}" for b in e["peak_activation_bytes_per_rank"])
            native = " ".join(f"{b / 2**20:.1f}" for b in e["native_peak_activation_bytes_per_rank"])
            flight = " ".join(f"{f:.1f}" for f in e["micro_batches_in_flight_per_rank"])
            lines.append(f"    {schedule:<18}{m:>3} {e['step_time_s'] * 1e3:8.1f} {e['native_step_time_s'] * 1e3:8.1f} "
                         f"{e['ratio_ours_vs_native']:6.3f}   {e['bubble']:.3f} / {e['bubble_predicted']:.3f} / "
                         f"{e['bubble_ideal']:.3f}   {ours} | {native}   {flight}")
    return lines


def format_result(result: dict[str, Any]) -> str:
    lines = [f"pipeline bench: {result['model']}, batch {result['batch_per_step']} per step, "
             f"{result['steps_each']} steps each, alternating; bubble = mean over ranks of idle / window"]
    for p, part in result["by_stages"].items():
        lines.append(f"  P = {p} (load average {part['load_average_before_after'][0]:.1f} -> "
                     f"{part['load_average_before_after'][1]:.1f})")
        lines += schedule_rows(part["schedules"])
        mp = part["model_parallel"]
        lines.append(f"    model-parallel       {mp['step_time_s'] * 1e3:8.1f}   bubble {mp['bubble']:.3f} "
                     f"(ideal {mp['bubble_ideal']:.3f})")
        if "llama" in part:
            lines.append(f"  P = {p}, {part['llama']['model']}:")
            lines += schedule_rows(part["llama"]["schedules"])
    return "\n".join(lines)


def worker(args: argparse.Namespace) -> None:
    ctx = init_distributed("gloo", timeout_s=900, threads_per_rank=1)
    result = run(ctx, args.steps, args.micro_batch)
    if result is not None:
        write_json(result, [args.part])
    shutdown_distributed()
    leave_process()


def main() -> None:
    """The driver: one world per P, then the parts merged into one result."""
    from shardwise.launch import launch_workers

    parser = argparse.ArgumentParser(prog="python -m bench.pipeline")
    parser.add_argument("--steps", type=int, default=12, help="measured steps per configuration")
    parser.add_argument("--micro-batch", type=int, default=16, help="samples per step (M of them per micro-batch)")
    parser.add_argument("--json", action="append", default=[], help="write the result here (repeatable)")
    parser.add_argument("--part", help=argparse.SUPPRESS)  # a worker of P ranks writes its part here
    args = parser.parse_args()
    if args.part:
        return worker(args)
    by_p = {}
    with tempfile.TemporaryDirectory() as tmp:
        for p in STAGES:
            part = Path(tmp) / f"{p}.json"
            launch_workers(LaunchConfig(nproc=p),
                           ["bench.pipeline", "--steps", str(args.steps), "--micro-batch",
                            str(args.micro_batch), "--part", str(part)])
            by_p[str(p)] = json.loads(part.read_text())
    first = by_p[str(STAGES[0])]
    result = {
        "bench": "pipeline",
        "model": first["model"],
        "batch_per_step": first["batch_per_step"],
        "threads_per_rank": first["threads_per_rank"],
        "steps_each": first["steps_each"],
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, gloo, torch {torch.__version__}",
        "by_stages": by_p,
        "targets": targets(by_p),
    }
    write_json(result, args.json)
    print(format_result(result), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
