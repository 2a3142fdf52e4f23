"""Faults for real, through the CLI: a SIGTERM'd job saves and resumes; a worker killed with
SIGKILL at a random step, or in the middle of writing a checkpoint, is restarted by the launcher
and the run ends bit-identical; a save onto a full disk fails clearly and loses nothing."""

from __future__ import annotations

import os
import random
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import REPO, losses, read_records
from jobs import STEPS, start_training, wait_for_step
from safetensors.torch import load_file

from shardwise.launch import worker_pids

pytestmark = pytest.mark.slow  # real jobs killed and restarted: a minute in all


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


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Iterator[tuple[Path, subprocess.Popen]]:
    """The run every interrupted one must end identical to: started here and waited for only when a
    test compares with it, so it runs beside the first interrupted one (mostly starting up)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    job = start_training(out)
    yield out, job
    if job.poll() is None:
        job.kill()


def assert_identical(run: Path, uninterrupted: tuple[Path, subprocess.Popen]) -> None:
    reference, job = uninterrupted
    assert job.wait(timeout=300) == 0, job.communicate()[1]
    weights, expected = load_file(str(run / "model.safetensors")), load_file(str(reference / "model.safetensors"))
    for key in expected:
        assert torch.equal(weights[key], expected[key]), (run.name, key)
    assert losses(run) == losses(reference)


def test_a_killed_worker_is_restarted_and_the_run_ends_bit_identical(tmp_path, uninterrupted):
    """One trial: its seed kills the second worker (rank 1) at step 30, mid-interval, so it resumes
    from step 28. (A second trial killed rank 1 again, at step 8; the next test kills rank 0, in
    the middle of a save.)"""
    rng = random.Random(0)
    job = start_training(tmp_path, "--checkpoint-every", "4", "--max-restarts", "1")
    kill_at = rng.randint(6, STEPS - 20)  # after the first checkpoint (step 4), well before the end
    wait_for_step(job, tmp_path, kill_at)
    victim = rng.choice(list(worker_pids(job.pid).values()))
    os.kill(victim, signal.SIGKILL)
    _, err = job.communicate(timeout=300)
    assert job.returncode == 0, f"killed at step {kill_at}:\n{err}"
    assert "resumed from" in err
    assert_identical(tmp_path, uninterrupted)


def stop_rank0_mid_save(job: subprocess.Popen, out: Path) -> str:
    """SIGSTOP rank 0 while a checkpoint after the first is half written: files in its temporary
    directory, and (rank 0 being the one that renames it into place) not yet renamed. Returns its
    name."""
    root = out / "checkpoints"
    while job.poll() is None:
        for tmp in root.glob(".tmp-step-*") if (root / "latest").is_file() else []:
            if any(tmp.glob("*")):  # (glob, unlike iterdir, takes a directory renamed meanwhile as empty)
                rank0 = worker_pids(job.pid)[0]
                os.kill(rank0, signal.SIGSTOP)
                name = tmp.name.removeprefix(".tmp-")
                if tmp.is_dir() and not (root / name).exists():
                    return name
                os.kill(rank0, signal.SIGCONT)  # stopped just after the rename: wait for the next save
        time.sleep(0.001)
    raise AssertionError(f"the run ended before a save was caught in progress:\n{job.communicate()[1]}")


def test_a_worker_killed_while_saving_resumes_from_the_previous_checkpoint(tmp_path, uninterrupted):
    job = start_training(tmp_path, "--checkpoint-every", "4", "--max-restarts", "1")
    saving = stop_rank0_mid_save(job, tmp_path)
    os.kill(worker_pids(job.pid)[0], signal.SIGKILL)
    _, err = job.communicate(timeout=300)
    assert job.returncode == 0, err
    previous = f"step-{int(saving.removeprefix('step-')) - 4:08d}"
    assert f"resumed from {tmp_path / 'checkpoints' / previous} " in err
    assert_identical(tmp_path, uninterrupted)


def test_a_save_onto_a_full_disk_fails_clearly_and_keeps_the_previous_checkpoint(tmp_path):
    job = start_training(tmp_path, "--steps", "20", "--checkpoint-every", "10")
    assert job.wait(timeout=300) == 0, job.communicate()[1]

    def resume(*flags: str, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "shardwise.cli", "train", str(tmp_path / "config.toml"),
                               "--resume", "--steps", "40", *flags], cwd=REPO, capture_output=True, text=True,
                              timeout=300, **kwargs)

    # No file may grow past 256 KiB: the disk is full for a checkpoint's shards (~800 KiB), not for
    # the metrics. The same OSError a full or read-only disk raises, without needing either.
    limit = 256 << 10
    full = resume(preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert full.returncode == 1, full.stderr
    assert (f"could not save checkpoint step-00000030 in {tmp_path / 'checkpoints'}: rank 1: [Errno 27] "
            "File too large; the newest complete one, step-00000020, is intact") in full.stderr
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000010", "step-00000020"]
    assert (root / "latest").read_text() == "step-00000020"
    again = resume()
    assert again.returncode == 0, again.stderr
    assert f"resumed from {root / 'step-00000020'} " in again.stderr
