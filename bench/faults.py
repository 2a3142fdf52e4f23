"""`shardwise bench faults`: one kind of fault, a worker SIGKILLed, 5 times at random steps of a
3-way data-parallel gpt-tiny job, recovered three ways, each a real `shardwise train` job:

- `restart, sync saves`: ddp on 3 ranks, a checkpoint every 25 steps written synchronously, and
  torchrun's `--max-restarts`: the whole job restarts and resumes from the newest checkpoint;
- `restart, async saves`: the same with the checkpoints written in the background (the default);
- `healing`: 3 replica groups of one rank on torchft (`--replica-groups 3`): the others go on,
  the killed group is restarted by the launcher (forked again) and copies a live group's state.

The same kills (step, worker) in each. The bench watches each job's metrics.jsonl files as they
grow (every 20 ms); it kills the next worker once the job has recovered from the last kill and
reached the next kill's step. For each kill it reports how long training made no new progress
(until a step past the last one before the kill was recorded) and the steps done again (a
restart's since its checkpoint; healing's committed steps are never done again). Under healing it
also reports how long the killed group took to rejoin, how many of the steps attempted were
committed, and whether every group's final weights are equal.

    python -m bench.faults [--steps 400] [--kills 5] [--seed 0] [--json FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import ROOT, bench_env
from bench.common import write_json
from shardwise.launch import worker_pids

EVERY = 25  # the restarts' checkpoint interval
TRAIN = ["train.eval_every=0", "train.global_batch=12", "train.micro_batch=4", "train.optimizer=sgd",
         "launch.threads_per_rank=1"]
WORKERS = 3
PATHS = {  # name -> flags; each is given as many restarts as it will be killed
    "restart, sync saves": ["--nproc", "3", "--max-restarts", "9", "--checkpoint-every", str(EVERY), "--set",
                            "train.checkpoint_async=false"],
    "restart, async saves": ["--nproc", "3", "--max-restarts", "9", "--checkpoint-every", str(EVERY)],
    "healing": ["--nproc", "1", "--replica-groups", "3", "--max-restarts", "9"],
}


class Watched:
    """A metrics.jsonl as it grows: each step record with the time it was first seen. A restarted
    job rewrites the file (truncated, then the records its checkpoint covers written again); a line
    seen before is not new, so a rewrite caught half done adds nothing twice."""

    def __init__(self, path: Path) -> None:
        self.path, self.seen, self.known = path, [], set()
        self.rewritten: float | None = None  # when a restarted job last rewrote it
        self.lines = 0

    def poll(self) -> None:
        lines = self.path.read_text().splitlines() if self.path.is_file() else []
        now = time.monotonic()
        if len(lines) < self.lines:
            self.rewritten = now
        self.lines = len(lines)
        for line in lines:
            if line in self.known or not line.endswith("}"):  # seen, or still being written
                continue
            self.known.add(line)
            record = json.loads(line)
            if record["event"] == "step":
                self.seen.append((now, record))

    def steps(self) -> int:
        return self.seen[-1][1]["step"] if self.seen else 0


def kill_plan(steps: int, kills: int, seed: int) -> list[tuple[int, int]]:
    """`kills` (step, worker) pairs: steps spread over the run at random within equal stretches
    (never on a checkpoint's step), the workers in a random order, each in turn."""
    rng = random.Random(seed)
    stretch = (steps - 40) // kills
    order = rng.sample(range(WORKERS), WORKERS)  # every worker killed in turn
    plan = []
    for i in range(kills):
        step = 20 + i * stretch + rng.randrange(stretch // 2)
        plan.append((step + (step % EVERY == 0), order[i % WORKERS]))
    return plan


def run_path(name: str, steps: int, plan: list[tuple[int, int]], out: Path) -> dict[str, Any]:
    """Run the job, kill its workers as `plan` says (each once the job has recovered from the one
    before), and measure each recovery."""
    healing = name == "healing"
    flags = PATHS[name]
    command = [sys.executable, "-m", "shardwise.cli", "train", "configs/gpt-tiny.toml", "--strategy", "ddp",
               "--steps", str(steps), "--out", str(out), *flags]
    for override in TRAIN:
        command += ["--set", override]
    started = time.monotonic()
    out.mkdir(parents=True)
    log = open(out.parent / f"{out.name}.log", "w")  # not a pipe: a full one would stall the job
    job = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log, env=bench_env(RUST_LOG="error"))
    files = [f"replica-{g}/metrics.jsonl" for g in range(WORKERS)] if healing else ["metrics.jsonl"]
    watched = [Watched(out / file) for file in files]
    pending, kills, recovering = list(plan), [], None
    while job.poll() is None:
        for each in watched:
            each.poll()
        progress = max(each.steps() for each in watched)
        if recovering is None and pending and progress >= pending[0][0]:
            _, which = pending.pop(0)
            victim = worker_pids(job.pid, which)[0] if healing else worker_pids(job.pid)[which]
            os.kill(victim, signal.SIGKILL)
            recovering = {"at": time.monotonic(), "before": progress, "worker": which}
        if recovering is not None and not healing and "restarted" not in recovering \
                and worker_pids(job.pid).get(recovering["worker"], victim) != victim:
            recovering["restarted"] = time.monotonic()  # the restarted job's rank is there
        if recovering is not None and _recovered(recovering, watched, healing):
            kills.append(recovering)
            recovering = None
        time.sleep(0.02)
    log.close()
    if job.returncode or pending or recovering is not None:
        err = Path(log.name).read_text()
        raise SystemExit(f"bench faults: {name} failed, or ended before its kills were done:\n{err[-3000:]}")
    result: dict[str, Any] = {"job_s": time.monotonic() - started, "kills": kills}
    for key in ("no_progress_s", "steps_done_again", *(("rejoin_s",) if healing else ())):
        result[key] = statistics.median(kill[key] for kill in kills)
    if healing:
        records = [[r for _, r in each.seen] for each in watched]
        committed = [[r["step"] for r in group if r["committed"]] for group in records]
        result |= {"committed_twice": sum(len(c) - len(set(c)) for c in committed),
                   "steps_committed": len(set().union(*committed)),
                   "by_group": [{"attempted": len(group), "committed": len(c)} for group, c in
                                zip(records, committed, strict=True)],
                   "final_weights_equal": _same_files([out / f"replica-{g}" / "model.safetensors"
                                                       for g in range(WORKERS)])}
    return result


def _recovered(kill: dict[str, Any], watched: list[Watched], healing: bool) -> bool:
    """Whether the job has made progress past the step it was at when `kill` happened (a restarted
    job: after rewriting its metrics; healing: the killed group back too). Fills in the measures."""
    since = kill["at"]
    if not healing:
        # Only what is recorded once the restarted job's ranks are there is its progress: a step the
        # dying job finished just before the kill can reach the file just after it. A restarted job
        # rewrites its metrics with the steps its checkpoint covers; where that is every step before
        # the kill, the file does not shrink, and what follows is simply new.
        if "restarted" not in kill:
            return False
        rewritten = watched[0].rewritten
        after = [(t, r) for t, r in watched[0].seen if t >= max(kill["restarted"], rewritten or since)]
        if not any(r["step"] > kill["before"] for _, r in after):
            return False
        kill.pop("restarted")
        kill["no_progress_s"] = next(t for t, r in after if r["step"] > kill["before"]) - since
        kill["steps_done_again"] = kill["before"] - (after[0][1]["step"] - 1)
        return True
    # The killed group's first step as healed (a step it recorded just before the kill may be seen
    # just after it, within a poll)
    back = [(t, r) for t, r in watched[kill["worker"]].seen
            if t > since and r["healed_at"] and r["healed_at"][-1] >= kill["before"]]
    onward = [t for each in watched for t, r in each.seen if t > since and r["step"] > kill["before"]]
    if not back or not onward:
        return False
    kill["no_progress_s"], kill["steps_done_again"] = min(onward) - since, 0
    kill["rejoin_s"], kill["rejoined_at_step"] = back[0][0] - since, back[0][1]["step"]
    return True


def _same_files(paths: list[Path]) -> bool:
    return len({hashlib.sha256(path.read_bytes()).hexdigest() for path in paths}) == 1


def format_result(result: dict[str, Any]) -> str:
    lines = [f"faults bench: {result['model']}, {result['fault']}"]
    for name, r in result["paths"].items():
        lines.append(f"  {name:<22} no progress for {r['no_progress_s']:5.1f} s a kill (median), "
                     f"{r['steps_done_again']:g} steps done again; job {r['job_s']:.1f} s")
        if name == "healing":
            groups = ", ".join(f"{g['committed']}/{g['attempted']}" for g in r["by_group"])
            lines.append(f"  {'':<22} the killed group back after {r['rejoin_s']:.1f} s; {r['steps_committed']} steps "
                         f"committed, {r['committed_twice']} twice; committed/attempted by group {groups}; final "
                         f"weights {'equal' if r['final_weights_equal'] else 'DIFFERENT'} across groups")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__)
    parser.add_argument("--steps", type=int, default=400, help="each job's steps")
    parser.add_argument("--kills", type=int, default=5, help="workers killed in each job")
    parser.add_argument("--seed", type=int, default=0, help="where the kills fall, and whom")
    parser.add_argument("--json", action="append", default=[])
    args = parser.parse_args()
    plan = kill_plan(args.steps, args.kills, args.seed)
    paths = {}
    with tempfile.TemporaryDirectory(prefix="bench-faults-", dir=ROOT / "runs" if (ROOT / "runs").is_dir()
                                     else None) as scratch:
        for name in PATHS:
            paths[name] = run_path(name, args.steps, plan, Path(scratch) / name.replace(", ", "-"))
    result = {"bench": "faults", "model": "gpt-tiny, 3-way data parallel, global batch 12, SGD",
              "fault": f"SIGKILL of one worker, {args.kills} times in {args.steps} steps (step, worker): {plan}",
              "paths": paths}
    write_json(result, args.json)
    print(format_result(result), flush=True)


if __name__ == "__main__":
    main()
