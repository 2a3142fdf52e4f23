"""What every ours-vs-native bench shares: configs, timed steps, A B A B alternation, JSON out."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardwise.config.load import load_config
from shardwise.config.schema import Config
from shardwise.dist import DistContext, init_distributed, leave_process, shutdown_distributed
from shardwise.trainer import Trainer


@dataclass(frozen=True)
class BenchArgs:
    """What bench_main hands a bench's run."""

    steps: int  # measured steps per variant
    rounds: int  # the blocks they are split into
    micro_batch: int  # per rank
    preset: str  # the GPT preset of the models it trains: small, tiny for a quick run


def bench_config(strategy: str, world_size: int, micro_batch: int, steps: int, *overrides: str,
                 preset: str = "small") -> Config:
    """A gpt `preset` on synthetic tokens, no warmup, one micro-batch per rank per step."""
    return load_config(None, [
        f"model.preset={preset}", "data.name=synthetic-tokens", f"parallel.strategy={strategy}",
        f"launch.nproc={world_size}", f"train.global_batch={micro_batch * world_size}",
        f"train.micro_batch={micro_batch}", f"train.steps={steps}", "train.warmup_steps=0", "run.out=unused",
        *overrides,
    ])


StepFn = Callable[[int], object]  # runs training step k to completion (Trainer.run_step)


def timed_steps(step: StepFn, first: int, count: int) -> list[float]:
    times = []
    for k in range(first, first + count):
        started = time.perf_counter()
        step(k)
        times.append(time.perf_counter() - started)
    return times


def build_trainers(ctx: DistContext, strategies: list[str], steps: int, micro_batch: int,
                   *overrides: str, preset: str = "small") -> dict[str, Trainer]:
    """One trainer per strategy, each built from the same seed on the same batches."""
    return {name: Trainer(bench_config(name, ctx.world_size, micro_batch, steps * 2, *overrides, preset=preset), ctx)
            for name in strategies}


def alternate(steps_of: dict[str, StepFn], steps: int, rounds: int) -> dict[str, list[float]]:
    """Warm each up, then time them in turn, `rounds` blocks of steps each (A B A B ...), so the
    machine's drift hits all alike."""
    per_round = max(1, steps // rounds)
    times: dict[str, list[float]] = {name: [] for name in steps_of}
    for step in steps_of.values():  # allocation, thread pools, first buckets
        timed_steps(step, 0, 2)
    for round_ in range(rounds):
        for name, step in steps_of.items():
            times[name] += timed_steps(step, 2 + round_ * per_round, per_round)
    return times


def write_json(result: dict[str, Any], paths: list[str]) -> None:
    for path in paths:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2) + "\n")


def bench_main(name: str, run: Callable[[DistContext, BenchArgs], dict[str, Any] | None],
               format_result: Callable[[dict], str], ranks: int = 2, rounds: int = 3, steps: int = 12,
               micro_batch: int = 8) -> None:
    """A bench's entry point on every rank: parse, join the world of `ranks`, run, report on rank 0,
    leave the process. `rounds`: how many blocks the measured steps are split into by default;
    `steps`: how many by default; `micro_batch`: sequences a rank's micro-batch holds by default."""
    parser = argparse.ArgumentParser(prog=f"python -m bench.{name.replace('-', '_')}")
    parser.add_argument("--steps", type=int, default=steps, help="measured steps per strategy")
    parser.add_argument("--rounds", type=int, default=rounds, help="blocks the steps are split into")
    parser.add_argument("--micro-batch", type=int, default=micro_batch)
    parser.add_argument("--preset", default="small", choices=("tiny", "small"),
                        help="the GPT preset of the benches that train shardwise's GPT (tiny: a quick check)")
    parser.add_argument("--json", action="append", default=[], help="write the result here (repeatable)")
    args = parser.parse_args()
    ctx = init_distributed("gloo", timeout_s=600, threads_per_rank=1)
    if ctx.world_size != ranks:
        raise SystemExit(f"bench {name} needs exactly {ranks} rank(s): run it as `shardwise bench {name}`")
    result = run(ctx, BenchArgs(args.steps, args.rounds, args.micro_batch, args.preset))
    if result is not None:
        write_json(result, args.json)
        print(format_result(result), flush=True)
    shutdown_distributed()
    leave_process()
