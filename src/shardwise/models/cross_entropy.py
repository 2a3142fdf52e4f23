"""Cross-entropy over a language model's logits that never holds them in float32 whole.

`F.cross_entropy` on `logits.float()` keeps the log-softmax's float32 output for backward, and its
backward makes two more float32 tensors of the logits' size (the gradient of that output, then of
its input): 12 bytes per logit live as backward starts, where a bf16 model's logits are 2. For
Llama-3's 128,256-entry vocabulary that is 1.5 MB a token, more than a block's activations.

`cross_entropy_sum` keeps only the logits, as they came, and each row's log-sum-exp. Forward and
backward go over the rows a chunk at a time, each chunk upcast to float32 alone; backward writes
each chunk's gradient, `softmax - one_hot` scaled, into one gradient in the logits' dtype. Live
as backward starts: the logits, their gradient and one float32 chunk. The values are the same
arithmetic as `F.cross_entropy`'s in float32 (log-softmax, then its gradient), in another order.
"""

from __future__ import annotations

from typing import Any

import torch

IGNORE = -100  # a target that does not count (a fine-tuning prompt's token)
CHUNK_ELEMENTS = 1 << 26  # float32 elements of one chunk: 256 MiB; few chunks, so few kernel launches


def chunk_rows(vocab: int) -> int:
    """Rows of a (rows, vocab) chunk of CHUNK_ELEMENTS at most (one row at least)."""
    return max(1, CHUNK_ELEMENTS // vocab)


def float32_chunk(logits: torch.Tensor, rows: int) -> torch.Tensor:
    """The one float32 chunk a pass over `logits` computes in, `rows` of them at most, reused chunk
    after chunk: a chunk made anew each time would be allocated while the last one is still held."""
    return torch.empty(min(rows, logits.shape[0]), logits.shape[-1], dtype=torch.float32, device=logits.device)


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of `logits` [N, V] against `targets` [N], in float32, a target of
    IGNORE counting 0."""
    return _ChunkedCrossEntropy.apply(logits, targets)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        rows = chunk_rows(logits.shape[-1])
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        buffer = float32_chunk(logits, rows)
        for start in range(0, logits.shape[0], rows):
            chunk = buffer[: min(rows, logits.shape[0] - start)].copy_(logits[start : start + rows])
            wanted = targets[start : start + rows]
            picked = chunk.gather(1, wanted.clamp(min=0).unsqueeze(1)).squeeze(1)
            top = chunk.amax(dim=-1)
            # log-sum-exp in place (torch.logsumexp would allocate its exponentials beside the chunk)
            rows_lse = chunk.sub_(top.unsqueeze(1)).exp_().sum(dim=-1).log_().add_(top)
            lse[start : start + rows] = rows_lse
            total += torch.where(wanted != IGNORE, rows_lse - picked, 0.0).sum()
        ctx.save_for_backward(logits, targets, lse)
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, targets, lse = ctx.saved_tensors
        rows = chunk_rows(logits.shape[-1])
        grad = torch.empty_like(logits)
        buffer = float32_chunk(logits, rows)
        for start in range(0, logits.shape[0], rows):
            chunk = buffer[: min(rows, logits.shape[0] - start)].copy_(logits[start : start + rows])
            chunk.sub_(lse[start : start + rows].unsqueeze(1)).exp_()  # the softmax, in place
            wanted = targets[start : start + rows]
            counted = (wanted != IGNORE).unsqueeze(1)
            chunk.scatter_add_(1, wanted.clamp(min=0).unsqueeze(1), torch.full_like(chunk[:, :1], -1.0))
            chunk.mul_(torch.where(counted, grad_total, 0.0))
            grad[start : start + rows].copy_(chunk)
        return grad, None
