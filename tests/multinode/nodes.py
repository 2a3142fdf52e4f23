"""Nodes for the multi-node tests: a cluster of network namespaces (shardwise.bench.netns), made
for a test and always removed after it; skipped, with the reason, where namespaces cannot be made."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import CONFIGS, REPO

from shardwise.bench.netns import Cluster, NetnsUnavailable, unavailable_reason

# gpt-tiny, a global batch of 8 in micro-batches of 4: 2 ranks take one each, one process accumulates 2.
TINY = ["--set", "train.global_batch=8", "--set", "train.micro_batch=4", "--set", "train.eval_every=0"]


@contextmanager
def cluster(nodes: int, rate: str | None = None) -> Iterator[Cluster]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"multi-node tests need network namespaces: {reason}")
    made = Cluster(nodes, rate)
    try:
        made.up()
    except NetnsUnavailable as error:
        pytest.skip(f"multi-node tests need network namespaces, and this machine cannot make them: {error}")
    try:
        yield made
    finally:
        made.down()


def train_on_nodes(nodes: Cluster, out: Path, *flags: str, nproc: int = 1, timeout: float = 180,
                   config: Path = CONFIGS / "gpt-tiny.toml") -> list[subprocess.CompletedProcess]:
    """`shardwise train` on every node into `out` (one file system: what a shared volume is to real
    nodes); waits for all, and fails the test with every node's error if one failed."""
    processes = nodes.train(str(config), ["--out", str(out), *TINY, *flags], nproc=nproc, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = []
    for rank, process in enumerate(processes):
        stdout, stderr = process.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr))
        assert process.returncode == 0, f"node {rank} exited {process.returncode}:\n{stderr[-3000:]}"
    return results


def bytes_sent(nodes: Cluster, rank: int) -> int:
    """What node `rank` has sent over its link so far (its interface's counter)."""
    node = nodes.nodes[rank]
    return int(subprocess.run(["ip", "netns", "exec", node.netns, "cat", f"/sys/class/net/{node.interface}/"
                               "statistics/tx_bytes"], capture_output=True, text=True, check=True).stdout)
