"""All-to-all attention (DeepSpeed's Ulysses): the sequence is split across the ranks everywhere
but in attention, which instead splits the heads.

Each rank holds the queries, keys and values of its contiguous part of the sequence for every
head. One all-to-all (q, k and v together) gives each rank the whole sequence for `heads / size`
of the heads; attention runs there as on one device (any kernel, any mask); a second all-to-all
gives each rank its part of the output back, for every head. Backward is the same two all-to-alls
the other way round. Each moves (size - 1) / size of what it carries, however long the sequence;
attention itself needs no communication, but the heads must divide among the ranks (key/value
heads that do not are repeated for every query head first).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.parallel.context.ring import causal_attention


def sequence_to_heads(*xs: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, ...]:
    """Each `[batch, heads, local_len, dim]` of this rank's part of the sequence -> `[batch, heads /
    size, seq_len, dim]`: this rank's share of its heads (rank r: the r-th) over the whole sequence.
    The tensors (q, k and v, whose head counts may differ) travel in one all-to-all."""
    return _SequenceToHeads.apply(group, *xs)


def heads_to_sequence(*xs: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, ...]:
    """`sequence_to_heads`'s inverse."""
    return _HeadsToSequence.apply(group, *xs)


def _sequence_to_heads(xs: tuple[torch.Tensor, ...], group: dist.ProcessGroup) -> tuple[torch.Tensor, ...]:
    size = group.size()
    batch, _, length, dim = xs[0].shape
    shares = [x.shape[1] // size for x in xs]
    # Piece r of dimension 0 goes to rank r: its share of each tensor's heads, for this rank's tokens.
    send = torch.cat([x.reshape(batch, size, share, length, dim) for x, share in zip(xs, shares, strict=True)], 2)
    send = send.transpose(0, 1).contiguous()
    received = torch.empty_like(send)  # piece r: rank r's tokens, for this rank's heads
    dist.all_to_all_single(received, send, group=group)
    whole = received.permute(1, 2, 0, 3, 4).reshape(batch, sum(shares), size * length, dim)
    return whole.split(shares, dim=1)


def _heads_to_sequence(xs: tuple[torch.Tensor, ...], group: dist.ProcessGroup) -> tuple[torch.Tensor, ...]:
    size = group.size()
    batch, _, seq_len, dim = xs[0].shape
    heads = [x.shape[1] for x in xs]
    # Piece r goes to rank r: its tokens, for this rank's heads of each tensor.
    send = torch.cat(xs, dim=1).reshape(batch, sum(heads), size, seq_len // size, dim).permute(2, 0, 1, 3, 4)
    send = send.contiguous()
    received = torch.empty_like(send)  # piece r: rank r's heads, for this rank's tokens
    dist.all_to_all_single(received, send, group=group)
    # Laid out [batch, tokens, heads, dim], as scaled_dot_product_attention's fused kernels return
    # their output, so a model's transpose back to [batch, tokens, width] copies nothing.
    return tuple(piece.permute(1, 3, 0, 2, 4).reshape(batch, seq_len // size, size * h, dim).transpose(1, 2)
                 for piece, h in zip(received.split(heads, dim=2), heads, strict=True))


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *xs):
        ctx.group = group
        return _sequence_to_heads(xs, group)

    @staticmethod
    def backward(ctx, *grads):
        return None, *_heads_to_sequence(grads, ctx.group)


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *xs):
        ctx.group = group
        return _heads_to_sequence(xs, group)

    @staticmethod
    def backward(ctx, *grads):
        return None, *_sequence_to_heads(grads, ctx.group)


def all_to_all_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup,
                         documents: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries on the whole sequence, by all-to-all over `group`.

    q `[batch, heads, local_len, head_dim]`, k and v `[batch, kv_heads, local_len, head_dim]`, this
    rank's contiguous part of the sequence (`SequenceLayout.contiguous`); `heads` must divide by the
    group's size. Key/value heads that do not (grouped-query attention with fewer of them than
    ranks) are repeated for every query head first, as grouped-query attention reads them. Returns
    this rank's output, shaped as q. `documents` and `scale` as in `ring_attention`."""
    size = group.size()
    if q.shape[1] % size:
        raise ValueError(f"all-to-all attention over {size} ranks: {q.shape[1]} heads must divide by {size}")
    if k.shape[1] % size:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    heads = sequence_to_heads(q, k, v, group=group)
    return heads_to_sequence(causal_attention(*heads, documents, scale), group=group)[0]
