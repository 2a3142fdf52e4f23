"""`shardwise bench moe`: expert parallel against the same gpt-moe with every expert replicated,
and our MoE layer's expert-parallel dispatch against DeepSpeed's MoE layer.

1. Whole jobs. One gpt-moe (2 blocks of width 128, 8 experts of hidden width 512 each, top-2, a
   128-token context, 4 sequences per rank per step, AdamW) trained as real `shardwise train`
   jobs under `ddp` on 4 ranks with ep 1 (every rank holds every expert), ep 2 and ep 4, and on 2
   ranks with ep 1 and ep 2; all five alternated job by job over `--rounds` rounds. Each job
   trains `--steps` measured steps after 2 warm-up steps, whose records are left out. Per
   variant, from the jobs' metrics.jsonl: the median step time over every round's measured steps
   as tokens/s, and its ratio to ep 1 of the same world (also round by round, and the median of
   those: neighbouring jobs share the machine's load); parameter, gradient and optimizer bytes of a rank (rank 0's, the
   largest of any rank beside as a check) and the parameter bytes that splitting the experts
   predicts; the median of all_to_all_s / step_time_s (rank 0's seconds in expert parallel's
   all-to-alls, the counts' included, and the time spent there waiting for slower ranks); the
   median of the layers' mean ep imbalance (the most pairs an ep rank computed over the mean)
   and expert imbalance.
   The tokens are synthetic (uniform bytes) and the learning rate 3e-4, so routing stays near its
   balance at initialisation (experts about 1.3x, ep ranks 1.05x their mean). Shakespeare's bytes
   at gpt-tiny's 3e-3 send up to 3.7x an expert's share to one expert within a few steps: the
   bench would then measure the router's collapse rather than the dispatch.
2. One layer. On 2 ranks, ep 2, the MoE layer of the same shapes (512 tokens of width 128 per
   rank, 8 experts, top-2), forward and backward, alternated step by step: ours (models.moe.MoE,
   its experts split by `ExpertParallel`) and, where `deepspeed` is importable,
   `deepspeed.moe.layer.MoE` with the same router and expert weights, dropless (`drop_tokens=False`,
   no random token selection, no sampled second expert), so both compute the same outputs (their
   largest difference is reported). DeepSpeed pads every expert's rows to the largest expert's
   count over the ep ranks and sends equal splits; ours sends each pair once. The ratio is ours'
   median time over DeepSpeed's (each the slower rank's). Beside it, one all-to-all of the rows
   alone, the ranks started together: what the bytes cost without waiting for a slower rank.
   Without DeepSpeed the result says so (`pip install -e '.[bench]'`).

    shardwise bench moe [--steps 12]   (or python -m bench.moe [--rounds 5] [--json FILE])
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import ROOT
from bench.common import alternate, write_json

N_LAYER, D_MODEL, N_HEAD, SEQ_LEN, N_EXPERTS, TOP_K, D_EXPERT, MICRO_BATCH = 2, 128, 4, 128, 8, 2, 512, 4
MODEL = ["model.name=gpt-moe", f"model.n_layer={N_LAYER}", f"model.d_model={D_MODEL}", f"model.n_head={N_HEAD}",
         f"model.seq_len={SEQ_LEN}", f"model.n_experts={N_EXPERTS}", f"model.top_k={TOP_K}",
         f"model.d_expert={D_EXPERT}", "data.name=synthetic-tokens", "train.lr=3e-4",
         f"train.micro_batch={MICRO_BATCH}", "train.warmup_steps=0", "train.eval_every=0", "train.eval_batches=1",
         "launch.threads_per_rank=1"]
JOBS = {  # name -> (ranks, ep); ddp, one micro-batch per rank per step
    "ep1": (4, 1), "ep2": (4, 2), "ep4": (4, 4),
    "2-ranks-ep1": (2, 1), "2-ranks-ep2": (2, 2),
}
WARMUP = 2  # steps of each job left out (allocation, thread pools, Gloo's first pairs)
MODEL_STATE = ("params", "grads", "optimizer")
LAYER_RANKS, LAYER_EP = 2, 2
AUX_LOSS_COEF = 0.01  # ours' default; DeepSpeed returns its auxiliary loss, added with this weight


def expert_bytes() -> int:
    """Bytes of every expert of every layer (fp32 w_up and w_down)."""
    return N_LAYER * N_EXPERTS * 2 * D_MODEL * D_EXPERT * 4


def baseline_of(name: str) -> str:
    """The variant a job is compared with: ep 1 on as many ranks."""
    return name.rsplit("ep", 1)[0] + "ep1"


# --- the whole jobs --------------------------------------------------------------------------------

def run_job(name: str, steps: int, out: Path) -> list[dict[str, Any]]:
    """One `shardwise train` job; its step records."""
    ranks, ep = JOBS[name]
    command = [sys.executable, "-m", "shardwise.cli", "train", "configs/gpt-tiny.toml", "--strategy", "ddp",
               "--nproc", str(ranks), "--ep", str(ep), "--steps", str(WARMUP + steps), "--out", str(out),
               "--set", f"train.global_batch={MICRO_BATCH * ranks}"]
    for override in MODEL:
        command += ["--set", override]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"bench moe: {name} failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["event"] == "step"]


def summarise(records: list[dict[str, Any]], tokens_per_step: int) -> dict[str, Any]:
    """What a variant's measured step records (warm-up left out, every round's) say: medians of
    step time (as tokens/s), of the all-to-alls' share of the step and of the layers' mean
    imbalance; each rank's model-state bytes."""
    times = [r["step_time_s"] for r in records]
    routers = [r["router"] for r in records]
    memory = records[-1]["memory"]
    by_rank = records[-1]["memory_by_rank"]
    result = {
        "median_step_time_s": statistics.median(times),
        "tokens_per_s": tokens_per_step / statistics.median(times),
        "steps": len(records),
        "bytes_per_rank": {key: memory[key] for key in MODEL_STATE},
        "most_bytes_of_any_rank": {key: max(m[key] for m in by_rank) for key in MODEL_STATE},
        "expert_imbalance": statistics.median(statistics.fmean(r["imbalance"]) for r in routers),
    }
    if "ep_imbalance" in routers[0]:
        result["ep_imbalance"] = statistics.median(statistics.fmean(r["ep_imbalance"]) for r in routers)
        result["ep_imbalance_worst_layer"] = statistics.median(max(r["ep_imbalance"]) for r in routers)
        result["all_to_all_share"] = statistics.median(r["all_to_all_s"] / t for r, t in zip(routers, times,
                                                                                              strict=True))
        result["all_to_all_s"] = statistics.median(r["all_to_all_s"] for r in routers)
    return result


def compare(variants: dict[str, dict[str, Any]], by_round: dict[str, list[float]]) -> None:
    """Add to each variant its tokens/s over its world's ep 1 (pooled medians, and round by round)
    and its parameter bytes beside those that splitting the experts over ep predicts."""
    for name, variant in variants.items():
        base = baseline_of(name)
        ep = JOBS[name][1]
        variant["vs_ep1"] = variant["tokens_per_s"] / variants[base]["tokens_per_s"]
        variant["vs_ep1_by_round"] = [a / b for a, b in zip(by_round[name], by_round[base], strict=True)]
        variant["vs_ep1_median_of_rounds"] = statistics.median(variant["vs_ep1_by_round"])
        replicated = variants[base]["bytes_per_rank"]["params"]
        variant["params_predicted"] = replicated - expert_bytes() * (ep - 1) // ep
        variant["params_as_predicted"] = variant["most_bytes_of_any_rank"]["params"] == variant["params_predicted"]
        variant["bytes_vs_ep1"] = {key: variant["bytes_per_rank"][key] / variants[base]["bytes_per_rank"][key]
                                   for key in MODEL_STATE}


def run_jobs(steps: int, rounds: int) -> dict[str, Any]:
    measured: dict[str, list[dict[str, Any]]] = {name: [] for name in JOBS}
    by_round: dict[str, list[float]] = {name: [] for name in JOBS}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(rounds):
            for name, (ranks, _) in JOBS.items():
                records = run_job(name, steps, Path(scratch) / f"{name}-{round_}")[WARMUP:]
                measured[name] += records
                by_round[name].append(MICRO_BATCH * ranks * SEQ_LEN / statistics.median(r["step_time_s"]
                                                                                         for r in records))
                print(f"  round {round_ + 1}/{rounds} {name:<12}{by_round[name][-1]:9,.0f} tokens/s", flush=True)
    variants = {name: {"ranks": JOBS[name][0], "ep": JOBS[name][1], "tokens_per_s_by_round": by_round[name],
                       **summarise(records, MICRO_BATCH * JOBS[name][0] * SEQ_LEN)}
                for name, records in measured.items()}
    compare(variants, by_round)
    return variants


# --- one layer: ours against DeepSpeed's, on 2 ranks under torchrun --------------------------------

class ExpertMLP(torch.nn.Module):
    """One expert as DeepSpeed takes it (a module it copies per local expert): ours' GELU MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(D_MODEL, D_EXPERT, bias=False)
        self.down = torch.nn.Linear(D_EXPERT, D_MODEL, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def our_layer(ctx: Any) -> tuple[torch.nn.Module, Any]:
    """Ours: the gpt-moe's layer, initialised as the model initialises it, its experts split over
    ep by ExpertParallel (every rank builds the same layer, then keeps its share); and the
    ExpertParallel, whose exchange times the layer's all-to-alls."""
    from shardwise.models.moe import MoE, MoEConfig
    from shardwise.parallel.dims import Mesh, MeshShape
    from shardwise.parallel.experts import ExpertParallel

    torch.manual_seed(0)
    layer = MoE(D_MODEL, MoEConfig(N_EXPERTS, TOP_K, D_EXPERT, aux_loss_coef=AUX_LOSS_COEF))
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.02)
    model = torch.nn.Sequential(layer)
    experts = ExpertParallel(Mesh.of(ctx, MeshShape(dp_replicate=LAYER_RANKS, ep=LAYER_EP)), model)
    experts.split(model)
    return model, experts


def deepspeed_layer(ours: torch.nn.Module) -> tuple[torch.nn.Module, Callable[[torch.Tensor], torch.Tensor]] | str:
    """DeepSpeed's MoE layer with ours' router and this rank's expert weights, dropless; or why not."""
    try:
        import deepspeed
        from deepspeed.moe.layer import MoE
    except ImportError:
        return "not installed (pip install -e '.[bench]')"
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")  # wraps the process group torchrun's ranks made
    layer = MoE(D_MODEL, ExpertMLP(), num_experts=N_EXPERTS, ep_size=LAYER_EP, k=TOP_K, drop_tokens=False,
                use_rts=False, top2_2nd_expert_sampling=False)
    layer.set_deepspeed_parallelism()
    mine = ours[0]
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(mine.router.weight)
        for expert, up, down in zip(layer.deepspeed_moe.experts.deepspeed_experts, mine.experts.w_up,
                                    mine.experts.w_down, strict=True):
            expert.up.weight.copy_(up.T)
            expert.down.weight.copy_(down.T)

    def forward(x: torch.Tensor) -> torch.Tensor:
        """The layer's output, with its auxiliary loss's gradient flowing in backward as ours'
        does: `layer_step`'s loss is the output's sum, so coef x aux / numel added to every element
        adds coef x aux to it."""
        out, aux, _ = layer(x)
        return out + AUX_LOSS_COEF * aux / out.numel()

    return layer, forward


def layer_step(module: torch.nn.Module, forward: Callable[[torch.Tensor], torch.Tensor],
               x: torch.Tensor) -> Callable[[int], torch.Tensor]:
    def step(k: int) -> torch.Tensor:
        module.zero_grad(set_to_none=True)
        x.grad = None
        y = forward(x)
        y.sum().backward()
        return y.detach()
    return step


def all_to_all_alone(rows: int, repeats: int = 50) -> dict[str, float]:
    """Seconds of one all-to-all of `rows` rows of the layer's width, equal splits, every rank
    starting it together (after a barrier), the least and the median of `repeats`: what the rows'
    bytes cost without waiting for a slower rank, beside the all-to-alls' share of a step."""
    import torch.distributed as dist

    x, out = torch.randn(rows, D_MODEL), torch.empty(rows, D_MODEL)
    times = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        dist.all_to_all_single(out, x)
        times.append(time.perf_counter() - started)
    return {"least_s": min(times), "median_s": statistics.median(times)}


def layer_worker(steps: int, rounds: int, part: Path) -> None:
    from shardwise.dist import init_distributed, leave_process, shutdown_distributed

    ctx = init_distributed("gloo", timeout_s=600, threads_per_rank=1)
    x = torch.randn(MICRO_BATCH, SEQ_LEN, D_MODEL, generator=torch.Generator().manual_seed(ctx.rank),
                    requires_grad=True)
    ours, experts = our_layer(ctx)
    steps_of = {"ours": layer_step(ours, ours, x)}
    result: dict[str, Any] = {"ranks": LAYER_RANKS, "ep": LAYER_EP, "tokens_per_rank": MICRO_BATCH * SEQ_LEN,
                              "d_model": D_MODEL, "d_expert": D_EXPERT, "experts": N_EXPERTS, "top_k": TOP_K}
    try:
        theirs = deepspeed_layer(ours)
        if not isinstance(theirs, str):
            with torch.no_grad():
                difference = (ours(x) - theirs[0](x)[0]).abs().max().item()
    except Exception as error:  # whatever stops DeepSpeed's layer here is the result
        theirs = f"failed: {type(error).__name__}: {error}"
    if isinstance(theirs, str):
        result["deepspeed"] = theirs
    else:
        import deepspeed

        result["deepspeed"] = f"deepspeed {deepspeed.__version__}"
        result["largest_output_difference"] = difference
        steps_of["deepspeed"] = layer_step(*theirs, x)
    exchange = experts.exchange
    exchange.take_seconds()
    times = alternate(steps_of, steps, rounds)
    exchanged = exchange.take_seconds() / (2 + len(times["ours"]))  # ours' all-to-alls per step, warm-up included
    alone = all_to_all_alone(MICRO_BATCH * SEQ_LEN * TOP_K)
    mine = {name: statistics.median(t) for name, t in times.items()}
    medians = ctx.all_gather_object(mine)
    if ctx.is_main:
        result["median_step_s"] = {name: max(m[name] for m in medians) for name in mine}  # the slower rank's
        result["steps"] = len(times["ours"])
        result["ours_all_to_all_s"] = exchanged
        # Per step ours moves each rank's pairs there and back, and their gradients back and there.
        result["all_to_all_alone"] = {"rows": MICRO_BATCH * SEQ_LEN * TOP_K, **alone,
                                      "four_per_step_least_s": 4 * alone["least_s"]}
        if "deepspeed" in result["median_step_s"]:
            result["ours_vs_deepspeed"] = result["median_step_s"]["ours"] / result["median_step_s"]["deepspeed"]
        write_json(result, [str(part)])
    shutdown_distributed()
    leave_process()


def run_layer(steps: int, rounds: int) -> dict[str, Any]:
    from shardwise.config.schema import LaunchConfig
    from shardwise.launch import launch_workers

    with tempfile.TemporaryDirectory() as scratch:
        part = Path(scratch) / "layer.json"
        launch_workers(LaunchConfig(nproc=LAYER_RANKS),
                       ["bench.moe", "--layer-part", str(part), "--steps", str(steps), "--rounds",
                        str(rounds)])
        return json.loads(part.read_text())


# --- the driver ------------------------------------------------------------------------------------

def run(steps: int, rounds: int, layer_steps: int) -> dict[str, Any]:
    load_before = os.getloadavg()
    variants = run_jobs(steps, rounds)
    load_between = os.getloadavg()
    layer = run_layer(layer_steps, max(rounds, 4))
    return {
        "bench": "moe",
        "model": f"gpt-moe: {N_LAYER} blocks of width {D_MODEL}, {N_EXPERTS} experts of width {D_EXPERT}, top-{TOP_K}, "
                 f"{SEQ_LEN}-token context, {MICRO_BATCH} sequences per rank per step; synthetic tokens, AdamW at "
                 "3e-4, fp32, ddp",
        "expert_bytes": expert_bytes(),
        "steps": steps, "warmup_steps_left_out": WARMUP, "rounds": rounds,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, gloo, torch {torch.__version__}, one thread per rank",
        "load_average_1min": {"before": load_before[0], "after_jobs": load_between[0],
                              "after": os.getloadavg()[0]},
        "variants": variants,
        "layer": layer,
    }


def format_result(result: dict[str, Any]) -> str:
    load = result["load_average_1min"]
    lines = [f"moe bench: {result['model']}",
             f"  {result['steps']} measured steps per job, medians over {result['rounds']} rounds; load average "
             f"{load['before']:.1f} before, {load['after_jobs']:.1f} after the jobs, {load['after']:.1f} after",
             f"  {'variant':<13}{'tokens/s':>9}{'vs ep1':>8}{'by round':>10}{'params/rank':>13}{'optimizer':>11}"
             f"{'a2a share':>11}{'ep imbal.':>10}{'exp. imbal.':>12}"]
    for name, v in result["variants"].items():
        share = f"{v['all_to_all_share']:.1%}" if "all_to_all_share" in v else "-"
        ep_imbalance = f"{v['ep_imbalance']:.3f}" if "ep_imbalance" in v else "-"
        lines.append(f"  {name:<13}{v['tokens_per_s']:>9,.0f}{v['vs_ep1']:>7.3f}x{v['vs_ep1_median_of_rounds']:>9.3f}x"
                     f"{v['bytes_per_rank']['params'] / 2**20:>9.2f} MiB"
                     f"{v['bytes_per_rank']['optimizer'] / 2**20:>7.2f} MiB"
                     f"{share:>11}{ep_imbalance:>10}{v['expert_imbalance']:>12.3f}")
    layer = result["layer"]
    line = (f"  one layer, {layer['ranks']} ranks, ep {layer['ep']}, {layer['tokens_per_rank']} tokens per rank, "
            f"forward+backward: ours {layer['median_step_s']['ours'] * 1e3:.1f} ms")
    alone = layer["all_to_all_alone"]
    line += (f" ({layer['ours_all_to_all_s'] * 1e3:.1f} ms in all-to-alls; one of the rows alone at least "
             f"{alone['least_s'] * 1e3:.2f} ms)")
    if "ours_vs_deepspeed" in layer:
        line += (f", DeepSpeed {layer['median_step_s']['deepspeed'] * 1e3:.1f} ms: ours / DeepSpeed "
                 f"{layer['ours_vs_deepspeed']:.3f} (outputs within {layer['largest_output_difference']:.1e})")
    else:
        line += f"; DeepSpeed: {layer['deepspeed']}"
    lines.append(line)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.moe", description=__doc__)
    parser.add_argument("--steps", type=int, default=12, help="measured steps per job (the layer: 5x as many)")
    parser.add_argument("--rounds", type=int, default=5, help="times every job is run, alternated")
    parser.add_argument("--json", action="append", default=[], help="write the result here (repeatable)")
    parser.add_argument("--layer-part", help=argparse.SUPPRESS)  # a rank of the layer comparison writes here
    args = parser.parse_args()
    if args.layer_part:
        return layer_worker(args.steps, args.rounds, Path(args.layer_part))
    result = run(args.steps, args.rounds, 5 * args.steps)
    write_json(result, args.json)
    print(format_result(result), flush=True)


if __name__ == "__main__":
    main()
