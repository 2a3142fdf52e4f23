"""The fixtures the tests share; what they share besides is in helpers.py."""

from __future__ import annotations

import fcntl
import os
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from helpers import COMPARED_STEPS, CONFIGS, shardwise, train_in_process

from shardwise.config.load import load_config


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`make test`), each worker takes its share of the cores for the work it does
    in its own process: OpenMP's threads spin while they wait for work, and two workers of 2 threads
    each on 2 cores ran a small matmul 9 times slower than one did. Ranks and jobs set their own
    count (launch.threads_per_rank)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Under pytest-xdist, a test marked `alone` runs with no other worker's test beside it (its setup
    and teardown included): the other worker's load once broke its job's recovery
    (docs/architecture.md#tests)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        yield
        return
    with _turn(Path(tempfile.gettempdir()) / f"shardwise-tests-{run}", item.get_closest_marker("alone") is not None):
        yield


@contextmanager
def _turn(base: Path, alone: bool) -> Iterator[None]:
    """A readers-writer lock between the workers' processes (flock, released if a worker dies): any
    number of tests share the room, a test alone holds it by itself. It waits for the tests in the
    room to end, and holds the turnstile meanwhile, which every test passes through on its way in, so
    the other workers' next tests cannot overtake it."""
    with open(base.with_suffix(".turnstile"), "a") as turnstile, open(base.with_suffix(".room"), "a") as room:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        fcntl.flock(room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)
            fcntl.flock(turnstile, fcntl.LOCK_UN)


@pytest.fixture
def tiny_config() -> Path:
    return CONFIGS / "gpt-tiny.toml"


@pytest.fixture(scope="session")
def cli_single_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`shardwise train configs/gpt-tiny.toml --steps 30` under single: the run the CLI tests compare with."""
    out = tmp_path_factory.mktemp("cli") / "single"
    result = shardwise("train", str(CONFIGS / "gpt-tiny.toml"), "--strategy", "single", "--steps", "30",
                       "--out", str(out))
    assert result.returncode == 0, result.stderr
    return out, result


@pytest.fixture(scope="session")
def cli_single_compared(tmp_path_factory) -> Path:
    """What `shardwise train configs/gpt-tiny.toml --steps 20` trains under single, trained in this
    process (test_train_cli's first test holds the two to the same losses, bit for bit): what the
    CLI comparisons hold runs to."""
    out = tmp_path_factory.mktemp("cli") / "single-compared"
    train_in_process(load_config(CONFIGS / "gpt-tiny.toml", [f"run.out={out}", f"train.steps={COMPARED_STEPS}",
                                                            "parallel.strategy=single"]))
    return out
