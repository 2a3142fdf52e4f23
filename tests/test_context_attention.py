"""Attention over a sequence split across ranks (src/shardwise/attention) against
`scaled_dot_product_attention` on the whole sequence, forward and backward, on real Gloo ranks.

Tolerance: queries, keys and values are unit normals, so outputs (convex combinations of value
rows) and gradients are of order 1. Ring attention computes each query's softmax in blocks merged
by log-sum-exp instead of one pass: the same sums in another order, plus one rescaling per merged
block (at most 2 x 4 blocks here), each rounding by about 6e-8 relative in fp32. Over sums of at
most 32 keys that is a few 1e-7 per step, measured at most 1.9e-6 (ATEN_CPU_CAPABILITY=default)
and 1.4e-6 (avx2) here; 1e-5 holds it with a margin and still catches any wrong mask, missed block
or misplaced chunk (errors of order 0.1 to 1). All-to-all attention runs the reference's kernel on
fewer heads at once (and with repeated key/value heads where they do not divide), which blocks and
sums differently: measured at most 1.4e-6 on both.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import run_ranks
from torch import nn

from shardwise.config.schema import ModelConfig
from shardwise.dist import DistContext
from shardwise.models import GPT, GPTConfig
from shardwise.models.hf import build_causal_lm
from shardwise.models.plans import find_positions
from shardwise.parallel.context import (
    Ring,
    RingStats,
    SequenceLayout,
    all_to_all_attention,
    blocks,
    causal_attention,
    ring_attention,
)
from shardwise.parallel.context.blocks import BlockMask
from shardwise.parallel.context.ring import RehearsalRing
from shardwise.parallel.context.split import ContextParallel

BATCH, HEADS, SEQ_LEN, HEAD_DIM = 3, 4, 32, 8
TOLERANCE = 1e-5
# Three packed rows: documents cut inside chunks, on chunk edges (chunks of 4 at cp 4 head-tail), and one document.
DOCUMENT_LENGTHS = ((5, 11, 3, 13), (8, 8, 8, 8), (32,))


def document_ids(lengths: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths])


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     documents: torch.Tensor | None) -> torch.Tensor:
    """The reference: scaled_dot_product_attention on the whole sequence with the whole causal and
    document mask written out."""
    positions = torch.arange(q.shape[2])
    visible = positions[None, :] <= positions[:, None]
    if documents is not None:
        visible = visible & (documents[:, None, :, None] == documents[:, None, None, :])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)


def attention_inputs(kv_heads: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(kv_heads)
    shapes = [(BATCH, HEADS, SEQ_LEN, HEAD_DIM)] + [(BATCH, kv_heads, SEQ_LEN, HEAD_DIM)] * 2 + \
        [(BATCH, HEADS, SEQ_LEN, HEAD_DIM)]
    return tuple(torch.randn(shape, generator=generator) for shape in shapes)  # q, k, v and the output's gradient


def errors_against_whole_sequence(mode: str, group: dist.ProcessGroup, kv_heads: int,
                                  documents: torch.Tensor | None) -> dict[str, float]:
    """This rank's largest difference from attention on the whole sequence, in its output and in its
    tokens' gradients of q, k and v; and the score entries ring attention computed."""
    q, k, v, grad = attention_inputs(kv_heads)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = masked_attention(*whole, documents)
    expected.backward(grad)
    rank, size = group.rank(), group.size()
    layout = SequenceLayout.head_tail(SEQ_LEN, size) if mode == "ring" else SequenceLayout.contiguous(SEQ_LEN, size)
    local = [layout.shard(t, rank, dim=2).requires_grad_() for t in (q, k, v)]
    stats = RingStats()
    if mode == "ring":
        out = ring_attention(*local, Ring(group, layout, stats), documents)
    else:
        out = all_to_all_attention(*local, group, documents)
    out.backward(layout.shard(grad, rank, dim=2))
    pairs = [(out, expected)] + [(mine.grad, theirs.grad) for mine, theirs in zip(local, whole, strict=True)]
    names = ("out", "dq", "dk", "dv")
    errors = {name: (got - layout.shard(want, rank, dim=2)).abs().max().item()
              for name, (got, want) in zip(names, pairs, strict=True)}
    return {**errors, "scores": stats.scores}


def every_case(ctx: DistContext) -> list[dict]:
    """Ring and all-to-all, over the 4 ranks and over groups of 2 whose group ranks are not the
    global ranks ((0, 2) and (1, 3), as a dp 2 x cp 2 mesh makes them), with and without documents,
    with as many key/value heads as heads and with half (grouped-query attention)."""
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    groups = {4: dist.group.WORLD, 2: pairs[ctx.rank % 2]}
    cases = []
    for cp, group in groups.items():
        for mode in ("ring", "all-to-all"):
            for kv_heads in (HEADS, HEADS // 2):
                for documents in (None, document_ids(DOCUMENT_LENGTHS)):
                    errors = errors_against_whole_sequence(mode, group, kv_heads, documents)
                    cases.append(dict(cp=cp, mode=mode, kv_heads=kv_heads, documents=documents is not None,
                                      rank=ctx.rank, **errors))
    return cases


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    return [case for rank_cases in run_ranks(every_case, 4) for case in rank_cases]


@pytest.mark.parametrize("mode", ["ring", "all-to-all"])
def test_split_attention_matches_the_whole_sequence_forward_and_backward(cases, mode):
    mine = [case for case in cases if case["mode"] == mode]
    assert len(mine) == 2 * 2 * 2 * 4  # cp 4 and 2, kv heads, documents, on every rank
    for case in mine:
        worst = max(case[name] for name in ("out", "dq", "dk", "dv"))
        assert worst <= TOLERANCE, case


def test_head_tail_ring_gives_every_rank_the_same_causal_work(cases):
    """At cp 4 over 32 tokens (chunks of 4): step 0 computes the two diagonal blocks (causal: 10
    scores each) and the tail on the head (16), each later step two whole blocks (2 x 16), forward
    and backward alike. With documents the diagonal blocks are masked whole (16 each), on every rank."""
    for cp in (4, 2):
        chunk = SEQ_LEN // (2 * cp)
        for documents in (False, True):
            ring = {case["scores"] for case in cases
                    if case["mode"] == "ring" and case["cp"] == cp and case["documents"] == documents}
            diagonal = chunk * chunk if documents else chunk * (chunk + 1) // 2
            assert ring == {2 * (2 * diagonal + chunk * chunk + 2 * (cp - 1) * chunk * chunk)}


def test_contiguous_ring_gives_the_last_rank_2cp_minus_1_times_the_first_ranks_work():
    """Why head-tail: with one chunk per rank, rank r attends to r whole blocks and a causal one.
    Counted by each rank's blocks rehearsed alone, which count as the real ring does."""
    scores = {}
    for layout in (SequenceLayout.contiguous(SEQ_LEN, 4), SequenceLayout.head_tail(SEQ_LEN, 4)):
        for rank in range(4):
            ring = RehearsalRing(layout, rank)
            q, k, v, _ = attention_inputs(HEADS)
            with torch.no_grad():
                ring_attention(*(layout.shard(t, rank, dim=2) for t in (q, k, v)), ring)
            scores.setdefault(layout.chunks_per_rank, []).append(ring.stats.scores)
    assert scores[1] == [64 * r + 36 for r in range(4)]
    assert scores[2] == [2 * 10 + 16 + 3 * 2 * 16] * 4  # as on real ranks, forward only


def test_written_out_block_math_matches_the_fused_kernel():
    """Off the CPU, blocks are computed by the math written out: the same outputs, log-sum-exps and
    gradients as the CPU's fused kernel, for whole, causal and masked blocks (with a query row that
    sees nothing) under grouped-query attention."""
    q, k, v, dout = attention_inputs(HEADS // 2)
    q, k, v, dout = (t[:, :, :8] for t in (q, k, v, dout))
    visible = torch.rand(BATCH, 1, 8, 8, generator=torch.Generator().manual_seed(3)) > 0.4
    visible[:, :, 2] = False
    for mask in (BlockMask(), BlockMask(causal=True), BlockMask(visible=visible)):
        out, lse = blocks.block_forward(q, k, v, mask, 0.3)
        math_out, math_lse = blocks._math_forward(q, k, v, mask, 0.3)
        torch.testing.assert_close(math_out, out, rtol=0, atol=TOLERANCE)
        torch.testing.assert_close(math_lse, lse, rtol=0, atol=TOLERANCE)
        fused = blocks.block_backward(dout, q, k, v, out, _finite(lse), mask, 0.3)
        written = blocks._math_backward(dout, q, k, v, out, _finite(lse), mask, 0.3)
        for got, want in zip(written, fused, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=TOLERANCE)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    return lse.masked_fill(torch.isinf(lse), 0.0)


def test_one_rank_ring_with_documents_matches_masked_attention():
    """A ring of one (the document mask of a run without context parallel) is blockwise attention
    with the mask, in both layouts' chunking."""
    documents = document_ids(DOCUMENT_LENGTHS)
    q, k, v, _ = attention_inputs(HEADS // 2)
    expected = masked_attention(q, k, v, documents)
    assert torch.equal(causal_attention(q, k, v, documents), ring_attention(
        q, k, v, Ring(None, SequenceLayout.head_tail(SEQ_LEN, 1), RingStats()), documents))
    for layout in (SequenceLayout.head_tail(SEQ_LEN, 1), SequenceLayout.contiguous(SEQ_LEN, 1)):
        got = ring_attention(q, k, v, Ring(None, layout, RingStats()), documents)
        torch.testing.assert_close(got, expected, rtol=0, atol=TOLERANCE)


def test_document_mask_stops_attention_at_every_boundary():
    """Changing one document's keys and values changes no other document's outputs."""
    documents = document_ids(((5, 11, 3, 13),))
    q, k, v, _ = (t[:1] for t in attention_inputs(HEADS))
    before = causal_attention(q, k, v, documents)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 5:16] += 1.0
    v2[:, :, 5:16] += 1.0
    after = causal_attention(q, k2, v2, documents)
    changed = (after - before).abs().amax(dim=(0, 1, 3)) > 0
    assert changed.nonzero().flatten().tolist() == list(range(5, 16))


def test_layout_shards_and_unshards_a_batch_and_its_targets():
    layout = SequenceLayout.head_tail(16, 4)
    assert [layout.chunks(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert layout.positions(1).tolist() == [2, 3, 12, 13]
    tokens = torch.arange(2 * 17).view(2, 17)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    parts = [(layout.shard(inputs, r), layout.shard(targets, r)) for r in range(4)]
    # every local target is still the token after its input: the split keeps the pairs together
    assert all(torch.equal(t, i + 1) for i, t in parts)
    assert torch.equal(layout.unshard([i for i, _ in parts]), inputs)
    with pytest.raises(ValueError, match="does not split into 8 equal chunks"):
        SequenceLayout.head_tail(20, 4)


MODEL_SEQ_LEN = 32


def tiny_model(family: str) -> tuple[nn.Module, nn.Module, int | str]:
    """A 2-block model of `family`, and where its plan says it takes positions."""
    torch.manual_seed(0)
    if family == "gpt":
        model = GPT(GPTConfig(n_layer=2, n_head=4, d_model=32, seq_len=MODEL_SEQ_LEN, vocab_size=256))
    else:
        model = build_causal_lm(ModelConfig(name="hf-llama", n_layer=2, n_head=4, n_kv_head=2, d_model=32, d_ff=64,
                                            seq_len=MODEL_SEQ_LEN, vocab_size=256))
    return model, *find_positions(model)


def model_differences(family: str, mode: str, group: dist.ProcessGroup, packed: bool) -> dict[str, float]:
    """The model, unmodified, on this rank's tokens under ContextParallel, against the whole
    sequence on one rank: its logits, and its gradients averaged over the group (each rank's loss is
    the mean over its tokens, an equal share of the sequence's)."""
    model, positions, argument = tiny_model(family)
    tokens = torch.randint(0, 256, (2, MODEL_SEQ_LEN + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    documents = document_ids(((5, 11, 3, 13), (32,))) if packed else None
    with ContextParallel(mode, None).attending(documents):
        logits = model(inputs)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    context = ContextParallel(mode, group)
    handle = context.feed_positions(positions, argument)
    with context.attending(documents):
        local = model(context.shard(inputs))
    F.cross_entropy(local.flatten(0, 1), context.shard(targets).flatten()).backward()
    handle.remove()
    worst = 0.0
    for name, param in model.named_parameters():
        dist.all_reduce(param.grad, group=group)
        scale = expected[name].abs().max().item() or 1.0
        worst = max(worst, (param.grad / group.size() - expected[name]).abs().max().item() / scale)
    with torch.no_grad():  # what the document mask changes: the logits of every document after the first
        unmasked = model(inputs)
    return {"logits": (local - context.shard(logits.detach())).abs().max().item(), "grads": worst,
            "masking": (unmasked - logits).abs().max().item()}


def every_model_case(ctx: DistContext) -> list[dict]:
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    cases = []
    for cp, group in {4: dist.group.WORLD, 2: pairs[ctx.rank % 2]}.items():
        for family in ("gpt", "llama"):
            for mode in ("ring", "all-to-all"):
                for packed in (False, True):
                    cases.append(dict(cp=cp, family=family, mode=mode, packed=packed,
                                      **model_differences(family, mode, group, packed)))
    return cases


@pytest.fixture(scope="module")
def model_cases() -> list[dict]:
    return [case for rank_cases in run_ranks(every_model_case, 4) for case in rank_cases]


def test_unmodified_models_split_by_context_parallel_compute_what_one_rank_does(model_cases):
    assert len(model_cases) == 2 * 2 * 2 * 2 * 4
    for case in model_cases:
        assert case["logits"] <= TOLERANCE and case["grads"] <= TOLERANCE, case
        assert (case["masking"] > 1e-2) == case["packed"], case
