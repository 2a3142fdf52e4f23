"""Slurm's environment: under `srun`, the launch a job step gives this node, read with no flag.

One launcher a node (`srun --ntasks-per-node=1 shardwise train ...`), each forking its node's ranks
as on one machine: the step's nodes (SLURM_STEP_NUM_NODES), this node's rank among them
(SLURM_NODEID) and the rendezvous on the first host of the step's node list (SLURM_STEP_NODELIST,
in Slurm's compressed form, `node[01-03,07],gpu1`), at MASTER_PORT or 29500. Flags given on the
command line win over them. One process a rank (`--ntasks-per-node` above 1) is refused, saying
what to run instead.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

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
