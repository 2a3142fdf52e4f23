"""`dp`: one process, the batch scattered over replicas that run in threads (here all on the CPU)."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import CONFIGS, SGD, assert_same_training, losses, train_in_process

from shardwise.config.load import load_config
from shardwise.config.schema import ConfigError
from shardwise.dist import DistContext
from shardwise.models import build_model
from shardwise.precision import make_precision
from shardwise.strategies.dp import DataParallel
from shardwise.validate import validate

BASE = ["train.steps=20", "train.eval_every=10", "train.eval_batches=1"]


def run(tmp_path, name: str, *overrides: str):
    out = tmp_path / name
    cfg = load_config(CONFIGS / "gpt-tiny.toml", [*BASE, f"run.out={out}", *overrides])
    validate(cfg)
    train_in_process(cfg)
    return out


@pytest.mark.parametrize("overrides", [
    [],
    ["parallel.recompute=blocks"],
    ["parallel.replicas=3", "train.micro_batch=16"],  # 16 samples do not split evenly in 3
], ids=["fp32", "recompute", "3-uneven"])
def test_dp_matches_single_over_20_steps(tmp_path, overrides):
    single = run(tmp_path, "single", *SGD, *[o for o in overrides if not o.startswith("parallel.replicas")])
    dp = run(tmp_path, "dp", "parallel.strategy=dp", *SGD, *overrides)
    assert_same_training(dp, single, steps=20)


def test_dp_in_bf16_mixed_trains_as_one_device_does(tmp_path):
    single = run(tmp_path, "single", "parallel.precision=bf16-mixed")
    dp = run(tmp_path, "dp", "parallel.strategy=dp", "parallel.precision=bf16-mixed")
    # bf16 rounds differently on half batches: the bound the pipeline and tensor tests use.
    worst = max(abs(a - b) / b for a, b in zip(losses(dp), losses(single), strict=True))
    assert worst < 5e-4


def _strategy(replicas: int) -> DataParallel:
    cfg = load_config(CONFIGS / "gpt-tiny.toml", ["parallel.strategy=dp", f"parallel.replicas={replicas}"])
    return DataParallel(DistContext(0, 1, 0, torch.device("cpu"), "gloo"), cfg.parallel)


def test_replicas_run_in_their_own_threads_and_follow_train_and_eval():
    torch.manual_seed(0)
    cfg = load_config(CONFIGS / "gpt-tiny.toml")
    model = _strategy(2).wrap(build_model(cfg.model))
    seen: list[tuple[str, int]] = []
    for replica in [model.module, *model.copies]:
        replica.register_forward_hook(lambda m, i, o: seen.append((threading.current_thread().name, i[0].shape[0])))
    tokens = torch.randint(0, 256, (6, 64))
    logits = model(tokens)
    assert logits.shape == (6, 64, 256)
    assert sorted(n for _, n in seen) == [3, 3]
    assert all(name.startswith("dp-replica") for name, _ in seen)
    # The gradients of both replicas' halves reach the primary's parameters, as one forward would.
    logits.mean().backward()
    whole = build_model(cfg.model)
    whole.load_state_dict(model.module.state_dict())
    whole(tokens).mean().backward()
    for (name, p), q in zip(model.module.named_parameters(), whole.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    # Autocast is per thread too: the replicas compute in bf16 when the caller asked for it.
    bf16 = _strategy(2)
    bf16.precision = make_precision("bf16-mixed")
    model_bf16 = bf16.wrap(build_model(cfg.model))
    with bf16.precision.autocast(torch.device("cpu")):
        assert model_bf16(tokens).dtype == torch.bfloat16
    model.eval()
    assert not any(m.training for replica in [model.module, *model.copies] for m in replica.modules())


@pytest.mark.parametrize("overrides, message", [
    (["launch.nproc=2"], "one process drives parallel.replicas = 2 devices, but the world size is 2"),
    (["parallel.replicas=0"], "parallel.replicas = 0"),
    (["parallel.replicas=9"], "more replicas than the train.micro_batch = 8"),
    (["parallel.sync_batchnorm=true"], "dp keeps replica 0's batch statistics"),
])
def test_bad_dp_configs_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):  # load_config validates
        load_config(CONFIGS / "gpt-tiny.toml", ["parallel.strategy=dp", *overrides])
