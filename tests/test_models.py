"""The built-in models: shapes, weight tying, the FLOPs estimate, memory counting."""

from __future__ import annotations

import json

import pytest
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_cross_entropy_is_torchs_in_float32_chunk_by_chunk(dtype, monkeypatch):
    """cross_entropy_sum against F.cross_entropy on the float32 logits: the loss within float32
    rounding (another summation order), the gradient (softmax - one-hot, within [-1, 1]) within a
    few float32 ulps (1e-6), in chunks of 3 rows and whole, an ignored target's row counting 0, and
    the logits left as they were."""
    from shardwise.models import cross_entropy

    torch.manual_seed(0)
    logits = (torch.randn(37, 50) * 3).to(dtype)
    targets = torch.randint(0, 50, (37,))
    targets[::5] = cross_entropy.IGNORE
    expected = logits.clone().requires_grad_()
    torch.nn.functional.cross_entropy(expected.float(), targets, reduction="sum").backward()
    for elements in (3 * 50, cross_entropy.CHUNK_ELEMENTS):
        monkeypatch.setattr(cross_entropy, "CHUNK_ELEMENTS", elements)
        got = logits.clone().requires_grad_()
        loss = cross_entropy.cross_entropy_sum(got, targets)
        loss.backward()
        reference = torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum")
        assert loss.item() == pytest.approx(reference.item(), rel=1e-6)
        assert got.grad.dtype == dtype and torch.allclose(got.grad.float(), expected.grad.float(), rtol=0, atol=1e-6)
        assert torch.equal(got.detach(), logits)
        assert not got.grad[::5].any()  # an ignored target's row gets no gradient


def test_the_chunked_cross_entropy_holds_one_float32_chunk_at_a_time(monkeypatch, tmp_path):
    """Over many chunks, beside the logits and their gradient, forward and backward hold one float32 chunk of
    rows at a time (the planner's `loss` counts one), not the last one beside the next (torch.profiler's
    memory timeline, as bench/gpu_profile.py reads it)."""
    from torch.profiler import ProfilerActivity, profile

    from shardwise.models import cross_entropy

    rows, vocab = 8, 4096
    monkeypatch.setattr(cross_entropy, "CHUNK_ELEMENTS", rows * vocab)
    logits = torch.randn(10 * rows, vocab, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, vocab, (10 * rows,))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        cross_entropy.cross_entropy_sum(logits, targets).backward()
    prof.export_memory_timeline(str(tmp_path / "timeline.json"), device="cpu")
    _, sizes = json.loads((tmp_path / "timeline.json").read_text())
    peak = max(sum(row[1:]) for row in sizes)
    chunk, logits_bytes = rows * vocab * 4, logits.numel() * 2
    # the logits, their gradient, the chunk, and a row's few float32 statistics (log-sum-exp, maxima)
    assert 2 * logits_bytes + chunk <= peak < 2 * logits_bytes + 1.5 * chunk, (peak, logits_bytes, chunk)
