"""Whole matrices for an optimizer that computes on them whole (Muon's Newton-Schulz), from what
each rank holds of them: whole already (`LocalMatrices`), or ZeRO's dim-0 shards (`ShardedMatrices`).

Under ZeRO a rank holds 1/N of every parameter's rows, and so 1/N of its gradient and momentum:
the elementwise part of such an optimizer (momentum, weight decay) stays sharded, but a function
of the whole matrix needs the whole matrix somewhere. Two ways to get it there:
- every rank all-gathers every matrix and computes every result, keeping its rows: N times the
  computation, and (N - 1)/N of the matrices received by each rank;
- each matrix has one *owner* rank, which receives every rank's rows of it, computes, and sends
  each rank its rows of the result back: the computation divided among the ranks, and 2 (N - 1)/N^2
  of the matrices sent and received by each rank (two all-to-alls).
The second is what this module does: it divides Newton-Schulz, the step's largest cost, by N and
sends less for any N; docs/muon.md has the two measured against each other.

A step, per group of ranks that shard alike (the dense units', the experts'):
1. Owners: the parameters, heaviest first (a matrix costs about numel x min(rows, cols)), each to
   the least loaded rank; every rank lists the same parameters in the same order, so every rank
   computes the same owners.
2. All-to-all: each rank sends each owner its rows of the owner's parameters, in the dtype the
   computation starts by casting to (Newton-Schulz's first step is that cast: sending bf16 loses
   nothing, and halves the bytes).
3. The owner lays every rank's rows end to end (the whole parameter, padding cut) and computes.
4. All-to-all back: each rank receives its rows of every result, padded as its shards are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from shardwise.parallel.shard import ShardGroup, Sharding, copy_in, copy_out

WholeFunction = Callable[[int, torch.Tensor], torch.Tensor]  # (index of the parameter, its whole value) -> result
Value = Callable[[int], torch.Tensor]  # index of the parameter -> what this rank holds of its value
Use = Callable[[int, torch.Tensor], None]  # (index of the parameter, this rank's part of its result)


class WholeMatrices(Protocol):
    """What an optimizer needs to compute on whole parameters from the tensors it steps on."""

    def whole_of(self, local: nn.Parameter) -> nn.Parameter:
        """The model's parameter `local` is (a part of)."""

    def apply(self, local: list[nn.Parameter], value: Value, function: WholeFunction, dtype: torch.dtype,
              use: Use) -> None:
        """For each `local[i]`: `use(i, part)`, where `part` is what `local[i]` holds of `function(i,
        whole)` and `value(i)` is what it holds of `whole`; computed in `dtype`. Each value is asked
        for once, and may be dropped once used."""


class LocalMatrices:
    """Every parameter whole on this rank (single, dp, ddp): computed where it is, one at a time (a
    value and its result alive at once, not the model's)."""

    def whole_of(self, local: nn.Parameter) -> nn.Parameter:
        return local

    def apply(self, local: list[nn.Parameter], value: Value, function: WholeFunction, dtype: torch.dtype,
              use: Use) -> None:
        for index in range(len(local)):
            use(index, function(index, value(index)))


def owners(costs: list[float], world: int) -> list[int]:
    """A rank for each of `costs`, heaviest first to the least loaded rank (the lowest on a tie)."""
    load, owner = [0.0] * world, [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owner[index] = min(range(world), key=lambda rank: (load[rank], rank))
        load[owner[index]] += costs[index]
    return owner


class ShardedMatrices:
    """`sharding`'s shards (parallel/shard.py: each rank a dim-0 chunk of every parameter, zero-padded
    to the same rows), each parameter's function computed by its owner; the bytes the all-to-alls
    put through (input + output) are counted in `sharding.bytes_moved`."""

    def __init__(self, sharding: Sharding) -> None:
        self.sharding = sharding
        held = [(unit, param, shard, shape) for unit in sharding.units
                for param, shard, shape in zip(unit.params, unit.shards, unit.shapes, strict=True)]
        self._group = {id(shard): unit.over for unit, _, shard, _ in held}
        self._whole = {id(shard): param for _, param, shard, _ in held}
        self._split_shape = {id(shard): shape for _, _, shard, shape in held}  # as split along dim 0

    def whole_of(self, local: nn.Parameter) -> nn.Parameter:
        return self._whole.get(id(local), local)

    def apply(self, local: list[nn.Parameter], value: Value, function: WholeFunction, dtype: torch.dtype,
              use: Use) -> None:
        groups: dict[int, tuple[ShardGroup, list[int]]] = {}
        for index, shard in enumerate(local):
            over = self._group[id(shard)]
            groups.setdefault(id(over), (over, []))[1].append(index)
        # Every rank in the same order: the dense group (every rank's) before the experts'
        for over, indices in sorted(groups.values(), key=lambda group: group[0].experts):
            results = self._exchange(over, [local[i] for i in indices], [value(i).to(dtype) for i in indices],
                                     lambda i, whole, at=indices: function(at[i], whole))
            for index, result in zip(indices, results, strict=True):
                use(index, result)

    def _exchange(self, over: ShardGroup, shards: list[nn.Parameter], values: list[torch.Tensor],
                  function: WholeFunction) -> list[torch.Tensor]:
        """Steps 1-4 above for the shards of one group of ranks (`values` in the dtype to send)."""
        wholes = [self._whole[id(shard)] for shard in shards]
        owner = owners([p.numel() * min(p.shape[-2:]) for p in wholes], over.world)
        by_owner = [[i for i in range(len(shards)) if owner[i] == rank] for rank in range(over.world)]
        lengths = [shard.numel() for shard in shards]  # the same on every rank: shards are padded alike
        sent = [sum(lengths[i] for i in held) for held in by_owner]
        send = torch.cat([values[i].reshape(-1) for held in by_owner for i in held])
        dtype = send.dtype
        mine = by_owner[over.rank]
        received = torch.empty(over.world, sent[over.rank], dtype=dtype, device=send.device)
        dist.all_to_all_single(received.view(-1), send, [sent[over.rank]] * over.world, sent, group=over.group)
        computed = torch.empty_like(received)
        offset = 0
        for i in mine:
            rows, shape = shards[i].shape[0], self._split_shape[id(shards[i])]  # experts folded or not
            whole = torch.empty(wholes[i].shape, dtype=dtype, device=received.device)
            copy_out(whole, shape, rows, offset, received)
            copy_in(computed, shape, rows, offset, function(i, whole))
            offset += lengths[i]
        back = torch.empty_like(send)
        dist.all_to_all_single(back, computed.view(-1), sent, [sent[over.rank]] * over.world, group=over.group)
        self.sharding.bytes_moved += 2 * (send.numel() + received.numel()) * send.element_size()
        results, at = [torch.empty(0)] * len(shards), 0
        for held in by_owner:
            for i in held:
                results[i] = back[at : at + lengths[i]].view_as(shards[i])
                at += lengths[i]
        return results

