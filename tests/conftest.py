from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardwise.config import Config, load_config
from shardwise.dist import init_distributed
from shardwise.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
# What parity runs train with (assert_same_training says why not AdamW): on gpt-tiny it brings the loss
# from 5.57 to 3.58 in 20 steps, as AdamW at 3e-3 does (3.55).
SGD = ("train.optimizer=sgd", "train.lr=0.1", "train.momentum=0.9")


def read_records(run_dir: Path, event: str = "step") -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


@pytest.fixture
def tiny_config() -> Path:
    return CONFIGS / "gpt-tiny.toml"


def shardwise(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The `shardwise` command, run to completion."""
    return subprocess.run(
        [sys.executable, "-m", "shardwise.cli", *args], cwd=REPO, capture_output=True, text=True,
        env={**os.environ, **(env or {})}, timeout=300,
    )


@pytest.fixture(scope="session")
def cli_single_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`shardwise train configs/gpt-tiny.toml --steps 30` under single: the run the CLI tests compare with."""
    out = tmp_path_factory.mktemp("cli") / "single"
    result = shardwise("train", str(CONFIGS / "gpt-tiny.toml"), "--strategy", "single", "--steps", "30",
                       "--out", str(out))
    assert result.returncode == 0, result.stderr
    return out, result


# CLI runs held to single's losses: 20 steps. gpt-tiny's loss jumps at step 20 (a hard batch), and
# AdamW carries each order of summation's rounding through the jump to about 1e-5 by step 30.
COMPARED_STEPS = 20


@pytest.fixture(scope="session")
def cli_single_compared(tmp_path_factory) -> Path:
    """What `shardwise train configs/gpt-tiny.toml --steps 20` trains under single, trained in this
    process (test_train_cli's first test holds the two to the same losses, bit for bit): what the
    CLI comparisons hold runs to."""
    out = tmp_path_factory.mktemp("cli") / "single-compared"
    train_in_process(load_config(CONFIGS / "gpt-tiny.toml", [f"run.out={out}", f"train.steps={COMPARED_STEPS}",
                                                            "parallel.strategy=single"]))
    return out


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_records(run_dir)]


def train_in_process(cfg: Config) -> None:
    """Train `single` in this process as a world of one, with one thread like every worker
    (thread count changes summation order), restoring pytest's thread count after."""
    threads = torch.get_num_threads()
    try:
        Trainer(cfg, init_distributed(threads_per_rank=1)).fit()
    finally:
        torch.set_num_threads(threads)


def assert_same_training(run: Path, reference: Path, steps: int, weights: bool = True) -> None:
    """Per-step losses within 1e-5 relative and, with `weights`, every tensor of the final state
    dict (parameters and buffers) within rtol 1e-5.

    Runs whose summation orders differ (ranks, micro-batches, split matrices) differ by rounding,
    and by a different amount on each CPU's kernels. Under SGD that noise stays of its own size in
    the weights, so rtol 1e-5 holds anywhere. AdamW divides each gradient by its running RMS, so
    where a gradient is about zero (the key bias of attention, a dead unit) the noise becomes a
    full step of either sign: weights trained by AdamW are not compared here (their losses are: a
    weight whose gradient is about zero moves the loss by about nothing)."""
    got, want = losses(run), losses(reference)
    assert len(got) == len(want) == steps
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
    assert worst <= 1e-5, f"{run.name}: loss differs by {worst:.2e} relative from {reference.name}"
    if weights:
        optimizers = {read_records(r, "summary")[0]["optimizer"] for r in (run, reference)}
        assert optimizers == {"sgd"}, f"weights compared after {optimizers}: train parity runs with SGD"
        state, expected = load_file(str(run / "model.safetensors")), load_file(str(reference / "model.safetensors"))
        assert state.keys() == expected.keys()
        for key in expected:
            torch.testing.assert_close(state[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)
