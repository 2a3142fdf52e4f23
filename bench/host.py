"""`shardwise bench host`: the host's work in a step, on the CPU, where a GPU's step of a small model
is bound by it (issue 73: gpt-2-124m's fsdp step at world 1 was 1.48x single's at micro-batch 8 on an
H200, and 1.03x at 32 with the same launches).

One process, a world of one (Gloo), a GPT of gpt-2-124m's 12 blocks at gpt tiny's width, so that
the arithmetic is small and the step is mostly the host's: `single`, and `fsdp` with 1, 2 and 4
blocks a unit (`parallel.sharding.blocks_per_unit`). For one step of each it counts the operators
dispatched (what becomes a kernel launch, or a view's bookkeeping, on a GPU), the Python functions
called and the collectives issued; then the steps' median time, alternating (A B C D A B C D), each
against single's.
"""

from __future__ import annotations

import platform
import statistics
import sys
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from bench.common import BenchArgs, alternate, bench_config, bench_main
from shardwise.dist import DistContext
from shardwise.trainer import Trainer

BLOCKS = 12
JOBS = {"single": ("single", 1), "fsdp": ("fsdp", 1), "fsdp-2": ("fsdp", 2), "fsdp-4": ("fsdp", 4)}


class Dispatched(TorchDispatchMode):
    """Operators dispatched, and the collectives among them."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.collectives = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.collectives += func.namespace == "c10d"
        return func(*args, **(kwargs or {}))


def counted_step(trainer: Trainer, step: int) -> dict[str, int]:
    """One step's operators and collectives, then another's Python calls (apart: the counting
    mode's own calls would be counted)."""
    dispatched = Dispatched()
    with dispatched:
        trainer.run_step(step)
    calls = 0

    def count(frame: object, event: str, arg: object) -> None:
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        trainer.run_step(step + 1)
    finally:
        sys.setprofile(None)
    return {"ops": dispatched.ops, "collectives": dispatched.collectives, "python_calls": calls}


def run(ctx: DistContext, args: BenchArgs) -> dict[str, Any]:
    trainers = {name: Trainer(bench_config(strategy, 1, args.micro_batch, args.steps + 4, f"model.n_layer={BLOCKS}",
                                           f"parallel.sharding.blocks_per_unit={per_unit}", preset="tiny"), ctx)
                for name, (strategy, per_unit) in JOBS.items()}
    times = alternate({name: trainer.run_step for name, trainer in trainers.items()}, args.steps, args.rounds)
    counts = {name: counted_step(trainer, args.steps) for name, trainer in trainers.items()}  # in a steady state
    median = {name: statistics.median(t) for name, t in times.items()}
    return {"machine": platform.processor() or platform.machine(), "model": f"gpt, {BLOCKS} blocks of width 64, "
            f"sequence 64, micro-batch {args.micro_batch}, world 1 (Gloo), 1 thread",
            "jobs": {name: {**counts[name], "step_ms": median[name] * 1e3,
                            "step_vs_single": median[name] / median["single"]} for name in JOBS}}


def format_result(result: dict[str, Any]) -> str:
    lines = [f"host bench: {result['model']} ({result['machine']})",
             f"  {'job':<8} {'ops':>6} {'python':>7} {'coll.':>6} {'step ms':>8} {'vs single':>9}"]
    for name, job in result["jobs"].items():
        lines.append(f"  {name:<8} {job['ops']:>6} {job['python_calls']:>7} {job['collectives']:>6} "
                     f"{job['step_ms']:>8.2f} {job['step_vs_single']:>9.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    bench_main("host", run, format_result, ranks=1, rounds=4, steps=40, micro_batch=1)
