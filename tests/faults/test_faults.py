"""Faults for real, through the CLI: a SIGTERM'd job saves and resumes; a worker killed with
SIGKILL at a random step is restarted by the launcher and the run ends bit-identical."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from conftest import CONFIGS, REPO, losses, read_records
from safetensors.torch import load_file

STEPS = 60


def start_training(out: Path, *flags: str) -> subprocess.Popen:
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


def worker_pids(out: Path) -> list[int]:
    """The worker processes of the run writing to `out` (their command line names its config)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"shardwise.worker" in cmdline and str(out / "config.toml").encode() in cmdline:
            pids.append(int(entry.name))
    return sorted(pids)


def test_sigterm_saves_a_checkpoint_and_resume_finishes_the_run(tmp_path):
    job = start_training(tmp_path)
    wait_for_step(job, tmp_path, 5)
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 143, err
    assert "continue with --resume" in err
    saved = int((tmp_path / "checkpoints" / "latest").read_text().removeprefix("step-"))
    assert 5 <= saved < STEPS
    resumed = subprocess.run(
        [sys.executable, "-m", "shardwise.cli", "train", str(tmp_path / "config.toml"), "--resume"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {tmp_path / 'checkpoints' / f'step-{saved:08d}'}" in resumed.stderr
    assert [r["step"] for r in read_records(tmp_path)] == list(range(1, STEPS + 1))


def test_a_killed_worker_is_restarted_and_the_run_ends_bit_identical(tmp_path):
    reference = tmp_path / "uninterrupted"
    job = start_training(reference)
    assert job.wait(timeout=300) == 0, job.communicate()[1]
    expected = load_file(str(reference / "model.safetensors"))
    rng = random.Random(0)
    for trial in range(5):
        out = tmp_path / f"trial{trial}"
        job = start_training(out, "--checkpoint-every", "4", "--max-restarts", "1")
        kill_at = rng.randint(6, STEPS - 20)  # after the first checkpoint (step 4), well before the end
        wait_for_step(job, out, kill_at)
        victim = rng.choice(worker_pids(out))
        os.kill(victim, signal.SIGKILL)
        _, err = job.communicate(timeout=300)
        assert job.returncode == 0, f"trial {trial} (killed at step {kill_at}):\n{err}"
        assert "resumed from" in err
        weights = load_file(str(out / "model.safetensors"))
        for key in expected:
            assert torch.equal(weights[key], expected[key]), (trial, key)
        assert losses(out) == losses(reference)
