"""`shardwise bench recovery`: a node lost, and the job recovered by a restart from disk or elastically
from memory (issue 74: elastic from memory within 0.3x of a restart from disk, on a model of at
least 1 GiB of state across the ranks).

The job: GPT-2 124M (sequences of 64 tokens; with AdamW's two moments, 1.49 GB of state, 0.5 GB a
rank) under fsdp on 3 network-namespace nodes of one process each, a global batch of 6, AdamW.
Once step 6 is written (and, on disk, step 4's checkpoint is whole), node 2's processes are
SIGKILLed.

- `restart from disk`: 3 nodes, checkpoints on disk every 4 steps (written in the background, the
  default) and --max-restarts 1. At the kill, the checkpoints' files are dropped from the page cache
  (posix_fadvise DONTNEED; they were fsynced when sealed), so that the restart reads the disk; the
  libraries stay cached, as on surviving nodes. Node 2 is started again at once (a spare node): the
  agents stop the survivors' workers and start all three again, which read the newest checkpoint.
- `elastic from memory, every 4`: --nnodes 2:3, memory checkpoints every 4 steps and none on disk:
  the two survivors re-form the world in their own processes, restore the newest generation from
  the memory they hold (node 2's file on node 0), and go on at 2.
- `elastic from memory, every step`: the same, a memory checkpoint after every step, which costs a
  copy of the state in host memory where a disk checkpoint writes it: the target's comparison.

The kill falls half a step after step 6's record (the median time between records so far, saves
included, which the table shows a step), so every way loses half a step in flight as well as the
steps since its checkpoint.

Each is timed from the kill, by the lines the nodes print (stamped as they arrive) and the steps
metrics.jsonl holds (read every 20 ms):
- detection: until a survivor's worker reports its collective failed on the lost peer;
- re-forming: until the state starts to be restored: a world formed again and the trainer built in
  it (for the restart: the agents' rendezvous, new processes, their imports);
- restoring: reading the state into the trainer (the run says how long: the disk read and load, or
  the files fetched from the peers and loaded);
- redoing: until the job has as many steps as at the kill again.

    python -m bench.recovery [--steps 12] [--preset gpt2-124m] [--json FILE]   # as root
"""

from __future__ import annotations

import argparse
import itertools
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

from bench import ROOT, bench_env
from bench.checkpoint import drop_from_page_cache
from bench.common import write_json
from bench.netns import Cluster
from shardwise.peer_checkpoints import node_directory

EVERY = 4  # steps between checkpoints (on disk, or in memory)
KILLED_AFTER = 6  # steps written when node 2 is killed: the two since the checkpoint are redone
TRAIN = ["train.optimizer=adamw", "train.global_batch=6", "train.micro_batch=1", "train.eval_every=0",
         "model.seq_len=64", "launch.threads_per_rank=1", "launch.timeout_s=30", "launch.shutdown_timeout_s=5"]
ELASTIC = ["--nnodes", "2:3", "--max-restarts", "1"]
WAYS = {
    "restart from disk": ["--nnodes", "3", "--max-restarts", "1", "--resume", "--checkpoint-every", str(EVERY)],
    f"elastic from memory, every {EVERY}": [*ELASTIC, "--set", f"train.memory_checkpoint_every={EVERY}"],
    "elastic from memory, every step": [*ELASTIC, "--set", "train.memory_checkpoint_every=1"],
}
LOST = re.compile(r"a peer was lost|Connection reset by peer|Connection closed by peer")
RESTORED = re.compile(r"(?:restored step (\d+) from the nodes' memory .* in|resumed from \S+ \(step (\d+),"
                      r" .*read in) ([\d.]+) s\)")


class Lines:
    """A process's output, line by line, each with the monotonic time it arrived."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: list[tuple[float, str]] = []
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def first(self, pattern: re.Pattern, since: float) -> tuple[float, re.Match] | None:
        return next(((t, found) for t, line in list(self.lines) if t >= since and (found := pattern.search(line))),
                    None)

    def tail(self) -> str:
        return "\n".join(line for _, line in self.lines[-40:] if not line.startswith(("E1", "W1", "[W", "frame")))


def steps_written(out: Path) -> int:
    metrics = out / "metrics.jsonl"
    return metrics.read_text().count('"event": "step"') if metrics.is_file() else 0


def recover(way: str, preset: str, steps: int, out: Path) -> dict[str, Any]:
    """One job of the way `way`, node 2 killed half a step after KILLED_AFTER steps; its recovery's parts."""
    config = str(ROOT / "configs" / "gpt-tiny.toml")
    flags = ["--strategy", "fsdp", "--steps", str(steps), "--out", str(out), "--set", f"model.preset={preset}",
             *WAYS[way], *(a for s in TRAIN for a in ("--set", s))]
    with Cluster(3) as nodes:
        processes = nodes.train(config, flags, cwd=ROOT, env=bench_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        lines = [Lines(process.stderr) for process in processes]
        written: list[float] = []  # when each step's record appeared

        def wait_for(condition: Any, what: str, timeout: float = 600) -> None:
            deadline = time.monotonic() + timeout
            while not condition():
                ended = [rank for rank, p in enumerate(processes[:2]) if p.poll() is not None]
                if ended or time.monotonic() > deadline:
                    tails = "\n".join(f"--- node {rank}:\n{node.tail()}" for rank, node in enumerate(lines))
                    raise SystemExit(f"bench recovery: {way}: {what}: "
                                     f"{f'node {ended[0]} ended' if ended else 'timed out'}:\n{tails}")
                time.sleep(0.02)

        def written_after(count: int) -> bool:
            while len(written) < steps_written(out):
                written.append(time.monotonic())
            return len(written) >= count

        latest = out / "checkpoints" / "latest"
        on_disk = way == "restart from disk"
        wait_for(lambda: written_after(KILLED_AFTER) and (not on_disk or latest.is_file()), f"{KILLED_AFTER} steps")
        step_s = statistics.median(b - a for a, b in itertools.pairwise(written[1:]))  # saves included
        time.sleep(step_s / 2)  # a kill half-way through a step
        lost_at, killed = steps_written(out), time.monotonic()
        nodes.kill(2)
        shutil.rmtree(node_directory(out, nodes.nodes[2].addr), ignore_errors=True)  # its memory, with the node
        uncached = 0
        if on_disk:
            drop_from_page_cache(out / "checkpoints")
            uncached = sum(file.stat().st_size for file in (out / "checkpoints").rglob("*") if file.is_file())
            again = nodes.popen(2, nodes.train_argv(2, config, 1, flags), cwd=ROOT, env=bench_env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            lines.append(Lines(again.stderr))
        wait_for(lambda: lines[0].first(RESTORED, killed), "no restore")
        restored_at, found = lines[0].first(RESTORED, killed)
        restored = int(found[1] or found[2])
        # Back where it was: the records of the steps to redo dropped at the restore, then written again
        dropped = restored >= lost_at

        def redone() -> bool:
            nonlocal dropped
            now = steps_written(out)
            dropped = dropped or now < lost_at
            return dropped and now >= lost_at

        wait_for(redone, "redoing the lost steps")
        back = time.monotonic()
        detected = min(seen[0] for node in lines[:2] if (seen := node.first(LOST, killed)))
    for node in nodes.nodes:  # the job was stopped, not ended: its memory checkpoints were left
        shutil.rmtree(node_directory(out, node.addr), ignore_errors=True)
    restore_s = float(found[3])
    return {
        "way": way, "step_s": step_s, "steps_at_kill": lost_at, "restored_step": restored,
        "detection_s": detected - killed, "reforming_s": restored_at - restore_s - detected,
        "restoring_s": restore_s, "redoing_s": max(0.0, back - restored_at), "total_s": max(back, restored_at) - killed,
        "checkpoint_bytes_uncached": uncached,
    }


def run(preset: str, steps: int, scratch: Path) -> dict[str, Any]:
    ways = {way: recover(way, preset, steps, scratch / way.replace(" ", "-").replace(",", "")) for way in WAYS}
    disk, every_step = ways["restart from disk"], ways["elastic from memory, every step"]
    ratio = every_step["total_s"] / disk["total_s"]
    return {"preset": preset, "nodes": 3, "strategy": "fsdp", "killed_after": KILLED_AFTER,
            "ways": list(ways.values()), "memory_over_disk": ratio, "target": 0.3, "met": ratio <= 0.3}


def format_result(result: dict[str, Any]) -> str:
    lines = [f"recovery: gpt {result['preset']} under fsdp on 3 namespace nodes, node 2 killed half a step after "
             f"step {result['killed_after']}",
             f"  {'way':<33} {'s/step':>6} {'restored':>8} {'detection':>10} {'re-forming':>11} {'restoring':>10} "
             f"{'redoing':>8} {'total':>8}"]
    for way in result["ways"]:
        lines.append(f"  {way['way']:<33} {way['step_s']:>6.2f} {way['restored_step']:>8} {way['detection_s']:>9.2f}s "
                     f"{way['reforming_s']:>10.2f}s {way['restoring_s']:>9.2f}s {way['redoing_s']:>7.2f}s "
                     f"{way['total_s']:>7.2f}s")
    lines.append(f"  elastic from memory every step / restart from disk: {result['memory_over_disk']:.3f} (target <= "
                 f"{result['target']}: {'met' if result['met'] else 'NOT met'})")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.recovery", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="each job's steps (it is stopped once recovered)")
    parser.add_argument("--preset", default="gpt2-124m", help="the GPT's size")
    parser.add_argument("--json", action="append", default=[], help="write the result here (repeatable)")
    args = parser.parse_args()
    if args.steps <= KILLED_AFTER:
        raise SystemExit(f"bench recovery: --steps {args.steps}: the job must outlast step {KILLED_AFTER}, the kill")
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as scratch:
        result = run(args.preset, args.steps, Path(scratch))
    write_json(result, args.json)
    print(format_result(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
