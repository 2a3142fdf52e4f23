"""Naming the sick rank (health.py): a non-finite loss on one rank is re-run from the same state and
judged transient or deterministic, a loss spike likewise, and a rank slowed 4x is named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from helpers import gpt_tiny, in_process, losses, read_records

from shardwise.dist import DistContext
from shardwise.health import BadStepError
from shardwise.trainer import Trainer

STEPS = 8


def cfg_for(out: Path, world: int, *overrides: str):
    return gpt_tiny(out, "ddp" if world > 1 else "single", world, "train.micro_batch=4", *overrides, steps=STEPS)


def inject(trainer: Trainer, rank: int, steps: set[int], attempts: int, fault) -> None:
    """Make `fault(forward, args, kwargs)` the model's forward on `rank` at the 1-based `steps`, for
    the first `attempts` attempts at each (a transient fault: 1; a deterministic one: more)."""
    forward, tried = trainer.model.forward, {}

    def faulty(*args, **kwargs):
        step = trainer.step + 1
        tried[step] = tried.get(step, 0) + 1
        if trainer.ctx.rank == rank and step in steps and tried[step] <= attempts:
            return fault(forward, args, kwargs)
        return forward(*args, **kwargs)

    trainer.model.forward = faulty


def nan(forward, args, kwargs):
    return forward(*args, **kwargs) * float("nan")


def _nan_runs(ctx: DistContext, root: Path) -> dict:
    """ddp on 2 ranks: clean; rank 1's loss NaN at step 3 once (transient); rank 1's loss NaN at
    step 3 every time, stopping and skipping."""
    Trainer(cfg_for(root / "clean", 2), ctx).fit()
    transient = Trainer(cfg_for(root / "transient", 2), ctx)
    inject(transient, 1, {3}, 1, nan)
    transient.fit()
    stop = Trainer(cfg_for(root / "stop", 2), ctx)
    inject(stop, 1, {3}, 9, nan)
    with pytest.raises(BadStepError) as raised:
        stop.fit()
    skip = Trainer(cfg_for(root / "skip", 2, "train.bad_step=skip"), ctx)
    inject(skip, 1, {3}, 9, nan)
    skip.fit()
    return {"stopped": str(raised.value), "stopped_at": stop.step, "skipped": skip.skipped_steps}


@pytest.fixture(scope="module")
def nan_runs(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("health")
    return root, run_ranks(_nan_runs, 2, root)


def test_a_transient_nan_on_one_rank_is_named_and_the_re_run_trains_as_if_it_never_happened(nan_runs):
    root, _ = nan_runs
    (event,) = read_records(root / "transient", "bad_step")
    assert event == {"event": "bad_step", "step": 3, "found": "non-finite loss on rank 1; non-finite gradients "
                     "on rank 0, 1", "loss_ranks": [1], "grad_ranks": [0, 1], "spike": False,
                     "verdict": "transient", "action": "re-run applied"}  # ddp averaged rank 1's NaN into both
    assert losses(root / "transient") == losses(root / "clean")  # the same state, RNG and batch: exactly


def test_a_deterministic_nan_stops_every_rank_at_its_step_or_is_skipped(nan_runs):
    root, ranks = nan_runs
    for rank in ranks:
        assert rank["stopped"] == ("step 3: non-finite loss on rank 1; non-finite gradients on rank 0, 1, and again "
                                   "when re-run from the same state (deterministic): stopping (train.bad_step = "
                                   "'skip' would go on without it)")
        assert rank["stopped_at"] == 2 and rank["skipped"] == 1
    (event,) = read_records(root / "skip", "bad_step")
    assert event["verdict"] == "deterministic" and event["action"] == "skip"
    skipped = losses(root / "skip")
    assert len(skipped) == STEPS and skipped[:2] == losses(root / "clean")[:2]
    assert all(loss == loss for loss in skipped[3:])  # the NaN step's update was not applied: training goes on


def _spiked(ctx: DistContext, root: Path) -> list[dict]:
    trainer = Trainer(cfg_for(root, 1, "train.spike_factor=2", "train.lr=1e-4", "train.min_lr=1e-5"), ctx)
    inject(trainer, 0, {7}, 1, lambda forward, args, kwargs: forward(*args, **kwargs) * 30)
    trainer.fit()
    return read_records(root, "bad_step")


def test_a_loss_spike_is_re_run_and_judged(tmp_path):
    (event,) = in_process(_spiked, tmp_path)
    assert event["step"] == 7 and event["found"] == "a loss spike" and event["verdict"] == "transient"


def _straggler(ctx: DistContext, root: Path) -> int:
    # About 4x the step's CPU seconds (3.9x to 4.9x measured): 19 more forwards, a backward being 2,
    # since the rest of a step (data, all-reduce, optimizer) is the same on both ranks. Nine more,
    # 4x the model's compute alone, measured 2.2x to 3.0x: too near train.straggler_factor's 2 to
    # be named every time on a loaded machine.
    def slowed(forward, args, kwargs):
        with torch.no_grad():
            for _ in range(19):
                forward(*args, **kwargs)
        return forward(*args, **kwargs)

    trainer = Trainer(cfg_for(root, 2), ctx)
    inject(trainer, 1, set(range(2, STEPS + 1)), 1, slowed)
    trainer.fit()
    return trainer.health.named


def test_a_rank_slowed_4x_is_named_within_5_steps(tmp_path):
    named, _ = run_ranks(_straggler, 2, tmp_path)
    assert named == {1}
    (event,) = read_records(tmp_path, "straggler")
    assert event["rank"] == 1 and event["step"] <= 2 + 5 and event["ratio"] > 2  # train.straggler_factor
    assert read_records(tmp_path, "summary")[0]["stragglers"] == [1]
