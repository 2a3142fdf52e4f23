"""Several "nodes" on one Linux machine: network namespaces joined by veth pairs to a bridge.

Each node is a namespace with its own loopback and one interface holding its own address; the
bridge lives in a namespace of its own (the switch), so nothing touches the host's network and
every cluster is isolated from every other (names carry a random id, so parallel runs do not
collide, and the same addresses serve all of them). A link can be rate-limited with a token
bucket (`tc qdisc ... tbf`) on both of its ends, cut (`ip link set down`) and restored. Traffic
between a node's own processes stays on its loopback, unlimited, as inside a real machine.

    python -m bench.netns up 2 [--rate 1gbit]      # prints the cluster's name and nodes
    python -m bench.netns train NAME CONFIG [--nproc N] [shardwise train flags ...]
    python -m bench.netns down NAME

(scripts/netns-nodes.sh wraps these.) `train` starts `shardwise train` in every node with
--nnodes, --node-rank, --node-addr and a c10d rendezvous on node 0's address. Needs root.

Benches run their own worker module over a cluster with `run_job`, and their ranks change the
links' rate between measurements with `LinkRate` (the host sets it when rank 0 asks).
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
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import bench_env

SUBNET = "10.213.0"  # node i is SUBNET.(i+1)/24; each cluster is its own network, so all share it
RDZV_PORT = 29400
# tc's bucket must hold at least one of the largest packets the veth hands it (GSO makes them up
# to 64 KiB), or tbf drops them all; a few ms of the rate beyond that smooths the bursts.
MIN_BURST_BYTES = 256 * 1024


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be made here; the message says why."""


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made on this machine, or None if they can (as far as can be told
    without making one)."""
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, as CI does)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "`ip` and `tc` (iproute2) are not installed"
    return None


def parse_rate(rate: str) -> float:
    """Bytes per second of a tc rate such as 1gbit, 200mbit, 500kbit."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1}
    for unit, bits in units.items():
        if rate.endswith(unit):
            try:
                return float(rate[: -len(unit)]) * bits / 8
            except ValueError:
                break
    raise ValueError(f"rate {rate!r}: expected a number and a unit, e.g. 1gbit, 200mbit, 500kbit")


@dataclass(frozen=True)
class Node:
    rank: int
    netns: str
    interface: str  # the node's end of its veth pair
    port: str  # the switch's end
    addr: str


class Cluster:
    """`nodes` namespaces on a bridge; a context manager that always removes what it made."""

    def __init__(self, nodes: int, rate: str | None = None, name: str | None = None) -> None:
        if not 1 <= nodes <= 250:
            raise ValueError(f"nodes = {nodes}: expected 1 to 250")
        self.name = name or f"sw{uuid.uuid4().hex[:6]}"
        self.switch = f"{self.name}-switch"
        self.nodes = [Node(i, f"{self.name}-n{i}", f"{self.name}n{i}", f"{self.name}p{i}", f"{SUBNET}.{i + 1}")
                      for i in range(nodes)]
        self.rate = rate
        self.processes: list[subprocess.Popen] = []

    def __enter__(self) -> Cluster:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        reason = unavailable_reason()
        if reason:
            raise NetnsUnavailable(reason)
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for node in self.nodes:
                _ip("netns", "add", node.netns)
                _ip("-n", node.netns, "link", "set", "lo", "up")
                _ip("link", "add", node.interface, "netns", node.netns, "type", "veth",
                    "peer", "name", node.port, "netns", self.switch)
                _ip("-n", self.switch, "link", "set", node.port, "master", "br0")
                _ip("-n", self.switch, "link", "set", node.port, "up")
                _ip("-n", node.netns, "addr", "add", f"{node.addr}/24", "dev", node.interface)
                _ip("-n", node.netns, "link", "set", node.interface, "up")
            self.set_rate(self.rate)
        except BaseException:
            self.down()
            raise

    def set_rate(self, rate: str | None) -> None:
        """Limit every link to `rate` (tc syntax, e.g. 1gbit) each way, or lift the limit (None)."""
        self.rate = rate
        for node in self.nodes:
            for netns, interface in ((node.netns, node.interface), (self.switch, node.port)):
                subprocess.run(["tc", "-n", netns, "qdisc", "del", "dev", interface, "root"], capture_output=True)
                if rate is not None:
                    burst = max(MIN_BURST_BYTES, int(parse_rate(rate) * 0.005))
                    result = subprocess.run(["tc", "-n", netns, "qdisc", "add", "dev", interface, "root", "tbf",
                                             "rate", rate, "burst", str(burst), "latency", "100ms"],
                                            capture_output=True, text=True)
                    if result.returncode:
                        raise NetnsUnavailable(f"tc tbf on {interface} in {netns} failed: {result.stderr.strip()}")

    def cut(self, rank: int) -> None:
        """Take node `rank`'s link down, as a pulled cable or a dead switch port would."""
        _ip("-n", self.switch, "link", "set", self.nodes[rank].port, "down")

    def restore(self, rank: int) -> None:
        _ip("-n", self.switch, "link", "set", self.nodes[rank].port, "up")

    def kill(self, rank: int) -> None:
        """SIGKILL every process on node `rank` (its launcher and workers), as a node's crash would;
        the node stays, to be started on again."""
        kill_processes(self.nodes[rank].netns)

    def popen(self, rank: int, argv: list[str], **kwargs: object) -> subprocess.Popen:
        """Start `argv` inside node `rank`'s namespace."""
        process = subprocess.Popen(["ip", "netns", "exec", self.nodes[rank].netns, *argv], **kwargs)
        self.processes.append(process)
        return process

    def node_flags(self, rank: int) -> list[str]:
        """What a launcher on node `rank` is told: the job's nodes, its rank and address, node 0's rendezvous."""
        return ["--nnodes", str(len(self.nodes)), "--node-rank", str(rank),
                "--rdzv-endpoint", f"{self.nodes[0].addr}:{RDZV_PORT}", "--node-addr", self.nodes[rank].addr]

    def train_argv(self, rank: int, config: str, nproc: int, flags: list[str]) -> list[str]:
        """`shardwise train` as node `rank` of this cluster runs it."""
        return [sys.executable, "-m", "shardwise.cli", "train", config, "--nproc", str(nproc),
                *self.node_flags(rank), *flags]

    def train(self, config: str, flags: list[str], nproc: int = 1, **kwargs: object) -> list[subprocess.Popen]:
        """Start `shardwise train CONFIG FLAGS` on every node; one process per node, node 0 first."""
        return [self.popen(node.rank, self.train_argv(node.rank, config, nproc, flags), **kwargs)
                for node in self.nodes]

    def down(self) -> None:
        """Kill what runs in the namespaces (what this cluster started, and their children) and
        remove them, the veths and the bridge with them. Safe to call twice."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for netns in [node.netns for node in self.nodes] + [self.switch]:
            kill_and_remove(netns)
        for process in self.processes:
            process.wait()


# --- a job over a cluster, its ranks choosing the links' rate --------------------------------

class LinkRate:
    """A rank's side of the rate handshake, through files in a directory host and ranks share:
    rank 0 asks for a rate and waits until the host has set it; then every rank goes on together."""

    def __init__(self, ctx: Any, handshake: Path) -> None:
        self.ctx, self.handshake, self.asked = ctx, handshake, 0

    def set(self, rate: str | None) -> None:
        """Every link at `rate` (tc syntax) each way, or unlimited (None); called by every rank."""
        if self.ctx.is_main:
            want = self.handshake / f"want-{self.asked}"
            (self.handshake / "asking").write_text(rate or "unlimited")
            (self.handshake / "asking").rename(want)  # whole, or not at all, when the host looks
            while not (self.handshake / f"set-{self.asked}").exists():
                time.sleep(0.05)
        self.asked += 1
        self.ctx.barrier()


def run_job(cluster: Cluster, nproc: int, module: str, args: list[str]) -> Any:
    """Run `python -m MODULE ARGS --handshake DIR` as `nproc` ranks on every node of `cluster` (a
    c10d rendezvous on node 0), setting the links' rate whenever rank 0 asks (`LinkRate`);
    returns the JSON rank 0 wrote to DIR/result.json. A failed node fails the job at once, with
    its error output."""
    with tempfile.TemporaryDirectory() as tmp:
        handshake = Path(tmp)
        processes = [cluster.popen(node.rank, [sys.executable, "-m", "bench.netns", "node",
                                               "--nproc", str(nproc), *cluster.node_flags(node.rank),
                                               module, *args, "--handshake", tmp],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=bench_env())
                     for node in cluster.nodes]
        errors = [tempfile.TemporaryFile(mode="w+") for _ in processes]
        readers = [_drain(process, error) for process, error in zip(processes, errors, strict=True)]
        answered = 0
        while any(process.poll() is None for process in processes):
            want = handshake / f"want-{answered}"
            if want.exists():
                rate = want.read_text()
                cluster.set_rate(None if rate == "unlimited" else rate)
                (handshake / f"set-{answered}").write_text("")
                answered += 1
                continue
            _check_alive(processes, errors)
            time.sleep(0.05)
        for reader in readers:
            reader.join()
        _check_alive(processes, errors)
        return json.loads((handshake / "result.json").read_text())


def _drain(process: subprocess.Popen, sink: Any) -> threading.Thread:
    """A thread copying the process's stderr to `sink` (so a full pipe never blocks it)."""
    thread = threading.Thread(target=lambda: sink.write(process.stderr.read()), daemon=True)
    thread.start()
    return thread


def _check_alive(processes: list[subprocess.Popen], errors: list[Any]) -> None:
    for rank, (process, error) in enumerate(zip(processes, errors, strict=True)):
        code = process.poll()
        if code:  # a failed node: the others would wait for it until the timeout
            error.seek(0)
            raise RuntimeError(f"node {rank} failed (exit {code}):\n{error.read()[-3000:]}")


def kill_processes(netns: str) -> None:
    """SIGKILL every process inside namespace `netns`."""
    pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_and_remove(netns: str) -> None:
    """Kill every process inside namespace `netns` (a namespace lives on while one does), then delete it."""
    kill_processes(netns)
    subprocess.run(["ip", "netns", "del", netns], capture_output=True)


def _namespaces(name: str) -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    return [line.split()[0] for line in listed if line.startswith(f"{name}-")]


def _cluster_of(name: str) -> Cluster:
    nodes = sum(1 for netns in _namespaces(name) if netns.startswith(f"{name}-n"))
    if not nodes:
        raise SystemExit(f"no cluster named {name!r}: `ip netns list` shows no {name}-n0")
    return Cluster(nodes, name=name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.netns", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="make N nodes on a bridge; prints the cluster's name")
    up.add_argument("nodes", type=int)
    up.add_argument("--rate", help="limit every link to this rate each way (tc syntax: 1gbit, 200mbit)")
    # No abbreviations: every flag it does not know is shardwise train's
    train = commands.add_parser("train", help="run `shardwise train` on every node of a cluster, wait for all",
                                allow_abbrev=False)
    train.add_argument("name")
    train.add_argument("config")
    train.add_argument("--nproc", type=int, default=1, help="processes per node")
    down = commands.add_parser("down", help="kill what runs in a cluster's nodes and remove them")
    down.add_argument("name")
    node = commands.add_parser("node", help="one node's ranks of a run_job job: python -m MODULE ARGS on each",
                               allow_abbrev=False)
    for flag in ("--nproc", "--nnodes", "--node-rank"):
        node.add_argument(flag, type=int, required=True)
    node.add_argument("--node-addr", required=True)
    node.add_argument("--rdzv-endpoint", required=True)
    args, rest = parser.parse_known_args(argv)
    if args.command == "node":
        from shardwise.config.schema import LaunchConfig
        from shardwise.launch import launch_workers

        launch_workers(LaunchConfig(nproc=args.nproc, nnodes=args.nnodes, node_rank=args.node_rank,
                                    rdzv_endpoint=args.rdzv_endpoint, node_addr=args.node_addr), rest)
        return 0
    if args.command == "up":
        cluster = Cluster(args.nodes, args.rate)
        try:
            cluster.up()
        except NetnsUnavailable as error:
            print(f"netns: {error}", file=sys.stderr)
            return 2
        print(cluster.name)
        for node in cluster.nodes:
            print(f"  node {node.rank}: ip netns exec {node.netns} ...  address {node.addr} on {node.interface}")
        return 0
    if rest and args.command != "train":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    cluster = _cluster_of(args.name)
    if args.command == "down":
        for netns in _namespaces(args.name):
            kill_and_remove(netns)
        return 0
    processes = cluster.train(args.config, rest, args.nproc, env=bench_env())
    return max(process.wait() for process in processes)


if __name__ == "__main__":
    sys.exit(main())
