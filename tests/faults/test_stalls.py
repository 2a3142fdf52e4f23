"""No silent hangs: a rank that stops participating fails the job within the collective timeout,
naming the collective and the missing rank; ranks that disagree on the next collective are named
too, and caught at the first mismatched call with --debug-collectives."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist
from distributed import DEFAULT_TIMEOUT_S, run_ranks
from helpers import gpt_tiny
from jobs import start_training, steps_logged

from bench.crash import running
from shardwise.launch import worker_pids
from shardwise.stalls import explain, is_collective_failure
from shardwise.trainer import Trainer

TIMEOUT_S = 5


@pytest.mark.slow
def test_a_stalled_rank_fails_the_job_naming_the_collective_and_the_rank(tmp_path):
    """Rank 0 stalled in one job, rank 1 in another: the two run at once, since most of each is
    starting up or waiting out the timeout. Each rank is stopped (SIGSTOP, as a hung rank stops
    participating) once its job has logged step 5."""
    outs = [tmp_path / f"rank-{stalled}-stalled" for stalled in (0, 1)]
    jobs = [start_training(out, "--set", f"launch.timeout_s={TIMEOUT_S}", "--set", "launch.shutdown_timeout_s=1")
            for out in outs]
    stalled_at: dict[int, float] = {}
    workers: dict[int, list[int]] = {}  # the workers of each job, found while it runs
    try:
        deadline = time.monotonic() + 120
        while len(stalled_at) < 2:
            for stalled, (job, out) in enumerate(zip(jobs, outs, strict=True)):
                if stalled not in stalled_at and steps_logged(out) >= 5:
                    workers[stalled] = list(worker_pids(job.pid).values())
                    os.kill(workers[stalled][stalled], signal.SIGSTOP)
                    stalled_at[stalled] = time.monotonic()
                assert job.poll() is None, job.communicate()[1]
            assert time.monotonic() < deadline, "no step 5 within 120 s"
            time.sleep(0.05)
        errors = [job.communicate(timeout=120)[1] for job in jobs]
        elapsed = [time.monotonic() - stalled_at[stalled] for stalled in (0, 1)]
        outlived = [pid for pids in workers.values() for pid in pids if running(pid)]
    finally:
        for stalled, job in enumerate(jobs):
            pids = workers.get(stalled, []) + list(worker_pids(job.pid).values())
            if job.poll() is None:
                job.kill()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    for stalled, (err, job) in enumerate(zip(errors, jobs, strict=True)):
        assert job.returncode == 1, err
        assert elapsed[stalled] < TIMEOUT_S + 30, f"the job took {elapsed[stalled]:.0f} s to end after the stall"
        survivor = 1 - stalled
        message = re.search(rf"CollectiveFailure: rank {survivor}: (\w+) #\d+ on group 'default_pg' .*", err)
        assert message, err
        assert message[1] in {"all_reduce", "allreduce", "all_gather", "broadcast"}, message[0]
        assert f"did not complete within launch.timeout_s = {TIMEOUT_S} s" in message[0]
        assert f"Rank(s) {stalled} never joined it" in message[0]
    assert outlived == [], "worker processes outlived the job"


def _mismatched_collectives(ctx, debug: bool) -> str:
    """Rank 0 all-reduces while rank 1, a second later, broadcasts: user code that took different
    branches. Rank 0 times out first and closes its connections, so rank 1 sees its peer leave."""
    tensor = torch.ones(8)
    dist.barrier()
    try:
        if ctx.rank == 0:
            dist.all_reduce(tensor)
        else:
            time.sleep(0 if debug else 1)
            dist.broadcast(tensor, src=0)
    except RuntimeError as error:
        message = str(error) if debug or not is_collective_failure(error) else str(explain(error, ctx, 2, "test"))
        dist.destroy_process_group()  # broken now: skip the harness's closing barrier
        return message
    return "no error"


def test_ranks_in_different_collectives_are_both_named_after_the_timeout():
    messages = run_ranks(_mismatched_collectives, 2, False, timeout_s=2)
    assert messages[0].startswith("rank 0: all_reduce #2 on group 'default_pg' (Float[8]) did not complete within "
                                  "launch.timeout_s = 2 s"), messages[0]
    assert messages[1].startswith("rank 1: broadcast #2 on group 'default_pg' (Float[8]) failed: a peer closed its "
                                  "connection"), messages[1]
    for message in messages:
        assert "the ranks disagree on which collective comes next" in message
        assert "rank 0: all_reduce #2 on group 'default_pg' (Float[8])" in message
        assert "rank 1: broadcast #2 on group 'default_pg' (Float[8])" in message
        assert "--debug-collectives" in message


def test_debug_collectives_stops_at_the_first_mismatched_call_without_waiting_for_the_timeout():
    started = time.monotonic()
    messages = run_ranks(_mismatched_collectives, 2, True, timeout_s=60, debug_collectives=True)
    assert time.monotonic() - started < 60  # well inside the collective timeout: no waiting for it
    for message in messages:
        assert "Detected mismatch between collectives on ranks" in message
        assert "ALLREDUCE" in message and "BROADCAST" in message


def _group_timeouts(ctx, root) -> dict[str, float]:
    """Train runs that make process groups besides the world: the mesh's dimensions, the background
    saves' own Gloo group, experts over ep, a pipeline's tied embedding, PowerSGD's thread; each
    group (name, description, size) with its timeout in s."""
    runs = {"saves-experts": ("ddp", "model.name=gpt-moe", "parallel.ep=2", "train.checkpoint_every=1"),
            "tied-stages": ("pipeline", "parallel.pp=2", "parallel.pipeline.micro_batches=2"),
            "powersgd": ("ddp", "parallel.ddp.grad_compression=powersgd", "parallel.ddp.powersgd_start_step=1")}
    for name, (strategy, *overrides) in runs.items():
        Trainer(gpt_tiny(root / name, strategy, ctx.world_size, "train.micro_batch=4", *overrides, steps=2), ctx).fit()
    groups = dist.distributed_c10d._world.pg_map
    return {f"{group.group_name} {group.group_desc} {group.size()}":
            group._get_backend(torch.device("cpu")).options._timeout.total_seconds() for group in groups}


def test_every_group_a_run_makes_times_out_as_the_world_does(tmp_path):
    """new_group's default is 30 minutes, and a device mesh's dimensions and flattened groups other
    than the whole world are new groups: a cut link that landed in a background save held the rank
    waiting for it on its way out (node 0, in the suite) that long, instead of launch.timeout_s."""
    timeouts = run_ranks(_group_timeouts, 2, tmp_path)[0]
    # the world, 3 meshes' dimensions, the save's, ep's, the tied pair's, PowerSGD's
    assert len([name for name in timeouts if name.endswith(" 2")]) >= 5, timeouts
    assert set(timeouts.values()) == {DEFAULT_TIMEOUT_S}, timeouts
