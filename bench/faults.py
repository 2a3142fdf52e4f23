"""`shardwise bench faults`: one fault, a worker SIGKILLed at step K of a 3-way data-parallel
gpt-tiny job, recovered three ways, each a real `shardwise train` job:

- `restart, sync saves`: ddp on 3 ranks, a checkpoint every 25 steps written synchronously, and
  torchrun's `--max-restarts 1`: the whole job restarts and resumes from the newest checkpoint;
- `restart, async saves`: the same with the checkpoints written in the background (the default);
- `healing`: 3 replica groups of one rank on torchft (`--replica-groups 3`): the others go on,
  the killed group is restarted by its torchrun and copies a live group's state.

The bench watches each job's metrics.jsonl as it grows (every 20 ms), kills the worker once the
job has recorded step K, and reports: how long training made no new progress (until a step past
the last one before the kill was recorded), the steps done again (a restart's since its
checkpoint; healing's committed steps are never done again), and under healing how long the
killed group took to rejoin and how many of the steps attempted were committed.

    python -m bench.faults [--steps 300] [--kill-at 110] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import ROOT, bench_env
from bench.common import write_json

EVERY = 25  # the restarts' checkpoint interval
TRAIN = ["train.eval_every=0", "train.global_batch=12", "train.micro_batch=4", "train.optimizer=sgd",
         "launch.threads_per_rank=1"]
PATHS = {  # name -> (flags, the run directory's metrics files watched: the first is the job's progress)
    "restart, sync saves": (["--nproc", "3", "--max-restarts", "1", "--checkpoint-every", str(EVERY), "--set",
                             "train.checkpoint_async=false"], ["metrics.jsonl"]),
    "restart, async saves": (["--nproc", "3", "--max-restarts", "1", "--checkpoint-every", str(EVERY)],
                             ["metrics.jsonl"]),
    "healing": (["--nproc", "1", "--replica-groups", "3", "--max-restarts", "1"],
                ["replica-0/metrics.jsonl", "replica-1/metrics.jsonl"]),
}


class Watched:
    """A metrics.jsonl as it grows: each step record with the time it was first seen."""

    def __init__(self, path: Path) -> None:
        self.path, self.seen, self.lines = path, [], 0
        self.rewritten: float | None = None  # when a restarted job rewrote it

    def poll(self) -> None:
        lines = self.path.read_text().splitlines() if self.path.is_file() else []
        if len(lines) < self.lines:  # a restarted job rewrote it, keeping what its checkpoint covered
            self.lines, self.rewritten = len(lines), time.monotonic()
            return
        now = time.monotonic()
        for line in lines[self.lines:]:
            record = json.loads(line)
            if record["event"] == "step":
                self.seen.append((now, record))
        self.lines = len(lines)

    def steps(self) -> int:
        return self.seen[-1][1]["step"] if self.seen else 0


def victim(out: Path, healing: bool) -> int:
    """The worker to kill: rank 1 of the job, or the worker of replica group 1."""
    wanted = b"SHARDWISE_REPLICA_GROUP=1" if healing else b"RANK=1"
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if (b"shardwise.worker" in cmdline and b"torch.distributed.run" not in cmdline
                and str(out / "config.toml").encode() in cmdline and wanted in environ):
            return int(entry.name)
    raise SystemExit(f"bench faults: no worker to kill under {out}")


def run_path(name: str, steps: int, kill_at: int, out: Path) -> dict[str, Any]:
    flags, files = PATHS[name]
    command = [sys.executable, "-m", "shardwise.cli", "train", "configs/gpt-tiny.toml", "--strategy", "ddp",
               "--steps", str(steps), "--out", str(out), *flags]
    for override in TRAIN:
        command += ["--set", override]
    started = time.monotonic()
    out.mkdir(parents=True)
    log = open(out.parent / f"{out.name}.log", "w")  # not a pipe: a full one would stall the job
    job = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log, env=bench_env(RUST_LOG="error"))
    watched = [Watched(out / file) for file in files]
    killed = None
    while job.poll() is None:
        for each in watched:
            each.poll()
        if killed is None and watched[-1].steps() >= kill_at:
            before = watched[0].steps()
            os.kill(victim(out, name == "healing"), signal.SIGKILL)
            killed = time.monotonic()
        time.sleep(0.02)
    log.close()
    if job.returncode or killed is None:
        err = Path(log.name).read_text()
        raise SystemExit(f"bench faults: {name} failed, or ended before step {kill_at}:\n{err[-3000:]}")
    for each in watched:
        each.poll()
    # What the job recorded once it had recovered: a restarted job's records from its rewrite on
    # (a step the dying job's other ranks finished as the worker was killed does not count).
    since = watched[0].rewritten if name != "healing" and watched[0].rewritten is not None else killed
    after = [(t, r) for t, r in watched[0].seen if t >= since]
    progress = next(t for t, r in after if r["step"] > before)
    result = {"job_s": time.monotonic() - started, "steps_before_kill": before,
              "no_progress_s": progress - killed}
    if name == "healing":
        committed = [r["step"] for _, r in watched[0].seen if r["committed"]]
        rejoined = next((t, r) for t, r in watched[1].seen if t > killed)
        result |= {"steps_done_again": len(committed) - len(set(committed)),
                   "attempted": len(watched[0].seen), "committed": len(committed),
                   "committed_while_away": sum(1 for _, r in after if r["committed"] and r["replica_groups"] < 3),
                   "rejoin_s": rejoined[0] - killed, "rejoined_at_step": rejoined[1]["healed_at"][-1]}
    else:
        resumed = next(r["step"] for t, r in after) - 1  # the checkpoint the restarted job resumed from
        result |= {"steps_done_again": before - resumed, "resumed_from": resumed}
    return result


def format_result(result: dict[str, Any]) -> str:
    lines = [f"faults bench: {result['model']}, {result['fault']}"]
    for name, r in result["paths"].items():
        again = f"{r['steps_done_again']} steps done again"
        extra = (f"; group rejoined after {r['rejoin_s']:.1f} s at step {r['rejoined_at_step']}, "
                 f"{r['committed_while_away']} steps committed without it, {r['committed']} of {r['attempted']} "
                 "attempts committed") if name == "healing" else f" (resumed from step {r['resumed_from']})"
        lines.append(f"  {name:<22} no progress for {r['no_progress_s']:5.1f} s, {again}{extra}; job "
                     f"{r['job_s']:.1f} s")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kill-at", type=int, default=110, help="a step between checkpoints (every 25)")
    parser.add_argument("--json", action="append", default=[])
    args = parser.parse_args()
    paths = {}
    with tempfile.TemporaryDirectory(prefix="bench-faults-", dir=ROOT / "runs" if (ROOT / "runs").is_dir()
                                     else None) as scratch:
        for name in PATHS:
            paths[name] = run_path(name, args.steps, args.kill_at, Path(scratch) / name.replace(", ", "-"))
    result = {"bench": "faults", "model": "gpt-tiny, 3-way data parallel, global batch 12, SGD",
              "fault": f"SIGKILL of one worker at step {args.kill_at} of {args.steps}", "paths": paths}
    write_json(result, args.json)
    print(format_result(result), flush=True)


if __name__ == "__main__":
    main()
