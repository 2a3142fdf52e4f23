"""Attention of one block of queries on one block of keys, forward and backward, in the form that
lets blocks be combined: each block returns its output and the log-sum-exp of its scores, and
outputs of blocks over different keys merge exactly by their log-sum-exps (the online softmax of
FlashAttention). Ring attention computes the blocks one key block at a time as the blocks travel.

Shapes are `scaled_dot_product_attention`'s: queries `[batch, heads, queries, head_dim]`, keys and
values `[batch, kv_heads, keys, head_dim]` (grouped-query attention where kv_heads < heads);
inputs are fp32. On the CPU a block is torch's fused flash-attention kernel for the CPU, which
returns the log-sum-exp and whose backward takes it; elsewhere it is the same math written out
(scores, softmax, matmuls), which holds a block's scores whole.

Which query may see which key is the causal mask by global position and, for packed sequences,
the document mask: a query sees only keys of its own document (`block_mask`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_fused = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_fused_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@dataclass(frozen=True)
class BlockMask:
    """Which keys of a block each query sees: all (neither field), causally (the keys are the
    queries' own positions: key j visible to query i iff j <= i), or as `visible` says
    (`[batch or 1, 1, queries, keys]`, True: visible)."""

    causal: bool = False
    visible: torch.Tensor | None = None

    def area(self, queries: int, keys: int) -> int:
        """Score entries computed per batch row and head (a causal block computes its lower triangle)."""
        return queries * (queries + 1) // 2 if self.causal else queries * keys


def block_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, q_docs: torch.Tensor | None,
               k_docs: torch.Tensor | None) -> BlockMask | None:
    """The mask of queries at global positions `q_pos` on keys at `k_pos` (each ascending), within
    documents where ids per token are given (`[batch, queries]`, `[batch, keys]`); None where no
    query sees any key (the block is skipped)."""
    if k_pos[0] > q_pos[-1]:
        return None  # wholly in the queries' future
    if q_docs is None:
        if k_pos[-1] <= q_pos[0]:
            return BlockMask()
        if torch.equal(q_pos, k_pos):
            return BlockMask(causal=True)
    visible = k_pos[None, :] <= q_pos[:, None]
    if q_docs is not None:
        visible = visible & (q_docs[:, :, None] == k_docs[:, None, :])
    if not bool(visible.any()):
        return None
    return BlockMask(visible=visible.view(visible.shape[0] if visible.dim() == 3 else 1, 1, *visible.shape[-2:]))


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp of the scores `[batch, heads, queries]`) of the block; a query that sees
    none of its keys gets output 0 and log-sum-exp -inf, which merge as "nothing"."""
    if q.device.type != "cpu":
        return _math_forward(q, k, v, mask, scale)
    out, lse = _fused(q, k, v, 0.0, mask.causal, attn_mask=_additive(mask), scale=scale)
    if mask.visible is not None:
        blind = ~mask.visible.any(-1)  # the kernel gives such a row output 0 and log-sum-exp 0
        lse = lse.masked_fill(blind, float("-inf"))
    return out, lse


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, mask: BlockMask, scale: float) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) of the block, given the *final* output and log-sum-exp of each query over all
    keys: the block's probabilities are then its part of the whole softmax, and its gradients add
    up over blocks (FlashAttention-2's backward)."""
    if q.device.type != "cpu":
        return _math_backward(dout, q, k, v, out, lse, mask, scale)
    return _fused_backward(dout, q, k, v, out, lse, 0.0, mask.causal, attn_mask=_additive(mask), scale=scale)


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and log-sum-exp over the keys of both: each output weighted by its share of the
    combined softmax denominator."""
    total = torch.logaddexp(lse, block_lse)
    finite = _finite(total)
    out = out * torch.exp(lse - finite).unsqueeze(-1) + block_out * torch.exp(block_lse - finite).unsqueeze(-1)
    return out, total


def _additive(mask: BlockMask) -> torch.Tensor | None:
    """The fused kernel's form of a visibility mask: 0 where visible, -inf where not."""
    if mask.visible is None:
        return None
    return torch.zeros(mask.visible.shape, device=mask.visible.device).masked_fill(~mask.visible, float("-inf"))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """`lse` with the -inf of a row that sees no key replaced by 0, so exp(x - lse) is 0 there, not NaN."""
    return lse.masked_fill(torch.isinf(lse), 0.0)


def _grouped(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q as `[batch, kv_heads, group, queries, dim]` and k as `[batch, kv_heads, 1, keys, dim]`: the
    query heads that share a key/value head side by side, so grouped-query attention broadcasts."""
    batch, heads, length, dim = q.shape
    return q.view(batch, k.shape[1], heads // k.shape[1], length, dim), k.unsqueeze(2)


def _math_scores(q: torch.Tensor, k: torch.Tensor, mask: BlockMask, scale: float) -> torch.Tensor:
    """`[batch, kv_heads, group, queries, keys]`, -inf where a key is hidden."""
    scores = (q @ k.transpose(-1, -2)) * scale
    if mask.causal:
        hidden = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        return scores.masked_fill(hidden, float("-inf"))
    return scores if mask.visible is None else scores.masked_fill(~mask.visible.unsqueeze(2), float("-inf"))


def _math_forward(q, k, v, mask: BlockMask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    q5, k5 = _grouped(q, k)
    scores = _math_scores(q5, k5, mask, scale)
    lse = scores.logsumexp(-1)
    out = torch.exp(scores - _finite(lse).unsqueeze(-1)) @ v.unsqueeze(2)
    return out.view(q.shape), lse.view(q.shape[:-1])


def _math_backward(dout, q, k, v, out, lse, mask: BlockMask, scale: float) -> tuple[torch.Tensor, ...]:
    q5, k5 = _grouped(q, k)
    dout5, v5 = dout.view(q5.shape), v.unsqueeze(2)
    probs = torch.exp(_math_scores(q5, k5, mask, scale) - lse.view(q5.shape[:-1]).unsqueeze(-1))
    delta = (dout * out).sum(-1).view(q5.shape[:-1])
    dscores = probs * (dout5 @ v5.transpose(-1, -2) - delta.unsqueeze(-1))
    dq = (dscores @ k5) * scale
    dk = (dscores.transpose(-1, -2) @ q5).sum(2) * scale
    dv = (probs.transpose(-1, -2) @ dout5).sum(2)
    return dq.view(q.shape), dk, dv
