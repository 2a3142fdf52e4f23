"""Ring attention: causal attention over a sequence split across the ranks of a group, with no
rank ever holding more than its own part and one other rank's keys and values.

Each rank holds the queries, keys and values of its tokens (a `SequenceLayout`, head-tail for
balanced causal work). The keys and values travel around the ring: at step s rank r has those of
rank r - s, attends its queries to them block by block, and merges the result into its output by
the log-sum-exp of each block (`blocks.merge`), while the next block is already on its way. After
`size` steps every query has seen every key; blocks wholly in a query's future (or in other
documents) are skipped.

Backward travels the same ring: rank r recomputes each block's probabilities from the saved final
log-sum-exp and gets its part of dq, and of the dk and dv of the keys it holds now. Those travel
on a ring of their own, one step behind the keys, each rank adding its part, until the finished
dk and dv arrive at the rank that owns the keys.

Communication is point to point with the two neighbours (`isend`/`irecv`), so it runs on Gloo as
on NCCL; keys and values go in one message, as do their gradients.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise.parallel.context.blocks import BlockMask, block_backward, block_forward, block_mask, merge
from shardwise.parallel.context.layout import SequenceLayout

KEYS_TAG, GRADIENTS_TAG = 0, 1  # the two rings of messages between the same neighbours
# torch's own, taken before anything could replace it (ContextParallel.attending replaces it with
# what calls the functions here)
SDPA = F.scaled_dot_product_attention


@dataclass
class RingStats:
    """What a rank's ring attention computed: score entries (per batch row and head, forward and
    backward counted once each; `BlockMask.area`) and the seconds spent computing blocks (not
    waiting for neighbours). Equal work across ranks is what the head-tail layout is for."""

    scores: int = 0
    compute_s: float = 0.0


@dataclass
class Ring:
    """A context-parallel group seen as a ring (rank r sends to r + 1 and receives from r - 1), the
    layout of the sequence over it, and the counters of this rank's work. `group` None: one rank."""

    group: dist.ProcessGroup | None
    layout: SequenceLayout
    stats: RingStats

    @property
    def rank(self) -> int:
        return 0 if self.group is None else self.group.rank()

    @property
    def size(self) -> int:
        return 1 if self.group is None else self.group.size()

    def pass_on(self, send: torch.Tensor, tag: int) -> tuple[torch.Tensor, list[dist.Work]]:
        """Start sending `send` to the next rank and receiving the previous rank's into a new tensor;
        returns that tensor and the requests to wait on before reading it."""
        received = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, group=self.group, group_peer=(self.rank + 1) % self.size, tag=tag),
               dist.P2POp(dist.irecv, received, group=self.group, group_peer=(self.rank - 1) % self.size, tag=tag)]
        return received, dist.batch_isend_irecv(ops)


def _wait(requests: list[dist.Work]) -> None:
    for request in requests:
        request.wait()


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring,
                   documents: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries on the keys and values of the whole sequence.

    q `[batch, heads, local_len, head_dim]`, k and v `[batch, kv_heads, local_len, head_dim]`
    (`kv_heads` dividing `heads`: grouped-query attention), this rank's tokens in `ring.layout`'s
    order, as `scaled_dot_product_attention` takes them; returns this rank's output, shaped as q.
    `documents`: each token's document id over the whole sequence `[batch, seq_len]` (the same on
    every rank), so no query sees a key of another document; None: one document per sequence.
    `scale`: of the scores, 1 / sqrt(head_dim) by default."""
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads cannot share {k.shape[1]} key/value heads evenly")
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _RingAttention.apply(q, k, v, ring, documents, scale)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor | None = None,
                     scale: float | None = None) -> torch.Tensor:
    """Causal attention of a whole sequence on one rank, within documents where `documents` (ids
    per token, `[batch, seq_len]`) is given: `scaled_dot_product_attention` without documents; with
    them a ring of one, which computes its blocks' masks as it goes instead of holding a mask of
    seq_len x seq_len for backward, as the fused kernel given one would."""
    if documents is None:
        return SDPA(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return ring_attention(q, k, v, Ring(None, SequenceLayout.head_tail(q.shape[2], 1), RingStats()), documents, scale)


class _Chunks:
    """The chunks of one rank's local sequence: their global positions and document ids."""

    def __init__(self, ring: Ring, rank: int, documents: torch.Tensor | None, device: torch.device) -> None:
        self.positions = [ring.layout.chunk_positions(c).to(device) for c in ring.layout.chunks(rank)]
        self.documents = [None if documents is None else documents[:, p] for p in self.positions]


def _blocks(ring: Ring, queries: _Chunks, source: int, documents: torch.Tensor | None,
            device: torch.device) -> Iterator[tuple[int, int, BlockMask]]:
    """The (query chunk, key chunk, mask) of every block in which some query sees some key, when this
    rank holds the keys of rank `source`."""
    keys = _Chunks(ring, source, documents, device)
    for i, (q_pos, q_docs) in enumerate(zip(queries.positions, queries.documents, strict=True)):
        for j, (k_pos, k_docs) in enumerate(zip(keys.positions, keys.documents, strict=True)):
            mask = block_mask(q_pos, k_pos, q_docs, k_docs)
            if mask is not None:
                yield i, j, mask


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, documents, scale: float):
        n = ring.layout.chunks_per_rank
        q_chunks = q.float().chunk(n, dim=2)
        kv = torch.stack([k.float(), v.float()])  # one message: [2, batch, kv_heads, local_len, head_dim]
        queries = _Chunks(ring, ring.rank, documents, q.device)
        outs = [torch.zeros_like(chunk) for chunk in q_chunks]
        lses = [torch.full(chunk.shape[:-1], float("-inf"), device=q.device) for chunk in q_chunks]
        for step in range(ring.size):
            if step + 1 < ring.size:
                arriving, requests = ring.pass_on(kv, KEYS_TAG)
            started = time.perf_counter()
            k_chunks, v_chunks = kv[0].chunk(n, dim=2), kv[1].chunk(n, dim=2)
            for i, j, mask in _blocks(ring, queries, (ring.rank - step) % ring.size, documents, q.device):
                block_out, block_lse = block_forward(q_chunks[i], k_chunks[j], v_chunks[j], mask, scale)
                outs[i], lses[i] = merge(outs[i], lses[i], block_out, block_lse)
                ring.stats.scores += mask.area(q_chunks[i].shape[2], k_chunks[j].shape[2])
            ring.stats.compute_s += time.perf_counter() - started
            if step + 1 < ring.size:
                _wait(requests)
                kv = arriving
        # In q's dtype and laid out [batch, tokens, heads, head_dim] as scaled_dot_product_attention's
        # fused kernels return it, so a model's transpose back to [batch, tokens, width] copies nothing.
        batch, heads, length, dim = q.shape
        out = q.new_empty(batch, length, heads, dim).transpose(1, 2).copy_(torch.cat(outs, dim=2))
        ctx.save_for_backward(q, k, v, out, torch.cat(lses, dim=2))
        ctx.ring, ctx.documents, ctx.scale = ring, documents, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, documents, scale = ctx.ring, ctx.documents, ctx.scale
        n = ring.layout.chunks_per_rank
        q_chunks, out_chunks, lse_chunks = q.float().chunk(n, dim=2), out.float().chunk(n, dim=2), lse.chunk(n, dim=2)
        dout_chunks = dout.float().contiguous().chunk(n, dim=2)
        dq = torch.zeros_like(q, dtype=torch.float32)
        dq_chunks = dq.chunk(n, dim=2)
        kv = torch.stack([k.float(), v.float()])
        queries = _Chunks(ring, ring.rank, documents, q.device)
        incoming, gradient_requests = None, []  # the gradient of the keys held now, from the ranks before this one
        for step in range(ring.size):
            if step + 1 < ring.size:
                arriving, requests = ring.pass_on(kv, KEYS_TAG)
            started = time.perf_counter()
            dkv = torch.zeros_like(kv)  # this rank's part of the gradient of the keys it holds now
            k_chunks, v_chunks = kv[0].chunk(n, dim=2), kv[1].chunk(n, dim=2)
            dk_chunks, dv_chunks = dkv[0].chunk(n, dim=2), dkv[1].chunk(n, dim=2)
            for i, j, mask in _blocks(ring, queries, (ring.rank - step) % ring.size, documents, q.device):
                dq_i, dk_j, dv_j = block_backward(dout_chunks[i], q_chunks[i], k_chunks[j], v_chunks[j],
                                                  out_chunks[i], lse_chunks[i], mask, scale)
                dq_chunks[i].add_(dq_i)
                dk_chunks[j].add_(dk_j)
                dv_chunks[j].add_(dv_j)
                ring.stats.scores += mask.area(q_chunks[i].shape[2], k_chunks[j].shape[2])
            ring.stats.compute_s += time.perf_counter() - started
            if incoming is not None:
                _wait(gradient_requests)
                dkv += incoming
            if ring.size > 1:
                incoming, gradient_requests = ring.pass_on(dkv, GRADIENTS_TAG)
            if step + 1 < ring.size:
                _wait(requests)
                kv = arriving
        if ring.size > 1:  # this rank's own keys' gradient, finished by the rank before it
            _wait(gradient_requests)
            dkv = incoming
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


class RehearsalRing(Ring):
    """Rank `rank`'s part of a ring of `layout.size`, computed alone, with no group: each step
    attends to this rank's own keys and values in place of those that would arrive. The blocks,
    masks and work are the ring's, the values are not: for measuring one rank's share of the work
    without the others competing for the cores."""

    def __init__(self, layout: SequenceLayout, rank: int) -> None:
        super().__init__(None, layout, RingStats())
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self.layout.size

    def pass_on(self, send: torch.Tensor, tag: int) -> tuple[torch.Tensor, list[dist.Work]]:
        return send, []
