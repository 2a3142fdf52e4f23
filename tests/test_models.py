"""The built-in models: shapes, weight tying, the FLOPs estimate, memory counting."""

from __future__ import annotations

import torch

from shardwise.config.load import load_config
from shardwise.memory import ActivationCounter, storage_bytes
from shardwise.models import CNN, GPT, MLP, GPTConfig, build_model


def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, vocab_size=256))


def test_gpt_maps_tokens_to_logits_and_ties_the_head():
    model = tiny_gpt()
    logits = model(torch.randint(0, 256, (3, 16)))
    assert logits.shape == (3, 16, 256)
    assert model.head.weight is model.tok_emb.weight


def test_gpt_is_causal():
    model = tiny_gpt()
    tokens = torch.randint(0, 256, (1, 16))
    changed = tokens.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 256
    a, b = model(tokens), model(changed)
    assert torch.allclose(a[0, :10], b[0, :10]) and not torch.allclose(a[0, 10:], b[0, 10:])


def test_gpt_flops_estimate_is_six_per_parameter_plus_attention():
    model = tiny_gpt()
    params = sum(p.numel() for p in model.parameters()) - 16 * 32
    assert model.num_params() == params
    assert model.flops_per_token() == 6 * params + 12 * 2 * 32 * 16


def test_gpt2_124m_preset_has_gpt2_size():
    cfg = load_config(None, ["model.preset=gpt2-124m"])
    with torch.device("meta"):
        model = build_model(cfg.model)
    assert 123e6 < model.num_params(non_embedding=False) < 126e6


def test_cnn_and_mlp_classify_digit_sized_images():
    images = torch.rand(5, 1, 8, 8)
    assert CNN(width=8)(images).shape == (5, 10)
    assert MLP(64, 16)(images).shape == (5, 10)


def test_storage_bytes_counts_shared_storage_once():
    base = torch.zeros(100)
    assert storage_bytes([base, base[:10], base.view(10, 10)]) == 400
    model = tiny_gpt()
    # the tied head adds nothing
    assert storage_bytes(model.parameters()) == 4 * sum(p.numel() for p in model.parameters())


def test_activation_counter_counts_saved_activations_and_not_parameters():
    model = tiny_gpt()
    with ActivationCounter(model) as small:
        model(torch.randint(0, 256, (1, 16))).sum()
    with ActivationCounter(model) as large:
        model(torch.randint(0, 256, (4, 16))).sum()
    assert small.bytes > 16 * 256 * 4  # at least the logits of one sequence
    # four times the batch saves four times the activations (nothing batch-independent counted)
    assert abs(large.bytes / small.bytes - 4) < 0.05


def test_activation_counter_reports_the_most_held_at_once():
    model = tiny_gpt()
    batch = torch.randint(0, 256, (2, 16))
    with ActivationCounter(model) as one:
        model(batch).sum().backward()
    with ActivationCounter(model) as in_turn:  # each backward frees what its forward saved
        for _ in range(3):
            model(batch).sum().backward()
    with ActivationCounter(model) as together:  # three forwards first, as a pipeline schedule may run them
        outputs = [model(batch.clone()).sum() for _ in range(3)]  # the same input tensor would count once
        for out in outputs:
            out.backward()
    assert in_turn.bytes == one.bytes > 0
    assert together.bytes == 3 * one.bytes
    assert together.live_bytes == 0
