"""Data parallel, ours (`ddp`) and PyTorch's (`ddp-native`), on 2 real Gloo ranks, held to
parity with `single` on the same global batch."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from helpers import SGD, assert_same_training, cnn_config, gpt_tiny, losses, train_in_process, train_runs
from torch import nn

from shardwise.config.schema import DDPConfig, ParallelConfig
from shardwise.dist import DistContext
from shardwise.models import CNN
from shardwise.parallel.replicate import plan_buckets
from shardwise.strategies.ddp import DDP
from shardwise.strategies.fsdp import ShardedDataParallel
from shardwise.trainer import Trainer

STEPS = 20


def train_cfg(out: Path, strategy: str, nproc: int, *overrides: str):
    return gpt_tiny(out, strategy, nproc, *SGD, *overrides, steps=STEPS)


@pytest.fixture(scope="module")
def gpt_runs(tmp_path_factory) -> Path:
    """Every GPT parity run, made once: data parallel ones in one 2-rank world, single here."""
    root = tmp_path_factory.mktemp("ddp")
    runs = {
        "ddp": ("ddp", "train.micro_batch=4"),
        "ddp-accum2": ("ddp", "train.micro_batch=2"),
        "ddp-small-buckets": ("ddp", "train.micro_batch=4", "parallel.ddp.bucket_mb=0.01"),
        "ddp-native": ("ddp-native", "train.micro_batch=4"),
        "ddp-native-accum2": ("ddp-native", "train.micro_batch=2"),
    }
    run_ranks(train_runs, 2, root, runs, train_cfg)
    train_in_process(train_cfg(root / "single", "single", 1, "train.micro_batch=4"))  # 2 accumulation steps
    return root


@pytest.mark.parametrize("run", ["ddp", "ddp-accum2", "ddp-small-buckets", "ddp-native", "ddp-native-accum2"])
def test_data_parallel_matches_single_device_over_20_steps(gpt_runs, run):
    assert_same_training(gpt_runs / run, gpt_runs / "single", STEPS)


def test_ddp_matches_ddp_native(gpt_runs):
    assert_same_training(gpt_runs / "ddp", gpt_runs / "ddp-native", STEPS)
    assert_same_training(gpt_runs / "ddp-accum2", gpt_runs / "ddp-native-accum2", STEPS)


def test_the_loss_actually_moves(gpt_runs):
    history = losses(gpt_runs / "ddp")
    assert history[-1] < history[0] - 1.0


def test_buckets_follow_the_given_order_and_size():
    params = [nn.Parameter(torch.zeros(n)) for n in (10, 10, 30, 5)]
    groups = plan_buckets(params, bucket_bytes=80)
    assert [[p.numel() for p in g] for g in groups] == [[10, 10], [30], [5]]


# --- behaviour inside one 2-rank world -------------------------------------------------------

class TwoHeads(nn.Module):
    """`unused` gets no gradient: the case that hangs a naive data parallel."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def ddp_behaviour(ctx: DistContext) -> dict:
    out: dict = {}
    # 1. Wrapping broadcasts rank 0's parameters and buffers.
    torch.manual_seed(100 + ctx.rank)  # each rank starts from different weights
    model = CNN(width=4)
    model.features[1].running_mean.fill_(float(ctx.rank))
    strategy = DDP(ctx, ParallelConfig(strategy="ddp", ddp=DDPConfig(bucket_mb=0.0005)))
    model = strategy.wrap(model)
    flat = torch.cat([t.flatten() for t in [*model.parameters(), *model.buffers()]])
    gathered = [torch.empty_like(flat) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, flat)
    out["equal_after_wrap"] = torch.equal(gathered[0], gathered[1])
    out["buckets"] = len(strategy.gradients.buckets)

    # 2. Gradients are views into the buckets, averaged over ranks.
    x = torch.full((2, 1, 8, 8), float(ctx.rank + 1))
    strategy.backward(model(x).sum())
    buffers = {b.buffer.untyped_storage().data_ptr() for b in strategy.gradients.buckets}
    out["grads_are_bucket_views"] = all(p.grad.untyped_storage().data_ptr() in buffers for p in model.parameters())
    out["classifier_bias_grad"] = model.classifier.bias.grad.clone()

    # 3. no_sync: no all-reduce until the last micro-step; the last one reduces the sum.
    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        calls.append("all_reduce")
        return real_all_reduce(*args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        for p in model.parameters():
            p.grad = None
        with strategy.no_sync():
            strategy.backward(model(x).sum())
        out["all_reduces_in_no_sync"] = len(calls)
        strategy.backward(model(x).sum())
        out["all_reduces_after"] = len(calls)
        out["accumulated_bias_grad"] = model.classifier.bias.grad.clone()
    finally:
        dist.all_reduce = real_all_reduce

    # 4. Overlap: the first bucket's all-reduce starts before backward produces the last gradient.
    events: list[str] = []

    def logging_all_reduce(*args, **kwargs):
        events.append("all_reduce")
        return real_all_reduce(*args, **kwargs)

    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: events.append(f"grad {name}"))
    dist.all_reduce = logging_all_reduce
    try:
        for p in model.parameters():
            p.grad = None
        strategy.backward(model(x).sum())
    finally:
        dist.all_reduce = real_all_reduce
    out["events"] = events

    # 5. A parameter with no gradient: a clear error naming it, or handled when asked.
    torch.manual_seed(0)
    strict = DDP(ctx, ParallelConfig(strategy="ddp"))
    twoheads = strict.wrap(TwoHeads())
    try:
        strict.backward(twoheads(torch.ones(2, 4)).sum())
        out["unused_error"] = None
    except RuntimeError as error:
        out["unused_error"] = str(error)
    lenient = DDP(ctx, ParallelConfig(strategy="ddp", ddp=DDPConfig(find_unused_parameters=True)))
    twoheads = lenient.wrap(TwoHeads())
    lenient.backward(twoheads(torch.full((2, 4), float(ctx.rank + 1))).sum())
    out["unused_grad"] = twoheads.unused.weight.grad.abs().sum().item()
    out["used_bias_grad"] = twoheads.used.bias.grad.clone()

    # 6. A strategy let go of goes, with its reducer's thread and its process groups (the hooks on its
    # model's parameters hold it weakly: autograd keeps them out of the garbage collector's sight).
    ringed = DDP(ctx, ParallelConfig(strategy="ddp", ddp=DDPConfig(all_reduce="ring")))
    ringed.wrap(CNN(width=4))
    released = weakref.ref(ringed)
    del ringed
    gc.collect()
    out["released"] = released() is None
    deadline = time.monotonic() + 10  # the thread ends once it reads the finalizer's stop
    while any(t.name == "shardwise-ddp-reduce" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    out["reduce_threads"] = sum(t.name == "shardwise-ddp-reduce" for t in threading.enumerate())
    # A model kept after its strategy (zero2's holds no hook of its own on the model) cannot go on
    # training unsynchronised: its backward fails, saying why.
    sharded = ShardedDataParallel(ctx, ParallelConfig(strategy="zero2"))
    orphan = sharded.wrap(CNN(width=4))
    del sharded
    gc.collect()
    try:
        orphan(x).sum().backward()
        out["orphan_error"] = None
    except RuntimeError as error:
        out["orphan_error"] = str(error)
    return out


@pytest.fixture(scope="module")
def behaviour() -> list[dict]:
    return run_ranks(ddp_behaviour, 2)


def test_parameters_and_buffers_are_broadcast_from_rank_0(behaviour):
    assert all(r["equal_after_wrap"] for r in behaviour)
    assert behaviour[0]["buckets"] > 2  # the test's tiny bucket size really made several


def test_gradients_are_views_into_bucket_buffers_and_averaged(behaviour):
    assert all(r["grads_are_bucket_views"] for r in behaviour)
    # d(sum of logits)/d(bias) is the batch size, 2, on both ranks: the average is 2.
    for r in behaviour:
        torch.testing.assert_close(r["classifier_bias_grad"], torch.full((10,), 2.0))


def test_no_sync_defers_communication_to_the_last_micro_step(behaviour):
    for r in behaviour:
        assert r["all_reduces_in_no_sync"] == 0
        assert r["all_reduces_after"] == r["buckets"]
        torch.testing.assert_close(r["accumulated_bias_grad"], torch.full((10,), 4.0))


def test_first_all_reduce_is_launched_before_backward_ends(behaviour):
    events = behaviour[0]["events"]
    first_reduce = events.index("all_reduce")
    last_grad = max(i for i, e in enumerate(events) if e.startswith("grad "))
    assert first_reduce < last_grad, events


def test_parameters_without_gradient_are_named_or_handled(behaviour):
    for r in behaviour:
        assert "unused.weight" in r["unused_error"] and "unused.bias" in r["unused_error"]
        assert "find_unused_parameters" in r["unused_error"]
        assert r["unused_grad"] == 0.0
        torch.testing.assert_close(r["used_bias_grad"], torch.full((4,), 2.0))


def test_a_strategy_let_go_of_is_released_and_a_model_kept_without_it_cannot_train(behaviour):
    """A hook holding its strategy kept the strategy, its model and its process groups (3 threads
    each, one waking every 10 ms) alive for good: every pooled rank of the suite grew a few a call."""
    for r in behaviour:
        assert r["released"] and r["reduce_threads"] == 0
        assert "strategy is gone" in r["orphan_error"]


# --- SyncBatchNorm --------------------------------------------------------------------------

def train_cnn_data_parallel(ctx: DistContext, root: Path) -> None:
    for sync in (True, False):
        Trainer(cnn_config(root / f"sync-{sync}", "ddp", ctx.world_size, sync), ctx).fit()


def test_sync_batchnorm_matches_single_device_and_plain_batchnorm_does_not(tmp_path):
    run_ranks(train_cnn_data_parallel, 2, tmp_path)
    train_in_process(cnn_config(tmp_path / "single", "single", 1, False))
    # the final state dict holds running_mean / running_var too
    assert_same_training(tmp_path / "sync-True", tmp_path / "single", STEPS)
    with pytest.raises(AssertionError):
        assert_same_training(tmp_path / "sync-False", tmp_path / "single", STEPS)


def test_ddp_native_with_sync_batchnorm_on_cpu_is_refused_before_launch():
    from shardwise.config.schema import ConfigError

    if torch.cuda.is_available():
        pytest.skip("the refusal is for machines without CUDA")
    with pytest.raises(ConfigError, match="parallel.sync_batchnorm"):
        cnn_config(Path("unused"), "ddp-native", 2, True)
