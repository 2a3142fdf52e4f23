"""`shardwise bench planner`: the planner's predictions against real runs on this machine, in one
2-rank world.

First the machine is measured (`bench hardware`'s measurements, as the device profile; with
--quick-profile, their quick form), then for each scenario every candidate trains a few steps
(candidates alternating, A B C A B C, so the machine's drift hits all alike) and is compared with
its prediction: the median step time, and per rank the params, grads, optimizer and activation
bytes `memory` counts.

The world's 2 ranks are 2 nodes of one process each (network namespaces, bench/netns.py; as
root), so the link between them can be slowed: the scenarios with a link rate run with it
limited to that rate each way (tc tbf), and the planner predicts them from the same profile
with the rate as its inter-node bandwidth, as a user who knows their network would. The others
run with the link unlimited: a veth is a memory copy, as within a node. Without namespaces the
world is 2 processes on this host and only those run.

A scenario's ranking matches when the predicted order of its candidates agrees with the measured
one on every pair the measurement tells apart: medians more than `NOISE` (relative) apart and
further apart than the two candidates' spreads (half their step times' interquartile ranges)
together. The machine is shared: the same candidate's median moves by ~10% from run to run, and
two within that swap places.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import write_json
from bench.hardware import measure_profile
from bench.netns import Cluster, LinkRate, parse_rate, run_job, unavailable_reason
from shardwise.config.load import load_config
from shardwise.config.schema import LaunchConfig
from shardwise.dist import DistContext, init_distributed, leave_process, shutdown_distributed
from shardwise.measure import measure_candidates
from shardwise.planner.candidates import Candidate
from shardwise.planner.devices import DeviceProfile
from shardwise.planner.memory_model import predict_memory
from shardwise.planner.timing import predict_step_time

NOISE = 0.10
MEMORY_KEYS = ("params", "grads", "optimizer", "activations")


def _data_parallel(strategies: str, precision: str, micro_batch: int) -> list[Candidate]:
    return [Candidate(strategy, 2, 1, 1, precision, "none", micro_batch) for strategy in strategies.split()]


def _split(micro_batch: int, pipeline: bool = True) -> list[Candidate]:
    """A 2-stage 1F1B pipeline (M = 4, or 2 for small micro-batches) and a 2-way tensor split."""
    runs = min(4, micro_batch)
    pipe = [Candidate("pipeline", 1, 2, 1, "fp32", "none", micro_batch, runs, "1f1b")] if pipeline else []
    return pipe + [Candidate("tensor", 1, 1, 2, "fp32", "none", micro_batch)]


@dataclasses.dataclass(frozen=True)
class Scenario:
    overrides: list[str]
    candidates: list[Candidate]
    link: str | None = None  # the link's rate (tc syntax), or unlimited


def scenarios() -> dict[str, Scenario]:
    """Model size, batch, precision and bandwidth vary: a slower link, or a wide model on short
    sequences, which sends much more per FLOP."""
    every = "ddp zero1 zero2 fsdp"
    small, tiny = ["model.preset=small"], ["model.preset=tiny"]
    return {
        "tiny, micro-batch 8": Scenario(tiny, _data_parallel(every, "fp32", 8) + _split(8)),
        "small, micro-batch 8": Scenario(small, _data_parallel(every, "fp32", 8) + _split(8)),
        "small, micro-batch 2": Scenario(small, _data_parallel(every, "fp32", 2) + _split(2)),
        "small, bf16-mixed vs fp32": Scenario(small, _data_parallel("ddp fsdp", "bf16-mixed", 8)
                                              + _data_parallel("ddp fsdp", "fp32", 8)),
        "wide, short sequences (communication-heavy)": Scenario(
            ["model.preset=small", "model.d_model=768", "model.n_head=12", "model.seq_len=32"],
            _data_parallel(every, "fp32", 4) + _split(4, pipeline=False)),
        "small, micro-batch 8, link 1 Gbit/s": Scenario(small, _data_parallel(every, "fp32", 8) + _split(8), "1gbit"),
        "small, micro-batch 8, link 200 Mbit/s": Scenario(small, _data_parallel(every, "fp32", 8) + _split(8),
                                                          "200mbit"),
        "tiny, micro-batch 8, link 20 Mbit/s": Scenario(tiny, _data_parallel(every, "fp32", 8) + _split(8), "20mbit"),
    }


def _spread(times: list[float]) -> float:
    """Half the interquartile range of a candidate's step times: how far its median may wander."""
    quartiles = statistics.quantiles(times, n=4)
    return (quartiles[2] - quartiles[0]) / 2


def _agree(predicted: list[float], measured: list[float], spreads: list[float]) -> tuple[int, int]:
    """(pairs ordered alike, pairs told apart): two candidates are told apart when their measured
    medians differ by more than NOISE and by more than their spreads together."""
    alike = told = 0
    for i, j in itertools.combinations(range(len(measured)), 2):
        gap = abs(measured[i] - measured[j])
        if gap <= NOISE * min(measured[i], measured[j]) or gap <= spreads[i] + spreads[j]:
            continue
        told += 1
        alike += (predicted[i] < predicted[j]) == (measured[i] < measured[j])
    return alike, told


def run_scenario(ctx: DistContext, overrides: list[str], candidates: list[Candidate], device: DeviceProfile,
                 steps: int) -> dict[str, Any]:
    # Every candidate trains the same global batch, one micro-batch per rank: a model-splitting
    # one (a single replica) accumulates over the micro-batches the data-parallel ones split.
    global_batch = ctx.world_size * candidates[0].micro_batch
    base = load_config(None, [*overrides, "data.name=synthetic-tokens", "train.warmup_steps=0", "run.out=unused",
                              f"train.steps={steps + 2}", "train.micro_batch=1", f"train.global_batch={global_batch}"])
    rows = []
    for measured in measure_candidates(ctx, base, candidates, steps):
        candidate = Candidate(**measured["candidate"])
        cfg = candidate.config(base, ctx.world_size)
        predicted = predict_memory(candidate, cfg)
        memory = [{key: {"predicted": getattr(predicted[r if len(predicted) > 1 else 0], key), "counted": got[key]}
                   for key in MEMORY_KEYS} for r, got in enumerate(measured["memory_by_rank"])]
        rows.append({**candidate.as_dict(), "label": candidate.label,
                     "predicted_step_s": predict_step_time(candidate, cfg, device, ctx.world_size).total,
                     "measured_step_s": measured["measured_step_s"], "step_times_s": measured["step_times_s"],
                     "memory_by_rank": memory})
    predicted = [row["predicted_step_s"] for row in rows]
    measured = [row["measured_step_s"] for row in rows]
    alike, told = _agree(predicted, measured, [_spread(row["step_times_s"]) for row in rows])
    return {"candidates": rows, "pairs_ordered_alike": alike, "pairs_told_apart": told,
            "ranking_matches": alike == told,
            "predicted_order": [rows[i]["label"] for i in sorted(range(len(rows)), key=predicted.__getitem__)],
            "measured_order": [rows[i]["label"] for i in sorted(range(len(rows)), key=measured.__getitem__)]}


def link_profile(profile: DeviceProfile, world: int, link: str | None) -> DeviceProfile:
    """The profile the planner predicts a scenario from: one node of `world` ranks over an
    unlimited link, else a rank per node at the link's rate."""
    if link is None:
        return dataclasses.replace(profile, gpus_per_node=world)
    return dataclasses.replace(profile, inter_node_bandwidth=parse_rate(link), gpus_per_node=1)


def run(ctx: DistContext, steps: int, count: int, link: LinkRate | None,
        quick_profile: bool = False) -> dict[str, Any] | None:
    """Measure the machine (`quick_profile`: briefly, `measure_profile`'s quick form), then the first
    `count` scenarios (those with a link rate only if `link` can set it)."""
    profile = ctx.all_gather_object(measure_profile(ctx, quick=quick_profile))[0]
    device = DeviceProfile(**profile)
    results = {}
    for name, scenario in list(scenarios().items())[:count]:
        if scenario.link is not None and link is None:
            continue
        if link is not None:
            link.set(scenario.link)
        results[name] = {"link": scenario.link or "unlimited",
                         **run_scenario(ctx, scenario.overrides, scenario.candidates,
                                        link_profile(device, ctx.world_size, scenario.link), steps)}
    if not ctx.is_main:
        return None
    ratios = [cell["predicted"] / cell["counted"] for scenario in results.values() for row in scenario["candidates"]
              for rank in row["memory_by_rank"] for cell in rank.values() if cell["counted"]]
    return {"device": profile, "noise": NOISE, "scenarios": results,
            "scenarios_matching": sum(s["ranking_matches"] for s in results.values()),
            # a scenario whose candidates the measurement cannot tell apart matches by default: say how many did
            "scenarios_with_pairs_told_apart": sum(s["pairs_told_apart"] > 0 for s in results.values()),
            "pairs_ordered_alike": sum(s["pairs_ordered_alike"] for s in results.values()),
            "pairs_told_apart": sum(s["pairs_told_apart"] for s in results.values()),
            "memory_ratio_range": [min(ratios), max(ratios)]}


def format_result(result: dict[str, Any]) -> str:
    lines = [f"ranking matches in {result['scenarios_matching']} of {len(result['scenarios'])} scenarios "
             f"({result['scenarios_with_pairs_told_apart']} with pairs told apart: more than {result['noise']:.0%} "
             f"and their spreads apart); {result['pairs_ordered_alike']} of {result['pairs_told_apart']} pairs "
             f"ordered alike; memory predicted / counted in "
             f"[{result['memory_ratio_range'][0]:.4f}, {result['memory_ratio_range'][1]:.4f}]"]
    for name, scenario in result["scenarios"].items():
        lines.append(f"{name} (link {scenario['link']}): {scenario['pairs_ordered_alike']}/"
                     f"{scenario['pairs_told_apart']} pairs alike")
        for row in scenario["candidates"]:
            lines.append(f"  {row['label']:<44} predicted {row['predicted_step_s'] * 1000:8.1f} ms  "
                         f"measured {row['measured_step_s'] * 1000:8.1f} ms")
    return "\n".join(lines)


def worker(args: argparse.Namespace) -> None:
    ctx = init_distributed("gloo", timeout_s=900, threads_per_rank=1)
    handshake = Path(args.handshake)
    result = run(ctx, args.steps, args.scenarios, LinkRate(ctx, handshake) if args.link else None,
                 args.quick_profile)
    if result is not None:
        (handshake / "result.json").write_text(json.dumps(result))
    shutdown_distributed()
    leave_process()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.planner", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", nargs="?", default="host", choices=("host", "worker"))
    parser.add_argument("--steps", type=int, default=10, help="measured steps per candidate")
    parser.add_argument("--scenarios", type=int, default=len(scenarios()), help="run the first N scenarios "
                        "(default all)")
    parser.add_argument("--quick-profile", action="store_true", help="measure the device profile once over small "
                        "buffers, not as the best of several (a check that it runs: its predictions rough)")
    parser.add_argument("--json", action="append", default=[], help="write the result here (repeatable)")
    parser.add_argument("--handshake", help=argparse.SUPPRESS)
    parser.add_argument("--link", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "worker":
        worker(args)
        return 0
    worker_args = ["worker", "--steps", str(args.steps), "--scenarios", str(args.scenarios),
                   *(["--quick-profile"] if args.quick_profile else [])]
    reason = unavailable_reason()
    if reason is None:
        with Cluster(2) as cluster:
            result = run_job(cluster, 1, "bench.planner", [*worker_args, "--link"])
    else:
        from shardwise.launch import launch_workers

        skipped = [name for name, scenario in list(scenarios().items())[:args.scenarios] if scenario.link]
        if skipped:
            print(f"shardwise bench planner: the scenarios with a slower link ({'; '.join(skipped)}) run over "
                  f"network namespaces, and {reason}: running the others on this host", file=sys.stderr)
        with tempfile.TemporaryDirectory() as handshake:
            launch_workers(LaunchConfig(nproc=2), ["bench.planner", *worker_args, "--handshake", handshake])
            result = json.loads((Path(handshake) / "result.json").read_text())
        result["not_run"] = {"scenarios": skipped, "why": reason}
    write_json(result, args.json)
    print(format_result(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
