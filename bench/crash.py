"""`shardwise bench crash`: are checkpoints crash-safe? Issue 43's target: SIGKILL the job at 20
random moments, in and between asynchronous saves; every resume is bit-identical to the
uninterrupted run, and no complete checkpoint is ever lost or left half-written.

Two real `shardwise train` jobs of gpt-tiny under ddp on 2 ranks (SGD, a checkpoint every 5 steps
written in the background, the newest 3 kept), into directories of their own:

- the reference, uninterrupted; from its first step on, the bench watches its checkpoint directory
  every millisecond to learn how long a save is in flight on disk (from its temporary directory
  appearing until `latest` has moved and old checkpoints are pruned) and how long a step takes;
- the crashed run: the same job, killed whole (the launcher and every worker, SIGKILL to each
  process group) at moments drawn from a seeded RNG, one in each equal stretch of the run. Half
  fall during a save (the attempt's first, which is slower, or a later one), in a phase drawn at
  random: while it writes its files (a random time into it, up to how long the reference's like
  save was in flight), or as soon as the disk shows it sealed but not renamed, renamed with
  `latest` not yet moved, or `latest` moved with old checkpoints not yet pruned (each about a
  millisecond: a random time would almost never land there). Where the save gets past the phase
  first, the next save is tried; where none is left, the kill falls between saves (counted). The
  other half fall a random time into the step after a random step, once no save is in flight. At
  the moment every process group is stopped (SIGSTOP, every thread), the disk is looked at (where
  it is not the moment aimed at, the job goes on: SIGCONT), and then the job is killed: the disk
  holds what a kill at the stop would leave.

After each kill, before the restart, with every process gone, the bench reads
RUN/checkpoints: what the kill interrupted (a save writing its files, sealed but not renamed,
renamed with `latest` not yet moved, pruning; or nothing), every `step-*` directory's checksums
against its manifest (checkpoint.py's `problem_with`), whether `latest` names one that verifies,
and whether every checkpoint complete before the kill (renamed into place: the commit) is still
there, unless rotation removes it (there are `keep` newer ones). Then it restarts the job with
`--resume` and reads which checkpoint it resumed from, against the newest good one. At the end
the crashed run's model.safetensors must be byte-identical to the reference's, and its losses
(metrics.jsonl's last record of each step) equal, bit for bit.

    python -m bench.crash [--steps 200] [--kills 20] [--seed 0] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import ROOT, bench_env
from bench.common import write_json
from shardwise.checkpoint import LATEST, MANIFEST, problem_with
from shardwise.launch import process_stat

EVERY = 5  # the checkpoint interval, in steps
KEEP = 3  # train.keep_checkpoints (its default): rotation keeps the newest 3
TRAIN = ["train.eval_every=0", "train.optimizer=sgd", "train.checkpoint_async=true", "launch.threads_per_rank=1"]
POLL_S = 0.001  # a save is in flight for tens of milliseconds: the checkpoint directory is listed this often
READS_EVERY = 10  # polls between reads of metrics.jsonl (each reads the whole file)
TMP = ".tmp-"  # checkpoint.py's temporary directory: `.tmp-step-NNNNNNNN`
LATEST_OK = ("a verified checkpoint", "none yet")
# What the disk shows of a save in flight, in order (save_in_flight). The last three last about a
# millisecond each: a kill aimed at one of them is sent as soon as the disk shows it.
SAVE_PHASES = ("writing files", "sealed, not renamed", "renamed, latest not moved", "latest moved, pruning")
SPIN_S = 0.0002  # how often a save is looked at while a kill waits for one of its short phases
TRIES = 6  # saves a save kill is tried in before it settles for the next one's first moment


@dataclass
class Kill:
    """One planned kill. `between`: in the step after `step`, `fraction` of a step's usual time into
    it, once no save is in flight. `save`: during the save of checkpoint `step` (or, `later_save`,
    of the attempt's second), in `phase` (one of SAVE_PHASES): while it writes its files,
    `fraction` of how long such a save was in flight in the reference; in the others, as soon as
    the disk shows it. Both the attempt's first save (slower: its buffers and DCP's thread are new)
    and later ones are aimed at."""

    kind: str  # "save" or "between"
    step: int
    fraction: float
    phase: str | None = None
    later_save: bool = False


@dataclass
class Attempt:
    """One start of the job: the launcher (a session of its own), its stderr, when it started."""

    process: subprocess.Popen
    log: Path
    started_ns: int  # wall clock; what its checkpoint directory holds from before is older
    groups: list[int]  # the process groups to kill: torchrun starts every worker in a session of its own


def train_command(steps: int, out: Path) -> list[str]:
    command = [sys.executable, "-m", "shardwise.cli", "train", "configs/gpt-tiny.toml", "--strategy", "ddp",
               "--nproc", "2", "--steps", str(steps), "--out", str(out), "--checkpoint-every", str(EVERY),
               "--keep", str(KEEP)]
    for override in TRAIN:
        command += ["--set", override]
    return command


def start(command: list[str], log: Path) -> Attempt:
    started_ns = time.time_ns()
    with open(log, "w") as stderr:  # a file, not a pipe: a full pipe would stall the job
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr,
                                   env=bench_env(), start_new_session=True)
    return Attempt(process, log, started_ns, [])


class NewSteps:
    """The step records a metrics.jsonl gains, each line once. Lines there when it is made are not
    new: a restarted job rewrites the records its checkpoint covers, line for line; a step it
    trains again is a new line (its timings differ)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.known = set(self._lines())
        self.last = 0  # the newest step recorded since

    def _lines(self) -> list[str]:
        return self.path.read_text().splitlines() if self.path.is_file() else []

    def poll(self) -> bool:
        """Read what is new; whether anything was."""
        fresh = [line for line in self._lines() if line not in self.known and line.endswith("}")]  # whole lines
        self.known.update(fresh)
        for record in map(json.loads, fresh):
            if record["event"] == "step":
                self.last = max(self.last, record["step"])
        return bool(fresh)


def step_records(run: Path) -> dict[int, dict[str, Any]]:
    """The last record of each step in the run's metrics.jsonl (a line torn by a kill skipped)."""
    records = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record["event"] == "step":
            records[record["step"]] = record
    return records


def job_groups(launcher: int) -> list[int]:
    """The process groups of the launcher and its descendants (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])  # after "pid (comm) state"
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    pids, todo = [launcher], [launcher]
    while todo:
        for child in children.get(todo.pop(), []):
            pids.append(child)
            todo.append(child)
    groups = []
    for pid in pids:
        try:
            groups.append(os.getpgid(pid))
        except ProcessLookupError:
            continue
    return sorted(set(groups), key=lambda group: group == launcher)  # the launcher's last: workers first


def freeze(attempt: Attempt) -> None:
    """SIGSTOP every process group of the job; return once every thread of each has stopped. This is
    the crash's moment: the disk holds what a kill then would leave, and the bench can look before
    it kills (or lets the job go on, where the moment is not the one it aims at)."""
    for group in attempt.groups:
        os.killpg(group, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while not all(_stopped(group) for group in attempt.groups):  # a thread in a syscall stops as it returns
        if time.monotonic() > deadline:
            raise SystemExit(f"bench crash: process groups {attempt.groups} did not stop")
        time.sleep(SPIN_S)


def thaw(attempt: Attempt) -> None:
    for group in attempt.groups:
        os.killpg(group, signal.SIGCONT)


def _stopped(pid: int) -> bool:
    try:
        states = [(task / "stat").read_text().rsplit(")", 1)[1].split()[0]
                  for task in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:  # gone (or a thread gone as it was read: look again)
        return not Path(f"/proc/{pid}").exists()
    return all(state in "tTZX" for state in states)


def kill_job(attempt: Attempt) -> None:
    """SIGKILL every process group of the job; return once none of its processes runs."""
    for group in attempt.groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
    attempt.process.wait()
    deadline = time.monotonic() + 30
    while any(running(group) for group in attempt.groups):  # each group's leader; orphans go to init
        if time.monotonic() > deadline:
            raise SystemExit(f"bench crash: processes of groups {attempt.groups} outlived SIGKILL")
        time.sleep(0.01)


def running(pid: int) -> bool:
    """Process `pid` exists and is not a zombie."""
    stat = process_stat(pid)
    return stat is not None and stat[1] != "Z"  # a zombie runs no more; its parent, gone, cannot reap it


def listing(root: Path) -> dict[str, int]:
    """The checkpoint directory's entries and their modification times (ns)."""
    entries = {}
    with contextlib.suppress(FileNotFoundError), os.scandir(root) as scan:  # none yet
        for entry in scan:
            try:
                entries[entry.name] = entry.stat(follow_symlinks=False).st_mtime_ns
            except FileNotFoundError:  # renamed or removed as it was listed
                continue
    return entries


def read_latest(root: Path) -> str | None:
    try:
        return (root / LATEST).read_text().strip()
    except FileNotFoundError:
        return None


def save_in_flight(root: Path, since_ns: int) -> str | None:
    """What the disk shows of a save the job since `since_ns` began and has not finished, or None.
    What is older was left by an attempt before it (a temporary directory a kill cut short)."""
    entries = listing(root)
    fresh = {name for name, mtime in entries.items() if mtime >= since_ns}
    steps = sorted(name for name in entries if name.startswith("step-"))
    latest = read_latest(root)
    for name in sorted(fresh):
        if name.startswith(TMP + "step-"):
            return SAVE_PHASES[1] if (root / name / MANIFEST).is_file() else SAVE_PHASES[0]
    if any(name in fresh and name > (latest or "") for name in steps):
        return SAVE_PHASES[2]
    if LATEST in fresh and len(steps) > KEEP:
        return SAVE_PHASES[3]
    return None


def made_since(path: Path, since_ns: int) -> bool:
    """Whether `path` exists and was made (or last changed) since `since_ns`."""
    try:
        return path.stat().st_mtime_ns >= since_ns
    except FileNotFoundError:
        return False


def checkpoint_steps(root: Path) -> list[str]:
    return sorted(name for name in listing(root) if name.startswith("step-"))


def inspect(root: Path, complete: set[str], latest_before: str | None) -> dict[str, Any]:
    """The checkpoint directory after a kill, against the checkpoints known to be complete and the
    checkpoint `latest` named after the kill before."""
    names = checkpoint_steps(root)
    problems = {name: problem_with(root / name) for name in names}
    pruned_next = set(names[:-KEEP])  # what the next save's rotation removes; a removal cut short fails here
    verified = [name for name in names if problems[name] is None]
    # Gone for good reason: rotation removes a checkpoint once `keep` newer ones are in place.
    gone = sorted(complete - set(names))
    rotated = [name for name in gone if sum(other > name for other in names) >= KEEP]
    latest = read_latest(root)
    return {
        "latest": latest,
        "latest_names": latest_state(root, latest, latest_before, verified),
        "verified": verified,
        "failing": {name: why for name, why in problems.items() if why is not None and name not in pruned_next},
        "removal_cut_short": {name: problems[name] for name in sorted(pruned_next) if problems[name] is not None},
        "lost": [name for name in gone if name not in rotated],
        "rotated": rotated,
        "temporary": sorted(name for name in listing(root) if name.startswith(TMP)),
        "expected_resume": latest if latest in verified else (verified[-1] if verified else None),
    }


def latest_state(root: Path, latest: str | None, latest_before: str | None, verified: list[str]) -> str:
    """What `latest` names: "a verified checkpoint" and "none yet" are as they should be."""
    if latest is None:
        return "none yet" if latest_before is None else "nothing: the file is gone"
    if latest_before is not None and latest < latest_before:
        return f"an older checkpoint than before ({latest_before})"
    if latest in verified:
        return "a verified checkpoint"
    return "a checkpoint failing verification" if (root / latest).is_dir() else "a missing directory"


def resumed_from(log: Path) -> tuple[str | None, int, list[str]]:
    """From an attempt's stderr: the checkpoint it resumed from (None: none, from step 0), its step,
    and the checkpoints the loader skipped as unusable."""
    text = log.read_text()
    skipped = re.findall(r"warning: checkpoint (\S+) is unusable", text)
    found = re.search(r"resumed from (\S+) \(step (\d+)", text)
    if found:
        return Path(found.group(1)).name, int(found.group(2)), skipped
    if "starting from step 0" in text:
        return None, 0, skipped
    raise SystemExit(f"bench crash: {log.name} says neither where it resumed from nor that it started afresh:\n"
                     f"{text[-3000:]}")


def kill_plan(steps: int, kills: int, rng: random.Random) -> list[Kill]:
    """`kills` moments, one in each equal stretch of the run after its first checkpoint and before
    its last two: half (in random order) during the save of the stretch's first checkpoint from a
    random step on, in a random phase; half in the step after a random step."""
    first, last = EVERY + 1, steps - 2 * EVERY
    stretch = (last - first) // kills
    if stretch < 2:
        raise SystemExit(f"bench crash: {kills} kills need at least {2 * kills + 3 * EVERY + 1} steps, not {steps}")
    kinds = ["save"] * (kills - kills // 2) + ["between"] * (kills // 2)
    rng.shuffle(kinds)
    plan = []
    for i, kind in enumerate(kinds):
        step = first + i * stretch + rng.randrange(stretch)
        if kind == "save":
            plan.append(Kill(kind, math.ceil(step / EVERY) * EVERY, rng.random(), rng.choice(SAVE_PHASES),
                             later_save=rng.random() < 0.5))
        else:
            plan.append(Kill(kind, step, rng.random()))
    return plan


def reference_run(steps: int, out: Path) -> dict[str, Any]:
    """The uninterrupted job; how long its saves were in flight on disk (its first, and the median
    of the rest) and its steps took."""
    records = NewSteps(out / "metrics.jsonl")
    attempt = start(train_command(steps, out), out.parent / "reference.log")
    while not records.last and attempt.process.poll() is None:  # it saves after its first step: till then, less often
        records.poll()
        time.sleep(POLL_S * READS_EVERY)
    root, spans, since = out / "checkpoints", [], None
    while attempt.process.poll() is None:
        flight = save_in_flight(root, attempt.started_ns)
        if flight is not None and since is None:
            since = time.monotonic()
        elif flight is None and since is not None:
            spans.append(time.monotonic() - since)
            since = None
        time.sleep(POLL_S)
    if attempt.process.returncode:
        raise SystemExit(f"bench crash: the reference run failed:\n{attempt.log.read_text()[-3000:]}")
    return {"first_save_s": spans[0], "save_s": statistics.median(spans[1:]), "spans_s": spans,
            "step_s": statistics.median(r["step_time_s"] for r in step_records(out).values())}


def wait_for_moment(attempt: Attempt, records: NewSteps, kill: Kill, resumed: int, total: int,
                    timing: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """Watch the attempt until `kill`'s moment; kill the job there. Returns what was aimed at."""
    root, polls, tries, planned = records.path.parent / "checkpoints", 0, 0, kill.kind
    target = max(kill.step, resumed + 1)  # a kill planned before the checkpoint resumed from: the first step after
    first_save = (resumed // EVERY + 1) * EVERY
    if kill.kind == "save":
        target = max(kill.step, first_save + EVERY * kill.later_save)
    phase, fraction = kill.phase, kill.fraction
    while True:
        if attempt.process.poll() is not None:
            raise SystemExit(f"bench crash: the job ended before its kill at step {target}:\n"
                             f"{attempt.log.read_text()[-3000:]}")
        if polls % READS_EVERY == 0 or not attempt.groups:
            records.poll()
        if records.last and not attempt.groups:  # its workers are up: it has recorded a step
            attempt.groups = job_groups(attempt.process.pid)
        polls += 1
        if not attempt.groups:  # no step recorded yet, so no save to catch: looked at less often
            time.sleep(POLL_S * READS_EVERY)
            continue
        if kill.kind == "between" and records.last >= target:
            time.sleep(fraction * timing["step_s"])
            while True:
                while save_in_flight(root, attempt.started_ns) is not None:
                    time.sleep(POLL_S)
                freeze(attempt)
                if save_in_flight(root, attempt.started_ns) is None:
                    break
                thaw(attempt)  # a save began meanwhile
            break
        started = kill.kind == "save" and made_since(root / f"{TMP}step-{target:08d}", attempt.started_ns)
        # gone by unseen: a loaded machine may not run this loop for the whole of a short save
        unseen = not started and records.last > target and made_since(root / f"step-{target:08d}", attempt.started_ns)
        if kill.kind == "save" and (started or unseen):
            if target + EVERY >= total or tries + 1 == TRIES:  # no later save to try: now, as it starts
                phase, fraction = SAVE_PHASES[0], 0.0
            usual = timing["first_save_s" if target == first_save else "save_s"]
            if started and in_phase(root, attempt.started_ns, phase, fraction * usual):
                freeze(attempt)
                if save_in_flight(root, attempt.started_ns) is not None:  # in this phase or a later one
                    break
                thaw(attempt)
            records.poll()  # it went by: the next save not yet begun (a long wait may have let several go by)
            tries, target, fraction = tries + 1, max(target, records.last // EVERY * EVERY) + EVERY, rng.random()
            if target >= total:  # no save left to aim at: a kill between saves, as soon as none is in flight
                kill, target, phase = Kill("between", records.last, fraction), records.last, None
            continue
        time.sleep(POLL_S)
    complete = set(checkpoint_steps(root))  # renamed into place, so sealed: the commit point
    kill_job(attempt)  # frozen: the disk holds what it did when the job stopped
    return {"planned": planned, "fell_back_to_between": kill.kind != planned, "target_step": target,
            "first_save_of_attempt": target == first_save,
            "aimed_at": phase, "fraction": round(fraction, 3) if phase == SAVE_PHASES[0] else None,
            "saves_missed": tries, "complete_before": complete}


def in_phase(root: Path, since_ns: int, phase: str | None, delay_s: float) -> bool:
    """Whether the save in flight is in `phase` now (after `delay_s` if writing files; else as soon
    as the disk shows it), rather than past it."""
    if phase == SAVE_PHASES[0]:
        time.sleep(delay_s)
        return save_in_flight(root, since_ns) is not None
    while (now := save_in_flight(root, since_ns)) is not None:
        if now == phase:
            return True
        time.sleep(SPIN_S)
    return False


def crashed_run(steps: int, plan: list[Kill], out: Path, timing: dict[str, Any], rng: random.Random) -> \
        tuple[list[dict[str, Any]], dict[str, Any]]:
    """The job killed as `plan` says and resumed after each kill; per kill what was found, and the
    directory's state once the last attempt finished."""
    command, root = train_command(steps, out), out / "checkpoints"
    complete: set[str] = set()  # every checkpoint seen complete: each must stay until rotation removes it
    latest_before: str | None = None
    kills: list[dict[str, Any]] = []
    for i in range(len(plan) + 1):
        steps_seen = NewSteps(out / "metrics.jsonl")
        attempt = start(command + (["--resume"] if i else []), out.parent / f"attempt-{i:02d}.log")
        if i:  # what the last kill led to
            if i == len(plan):
                attempt.process.wait()
            else:
                while not steps_seen.poll() and attempt.process.poll() is None:
                    time.sleep(POLL_S * READS_EVERY)
            name, at_step, skipped = resumed_from(attempt.log)
            previous = kills[-1]
            previous |= {"resumed_from": name, "resumed_at_step": at_step, "loader_skipped": skipped,
                         "resumed_as_expected": name == previous["checkpoints"]["expected_resume"],
                         "steps_redone": previous["killed_after_step"] - at_step}
        if i == len(plan):
            break
        aimed = wait_for_moment(attempt, steps_seen, plan[i], kills[-1]["resumed_at_step"] if i else 0, steps,
                                timing, rng)
        complete |= aimed.pop("complete_before")
        flight = save_in_flight(root, attempt.started_ns)
        found = inspect(root, complete, latest_before)
        complete = (complete | set(found["verified"])) - set(found["lost"]) - set(found["rotated"])
        latest_before = found["latest"] or latest_before
        kills.append({**aimed, "killed_after_step": max(step_records(out), default=0), "save_in_flight": flight,
                      "checkpoints": found})
    if attempt.process.returncode:
        raise SystemExit(f"bench crash: the last attempt failed:\n{attempt.log.read_text()[-3000:]}")
    return kills, inspect(root, complete, latest_before)


def check_kill(kill: dict[str, Any]) -> dict[str, Any]:
    """Per kill: which of the target's promises held."""
    found = kill["checkpoints"]
    taken_as_complete = int(found["latest_names"] == "a checkpoint failing verification") + \
        int(kill["resumed_from"] in found["failing"])
    return {"verified": not found["failing"], "lost": len(found["lost"]),
            "latest_ok": found["latest_names"] in LATEST_OK, "half_written_seen_as_complete": taken_as_complete,
            "resumed_from_newest_good": kill["resumed_as_expected"]}


def compare(crashed: Path, reference: Path) -> dict[str, Any]:
    """The crashed run's final weights and losses against the reference's, bit for bit."""
    ours, theirs = step_records(crashed), step_records(reference)
    differ = [step for step in sorted(theirs) if step not in ours or ours[step]["loss"] != theirs[step]["loss"]]
    lines = (crashed / "metrics.jsonl").read_text().splitlines()
    return {"final_weights_identical": (crashed / "model.safetensors").read_bytes()
            == (reference / "model.safetensors").read_bytes(),
            "losses_identical": not differ and ours.keys() == theirs.keys(), "steps_compared": len(theirs),
            "first_loss_differing_at": differ[0] if differ else None,
            "step_records_in_final_file": sum('"event": "step"' in line for line in lines)}


def run(steps: int, kills: int, seed: int, scratch: Path) -> dict[str, Any]:
    rng = random.Random(seed)
    plan = kill_plan(steps, kills, rng)
    started, load_before = time.monotonic(), os.getloadavg()[0]
    timing = reference_run(steps, scratch / "reference")
    reference_s = time.monotonic() - started
    records, final = crashed_run(steps, plan, scratch / "crashed", timing, rng)
    crashed_s = time.monotonic() - started - reference_s
    checks = [check_kill(kill) for kill in records]
    for kill, check in zip(records, checks, strict=True):
        kill["checks"] = check
    final_ok = not final["failing"] and final["latest"] == f"step-{steps:08d}" and not final["lost"] \
        and final["latest_names"] == "a verified checkpoint"
    outcome = compare(scratch / "crashed", scratch / "reference")
    result = {
        "bench": "crash",
        "model": f"gpt-tiny, ddp on 2 ranks, SGD, {steps} steps, a checkpoint every {EVERY} (async), keep {KEEP}",
        "fault": f"SIGKILL of the whole job (launcher and workers), {kills} times, seed {seed}",
        "kills": len(records),
        "kills_planned_during_save": sum(kill["planned"] == "save" for kill in records),
        "kills_fell_back_to_between": sum(kill["fell_back_to_between"] for kill in records),
        "kills_during_save": sum(kill["save_in_flight"] is not None for kill in records),
        "kills_by_save_phase": {phase: sum(kill["save_in_flight"] == phase for kill in records)
                                for phase in SAVE_PHASES},
        "all_checkpoints_verified": all(check["verified"] for check in checks) and not final["failing"],
        "checkpoints_lost": sum(check["lost"] for check in checks) + len(final["lost"]),
        "half_written_seen_as_complete": sum(check["half_written_seen_as_complete"] for check in checks),
        "latest_always_named_a_verified_checkpoint": all(check["latest_ok"] for check in checks),
        # A kill while rotation deletes an old checkpoint leaves part of it under its name: it fails
        # verification, `latest` never names it, and the next save's rotation removes it.
        "removals_cut_short": sorted({name for kill in records for name in kill["checkpoints"]["removal_cut_short"]}),
        "resumes_from_newest_good": sum(check["resumed_from_newest_good"] for check in checks),
        **outcome,
        "steps_redone_total": sum(kill["steps_redone"] for kill in records),
        "final_checkpoints": final, "final_checkpoints_ok": final_ok,
        "wall_s": round(time.monotonic() - started, 1), "reference_s": round(reference_s, 1),
        "crashed_s": round(crashed_s, 1), "attempts": len(records) + 1,
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],  # 1-minute, at start and end
        "first_save_in_flight_s": round(timing["first_save_s"], 4),
        "save_in_flight_s_median": round(timing["save_s"], 4),
        "reference_saves_in_flight_s": [round(span, 4) for span in timing["spans_s"]],
        "step_s_median": round(timing["step_s"], 4),
        "per_kill": records,
    }
    result["passed"] = (result["all_checkpoints_verified"] and not result["checkpoints_lost"]
                        and result["latest_always_named_a_verified_checkpoint"]
                        and not result["half_written_seen_as_complete"] and final_ok
                        and result["resumes_from_newest_good"] == len(records)
                        and result["final_weights_identical"] and result["losses_identical"])
    return result


def format_result(result: dict[str, Any]) -> str:
    lines = [f"crash bench: {result['model']}; {result['fault']}",
             f"  {'kill':>4} {'planned':>8} {'after step':>10}  {'save in flight':<26} {'latest':<14} "
             f"{'resumed from':<14} {'redone':>6}  checks"]
    for i, kill in enumerate(result["per_kill"], 1):
        check = kill["checks"]
        problems = [name for name, bad in (("unverified", not check["verified"]), ("lost", check["lost"]),
                                           ("latest wrong", not check["latest_ok"]),
                                           ("half-written taken", check["half_written_seen_as_complete"]),
                                           ("not newest", not check["resumed_from_newest_good"])) if bad]
        planned = "1st save" if kill["planned"] == "save" and kill["first_save_of_attempt"] else kill["planned"]
        lines.append(f"  {i:>4} {planned:>8} {kill['killed_after_step']:>10}  "
                     f"{kill['save_in_flight'] or '-':<26} {kill['checkpoints']['latest'] or '-':<14} "
                     f"{kill['resumed_from'] or '(step 0)':<14} {kill['steps_redone']:>6}  "
                     f"{', '.join(problems) or 'ok'}")
    yes = {True: "yes", False: "NO"}
    lines += [f"  {result['kills_during_save']}/{result['kills']} kills during a save (in flight on disk: a "
              f"job's first save {result['first_save_in_flight_s'] * 1000:.0f} ms, the rest "
              f"{result['save_in_flight_s_median'] * 1000:.0f} ms; a step {result['step_s_median'] * 1000:.0f} ms): "
              + ", ".join(f"{phase} {n}" for phase, n in result["kills_by_save_phase"].items()) + "; "
              f"every checkpoint verified: {yes[result['all_checkpoints_verified']]}; lost: "
              f"{result['checkpoints_lost']}; half-written taken as complete: "
              f"{result['half_written_seen_as_complete']}; resumed from the newest good: "
              f"{result['resumes_from_newest_good']}/{result['kills']}; old checkpoints left part-deleted by a kill "
              f"during rotation (failing verification, as they should): {len(result['removals_cut_short'])}",
              f"  final weights identical: {yes[result['final_weights_identical']]}; losses identical: "
              f"{yes[result['losses_identical']]} ({result['steps_compared']} steps); "
              f"{result['steps_redone_total']} steps redone in all; {result['wall_s']:.0f} s "
              f"(reference {result['reference_s']:.0f} s, crashed {result['crashed_s']:.0f} s, "
              f"{result['attempts']} attempts)",
              f"  {'PASSED' if result['passed'] else 'FAILED'}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.crash", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="each job's steps")
    parser.add_argument("--kills", type=int, default=20, help="times the crashed job is killed")
    parser.add_argument("--seed", type=int, default=0, help="where the kills fall")
    parser.add_argument("--json", action="append", default=[], help="write the result here (repeatable)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-crash-", dir=ROOT / "runs" if (ROOT / "runs").is_dir()
                                     else None) as scratch:
        result = run(args.steps, args.kills, args.seed, Path(scratch))
    write_json(result, args.json)
    print(format_result(result), flush=True)
    if not result["passed"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
