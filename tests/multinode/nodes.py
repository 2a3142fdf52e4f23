"""Nodes for the multi-node tests: a cluster of network namespaces (bench.netns), made
for a test and always removed after it; skipped, with the reason, where namespaces cannot be made."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import CONFIGS, REPO

from bench.netns import Cluster, NetnsUnavailable, unavailable_reason

HERE = Path(__file__).resolve().parent

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


def train_many_on_nodes(nodes: Cluster, runs: list[dict], nproc: int, timeout: float = 300) -> None:
    """Every run (`out`, `overrides` of gpt-tiny) in one job over the nodes (train_many.py)."""
    spec = Path(runs[0]["out"]).parent / f"runs-{nproc}.json"
    spec.write_text(json.dumps([{**run, "out": str(run["out"])} for run in runs]))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    processes = [nodes.popen(node.rank, [sys.executable, "-m", "bench.netns", "node", "--nproc", str(nproc),
                                         *nodes.node_flags(node.rank), "train_many", str(spec)],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for node in nodes.nodes]
    for rank, process in enumerate(processes):
        _, stderr = process.communicate(timeout=timeout)
        assert process.returncode == 0, f"node {rank} exited {process.returncode}:\n{stderr[-3000:]}"


def start_on_nodes(nodes: Cluster, out: Path, *flags: str, nproc: int = 1) -> list[subprocess.Popen]:
    """`shardwise train` started on every node into `out`, not waited for."""
    return nodes.train(str(CONFIGS / "gpt-tiny.toml"), ["--out", str(out), *TINY, *flags], nproc=nproc, cwd=REPO,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_step(processes: list[subprocess.Popen], out: Path, step: int, timeout: float = 120) -> None:
    """Until `out`'s metrics.jsonl has `step` steps (every node still running)."""
    deadline = time.monotonic() + timeout
    metrics = out / "metrics.jsonl"
    while not metrics.is_file() or metrics.read_text().count('"event": "step"') < step:
        for rank, process in enumerate(processes):
            assert process.poll() is None, f"node {rank} ended early:\n{process.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"no step {step} within {timeout} s"
        time.sleep(0.05)
