"""Hugging Face causal LMs (tiny Llama and GPT-2 configs built offline, randomly initialised, nothing
downloaded) under every data-parallel and sharded strategy, through the Python API and through the
config (`model.name = "hf-llama" | "hf-gpt2"`), held to parity with `single`."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from distributed import run_ranks
from helpers import CONFIGS, assert_same_training, assert_states_close, read_records, train_in_process
from safetensors.torch import load_file
from torch.distributed.fsdp import FSDPModule

import shardwise as sw
from shardwise.config.load import load_config
from shardwise.data.corpus import TokenWindows, load_corpus, split_tokens
from shardwise.dist import DistContext
from shardwise.models.hf import decoder_layer_class
from shardwise.trainer import Trainer

# Set before transformers is first imported (in the functions below), here and in every rank.
os.environ["HF_HUB_OFFLINE"] = "1"

STEPS = 10
BATCH = 8
SEQ_LEN = 32
STRATEGIES = ("ddp", "ddp-native", "zero1", "zero2", "fsdp", "fsdp-native")


def tiny_llama() -> torch.nn.Module:
    """2 decoder layers, grouped-query attention (2 query heads, 1 key/value head), no biases."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    return AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=SEQ_LEN, bos_token_id=None, eos_token_id=None))


def train_llama(strategy: str, build: Callable[[], torch.nn.Module] = tiny_llama, **options) -> dict:
    """A user's loop over a transformers model, its own loss (labels = inputs; it shifts them).
    SGD, as every parity run (conftest.assert_same_training says why)."""
    run = sw.setup(strategy, grad_accum=2, grad_clip=0.5, **options)
    model, optimizer = run.prepare(build(), lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    data = TokenWindows(split_tokens(load_corpus("shakespeare"), 0.05)[0], SEQ_LEN)
    losses, total = [], 0.0
    for i, (inputs, _) in enumerate(run.loader(data, BATCH, steps=STEPS)):
        loss = model(input_ids=inputs, labels=inputs).loss
        run.backward(loss)
        run.step(optimizer)
        total += loss.item() / 2
        if i % 2:
            losses.append(run.reduce_mean(torch.tensor(total)).item())
            total = 0.0
    units = len(run.strategy.sharding.units) if hasattr(run.strategy, "sharding") else \
        sum(isinstance(m, FSDPModule) for m in run.strategy.module.modules())
    return {"losses": losses, "state": run.strategy.view.full_state_dict(), "units": units,
            "block": run.strategy.cfg.block}


class TupleLayer(torch.nn.Module):
    """A layer that returns a tuple, as transformers layers did before transformers 5."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x + torch.tanh(self.linear(x)), None


class TupleLM(torch.nn.Module):
    _no_split_modules = ["TupleLayer"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, 32)
        self.layers = torch.nn.ModuleList([TupleLayer(), TupleLayer()])
        self.head = torch.nn.Linear(32, 256)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        x = self.embed(input_ids)
        for layer in self.layers:
            x, _ = layer(x)
        logits = self.head(x)
        return SimpleNamespace(loss=torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                                                       labels[:, 1:].flatten()))


def gpt2_config(out: Path, strategy: str, nproc: int):
    return load_config(CONFIGS / "gpt-tiny.toml", [
        "model.name=hf-gpt2", "model.d_model=32", f"model.seq_len={SEQ_LEN}", f"run.out={out}",
        f"train.steps={STEPS}", "train.global_batch=8", "train.micro_batch=2", "train.eval_every=0",
        f"parallel.strategy={strategy}", f"launch.nproc={nproc}"])


def on_2_ranks(ctx: DistContext, root: Path) -> dict[str, dict]:
    results = {strategy: train_llama(strategy) for strategy in STRATEGIES}
    results["fsdp-recompute"] = train_llama("fsdp", recompute="blocks")
    results["tuple-fsdp"] = train_llama("fsdp", TupleLM)
    for strategy in ("zero2", "fsdp"):
        Trainer(gpt2_config(root / strategy, strategy, ctx.world_size), ctx).fit()
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict[str, dict], dict, Path]:
    root = tmp_path_factory.mktemp("hf")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # as every rank: thread count changes summation order
        single = train_llama("single")
        single["tuple"] = train_llama("single", TupleLM)
    finally:
        torch.set_num_threads(threads)
    train_in_process(gpt2_config(root / "single", "single", 1))
    return run_ranks(on_2_ranks, 2, root)[0], single, root


def assert_matches(got: dict, single: dict) -> None:
    assert single["losses"][-1] < single["losses"][0] - 0.5  # it learns
    worst = max(abs(a - b) / b for a, b in zip(got["losses"], single["losses"], strict=True))
    assert len(got["losses"]) == STEPS and worst <= 1e-5, f"losses differ by {worst:.2e} relative"
    assert got["state"].keys() == single["state"].keys()
    assert_states_close(got["state"], single["state"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", [*STRATEGIES, "fsdp-recompute"])
def test_tiny_llama_matches_single_over_10_steps_on_2_ranks(runs, strategy):
    assert_matches(runs[0][strategy], runs[1])


def test_fsdp_regathers_a_layer_that_returns_a_tuple_for_backward(runs):
    assert_matches(runs[0]["tuple-fsdp"], runs[1]["tuple"])


def test_the_sharding_unit_is_the_decoder_layer_found_automatically(runs):
    two_ranks = runs[0]
    for strategy in ("zero1", "zero2", "fsdp", "fsdp-native"):
        assert two_ranks[strategy]["block"] == "LlamaDecoderLayer"
        assert two_ranks[strategy]["units"] == 2 + 1  # each decoder layer, and the root


def test_gpt2_from_the_config_matches_single_under_zero2_and_fsdp(runs):
    root = runs[2]
    for strategy in ("zero2", "fsdp"):
        # losses only: GPT-2's attention has a key bias, whose exact gradient is zero (FACTS-torch-cpu.md)
        assert_same_training(root / strategy, root / "single", STEPS, weights=False)
    losses = [r["loss"] for r in read_records(root / "single")]
    assert losses[-1] < losses[0] - 0.5
    weights = load_file(str(root / "fsdp" / "model.safetensors"))
    assert weights["transformer.h.1.attn.c_attn.weight"].shape == (32, 96)  # transformers' own names


def test_decoder_layer_class_comes_from_no_split_modules():
    from transformers import AutoModelForCausalLM, BertConfig, BertModel, GPT2Config

    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64))
    # BERT declares its embeddings too; the layer is the class that repeats
    bert = BertModel(BertConfig(num_hidden_layers=2, hidden_size=16, num_attention_heads=2, intermediate_size=32,
                                vocab_size=64))
    assert [decoder_layer_class(m) for m in (tiny_llama(), gpt2, bert)] == ["LlamaDecoderLayer", "GPT2Block",
                                                                            "BertLayer"]
    assert decoder_layer_class(torch.nn.Sequential(bert, torch.nn.Linear(16, 2))) == "BertLayer"
    assert decoder_layer_class(torch.nn.Linear(2, 2)) is None
