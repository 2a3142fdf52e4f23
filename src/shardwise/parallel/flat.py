"""Tensors laid out back to back in one flat buffer: what every collective over many tensors
sends (one collective's latency instead of one per tensor) and what ddp's buckets, ZeRO's units,
the packed all-reduce and PowerSGD's factors are made of.

- `views`: consecutive views of a buffer, one per shape, each taking its own number of elements
  or more (a ZeRO unit pads each parameter to a whole number of rows per rank);
- `pack` and `unpack`: copy tensors into one new buffer and back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def views(buffer: torch.Tensor, shapes: Sequence[torch.Size | tuple[int, ...]],
          spans: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Views of `buffer`, one of each of `shapes`, one after another from its start; each takes
    `spans[i]` elements of the buffer (default: its own number), the rest padding."""
    out, start = [], 0
    for i, shape in enumerate(shapes):
        numel = math.prod(shape)
        out.append(buffer[start : start + numel].view(shape))
        start += numel if spans is None else spans[i]
    return out


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """`tensors`, flattened, one after another in a new buffer."""
    return torch.cat([tensor.reshape(-1) for tensor in tensors])


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy `flat` (as `pack` laid them out) back into `tensors`."""
    for tensor, part in zip(tensors, views(flat, [t.shape for t in tensors]), strict=True):
        tensor.copy_(part)
