"""A backward split in two (parallel/pipeline/split_backward.py): B gives the input gradients and touches no weight,
W later gives exactly the weight gradients one full backward gives, running nothing of B again,
also under autocast and with blocks recomputed once (recompute.RecomputedOnce)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from shardwise.memory import ActivationCounter
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.parallel.pipeline.split_backward import backward_input
from shardwise.recompute import apply_recompute

VOCAB, SEQ, WIDTH = 256, 32, 64


@pytest.fixture(scope="module")
def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=2, d_model=WIDTH, bias=True))


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (2, SEQ), generator=g), torch.randint(0, VOCAB, (2, SEQ), generator=g),
            torch.randn(2, SEQ, WIDTH, generator=g))


def stage_forward(model: GPT, seed: int, first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the stage's input, its loss): the whole GPT from token ids with the input the first block's
    (a first stage), or its blocks and head from activations (a later one)."""
    ids, targets, activations = batch(seed)
    if first:
        x = model.tok_emb(ids) + model.pos_emb(torch.arange(SEQ))
    else:
        x = activations.requires_grad_()
    h = x
    for block in model.blocks:
        h = block(h)
    return x, F.cross_entropy(model.head(model.ln_f(h)).float().view(-1, VOCAB), targets.view(-1))


def trained(gpt: GPT, split: bool, first: bool, recompute: bool = False, dtype: torch.dtype = torch.float32):
    """Two micro-batches' gradients, accumulated: one full backward each, or B then W; with the
    input gradients and how many times block 1 ran forward."""
    model = copy.deepcopy(gpt)
    if recompute:
        apply_recompute(model, "blocks", "Block", once=split)
    forwards = []
    model.blocks[1].attn.register_forward_pre_hook(lambda *_: forwards.append(1))
    input_grads = []
    for seed in (1, 2):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            x, loss = stage_forward(model, seed, first)
        if split:
            (x_grad,), weights = backward_input(loss, None, [x], model.parameters())
            assert seed == 2 or all(p.grad is None for p in model.parameters())  # B leaves the weights alone
            ran = len(forwards)
            weights.run()
            assert len(forwards) == ran  # W recomputes nothing
        else:
            x.retain_grad()
            loss.backward()
            x_grad = x.grad
        input_grads.append(x_grad)
    return input_grads, {name: p.grad for name, p in model.named_parameters()}, len(forwards)


@pytest.mark.parametrize("first", [False, True], ids=["later-stage", "first-stage"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_b_then_w_gives_exactly_the_gradients_of_one_backward(gpt, first, dtype):
    full_inputs, full, _ = trained(gpt, split=False, first=first, dtype=dtype)
    split_inputs, split, _ = trained(gpt, split=True, first=first, dtype=dtype)
    assert all(torch.equal(a, b) for a, b in zip(full_inputs, split_inputs, strict=True))
    assert full.keys() == split.keys()
    for name in full:  # the embeddings too on the first stage: W runs from the first block's input
        assert (full[name] is None) == (split[name] is None), name
        assert full[name] is None or torch.equal(full[name], split[name]), name


def test_recomputed_once_blocks_run_forward_twice_and_give_the_same_gradients(gpt):
    _, checkpointed, checkpointed_forwards = trained(gpt, split=False, first=False, recompute=True)
    _, once, once_forwards = trained(gpt, split=True, first=False, recompute=True)
    assert checkpointed_forwards == once_forwards == 2 * 2  # two micro-batches: forward, and one recompute each
    assert all(torch.equal(checkpointed[name], once[name]) for name in checkpointed if checkpointed[name] is not None)
    assert [name for name, grad in once.items() if grad is None] == ["pos_emb.weight"]  # tok_emb is the head


def test_what_a_recomputed_once_block_keeps_counts_until_w_is_done(gpt):
    model = copy.deepcopy(gpt)
    apply_recompute(model, "blocks", "Block", once=True)
    with ActivationCounter(model) as counter:
        x, loss = stage_forward(model, 1, first=False)
        after_forward = counter.live_bytes
        _, weights = backward_input(loss, None, [x], model.parameters())
        after_b = counter.live_bytes
        weights.run()
        del x, loss, weights
        after_w = counter.live_bytes
    block_inputs = 2 * 2 * SEQ * WIDTH * 4  # the two blocks' inputs, fp32
    assert after_forward >= block_inputs
    assert after_b > after_forward  # the recomputed blocks' tensors, kept for W
    assert after_w == 0
