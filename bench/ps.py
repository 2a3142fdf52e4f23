"""`shardwise bench ps`: the parameter server (sync and async), `dp` and `ddp` on the same model,
global batch and number of workers, each a real `shardwise train` job, alternated A B C D A B C D.

Throughput is each job's own median step time (its first step, warm-up, left out); whole jobs are
alternated so the machine's drift hits every strategy alike. The loss columns show what async
training costs in quality for its speed.

    python -m bench.ps [--steps 20] [--rounds 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench import ROOT
from bench.common import write_json

WORKERS = 2
MODEL = ["model.preset=small", "data.name=shakespeare", "train.global_batch=16", "train.micro_batch=8",
         "train.warmup_steps=2", "train.eval_every=0", "train.eval_batches=2", "launch.threads_per_rank=1"]
JOBS = {  # name -> (strategy, processes, extra overrides); every one trains on 2 workers' worth of devices
    "ps-sync": ("param-server", WORKERS + 1, ["parallel.param_server.mode=sync"]),
    "ps-async": ("param-server", WORKERS + 1, ["parallel.param_server.mode=async"]),
    "dp": ("dp", 1, [f"parallel.replicas={WORKERS}"]),
    "ddp": ("ddp", WORKERS, []),
}
def run_job(name: str, steps: int, out: Path) -> dict[str, Any]:
    strategy, nproc, extra = JOBS[name]
    command = [sys.executable, "-m", "shardwise.cli", "train", "configs/gpt-tiny.toml", "--strategy", strategy,
               "--nproc", str(nproc), "--steps", str(steps), "--out", str(out)]
    for override in [*MODEL, *extra]:
        command += ["--set", override]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"bench ps: {name} failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = next(r for r in records if r["event"] == "summary")
    result = {"tokens_per_s": summary["tokens_per_s"], "final_loss": summary["final_loss"],
              "val_loss": summary["val_loss"]}
    if strategy == "param-server":
        result["server"] = json.loads((out / "param-server-0.json").read_text())
    return result


def run(steps: int, rounds: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in JOBS}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(rounds):
            for name in JOBS:
                runs[name].append(run_job(name, steps, Path(scratch) / f"{name}-{round_}"))
                print(f"  round {round_ + 1}/{rounds} {name:<9}{runs[name][-1]['tokens_per_s']:9,.0f} tokens/s",
                      flush=True)
    jobs = {}
    for name, results in runs.items():
        jobs[name] = {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in results),
            "tokens_per_s_by_round": [r["tokens_per_s"] for r in results],
            "final_loss": statistics.median(r["final_loss"] for r in results),
            "val_loss": statistics.median(r["val_loss"] for r in results),
            **({"server": results[-1]["server"]} if "server" in results[-1] else {}),
        }
    ddp = jobs["ddp"]["tokens_per_s"]
    for job in jobs.values():
        job["vs_ddp"] = job["tokens_per_s"] / ddp
    return {"model": "gpt small (10.7M parameters), Shakespeare, global batch 16", "workers": WORKERS,
            "steps": steps, "rounds": rounds, "cpu_cores": os.cpu_count(),
            "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
            "processes": {name: nproc for name, (_, nproc, _) in JOBS.items()}, "jobs": jobs}


def format_result(result: dict[str, Any]) -> str:
    lines = [f"ps bench: {result['model']}, {result['workers']} workers' worth of devices, {result['steps']} steps, "
             f"medians of {result['rounds']} rounds; load average {result['load_average_1min']['before']:.1f} before, "
             f"{result['load_average_1min']['after']:.1f} after on {result['cpu_cores']} cores",
             f"  {'job':<10}{'processes':>10}{'tokens/s':>11}{'vs ddp':>8}{'final loss':>12}{'val loss':>10}"]
    for name, job in result["jobs"].items():
        lines.append(f"  {name:<10}{result['processes'][name]:>10}{job['tokens_per_s']:>11,.0f}"
                     f"{job['vs_ddp']:>7.2f}x{job['final_loss']:>12.4f}{job['val_loss']:>10.4f}")
    server = result["jobs"]["ps-async"]["server"]
    lines.append(f"  ps-async applied {server['updates']} pushes by staleness {server['staleness']}, "
                 f"dropped {server['dropped']} (bound {server['max_staleness']})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ps", description=__doc__)
    parser.add_argument("--steps", type=int, default=20, help="training steps per job")
    parser.add_argument("--rounds", type=int, default=2, help="times every job is run, alternated")
    parser.add_argument("--json", action="append", default=[], help="write the result here (repeatable)")
    args = parser.parse_args()
    result = run(args.steps, args.rounds)
    write_json(result, args.json)
    print(format_result(result), flush=True)


if __name__ == "__main__":
    main()
