"""Measured mode: train candidates for a few steps on the real ranks, in one world, and report
their step times and the bytes `memory` counts, to set beside the predictions.

Candidates take turns one step at a time (A B C A B C), so the machine's drift hits all alike;
each first runs one step to warm up and one whose memory is recorded as metrics.jsonl records
it (after the step, before the gradients are dropped).

`shardwise plan --measure K` runs this module on every rank under torch.distributed.run:

    python -m shardwise.measure CONFIG CANDIDATES.json OUT.json --steps N
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import record

from shardwise.config.load import load_config
from shardwise.config.schema import Config
from shardwise.dist import DistContext, init_distributed, leave_process, shutdown_distributed
from shardwise.planner.candidates import Candidate
from shardwise.planner.model import PlanError
from shardwise.planner.search import Plan
from shardwise.trainer import Trainer


def measure_candidates(ctx: DistContext, base: Config, candidates: list[Candidate], steps: int) -> list[dict[str, Any]]:
    """Per candidate: the median step time over `steps` steps and every rank's counted memory."""
    trainers = {c: Trainer(c.config(base, ctx.world_size), ctx) for c in candidates}
    counted = {}
    for candidate, trainer in trainers.items():
        trainer.run_step(0)
        trainer.train_step(1).item()
        counted[candidate] = ctx.all_gather_object(trainer.memory().as_dict())  # before the gradients are dropped
        trainer.optimizer.zero_grad(set_to_none=True)
    times: dict[Candidate, list[float]] = {c: [] for c in candidates}
    for step in range(2, 2 + steps):
        for candidate, trainer in trainers.items():
            started = time.perf_counter()
            trainer.run_step(step)
            times[candidate].append(time.perf_counter() - started)
    return [{"candidate": c.as_dict(), "measured_step_s": statistics.median(times[c]), "step_times_s": times[c],
             "memory_by_rank": counted[c]} for c in candidates]


def measure_plan(plan: Plan, count: int, steps: int) -> list[dict[str, Any]]:
    """Train the plan's `count` fastest-predicted candidates that fit for `steps` steps each on
    this machine's ranks (workers started through torch.distributed.run); their measurements,
    predictions beside them, fastest measured first."""
    from shardwise.launch import WorkerFailed, launch_workers

    if plan.nodes != 1:
        raise PlanError(f"--measure runs on this machine's ranks; the plan is for {plan.nodes} nodes: "
                        "plan with --nproc N for this machine, or measure on the cluster itself")
    chosen = [e for e in plan.ranked if e.fits][:count]
    if not chosen:
        raise PlanError(f"--measure: nothing fits to measure ({plan.reason})")
    with tempfile.TemporaryDirectory() as tmp:
        # Saved as the first candidate, so the workers' load_config validates it on this world.
        first = chosen[0].candidate.config(plan.cfg, plan.world_size)
        cfg = dataclasses.replace(first, train=dataclasses.replace(first.train, steps=steps + 2),
                                  launch=dataclasses.replace(first.launch, nproc=plan.world_size, nnodes=1))
        cfg.save(Path(tmp) / "config.toml")
        (Path(tmp) / "candidates.json").write_text(json.dumps([e.candidate.as_dict() for e in chosen]))
        out = Path(tmp) / "measured.json"
        try:
            launch_workers(cfg.launch, ["shardwise.measure", str(Path(tmp) / "config.toml"),
                                        str(Path(tmp) / "candidates.json"), str(out), "--steps", str(steps)])
        except WorkerFailed as failure:
            raise PlanError(f"--measure: a worker failed: {failure}") from None
        measured = json.loads(out.read_text())
    for entry, evaluated in zip(measured, chosen, strict=True):
        entry["predicted_step_s"] = evaluated.step.total
        entry["predicted_memory"] = evaluated.memory.as_dict()
    return sorted(measured, key=lambda entry: entry["measured_step_s"])


@record
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m shardwise.measure", description=__doc__)
    parser.add_argument("config")
    parser.add_argument("candidates", help="JSON list of candidates (Candidate fields)")
    parser.add_argument("out", help="where rank 0 writes the measurements (JSON)")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args(argv)
    base = load_config(args.config)
    candidates = [Candidate(**fields) for fields in json.loads(Path(args.candidates).read_text())]
    ctx = init_distributed(base.launch.backend, base.launch.timeout_s, base.launch.threads_per_rank)
    results = measure_candidates(ctx, base, candidates, args.steps)
    if ctx.is_main:
        Path(args.out).write_text(json.dumps(results))
    shutdown_distributed()


if __name__ == "__main__":
    main()
    leave_process()
