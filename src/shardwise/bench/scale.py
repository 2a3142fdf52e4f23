"""`shardwise bench scale`: the largest GPT that trains a few steps (`--steps`, 2 in the results)
within a memory budget on this machine, under `single` (one process) and `ddp`, `zero2`, `fsdp`
and `fsdp-native` (4 processes), with SGD (momentum) and AdamW; each rank's peak resident set
and the planner's prediction beside it.

The budget (`--budget-gib`) is the memory of all of a job's ranks together: a job fits if it
trains its steps and its ranks' peak resident sets add up to at most the budget. A watchdog adds
up the ranks' resident sets ten times a second and kills a job that holds more at once, so the
shared machine never runs out. The models: GPTs of 32 blocks of width d (d / 64 heads), a
32-token context, the byte vocabulary, one sequence per rank per step, built on the meta device
as `shardwise train` builds them; the size searched is the width, in steps of 64.

Search, coarse then fine: the planner predicts every width (model state, activations and
buffers per rank, plus the runtime's own resident set, measured by the jobs) and names the widest
it expects to fit; real jobs then go up one width step at a time while they fit, or down until
one does. Every job is reported, fitting or not.

    shardwise bench scale [--budget-gib 16] [--steps 2]   (or python -m shardwise.bench.scale ... [--json FILE])
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

from shardwise.bench.common import write_json
from shardwise.config import Config, load_config
from shardwise.planner.candidates import Candidate
from shardwise.planner.memory import predict_memory, predict_setup_bytes
from shardwise.planner.model import model_facts, model_shape
from shardwise.strategies.registry import spec

STRATEGIES = ("single", "ddp", "zero2", "fsdp", "fsdp-native")
OPTIMIZERS = ("sgd", "adamw")
RANKS = 4  # processes of every multi-rank job
N_LAYER, SEQ_LEN, HEAD_WIDTH, WIDTH_STEP = 32, 32, 64, 64
RESULT = "SCALE-RESULT "  # the line rank 0 prints its job's measurements on
GIB = 2**30


def scale_config(strategy: str, optimizer: str, width: int, world: int, steps: int) -> Config:
    return load_config(None, [
        f"model.n_layer={N_LAYER}", f"model.d_model={width}", f"model.n_head={width // HEAD_WIDTH}",
        f"model.seq_len={SEQ_LEN}", "model.vocab_size=256", "data.name=synthetic-tokens",
        f"parallel.strategy={strategy}", f"launch.nproc={world}", f"train.optimizer={optimizer}",
        "train.micro_batch=1", f"train.global_batch={world}", f"train.steps={steps}", "train.warmup_steps=0",
        "train.eval_every=0", "train.lr=1e-4", "run.out=unused"])


def ranks_of(strategy: str) -> int:
    return 1 if spec(strategy).one_process else RANKS


def parameters(width: int) -> int:
    facts = model_facts(model_shape(scale_config("single", "sgd", width, 1, 1).model))
    return facts.params_total


def planned(strategy: str, optimizer: str, width: int, steps: int) -> dict[str, int]:
    """The planner's bytes per rank: at its peak in a step, and while the model is materialised."""
    world = ranks_of(strategy)
    cfg = scale_config(strategy, optimizer, width, world, steps)
    candidate = Candidate(strategy, world, 1, 1, "fp32", "none", 1)
    return {"step": predict_memory(candidate, cfg)[0].total, "setup": predict_setup_bytes(candidate, cfg)}


# --- one job: `--worker`, on every rank under torchrun ------------------------------------------

def worker(job: dict[str, Any]) -> None:
    from shardwise.dist import init_distributed, leave_process, shutdown_distributed
    from shardwise.memory import resident_bytes
    from shardwise.trainer import Trainer

    ctx = init_distributed("gloo", timeout_s=1800, threads_per_rank=1)
    trainer = Trainer(scale_config(job["strategy"], job["optimizer"], job["width"], ctx.world_size, job["steps"]),
                      ctx)
    started = time.perf_counter()
    losses = [trainer.run_step(step) for step in range(job["steps"])]
    seconds = time.perf_counter() - started
    mine = {"peak_rss": resident_bytes()[1], "runtime_rss": trainer.baseline_rss, "setup_rss": trainer.setup_rss,
            "setup_counted": trainer.strategy.setup_peak_bytes, "counted": trainer.memory().as_dict()}
    ranks = ctx.all_gather_object(mine)
    if ctx.is_main:
        print(RESULT + json.dumps({"losses": losses, "seconds": seconds, "ranks": ranks}), flush=True)
    shutdown_distributed()
    leave_process()


# --- the driver: jobs under a watchdog, the search ---------------------------------------------

def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry))
    found, stack = [], list(children.get(root, []))
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack += children.get(pid, [])
    return found


def resident(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def wait_for_memory(budget: int, patience_s: float = 600.0) -> None:
    """Start a job only when the machine has its budget available (other work shares it)."""
    deadline = time.monotonic() + patience_s
    while machine_memory()["MemAvailable"] < budget:
        if time.monotonic() > deadline:
            raise SystemExit(f"bench scale: {budget / GIB:.1f} GiB not available for {patience_s:.0f} s; "
                             "lower --budget-gib or wait for a quieter machine")
        time.sleep(5)


def run_job(strategy: str, optimizer: str, width: int, steps: int, budget: int) -> dict[str, Any]:
    """One job under the watchdog: its measurements, or why it did not fit."""
    wait_for_memory(budget)
    job = {"strategy": strategy, "optimizer": optimizer, "width": width, "steps": steps}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks_of(strategy)}",
               "-m", "shardwise.bench.scale", "--worker", json.dumps(job)]
    outcome: dict[str, Any] = {"width": width, "params": parameters(width), "planned": planned(strategy, optimizer,
                                                                                               width, steps)}
    most = 0
    with tempfile.TemporaryFile("w+") as out:
        started = time.perf_counter()
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
        while process.poll() is None:
            held = sum(resident(pid) for pid in descendants(process.pid))  # the ranks, not torchrun's agent
            most = max(most, held)
            if held > budget:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                break
            time.sleep(0.1)
        outcome["wall_s"] = round(time.perf_counter() - started, 1)
        out.seek(0)
        text = out.read()
    outcome["watched_peak_gib"] = round(most / GIB, 3)
    line = next((line for line in text.splitlines() if line.startswith(RESULT)), None)
    if most > budget:
        return {**outcome, "fits": False, "why": f"the ranks held {most / GIB:.2f} GiB at once: killed"}
    if process.returncode or line is None:
        last = [line for line in text.splitlines() if line.strip()][-3:]
        return {**outcome, "fits": False, "why": f"exit {process.returncode}: {' | '.join(last)[-400:]}"}
    result = json.loads(line[len(RESULT):])
    peaks = [rank["peak_rss"] for rank in result["ranks"]]
    outcome.update(fits=sum(peaks) <= budget, peak_rss_gib=[round(p / GIB, 3) for p in peaks],
                   runtime_rss_gib=round(max(rank["runtime_rss"] for rank in result["ranks"]) / GIB, 3),
                   setup_rss_gib=[round(rank["setup_rss"] / GIB, 3) for rank in result["ranks"]],
                   setup_counted_gib=[None if rank["setup_counted"] is None else round(rank["setup_counted"] / GIB, 3)
                                      for rank in result["ranks"]],
                   step_s=round(result["seconds"] / steps, 2), losses=result["losses"])
    if not outcome["fits"]:
        outcome["why"] = f"peaks add up to {sum(peaks) / GIB:.2f} GiB"
    return outcome


def round_width(width: float) -> int:
    return int(round(width / WIDTH_STEP)) * WIDTH_STEP


def largest(strategy: str, optimizer: str, steps: int, budget: int, runtime: int) -> dict[str, Any]:
    """The widest GPT that fits: the planner's widest (coarse, every width predicted), then real
    jobs one width step at a time, up while they fit or down until one does (fine)."""
    per_rank = budget / ranks_of(strategy)
    narrowest = 2 * WIDTH_STEP
    widths = range(narrowest, 256 * WIDTH_STEP + 1, WIDTH_STEP)
    fitting = [w for w in widths if planned(strategy, optimizer, w, steps)["step"] + runtime <= per_rank]
    attempts: dict[int, dict[str, Any]] = {}

    def fits(width: int) -> bool:
        attempts[width] = run_job(strategy, optimizer, width, steps, budget)
        a = attempts[width]
        print(f"  {strategy:<12}{optimizer:<6} width {width:>5} ({a['params'] / 1e6:7.1f} M params): "
              f"{'fits' if a['fits'] else 'does not fit (' + a['why'][:80] + ')'}, {a['wall_s']} s", flush=True)
        return a["fits"]

    width = fitting[-1] if fitting else narrowest
    if fits(width):
        low = width
        while fits(low + WIDTH_STEP):
            low += WIDTH_STEP
    else:
        low = width - WIDTH_STEP
        while low >= narrowest and not fits(low):
            low -= WIDTH_STEP
        low = low if low >= narrowest else None
    best = attempts.get(low) if low is not None else None
    return {"strategy": strategy, "optimizer": optimizer, "ranks": ranks_of(strategy),
            "largest_width": low, "largest_params": best["params"] if best else 0,
            "largest": best, "attempts": [attempts[w] for w in sorted(attempts)]}


def machine_memory() -> dict[str, int]:
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return {key: int(fields[key].split()[0]) * 1024 for key in ("MemTotal", "MemAvailable")}


def run(budget_gib: float, steps: int, strategies: list[str], optimizers: list[str]) -> dict[str, Any]:
    budget = int(budget_gib * GIB)
    memory = machine_memory()
    if memory["MemTotal"] < budget:
        raise SystemExit(f"bench scale: --budget-gib {budget_gib}: the machine has {memory['MemTotal'] / GIB:.1f} GiB")
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    runtime = int(0.5 * GIB)  # until a job has measured it
    searches = []
    for optimizer in optimizers:
        for strategy in strategies:
            search = largest(strategy, optimizer, steps, budget, runtime)
            measured = [a["runtime_rss_gib"] for a in search["attempts"] if "runtime_rss_gib" in a]
            runtime = int(max(measured, default=runtime / GIB) * GIB)
            searches.append(search)
    by = {(s["strategy"], s["optimizer"]): s["largest_params"] for s in searches}
    compared = [opt for opt in optimizers if by.get(("ddp", opt)) and ("fsdp", opt) in by]
    return {
        "bench": "scale",
        "budget_gib": budget_gib,
        "steps": steps,
        "model": {"n_layer": N_LAYER, "seq_len": SEQ_LEN, "head_width": HEAD_WIDTH, "vocab_size": 256,
                  "micro_batch_per_rank": 1},
        "machine": {"cpus": os.cpu_count(), "mem_total_gib": round(memory["MemTotal"] / GIB, 1),
                    "mem_available_gib_at_start": round(memory["MemAvailable"] / GIB, 1)},
        "load_average": {"before": load_before, "after": os.getloadavg()[0]},
        "wall_s": round(time.perf_counter() - started),
        "fsdp_over_ddp": {opt: round(by["fsdp", opt] / by["ddp", opt], 2) for opt in compared},
        "searches": searches,
    }


def format_result(result: dict[str, Any]) -> str:
    lines = [f"bench scale: the largest GPT ({N_LAYER} blocks) that trains {result['steps']} steps within "
             f"{result['budget_gib']} GiB (load {result['load_average']['before']:.1f} -> "
             f"{result['load_average']['after']:.1f}, {result['wall_s']} s)",
             f"{'strategy':<13}{'opt':<7}{'ranks':>5}{'width':>7}{'params':>10}{'peak RSS/rank GiB':>19}"
             f"{'planned GiB':>13}"]
    for s in result["searches"]:
        best = s["largest"]
        if best is None:
            lines.append(f"{s['strategy']:<13}{s['optimizer']:<7}{s['ranks']:>5}   none fits")
            continue
        lines.append(f"{s['strategy']:<13}{s['optimizer']:<7}{s['ranks']:>5}{s['largest_width']:>7}"
                     f"{best['params'] / 1e6:>9.0f}M{max(best['peak_rss_gib']):>19.2f}"
                     f"{best['planned']['step'] / GIB + best['runtime_rss_gib']:>13.2f}")
    lines.append("fsdp / ddp, parameters: " + ", ".join(f"{k} {v}x" for k, v in result["fsdp_over_ddp"].items()))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m shardwise.bench.scale")
    parser.add_argument("--budget-gib", type=float, default=16.0,
                        help="memory of all of a job's ranks together (of this machine's 24 GiB, what it can spare)")
    parser.add_argument("--steps", type=int, default=2, help="steps each job trains")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated, of the default's")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated, of sgd, adamw")
    parser.add_argument("--json", action="append", default=[], help="write the result here (repeatable)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one job's rank, under torchrun
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    result = run(args.budget_gib, args.steps, args.strategies.split(","), args.optimizers.split(","))
    write_json(result, args.json)
    print(format_result(result), flush=True)


if __name__ == "__main__":
    main()
