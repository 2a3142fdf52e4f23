"""Activation checkpointing: it changes no gradient, and it saves the bytes the estimate says."""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks
from helpers import CONFIGS

from shardwise.config.load import load_config
from shardwise.dist import DistContext
from shardwise.gradients import local_grads
from shardwise.memory import ActivationCounter
from shardwise.models import build_model, loss_fn
from shardwise.recompute import estimate_saved_bytes
from shardwise.strategies.classes import make_strategy

POLICIES = ("none", "blocks", "every:2", "selective")
LAYERS = 4
BATCH = 4


def gradients_and_saved_bytes(ctx: DistContext, strategy_name: str) -> dict[str, tuple[list[torch.Tensor], int]]:
    """For each policy: this rank's gradients after one forward/backward (a pipeline's: its
    schedule) on its replica's part of a fixed batch, and the most bytes saved for backward at once."""
    out = {}
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (BATCH * ctx.world_size, 65), generator=generator)
    for policy in POLICIES:
        cfg = load_config(CONFIGS / "gpt-tiny.toml", [
            f"parallel.strategy={strategy_name}", f"parallel.recompute={policy}", f"model.n_layer={LAYERS}",
            f"launch.nproc={ctx.world_size}", f"train.global_batch={BATCH * ctx.world_size}",
            f"train.micro_batch={BATCH}",
        ])
        torch.manual_seed(0)
        strategy = make_strategy(cfg.parallel, ctx)
        model = strategy.wrap(build_model(cfg.model))
        strategy.optimizer(lambda params: torch.optim.SGD(params, lr=0.1))
        mine = tokens[strategy.data_rank :: strategy.data_size]
        with ActivationCounter(model) as counter:
            strategy.forward_backward(model, [(mine[:, :-1], mine[:, 1:])], loss_fn, accum=1)
        out[policy] = ([g.clone() for g in local_grads(strategy.local_parameters())], counter.bytes)
    return out


def assert_same_gradients(results: dict[str, tuple[list[torch.Tensor], int]]) -> None:
    reference, _ = results["none"]
    assert len(reference) > 0
    for policy in POLICIES[1:]:
        grads, _ = results[policy]
        assert len(grads) == len(reference)
        for got, want in zip(grads, reference, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=policy)


def test_recomputation_changes_no_gradient_under_single():
    results = gradients_and_saved_bytes(DistContext(0, 1, 0, torch.device("cpu"), "gloo"), "single")
    assert_same_gradients(results)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "pipeline", "tensor"])
def test_recomputation_changes_no_gradient_on_2_ranks(strategy):
    for results in run_ranks(gradients_and_saved_bytes, 2, strategy):
        assert_same_gradients(results)
        assert results["blocks"][1] < 0.3 * results["none"][1]  # and it did recompute


def test_saved_bytes_fall_with_recomputation_as_estimated():
    results = gradients_and_saved_bytes(DistContext(0, 1, 0, torch.device("cpu"), "gloo"), "single")
    saved = {policy: nbytes for policy, (_, nbytes) in results.items()}
    assert saved["blocks"] < saved["every:2"] < saved["none"]
    assert saved["selective"] < saved["none"]
    cfg = build_model(load_config(CONFIGS / "gpt-tiny.toml").model).cfg
    estimate = {p: estimate_saved_bytes(LAYERS, cfg.d_model, cfg.seq_len, cfg.vocab_size, BATCH, p) for p in POLICIES}
    for policy in POLICIES[1:]:
        measured_ratio = saved[policy] / saved["none"]
        estimated_ratio = estimate[policy] / estimate["none"]
        assert measured_ratio == pytest.approx(estimated_ratio, rel=0.2), policy
    assert saved["none"] == pytest.approx(estimate["none"], rel=0.2)
