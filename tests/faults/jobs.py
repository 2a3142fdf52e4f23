"""Training jobs run through the CLI for the fault tests: start one, wait for a step. (Its worker
processes: shardwise.launch.worker_pids.)"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from helpers import CONFIGS, REPO

STEPS = 60


def start_training(out: Path, *flags: str) -> subprocess.Popen:
    """`shardwise train` of gpt-tiny under ddp on 2 ranks for STEPS steps into `out`."""
    return subprocess.Popen(
        [sys.executable, "-m", "shardwise.cli", "train", str(CONFIGS / "gpt-tiny.toml"), "--strategy", "ddp",
         "--nproc", "2", "--steps", str(STEPS), "--out", str(out), "--set", "train.eval_every=0",
         "--set", "train.global_batch=8", "--set", "train.micro_batch=4", *flags],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def steps_logged(out: Path) -> int:
    path = out / "metrics.jsonl"
    return path.read_text().count('"event": "step"') if path.is_file() else 0


def wait_for_step(process: subprocess.Popen, out: Path, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while steps_logged(out) < step:
        assert process.poll() is None, process.communicate()[1]
        assert time.monotonic() < deadline, f"no step {step} within {timeout} s"
        time.sleep(0.05)


