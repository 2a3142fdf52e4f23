"""Slurm's environment: under `srun`, the launch a job step gives this node, read with no flag.

Two ways to run a step, as Slurm users do:
- one launcher a node (`srun --ntasks-per-node=1 shardwise train ... --nproc G`), each forking its
  node's G ranks as on one machine: the step's nodes (SLURM_STEP_NUM_NODES), this node's rank
  among them (SLURM_NODEID) and the rendezvous on the first host of the step's node list
  (SLURM_STEP_NODELIST, in Slurm's compressed form, `node[01-03,07],gpu1`), at MASTER_PORT or 29500;
- one process a rank (`srun --ntasks-per-node=G shardwise train ...`): every task is a rank, its
  rank SLURM_PROCID of the step's SLURM_STEP_NUM_TASKS, with no launcher of ours between Slurm and
  it; node 0's first task hosts the rendezvous store at the same host and port.
Flags given on the command line win over them (but --nproc must agree with the tasks a node runs).

`shardwise slurm` writes the sbatch script that runs it either way (`sbatch_script`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from shardwise.config.registry import own_launcher_setting
from shardwise.config.schema import Config, ConfigError

RENDEZVOUS_PORT = 29500  # where node 0's rendezvous listens unless MASTER_PORT says otherwise


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list (`a[1-3,07],b2`, `n[01-02]x`) as its hosts, in order."""
    hosts: list[str] = []
    for name in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", hostlist):
        hosts += _expand(name.strip())
    return [host for host in hosts if host]


def _expand(name: str) -> list[str]:
    """One name of a host list, its first bracket expanded (and the rest, recursively)."""
    match = re.match(r"([^\[]*)\[([^\]]*)\](.*)", name)
    if match is None:
        return [name]
    head, ranges, tail = match.groups()
    hosts = []
    for part in ranges.split(","):
        first, _, last = part.partition("-")
        width = len(first)  # Slurm keeps the zero padding: n[01-03] is n01, n02, n03
        for number in range(int(first), int(last or first) + 1):
            hosts += [f"{head}{number:0{width}d}{rest}" for rest in _expand(tail)]
    return hosts


def tasks_per_node(spec: str) -> list[int]:
    """SLURM_STEP_TASKS_PER_NODE (`2(x3),1`) as each node's task count."""
    counts = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ConfigError(f"SLURM_STEP_TASKS_PER_NODE = {spec!r}: not Slurm's form (`2(x3),1`)")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def slurm_launch(environ: Mapping[str, str], nproc: int | None = None) -> dict[str, object]:
    """The launch keys a `srun` step gives this node (launch.nnodes, launch.node_rank,
    launch.rdzv_endpoint; with several tasks a node, launch.nproc: each task is a rank, and an
    `nproc` flag must say as many), or none outside one."""
    if "SLURM_STEP_NODELIST" not in environ or "SLURM_NODEID" not in environ:
        return {}
    hosts = expand_hostlist(environ["SLURM_STEP_NODELIST"])
    port = environ.get("MASTER_PORT", str(RENDEZVOUS_PORT))
    keys: dict[str, object] = {"launch.nnodes": int(environ.get("SLURM_STEP_NUM_NODES", len(hosts))),
                               "launch.node_rank": int(environ["SLURM_NODEID"]),
                               "launch.rdzv_endpoint": f"{hosts[0]}:{port}"}
    tasks = _tasks(environ)
    if tasks > 1 and nproc not in (None, tasks):
        raise ConfigError(f"--nproc {nproc}: srun started {tasks} tasks on this node, each a rank; leave --nproc "
                          "out (or give srun --ntasks-per-node)")
    if tasks > 1:
        keys["launch.nproc"] = tasks
    return keys


def _tasks(environ: Mapping[str, str]) -> int:
    """The tasks each node of the step runs: the same on every node (a node's ranks are launch.nproc)."""
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE", "1")
    counts = tasks_per_node(spec)
    if len(set(counts)) > 1:
        raise ConfigError(f"srun with tasks per node {spec!r} (SLURM_STEP_TASKS_PER_NODE): shardwise trains on "
                          "the same ranks a node everywhere; give srun --ntasks-per-node")
    return counts[0]


def rank_environment(environ: Mapping[str, str]) -> dict[str, str] | None:
    """Under a step of several tasks a node, what makes this task a rank of the job as torchrun's
    workers are (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, from
    SLURM_PROCID, SLURM_LOCALID, SLURM_STEP_NUM_TASKS and the step's first host); None otherwise:
    one task a node launches its node's ranks itself."""
    launch = slurm_launch(environ)
    if "launch.nproc" not in launch:
        return None
    host, port = str(launch["launch.rdzv_endpoint"]).rsplit(":", 1)
    nproc = int(launch["launch.nproc"])  # type: ignore[call-overload]
    return {"RANK": environ["SLURM_PROCID"], "LOCAL_RANK": environ["SLURM_LOCALID"],
            "WORLD_SIZE": environ.get("SLURM_STEP_NUM_TASKS", str(nproc * int(launch["launch.nnodes"]))),
            "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": host, "MASTER_PORT": port}


def check_task_per_rank(cfg: Config) -> None:
    """What one process a rank cannot do: what needs a launcher of shardwise's (restarting ranks:
    Slurm's --requeue does it; replica groups; a parameter server's own launch)."""
    launch = cfg.launch
    if launch.max_restarts:
        raise ConfigError(f"launch.max_restarts = {launch.max_restarts}: with one process a rank under srun no "
                          "launcher of shardwise's restarts them; Slurm requeues the job (sbatch --requeue), or "
                          "run one task a node (srun --ntasks-per-node=1)")
    own = own_launcher_setting(cfg.parallel.strategy, launch.replica_groups)
    if own is not None:
        raise ConfigError(f"{own}: starts its ranks with a launcher of its own; under srun run one task a node "
                          "(srun --ntasks-per-node=1)")


def train_as_rank(cfg: Config, config_path: Path, rank: Mapping[str, str]) -> int:
    """Run this task as the rank `rank` (rank_environment) says, in this process: what a launcher's
    forked worker runs (shardwise.worker), then leave as one does."""
    from shardwise import worker
    from shardwise.dist import leave_process
    from shardwise.launch import node_addr_settings

    os.environ.update(rank, OMP_NUM_THREADS=str(cfg.launch.threads_per_rank), **node_addr_settings(cfg.launch))
    worker.main([str(config_path)])
    leave_process()
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("slurm", help="write (and with --submit, submit) an sbatch script that trains a config",
                            description="Checks CONFIG for NODES x ranks a node, then writes OUT/job.sbatch: one "
                            "launcher a node under srun (or with --task-per-rank every task a rank; shardwise train "
                            "reads the step from Slurm's environment), SIGTERM GRACE seconds before the time limit "
                            "(the ranks save a checkpoint and stop), --requeue (a requeued or preempted job resumes "
                            "from its newest checkpoint: the script trains with --resume). docs/multinode.md.")
    p.add_argument("config", help="TOML config file")
    p.add_argument("--nodes", type=int, help="nodes of the job (with --from-plan, the plan's)")
    ranks = p.add_mutually_exclusive_group()
    ranks.add_argument("--gpus-per-node", type=int, metavar="G",
                       help="ranks a node, a GPU each (#SBATCH --gpus-per-node)")
    ranks.add_argument("--nproc", type=int, metavar="P", help="ranks a node, on its CPUs (no GPU asked for)")
    p.add_argument("--from-plan", metavar="FILE", help="train as `shardwise plan --json FILE` recommends: its "
                   "strategy, mesh, precision, recompute and micro-batch, on its nodes and GPUs a node")
    p.add_argument("--task-per-rank", action="store_true", help="one Slurm task a rank (srun --ntasks-per-node=G, "
                   "no launcher of shardwise's) instead of one launcher a node forking its ranks")
    p.add_argument("--out", required=True, help="the run directory, on storage every node sees; the script goes there")
    p.add_argument("--time", help="the job's time limit, as sbatch takes it (e.g. 04:00:00)")
    p.add_argument("--grace", type=int, default=120, metavar="SECONDS",
                   help="SIGTERM this long before the time limit, for the last checkpoint (default 120)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value (repeatable), passed on to shardwise train")
    p.add_argument("--submit", action="store_true", help="submit the script with sbatch")


def sbatch_script(args: argparse.Namespace, nodes: int, ranks: int, gpus: bool, settings: list[str]) -> str:
    """The job: its resources, the signal before its limit, requeue, and `shardwise train` under
    srun, one a node (forking `ranks`) or one a rank."""
    out = Path(args.out).resolve()
    tasks = ranks if args.task_per_rank else 1
    # this installation's `shardwise`: the nodes share it as they share the run directory
    train = ["srun", f"--ntasks-per-node={tasks}", str(Path(sys.executable).with_name("shardwise")), "train",
             str(Path(args.config).resolve()), *([] if args.task_per_rank else ["--nproc", str(ranks)]),
             "--resume", "--out", str(out), *(arg for each in settings for arg in ("--set", each))]
    if args.task_per_rank:  # a rank that fails ends the step, as a launcher would end its node's
        train.insert(1, "--kill-on-bad-exit=1")
    lines = ["#!/bin/bash", f"#SBATCH --job-name=shardwise-{out.name}", f"#SBATCH --nodes={nodes}",
             f"#SBATCH --ntasks-per-node={tasks}", f"#SBATCH --signal=TERM@{args.grace}", "#SBATCH --requeue",
             f"#SBATCH --output={out}/slurm-%j.out", "#SBATCH --open-mode=append"]  # a requeued run logs after
    if gpus:
        lines.append(f"#SBATCH --gpus-per-node={ranks}")
    if args.time:
        lines.append(f"#SBATCH --time={args.time}")
    return "\n".join([*lines, "", " ".join(shlex.quote(part) for part in train), ""])


class Job(NamedTuple):
    nodes: int
    ranks: int  # a node
    gpus: bool  # the ranks are GPUs (#SBATCH --gpus-per-node)
    settings: list[str]  # --set overrides of the config: a plan's recommendation
    global_batch: int | None = None  # what a plan was made for


def _from_plan(args: argparse.Namespace) -> Job:
    """The job `shardwise plan --json` FILE recommends: its nodes, ranks a node and settings; flags
    given must agree with it."""
    from shardwise.planner.candidates import Candidate

    try:
        plan = json.loads(Path(args.from_plan).read_text())
        best, nodes, per_node = plan["recommended"], plan["nodes"], plan["gpus_per_node"]
        gpus = plan["device"]["name"] != "cpu"
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"--from-plan {args.from_plan}: not a plan `shardwise plan --json` wrote "
                          f"({type(error).__name__}: {error})") from None
    if best is None:
        raise ConfigError(f"--from-plan {args.from_plan}: the plan recommends nothing (no candidate fit)")
    given = args.gpus_per_node or args.nproc
    for flag, value, planned in (("--nodes", args.nodes, nodes), ("ranks a node", given, per_node)):
        if value is not None and value != planned:
            raise ConfigError(f"{flag} {value}: the plan in {args.from_plan} is for {nodes} node(s) of {per_node}")
    fields = Candidate.__dataclass_fields__
    candidate = Candidate(**{key: value for key, value in best.items() if key in fields})
    return Job(nodes, per_node, bool(args.gpus_per_node) or (args.nproc is None and gpus), candidate.settings(),
               plan["global_batch"])


def run(args: argparse.Namespace) -> int:
    """`shardwise slurm`: the config checked for the job's world, its script written (and submitted)."""
    from shardwise.config.load import load_config

    if args.from_plan:
        job = _from_plan(args)
    elif args.nodes is None or (args.gpus_per_node or args.nproc) is None:
        raise ConfigError("give --nodes and --gpus-per-node (or --nproc), or --from-plan FILE")
    else:
        job = Job(args.nodes, args.gpus_per_node or args.nproc, bool(args.gpus_per_node), [])
    if job.nodes < 1 or job.ranks < 1:
        raise ConfigError(f"--nodes {job.nodes} and {job.ranks} ranks a node: each must be at least 1")
    settings = [*job.settings, *args.set]  # the user's --set wins over the plan's
    cfg = load_config(args.config, settings, {"launch.nnodes": job.nodes, "launch.nproc": job.ranks})  # or refused
    if job.global_batch is not None and cfg.train.global_batch != job.global_batch:
        raise ConfigError(f"--from-plan {args.from_plan}: planned for train.global_batch = {job.global_batch}, the "
                          f"config trains {cfg.train.global_batch}; plan this config again")
    script = Path(args.out) / "job.sbatch"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(sbatch_script(args, job.nodes, job.ranks, job.gpus, settings))
    how = "a task a rank" if args.task_per_rank else "a launcher a node"
    print(f"wrote {script}: {job.nodes} node(s) x {job.ranks} rank(s), {how}")
    if args.submit:
        if shutil.which("sbatch") is None:
            raise ConfigError(f"--submit: sbatch is not on PATH here; {script} is written, submit it where Slurm is")
        return subprocess.run(["sbatch", str(script)]).returncode
    return 0
