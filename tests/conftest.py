"""The fixtures the tests share; what they share besides is in helpers.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from helpers import COMPARED_STEPS, CONFIGS, shardwise, train_in_process

from shardwise.config.load import load_config


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
