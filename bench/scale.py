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

    shardwise bench scale [--budget-gib 16] [--steps 2]   (or python -m bench.scale ... [--json FILE])
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import bench_env
from bench.common import write_json
from shardwise.config.load import load_config
from shardwise.config.registry import spec
from shardwise.config.schema import Config
from shardwise.launch import process_stat
from shardwise.planner.candidates import Candidate
from shardwise.planner.memory_model import predict_memory
from shardwise.planner.model import model_facts, model_shape
from shardwise.planner.phases import predict_phases, predict_setup_bytes

STRATEGIES = ("single", "ddp", "zero2", "fsdp", "fsdp-native")
OPTIMIZERS = ("sgd", "adamw")
RANKS = 4  # processes of every multi-rank job
N_LAYER, SEQ_LEN, HEAD_WIDTH, WIDTH_STEP = 32, 32, 64, 64
RESULT = "SCALE-RESULT "  # the line rank 0 prints its job's measurements on
GIB = 2**30


def scale_config(strategy: str, optimizer: str, width: int, world: int, steps: int, *extra: str) -> Config:
    return load_config(None, [
        f"model.n_layer={N_LAYER}", f"model.d_model={width}", f"model.n_head={width // HEAD_WIDTH}",
        f"model.seq_len={SEQ_LEN}", "model.vocab_size=256", "data.name=synthetic-tokens",
        f"parallel.strategy={strategy}", f"launch.nproc={world}", f"train.optimizer={optimizer}",
        "train.micro_batch=1", f"train.global_batch={world}", f"train.steps={steps}", "train.warmup_steps=0",
        "train.eval_every=0", "train.lr=1e-4", "run.out=unused", *extra])


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
    """One job's rank: `steps` steps timed (the search), or with `end` a whole run through
    `Trainer.fit` (checkpoint, evaluation, final weights; resumed with `resume`)."""
    from shardwise.dist import init_distributed, leave_process, shutdown_distributed
    from shardwise.memory import resident_bytes
    from shardwise.trainer import Trainer

    ctx = init_distributed("gloo", timeout_s=1800, threads_per_rank=1)
    cfg = scale_config(job["strategy"], job["optimizer"], job["width"], ctx.world_size, job["steps"],
                       *job.get("end", ()))
    if "end" in job and ctx.is_main:
        cfg.save(Path(cfg.run.out) / "config.toml")  # as `shardwise train` does: consolidate reads it
    trainer = Trainer(cfg, ctx)
    started = time.perf_counter()
    if "end" in job:
        summary = trainer.fit()
        result = {"losses": [summary["final_loss"]], "phases": summary["phases_by_rank"]}
    else:
        result = {"losses": [trainer.run_step(step) for step in range(job["steps"])]}
    result["seconds"] = time.perf_counter() - started
    mine = {"peak_rss": resident_bytes()[1], "runtime_rss": trainer.baseline_rss, "setup_rss": trainer.setup_rss,
            "setup_counted": trainer.strategy.setup_peak_bytes, "counted": trainer.memory().as_dict()}
    result["ranks"] = ctx.all_gather_object(mine)
    if ctx.is_main:
        print(RESULT + json.dumps(result), flush=True)
    shutdown_distributed()
    leave_process()


# --- the driver: jobs under a watchdog, the search ---------------------------------------------

def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        stat = process_stat(entry) if entry.isdigit() else None
        if stat is not None:
            children.setdefault(stat[2], []).append(int(entry))
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


def run_job(job: dict[str, Any], budget: int) -> dict[str, Any]:
    """One job (`worker`'s) under the watchdog: its measurements, or why it did not fit."""
    strategy, optimizer, width, steps = job["strategy"], job["optimizer"], job["width"], job["steps"]
    wait_for_memory(budget)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks_of(strategy)}",
               "-m", "bench.scale", "--worker", json.dumps(job)]
    outcome: dict[str, Any] = {"width": width, "params": parameters(width), "planned": planned(strategy, optimizer,
                                                                                               width, steps)}
    text, most, seconds, returncode = watched(command, budget)
    outcome["wall_s"] = seconds
    outcome["watched_peak_gib"] = round(most / GIB, 3)
    line = next((line for line in text.splitlines() if line.startswith(RESULT)), None)
    if most > budget:
        return {**outcome, "fits": False, "why": f"the ranks held {most / GIB:.2f} GiB at once: killed"}
    if returncode or line is None:
        last = [line for line in text.splitlines() if line.strip()][-3:]
        return {**outcome, "fits": False, "why": f"exit {returncode}: {' | '.join(last)[-400:]}"}
    result = json.loads(line[len(RESULT):])
    peaks = [rank["peak_rss"] for rank in result["ranks"]]
    outcome.update(fits=sum(peaks) <= budget, peak_rss_gib=[round(p / GIB, 3) for p in peaks],
                   runtime_rss_gib=round(max(rank["runtime_rss"] for rank in result["ranks"]) / GIB, 3),
                   setup_rss_gib=[round(rank["setup_rss"] / GIB, 3) for rank in result["ranks"]],
                   setup_counted_gib=[None if rank["setup_counted"] is None else round(rank["setup_counted"] / GIB, 3)
                                      for rank in result["ranks"]],
                   step_s=round(result["seconds"] / steps, 2), losses=result["losses"])
    if "phases" in result:
        outcome["phases"] = result["phases"]
    if not outcome["fits"]:
        outcome["why"] = f"peaks add up to {sum(peaks) / GIB:.2f} GiB"
    return outcome


def watched(command: list[str], budget: int) -> tuple[str, int, float, int]:
    """Run `command` in a session of its own, killed if its processes hold more than `budget` bytes
    at once; its output, the most they held, its wall time and its exit code."""
    most = 0
    with tempfile.TemporaryFile("w+") as out:
        started = time.perf_counter()
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                   env=bench_env(OMP_NUM_THREADS="1"))
        while process.poll() is None:
            held = sum(resident(pid) for pid in descendants(process.pid) or [process.pid])  # torchrun's ranks
            most = max(most, held)
            if held > budget:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                break
            time.sleep(0.1)
        seconds = round(time.perf_counter() - started, 1)
        out.seek(0)
        return out.read(), most, seconds, process.returncode


# --- the end of a run: every phase of a 1B+ model's run, and consolidate -------------------------

END_WIDTH, END_SEQ_LEN = 1792, 64  # a GPT of 1.23B parameters, with 64-token sequences


def end_of_run(strategy: str, width: int, budget: int, root: Path) -> dict[str, Any]:
    """A whole run of the GPT of `width` (SGD, fp32, one 64-token sequence per rank) under `strategy`
    on 4 ranks: 2 steps, a checkpoint after the second, evaluation and final weights; resumed for a
    third step (its load, evaluation and final weights again); then `shardwise consolidate` of the
    checkpoint in one process. Each phase's peak resident set by rank beside the planner's
    prediction (`predict_phases`) on top of the rank's runtime (its resident set before the model)."""
    run_dir = root / f"{strategy}-{width}"
    common = (f"model.seq_len={END_SEQ_LEN}", f"run.out={run_dir}", "train.eval_batches=1", "train.checkpoint_every=2")
    job = {"strategy": strategy, "optimizer": "sgd", "width": width}
    jobs = {"first": run_job({**job, "steps": 2, "end": common}, budget)}
    if (run_dir / "model.safetensors").is_file():  # the weights at the checkpoint, for consolidate's
        os.replace(run_dir / "model.safetensors", run_dir / "saved.safetensors")
    jobs["resumed"] = run_job({**job, "steps": 3, "end": (*common, "run.resume=true")}, budget)
    cfg = scale_config(strategy, "sgd", width, ranks_of(strategy), 2, *common)
    predicted = predict_phases(Candidate(strategy, ranks_of(strategy), 1, 1, "fp32", "none", 1), cfg)
    outcome: dict[str, Any] = {"strategy": strategy, "width": width, "params": parameters(width),
                               "ranks": ranks_of(strategy), "seq_len": END_SEQ_LEN,
                               "predicted_gib": {k: round(v / GIB, 3) for k, v in predicted.items()},
                               "jobs": {name: {k: v for k, v in j.items() if k != "phases"}
                                        for name, j in jobs.items()}}
    if not all("phases" in j for j in jobs.values()):
        return {**outcome, "fits": False}
    outcome["phases"] = phase_table(jobs, predicted)
    outcome["consolidate"] = consolidate_job(run_dir, budget)
    shutil.rmtree(run_dir, ignore_errors=True)
    return {**outcome, "fits": True}


def phase_table(jobs: dict[str, dict[str, Any]], predicted: dict[str, int]) -> dict[str, dict[str, Any]]:
    """Per phase: each rank's peak resident set over the jobs (GiB), its runtime's, and the measured
    peak over the prediction (runtime + predicted bytes)."""
    table = {}
    for phase, bytes_ in predicted.items():
        ranks = []
        for rank in range(len(jobs["first"]["phases"])):
            seen = [(j["phases"][rank]["rss"][phase], j["phases"][rank]["baseline_rss"]) for j in jobs.values()
                    if phase in j["phases"][rank]["rss"]]
            ranks.append(max(seen))
        table[phase] = {"peak_rss_gib": [round(peak / GIB, 3) for peak, _ in ranks],
                        "runtime_gib": [round(runtime / GIB, 3) for _, runtime in ranks],
                        "measured_over_predicted": [round(peak / (runtime + bytes_), 3) for peak, runtime in ranks]}
    return table


def consolidate_job(run_dir: Path, budget: int) -> dict[str, Any]:
    """`shardwise consolidate` of the run's checkpoint in a process of its own, watched: its peak
    resident set, its runtime's, its time, and whether the file holds the run's final weights."""
    out = run_dir / "consolidated.safetensors"
    text, most, seconds, returncode = watched(
        [sys.executable, "-m", "bench.scale", "--consolidate", str(run_dir), str(out)], budget)
    line = next((line for line in text.splitlines() if line.startswith(RESULT)), None)
    if returncode or line is None:
        return {"ok": False, "why": text[-400:]}
    result = json.loads(line[len(RESULT):])
    return {"ok": True, "wall_s": seconds, "watched_peak_gib": round(most / GIB, 3), **result}


def consolidate_measured(run_dir: Path, out: Path) -> dict[str, Any]:
    """In the consolidating process: consolidate, with the peak resident set, and compare the file
    with the weights the run wrote when it saved the checkpoint, tensor by tensor, memory-mapped."""
    from shardwise.checkpoint import consolidate
    from shardwise.memory import reset_peak_resident, resident_bytes

    runtime = resident_bytes()[0]
    reset_peak_resident()
    started = time.perf_counter()
    consolidate(run_dir, out)
    seconds = time.perf_counter() - started
    peak = resident_bytes()[1]
    return {"runtime_rss_gib": round(runtime / GIB, 3), "peak_rss_gib": round(peak / GIB, 3),
            "seconds": round(seconds, 1), "equals_final_weights": same_tensors(run_dir / "saved.safetensors", out)}


def same_tensors(expected: Path, got: Path) -> bool:
    """Whether every tensor of the safetensors file `expected` is in `got`, of the same dtype, shape
    and bytes: read a tensor at a time (a memory-mapped comparison would make both files resident)."""
    headers = [safetensors_header(path) for path in (expected, got)]
    with open(expected, "rb") as a, open(got, "rb") as b:
        for key, entry in headers[0][0].items():
            other = headers[1][0].get(key)
            if other is None or (other["dtype"], other["shape"]) != (entry["dtype"], entry["shape"]):
                return False
            (start, stop), (their_start, _) = entry["data_offsets"], other["data_offsets"]
            a.seek(headers[0][1] + start)
            b.seek(headers[1][1] + their_start)
            if a.read(stop - start) != b.read(stop - start):
                return False
    return True


def safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's tensors by name (their dtype, shape and byte range) and where the data starts."""
    with open(path, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        header = json.loads(file.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


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
        attempts[width] = run_job({"strategy": strategy, "optimizer": optimizer, "width": width, "steps": steps},
                                  budget)
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


def run(budget_gib: float, steps: int, strategies: list[str], optimizers: list[str], parts: list[str],
        end_runs: list[tuple[str, int]], end_budget_gib: float) -> dict[str, Any]:
    memory = machine_memory()
    for name, gib in (("--budget-gib", budget_gib), ("--end-budget-gib", end_budget_gib)):
        if memory["MemTotal"] < gib * GIB:
            raise SystemExit(f"bench scale: {name} {gib}: the machine has {memory['MemTotal'] / GIB:.1f} GiB")
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    result: dict[str, Any] = {
        "bench": "scale",
        "budget_gib": budget_gib,
        "steps": steps,
        "model": {"n_layer": N_LAYER, "seq_len": SEQ_LEN, "head_width": HEAD_WIDTH, "vocab_size": 256,
                  "micro_batch_per_rank": 1},
        "machine": {"cpus": os.cpu_count(), "mem_total_gib": round(memory["MemTotal"] / GIB, 1),
                    "mem_available_gib_at_start": round(memory["MemAvailable"] / GIB, 1)},
    }
    if "search" in parts:
        result.update(search(int(budget_gib * GIB), steps, strategies, optimizers))
    if "end" in parts:
        with tempfile.TemporaryDirectory(prefix="scale-end-", dir=".") as root:
            result["end_budget_gib"] = end_budget_gib
            result["end_of_run"] = [end_of_run(strategy, width, int(end_budget_gib * GIB), Path(root))
                                    for strategy, width in end_runs]
    result["load_average"] = {"before": load_before, "after": os.getloadavg()[0]}
    result["wall_s"] = round(time.perf_counter() - started)
    return result


def search(budget: int, steps: int, strategies: list[str], optimizers: list[str]) -> dict[str, Any]:
    runtime = int(0.5 * GIB)  # until a job has measured it
    searches = []
    for optimizer in optimizers:
        for strategy in strategies:
            found = largest(strategy, optimizer, steps, budget, runtime)
            measured = [a["runtime_rss_gib"] for a in found["attempts"] if "runtime_rss_gib" in a]
            runtime = int(max(measured, default=runtime / GIB) * GIB)
            searches.append(found)
    by = {(s["strategy"], s["optimizer"]): s["largest_params"] for s in searches}
    compared = [opt for opt in optimizers if by.get(("ddp", opt)) and ("fsdp", opt) in by]
    return {"fsdp_over_ddp": {opt: round(by["fsdp", opt] / by["ddp", opt], 2) for opt in compared},
            "searches": searches}


def format_result(result: dict[str, Any]) -> str:
    lines = [f"bench scale (load {result['load_average']['before']:.1f} -> {result['load_average']['after']:.1f}, "
             f"{result['wall_s']} s)"]
    if "searches" in result:
        lines += [f"the largest GPT ({N_LAYER} blocks) that trains {result['steps']} steps within "
                  f"{result['budget_gib']} GiB",
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
    for end in result.get("end_of_run", []):
        lines.append(f"the end of a run: {end['strategy']} on {end['ranks']} ranks, {end['params'] / 1e9:.2f}B "
                     f"parameters, within {result['end_budget_gib']} GiB")
        if not end["fits"]:
            lines.append("  did not fit: " + "; ".join(j.get("why", "") for j in end["jobs"].values()))
            continue
        lines.append(f"  {'phase':<15}{'peak RSS by rank, GiB':>30}{'predicted GiB':>15}{'measured / predicted':>28}")
        for phase, row in end["phases"].items():
            predicted = end["predicted_gib"][phase] + max(row["runtime_gib"])
            lines.append(f"  {phase:<15}{' '.join(f'{x:6.2f}' for x in row['peak_rss_gib']):>30}{predicted:>15.2f}"
                         f"{' '.join(f'{x:6.3f}' for x in row['measured_over_predicted']):>28}")
        c = end["consolidate"]
        lines.append(f"  consolidate: peak RSS {c['peak_rss_gib']:.2f} GiB (runtime {c['runtime_rss_gib']:.2f}), "
                     f"{c['seconds']} s, equals the final weights: {c['equals_final_weights']}" if c["ok"]
                     else f"  consolidate failed: {c['why']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.scale")
    parser.add_argument("--budget-gib", type=float, default=16.0,
                        help="memory of all of a job's ranks together (of this machine's 24 GiB, what it can spare)")
    parser.add_argument("--steps", type=int, default=2, help="steps each job trains")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated, of the default's")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated, of sgd, adamw")
    parser.add_argument("--parts", default="search,end", help="search (the largest model per strategy), end (whole "
                        "runs of a 1B+ model, every phase, and consolidate), or both")
    parser.add_argument("--end-of-run", action="append", metavar="STRATEGY:WIDTH",
                        help=f"a whole run to measure (repeatable; default fsdp:{END_WIDTH}, 1.23B parameters)")
    parser.add_argument("--end-budget-gib", type=float, default=20.0, help="memory of a whole run's ranks together")
    parser.add_argument("--json", action="append", default=[], help="write the result here (repeatable)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # one job's rank, under torchrun
    parser.add_argument("--consolidate", nargs=2, help=argparse.SUPPRESS)  # RUN OUT: a measured consolidate
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    if args.consolidate:
        print(RESULT + json.dumps(consolidate_measured(*map(Path, args.consolidate))), flush=True)
        return
    end_runs = [(s, int(w)) for s, w in (each.split(":") for each in args.end_of_run or [f"fsdp:{END_WIDTH}"])]
    result = run(args.budget_gib, args.steps, args.strategies.split(","), args.optimizers.split(","),
                 args.parts.split(","), end_runs, args.end_budget_gib)
    write_json(result, args.json)
    print(format_result(result), flush=True)


if __name__ == "__main__":
    main()
