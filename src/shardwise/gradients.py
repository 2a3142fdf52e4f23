"""Clipping a rank's gradients by their global L2 norm, as every strategy does.

Clipping by the global norm scales every gradient by min(1, max_norm / (norm + 1e-6)), the factor
torch.nn.utils.clip_grad_norm_ uses. Where gradients are split over ranks (shards, stages, tensor
slices), each rank sums the squares of the elements it alone accounts for and the sums are added
over the groups that split them, so no element is counted twice or missed. Squares are summed in
fp32 whatever the gradients' dtype: in bf16 the small ones would round away.

The scaling is one foreach multiply for each device and dtype (on the CPU, a loop of the same
multiplies), and on a GPU so is the norm: a kernel or more per gradient made the host, launching
them, the bound of the step (bench/gpu_profile.py counted 2 of every 5 launches of gpt-2-124m's
step there). Elsewhere, as torch's clip_grad_norm_ does, each gradient's squares are summed by
itself: the CPU has no foreach kernels to save launches with, and a norm taken through a square
root and squared back rounds otherwise, which an SGD run at a high rate grows step by step.
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


def by_device_and_dtype(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` in lists of one device and dtype each, what a foreach kernel takes at once."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return list(groups.values())


def squared_norm(grads: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the squares of every element of `grads`, in fp32, as a 0-d tensor where the
    gradients are (`device` if there are none)."""
    groups = by_device_and_dtype(grads)
    if not groups:
        return torch.zeros((), device=device)
    squares = [squares_together(group) if group[0].is_cuda else squares_one_by_one(group) for group in groups]
    return torch.stack([square.to(squares[0].device) for square in squares]).sum()


def squares_together(grads: list[torch.Tensor]) -> torch.Tensor:
    """The fp32 sum of the squares of `grads` (one device and dtype) through one foreach norm."""
    return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum()


def squares_one_by_one(grads: list[torch.Tensor]) -> torch.Tensor:
    """The fp32 sum of the squares of `grads`, each gradient's summed by itself."""
    return torch.stack([grad.float().pow(2).sum() for grad in grads]).sum()


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
    for group in by_device_and_dtype(scaled):
        torch._foreach_mul_(group, coefficient.to(group[0].device))
    return norm
