"""Slurm's environment: under `srun`, the launch a job step gives this node, read with no flag.

One launcher a node (`srun --ntasks-per-node=1 shardwise train ...`), each forking its node's ranks
as on one machine: the step's nodes (SLURM_STEP_NUM_NODES), this node's rank among them
(SLURM_NODEID) and the rendezvous on the first host of the step's node list (SLURM_STEP_NODELIST,
in Slurm's compressed form, `node[01-03,07],gpu1`), at MASTER_PORT or 29500. Flags given on the
command line win over them. One process a rank (`--ntasks-per-node` above 1) is refused, saying
what to run instead.

`shardwise slurm` writes the sbatch script that runs it so (`sbatch_script`).
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from shardwise.config.schema import ConfigError

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


def slurm_launch(environ: Mapping[str, str]) -> dict[str, object]:
    """The launch keys a `srun` step gives this node (launch.nnodes, launch.node_rank,
    launch.rdzv_endpoint), or none outside one."""
    if "SLURM_STEP_NODELIST" not in environ or "SLURM_NODEID" not in environ:
        return {}
    hosts = expand_hostlist(environ["SLURM_STEP_NODELIST"])
    tasks = tasks_per_node(environ.get("SLURM_STEP_TASKS_PER_NODE", "1"))
    if max(tasks) > 1:
        raise ConfigError(f"srun with {max(tasks)} tasks on a node (SLURM_STEP_TASKS_PER_NODE = "
                          f"{environ.get('SLURM_STEP_TASKS_PER_NODE')!r}): shardwise train starts a node's ranks "
                          "itself; run one task a node (srun --ntasks-per-node=1) and give --nproc")
    port = environ.get("MASTER_PORT", str(RENDEZVOUS_PORT))
    return {"launch.nnodes": int(environ.get("SLURM_STEP_NUM_NODES", len(hosts))),
            "launch.node_rank": int(environ["SLURM_NODEID"]), "launch.rdzv_endpoint": f"{hosts[0]}:{port}"}


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("slurm", help="write (and with --submit, submit) an sbatch script that trains a config",
                            description="Checks CONFIG for NODES x ranks a node, then writes OUT/job.sbatch: one "
                            "launcher a node under srun (shardwise train reads the step from Slurm's environment), "
                            "SIGTERM GRACE seconds before the time limit (the ranks save a checkpoint and stop), "
                            "--requeue (a requeued or preempted job resumes from its newest checkpoint: the script "
                            "trains with --resume). docs/multinode.md.")
    p.add_argument("config", help="TOML config file")
    p.add_argument("--nodes", type=int, required=True, help="nodes of the job")
    ranks = p.add_mutually_exclusive_group(required=True)
    ranks.add_argument("--gpus-per-node", type=int, metavar="G",
                       help="ranks a node, a GPU each (#SBATCH --gpus-per-node)")
    ranks.add_argument("--nproc", type=int, metavar="P", help="ranks a node, on its CPUs (no GPU asked for)")
    p.add_argument("--out", required=True, help="the run directory, on storage every node sees; the script goes there")
    p.add_argument("--time", help="the job's time limit, as sbatch takes it (e.g. 04:00:00)")
    p.add_argument("--grace", type=int, default=120, metavar="SECONDS",
                   help="SIGTERM this long before the time limit, for the last checkpoint (default 120)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value (repeatable), passed on to shardwise train")
    p.add_argument("--submit", action="store_true", help="submit the script with sbatch")


def sbatch_script(args: argparse.Namespace, ranks: int) -> str:
    """The job: its resources, the signal before its limit, requeue, and one `shardwise train` a node."""
    out = Path(args.out).resolve()
    # this installation's `shardwise`: the nodes share it as they share the run directory
    train = ["srun", "--ntasks-per-node=1", str(Path(sys.executable).with_name("shardwise")), "train",
             str(Path(args.config).resolve()), "--nproc", str(ranks), "--resume", "--out", str(out),
             *(arg for each in args.set for arg in ("--set", each))]
    lines = ["#!/bin/bash", f"#SBATCH --job-name=shardwise-{out.name}", f"#SBATCH --nodes={args.nodes}",
             "#SBATCH --ntasks-per-node=1", f"#SBATCH --signal=TERM@{args.grace}", "#SBATCH --requeue",
             f"#SBATCH --output={out}/slurm-%j.out"]
    if args.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={args.gpus_per_node}")
    if args.time:
        lines.append(f"#SBATCH --time={args.time}")
    return "\n".join([*lines, "", " ".join(shlex.quote(part) for part in train), ""])


def run(args: argparse.Namespace) -> int:
    """`shardwise slurm`: the config checked for the job's world, its script written (and submitted)."""
    from shardwise.config.load import load_config

    ranks = args.gpus_per_node or args.nproc
    if args.nodes < 1 or ranks < 1:
        raise ConfigError(f"--nodes {args.nodes} and {ranks} ranks a node: each must be at least 1")
    load_config(args.config, args.set, {"launch.nnodes": args.nodes, "launch.nproc": ranks})  # refused here if bad
    script = Path(args.out) / "job.sbatch"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(sbatch_script(args, ranks))
    print(f"wrote {script}: {args.nodes} node(s) x {ranks} rank(s)")
    if args.submit:
        if shutil.which("sbatch") is None:
            raise ConfigError(f"--submit: sbatch is not on PATH here; {script} is written, submit it where Slurm is")
        return subprocess.run(["sbatch", str(script)]).returncode
    return 0
