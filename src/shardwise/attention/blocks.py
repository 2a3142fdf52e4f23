"""Attention of one block of queries on one block of keys, forward and backward, in the form that
lets blocks be combined: each block returns its output and the log-sum-exp of its scores, and
outputs of blocks over different keys merge exactly by their log-sum-exps (the online softmax of
FlashAttention). Ring attention computes the blocks one key block at a time as the blocks travel.

Shapes: queries `[batch, kv_heads, group, queries, head_dim]` and keys, values
`[batch, kv_heads, 1, keys, head_dim]`, so grouped-query attention (`group` query heads per
key/value head) is a broadcast, not a copy of the keys. Everything is computed in fp32.

Which query may see which key is the causal mask by global position, and, for packed sequences,
the document mask: a query sees only keys of its own document.
"""

from __future__ import annotations

import torch


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, q_docs: torch.Tensor | None,
            k_docs: torch.Tensor | None) -> torch.Tensor | None:
    """Which keys each query may attend to, as a mask broadcastable to the scores
    `[batch, kv_heads, group, queries, keys]` (True: visible); None where every key is visible.
    Positions are global (`[queries]`, `[keys]`); documents are ids per token (`[batch, queries]`,
    `[batch, keys]`) or None for one document."""
    if q_docs is None and k_pos[-1] <= q_pos[0]:
        return None  # a block wholly in the past, in one document
    mask = k_pos[None, :] <= q_pos[:, None]
    if q_docs is not None:
        mask = mask & (q_docs[:, :, None] == k_docs[:, None, :])
    return mask.view(mask.shape[0] if mask.dim() == 3 else 1, 1, 1, *mask.shape[-2:])


def sees_nothing(q_pos: torch.Tensor, k_pos: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether no query of the block may see any of its keys (the block can be skipped)."""
    return bool(k_pos[0] > q_pos[-1]) or (mask is not None and not bool(mask.any()))


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    scores = (q @ k.transpose(-1, -2)) * scale
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """`lse` with the -inf of a row that sees no key replaced by 0, so exp(scores - lse) is 0 there, not NaN."""
    return lse.masked_fill(torch.isinf(lse), 0.0)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp of the scores) of the block; a query that sees none of its keys gets
    output 0 and log-sum-exp -inf, which merge as "nothing"."""
    scores = _scores(q, k, mask, scale)
    lse = scores.logsumexp(-1)
    return torch.exp(scores - _finite(lse).unsqueeze(-1)) @ v, lse


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and log-sum-exp over the keys of both: each output weighted by its share of the
    combined softmax denominator."""
    total = torch.logaddexp(lse, block_lse)
    finite = _finite(total)
    out = out * torch.exp(lse - finite).unsqueeze(-1) + block_out * torch.exp(block_lse - finite).unsqueeze(-1)
    return out, total


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   lse: torch.Tensor, delta: torch.Tensor, scale: float) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) of the block, given the *final* log-sum-exp of each query over all keys and
    delta = rowsum(dout * out) of the final output: the block's probabilities are then its part
    of the whole softmax, and its gradients add up over blocks (FlashAttention-2's backward)."""
    probs = torch.exp(_scores(q, k, mask, scale) - lse.unsqueeze(-1))
    dv = (probs.transpose(-1, -2) @ dout).sum(2, keepdim=True)
    dscores = probs * (dout @ v.transpose(-1, -2) - delta.unsqueeze(-1))
    dq = (dscores @ k) * scale
    dk = (dscores.transpose(-1, -2) @ q).sum(2, keepdim=True) * scale
    return dq, dk, dv
