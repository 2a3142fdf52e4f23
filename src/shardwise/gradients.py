"""Clipping a rank's gradients by their global L2 norm, as every strategy does.

Clipping by the global norm scales every gradient by min(1, max_norm / (norm + 1e-6)), the factor
torch.nn.utils.clip_grad_norm_ uses. Where gradients are split over ranks (shards, stages, tensor
slices), each rank sums the squares of the elements it alone accounts for and the sums are added
over the groups that split them, so no element is counted twice or missed. Squares are summed in
fp32 whatever the gradients' dtype: in bf16 the small ones would round away.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from shardwise.memory import local_tensor


def local_grads(params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
    """The gradients of `params` (what a strategy's rank holds: `Strategy.local_parameters()`), as
    plain tensors on this rank."""
    return [local_tensor(p.grad) for p in params if p.grad is not None]


def squared_norm(grads: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the squares of every element of `grads`, in fp32, as a 0-d tensor on `device`."""
    squares = [grad.float().pow(2).sum() for grad in grads]
    return torch.stack(squares).sum() if squares else torch.zeros((), device=device)


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What gradients of global norm `norm` are multiplied by to have a norm of at most `max_norm`."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def clip_grad_norm_(counted: Sequence[torch.Tensor], scaled: Sequence[torch.Tensor], max_norm: float,
                    device: torch.device, groups: Sequence[dist.ProcessGroup] = ()) -> torch.Tensor:
    """Scale `scaled` (this rank's gradients) so that the global norm is at most `max_norm`; the
    global norm is that of `counted` (the gradients this rank accounts for) summed over every
    group of `groups` in turn. Returns the norm before clipping."""
    squares = squared_norm(counted, device).to(device)  # summed where the gradients are (the host, offloaded)
    for group in groups:
        dist.all_reduce(squares, group=group)
    norm = squares.sqrt()
    coefficient = clip_coefficient(norm, max_norm)
    for grad in scaled:
        grad.mul_(coefficient.to(grad.device))
    return norm
