"""The tp ranks of a model replica and what tensor parallel's layers need of them (parallel/tensor.py):
how a tensor splits over the ranks (`TensorShard`), the collectives (`TensorParallelGroup`, or
`ShapesOnly`, which answers with shapes for the planner), and the autograd functions that put them
in forward and backward: Megatron's f and g (`copy_to_tp`, `reduce_from_tp`) and a dimension split
or gathered (`SplitAlong`, `GatherAlong`: the sequence under sequence parallel, a layer's features).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from shardwise.memory import exact_storage
from shardwise.parallel.comm import all_gather_single, reduce_scatter_single

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

Ctx = torch.autograd.function.FunctionCtx


@dataclass(frozen=True)
class TensorShard:
    """How a tensor is split over the tp ranks: along `dim`, each of its `parts` (qkv's q, k and v)
    split on its own, so a rank's shard holds the same heads of each part."""

    dim: int
    parts: int = 1

    def take(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        """Rank `rank`'s shard of `full`, a copy."""
        return torch.cat([part.chunk(size, self.dim)[rank] for part in full.chunk(self.parts, self.dim)], self.dim)

    def join(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's shard, in rank order (one copy: each part's pieces in
        rank order, part after part)."""
        per_rank = [shard.chunk(self.parts, self.dim) for shard in shards]
        return torch.cat([parts[j] for j in range(self.parts) for parts in per_rank], self.dim)

    def pieces(self, rows: torch.Tensor, start: int, full: torch.Size, rank: int, size: int,
               ) -> list[tuple[torch.Tensor, tuple[int, ...]]]:
        """`rows`, rows [start, start + len(rows)) of rank `rank`'s shard of a tensor shaped `full`
        (what a sharded strategy keeps of it: fsdp over tensor parallel), as the pieces of the full
        tensor they are, each with its offset there. Split along dim 0, the rows may straddle two
        parts (qkv's q and k); along another dim they are the full tensor's rows, each part's
        columns a piece."""
        pieces = []
        stop = start + rows.shape[0]
        part_size = full[self.dim] // self.parts  # of the full tensor
        per_rank = part_size // size  # of a part, on one rank
        for j in range(self.parts):
            global_start = j * part_size + rank * per_rank
            if self.dim == 0:
                lo, hi = max(start, j * per_rank), min(stop, (j + 1) * per_rank)
                if lo < hi:
                    pieces.append((rows[lo - start : hi - start], (global_start + lo - j * per_rank,)
                                   + (0,) * (len(full) - 1)))
            elif stop > start:
                offset = [0] * len(full)
                offset[0], offset[self.dim] = start, global_start
                pieces.append((rows.narrow(self.dim, j * per_rank, per_rank), tuple(offset)))
        return pieces

    def as_dtensor(self, shard: torch.Tensor, full: torch.Tensor, mesh: DeviceMesh) -> DTensor:
        """This rank's `shard` as a DTensor, `Shard(dim)` over `mesh`, of a tensor shaped like
        `full` (a meta tensor), sharing `shard`'s storage: what a checkpoint saves and loads in place.

        A shard of several parts is as many pieces of the full tensor (qkv: rank r's rows of q, of k
        and of v), not the one chunk `Shard(dim)` alone would place. Its local tensor is then a
        LocalShardsWrapper, which tells DCP where each piece lies (torchrec's way of holding several
        shards on one rank)."""
        # Imported on first use: torch.distributed.tensor takes 0.6 s to import, which the planner,
        # reading these strategies' layouts, need not pay.
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

        local = shard
        if self.parts > 1:
            rank, part_size = mesh.get_local_rank(), full.shape[self.dim] // self.parts
            pieces = [exact_storage(piece) for piece in shard.chunk(self.parts, self.dim)]
            starts = [j * part_size + rank * piece.shape[self.dim] for j, piece in enumerate(pieces)]
            offsets = [tuple(start if d == self.dim else 0 for d in range(full.dim())) for start in starts]
            local = LocalShardsWrapper(pieces, offsets)
        return DTensor.from_local(local, mesh, [Shard(self.dim)], run_check=False, shape=full.shape,
                                  stride=full.stride())


class TensorParallelGroup:
    """The tp ranks a model replica's blocks are split over, and the collectives the split needs:
    sums of partial results, and activations split along a dimension, each rank a consecutive part
    of it: for sequence parallel [batch, seq, width] along seq, for a layer that gathers its output
    features (or splits its input's) along the last."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        """`x` summed over the ranks, in place."""
        dist.all_reduce(x, group=self.group)
        return x

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The whole of dimension `dim` (the sequence by default) from every rank's part of it."""
        parts = x.new_empty((self.size * x.shape[0], *x.shape[1:]))  # Gloo takes the parts concatenated on dim 0
        all_gather_single(parts, x.contiguous(), group=self.group)
        return torch.cat(parts.chunk(self.size), dim=dim)

    def reduce_scatter_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of the sequence of the sum of every rank's `x`."""
        parts = torch.cat(x.chunk(self.size, dim=1))  # rank r's part r-th along dim 0
        out = x.new_empty((x.shape[0], *parts.shape[1:]))
        reduce_scatter_single(out, parts, group=self.group)
        return out

    def part(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of dimension `dim` (the sequence by default), a copy."""
        return x.chunk(self.size, dim=dim)[self.rank].contiguous()


class ShapesOnly(TensorParallelGroup):
    """Rank 0 of `size` tp ranks, alone: each collective returns what it would, in shape and dtype,
    without the others' values. What the planner traces a rank's forward through, on fake tensors,
    to count what it saves for backward (planner/traces.py)."""

    def __init__(self, size: int) -> None:
        self.group, self.rank, self.size = None, 0, size

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        return torch.cat([x] * self.size, dim=dim)

    def reduce_scatter_sequence(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], x.shape[1] // self.size, *x.shape[2:])).copy_(x.chunk(self.size, dim=1)[0])


class CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx: Ctx, x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx: Ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.tp.all_reduce_(grad.clone()), None  # clone: autograd may hand the gradient to others too


class ReduceFromTensorParallel(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx: Ctx, x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
        return tp.all_reduce_(x.clone())  # an input must not be changed in place

    @staticmethod
    def backward(ctx: Ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    return CopyToTensorParallel.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
    return ReduceFromTensorParallel.apply(x, tp)


class SplitAlong(torch.autograd.Function):
    """This rank's part of dimension `dim` forward (of the sequence; of a layer's input features);
    all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx: Ctx, x: torch.Tensor, tp: TensorParallelGroup, dim: int) -> torch.Tensor:
        ctx.tp, ctx.dim = tp, dim
        return tp.part(x, dim)

    @staticmethod
    def backward(ctx: Ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.tp.gather(grad, ctx.dim), None, None


class GatherAlong(torch.autograd.Function):
    """All-gather of dimension `dim` forward (of the sequence; of a layer's output features);
    backward, this rank's part of the gradient, which every rank has whole (what follows is
    replicated)."""

    @staticmethod
    def forward(ctx: Ctx, x: torch.Tensor, tp: TensorParallelGroup, dim: int) -> torch.Tensor:
        ctx.tp, ctx.dim = tp, dim
        return tp.gather(x, dim)

    @staticmethod
    def backward(ctx: Ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return ctx.tp.part(grad, ctx.dim), None, None
