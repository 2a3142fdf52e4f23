"""The fixtures the tests share; what they share besides is in helpers.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import COMPARED_STEPS, CONFIGS, shardwise, train_in_process

from shardwise.config.load import load_config


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`make test TEST_WORKERS=2`), each worker takes its share of the cores for the work it does
    in its own process: OpenMP's threads spin while they wait for work, and two workers of 2 threads
    each on 2 cores ran a small matmul 9 times slower than one did. Ranks and jobs set their own
    count (launch.threads_per_rank)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


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
