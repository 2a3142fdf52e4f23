"""Whole matrices for an optimizer that computes on them whole (Muon's Newton-Schulz), from what
each rank holds of them: whole already (`LocalMatrices`), ZeRO's dim-0 shards (`ShardedMatrices`),
tensor parallel's shards (`TensorMatrices`), or ZeRO's shards of tensor parallel's (the one over
the other).

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

A step, per group of ranks that split alike (ZeRO's dense units', its experts'; the tp ranks):
1. Owners: the parameters, heaviest first (a matrix costs about numel x min(rows, cols)), each to
   the least loaded rank; every rank lists the same parameters in the same order, so every rank
   computes the same owners.
2. All-to-all: each rank sends each owner its part of the owner's parameters, in the dtype the
   computation starts by casting to (Newton-Schulz's first step is that cast: sending bf16 loses
   nothing, and halves the bytes).
3. The owner puts the parts together (ZeRO: rows end to end, padding cut; tp: each fused part's
   pieces in rank order, `TensorShard.join`) and computes.
4. All-to-all back: each rank receives its part of every result.

Over tensor parallel, ZeRO's owner of a matrix holds it whole as its tp rank holds it; the tp
ranks of that owner (the same data-parallel rank of each tp rank: they list the same parameters,
so they own the same ones) then exchange it the same way among themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from shardwise.parallel.shard import ShardGroup, Sharding, copy_in, copy_out
from shardwise.parallel.tensor_group import TensorShard

WholeFunction = Callable[[int, torch.Tensor], torch.Tensor]  # (index of the parameter, its whole value) -> result
Value = Callable[[int], torch.Tensor]  # index of the parameter -> what this rank holds of its value
Use = Callable[[int, torch.Tensor], None]  # (index of the parameter, this rank's part of its result)


class WholeMatrices(Protocol):
    """What an optimizer needs to compute on whole parameters from the tensors it steps on."""

    def whole_of(self, local: nn.Parameter) -> nn.Parameter:
        """The model's parameter `local` is (a part of)."""

    def shape_of(self, local: nn.Parameter) -> torch.Size:
        """The whole shape of what `local` is a part of (over tensor parallel, of the plain model's)."""

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

    def shape_of(self, local: nn.Parameter) -> torch.Size:
        return local.shape

    def apply(self, local: list[nn.Parameter], value: Value, function: WholeFunction, dtype: torch.dtype,
              use: Use) -> None:
        for index in range(len(local)):
            use(index, function(index, value(index).to(dtype)))


def owners(costs: list[float], world: int) -> list[int]:
    """A rank for each of `costs`, heaviest first to the least loaded rank (the lowest on a tie)."""
    load, owner = [0.0] * world, [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owner[index] = min(range(world), key=lambda rank: (load[rank], rank))
        load[owner[index]] += costs[index]
    return owner


class Exchange:
    """Steps 1, 2 and 4 over one group of ranks: which rank owns each of a list of parameters, every
    rank's part of each sent to its owner, and the owner's result's parts sent back. Each part of a
    parameter has the same number of elements on every rank (`lengths`)."""

    def __init__(self, group: dist.ProcessGroup, world: int, rank: int, costs: list[float], lengths: list[int]) -> None:
        self.group, self.world, self.rank, self.lengths = group, world, rank, lengths
        owner = owners(costs, world)
        self.by_owner = [[i for i in range(len(costs)) if owner[i] == r] for r in range(world)]
        self.mine = self.by_owner[rank]
        self.sent = [sum(lengths[i] for i in held) for held in self.by_owner]
        self.bytes_moved = 0
        self.dtype = torch.float32  # what to_owners sent, and from_owners sends back

    def to_owners(self, values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every rank's part of each parameter this rank owns ([world, its length] each, in `mine`'s
        order), from each rank's `values` (its parts, flat, in the dtype to send)."""
        send = torch.cat([values[i].reshape(-1) for held in self.by_owner for i in held])
        self.dtype = send.dtype
        received = torch.empty(self.world, self.sent[self.rank], dtype=send.dtype, device=send.device)
        dist.all_to_all_single(received.view(-1), send, [self.sent[self.rank]] * self.world, self.sent,
                               group=self.group)
        self.bytes_moved += (send.numel() + received.numel()) * send.element_size()
        return list(received.split([self.lengths[i] for i in self.mine], dim=1))

    def from_owners(self, computed: list[torch.Tensor]) -> list[torch.Tensor]:
        """This rank's part of each parameter's result (flat, in the list's order), from the
        owners' `computed` ([world, its length] each, in `mine`'s order: row r goes to rank r)."""
        send = torch.cat(computed, dim=1) if computed else torch.empty(self.world, 0, dtype=self.dtype)
        back = torch.empty(sum(self.sent), dtype=send.dtype, device=send.device)
        dist.all_to_all_single(back, send.reshape(-1), self.sent, [self.sent[self.rank]] * self.world,
                               group=self.group)
        self.bytes_moved += (send.numel() + back.numel()) * send.element_size()
        parts, at = [torch.empty(0)] * len(self.lengths), 0
        for held in self.by_owner:
            for i in held:
                parts[i] = back[at : at + self.lengths[i]]
                at += self.lengths[i]
        return parts


def cost(shape: torch.Size) -> float:
    """About what orthogonalizing a matrix of `shape` costs (numel x its shorter side)."""
    return shape.numel() * min(shape[-2:])


class TensorMatrices:
    """Parameters split over the tp ranks of `group` (`tensor_shards`: id -> how; the rest whole on
    every tp rank, computed where they are): each split one put together by its owner."""

    def __init__(self, group: dist.ProcessGroup, tensor_shards: dict[int, TensorShard]) -> None:
        self.group, self.tensor_shards = group, tensor_shards
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def whole_of(self, local: nn.Parameter) -> nn.Parameter:
        return local

    def shape_of(self, local: nn.Parameter) -> torch.Size:
        shard = self.tensor_shards.get(id(local))
        if shard is None:
            return local.shape
        shape = list(local.shape)
        shape[shard.dim] *= self.world
        return torch.Size(shape)

    def apply(self, local: list[nn.Parameter], value: Value, function: WholeFunction, dtype: torch.dtype,
              use: Use) -> None:
        split = [i for i, param in enumerate(local) if id(param) in self.tensor_shards]
        for index in (i for i in range(len(local)) if id(local[i]) not in self.tensor_shards):
            use(index, function(index, value(index).to(dtype)))
        if not split:  # every tp rank lists the same parameters: none of them exchanges
            return
        exchange = Exchange(self.group, self.world, self.rank, [cost(self.shape_of(local[i])) for i in split],
                            [local[i].numel() for i in split])
        received = exchange.to_owners([value(i).to(dtype) for i in split])
        computed = []
        for j, parts in zip(exchange.mine, received, strict=True):
            param = local[split[j]]
            shard = self.tensor_shards[id(param)]
            result = function(split[j], shard.join([part.view(param.shape) for part in parts]))
            computed.append(torch.stack([shard.take(result, r, self.world).reshape(-1) for r in range(self.world)]))
        for j, part in enumerate(exchange.from_owners(computed)):
            use(split[j], part.view(local[split[j]].shape))


class ShardedMatrices:
    """`sharding`'s shards (parallel/shard.py: each rank a dim-0 chunk of every parameter, zero-padded
    to the same rows), each parameter put together by its owner, which computes on it through
    `inner` (LocalMatrices; over tensor parallel, TensorMatrices); the bytes the all-to-alls put
    through (input + output) are counted in `sharding.bytes_moved`."""

    def __init__(self, sharding: Sharding, inner: LocalMatrices | TensorMatrices) -> None:
        self.sharding, self.inner = sharding, inner
        # the sharding maps a parameter to its shard, unit and split; this, a shard to its parameter
        self._whole = {id(shard): param for unit in sharding.units
                       for param, shard in zip(unit.params, unit.shards, strict=True)}

    def whole_of(self, local: nn.Parameter) -> nn.Parameter:
        return self._whole.get(id(local), local)

    def shape_of(self, local: nn.Parameter) -> torch.Size:
        return self.inner.shape_of(self.whole_of(local))

    def apply(self, local: list[nn.Parameter], value: Value, function: WholeFunction, dtype: torch.dtype,
              use: Use) -> None:
        groups: dict[int, tuple[ShardGroup, list[int]]] = {}
        for index, shard in enumerate(local):
            over = self.sharding.unit_of(self._whole[id(shard)]).over
            groups.setdefault(id(over), (over, []))[1].append(index)
        # Every rank in the same order: the dense group (every rank's) before the experts'
        for over, indices in sorted(groups.values(), key=lambda group: group[0].experts):
            self._exchange(over, indices, [local[i] for i in indices], value, function, dtype, use)

    def _exchange(self, over: ShardGroup, indices: list[int], shards: list[nn.Parameter], value: Value,
                  function: WholeFunction, dtype: torch.dtype, use: Use) -> None:
        """Steps 1-4 above for the shards of one group of ranks (`indices`: theirs in apply's list)."""
        wholes = [self._whole[id(shard)] for shard in shards]
        exchange = Exchange(over.group, over.world, over.rank, [cost(p.shape) for p in wholes],
                            [shard.numel() for shard in shards])
        received = exchange.to_owners([value(i).to(dtype) for i in indices])
        owned = [wholes[j] for j in exchange.mine]
        assembled, computed = [], []
        for j, parts in zip(exchange.mine, received, strict=True):
            whole = torch.empty(wholes[j].shape, dtype=dtype, device=parts.device)
            rows, shape = self.sharding.split_of(wholes[j])  # each rank's rows, and the shape split along dim 0
            copy_out(whole, shape, rows, 0, parts)
            assembled.append(whole)
            computed.append(torch.empty_like(parts))

        def padded(k: int, result: torch.Tensor) -> None:  # the result's rows as each rank's shard holds them
            rows, shape = self.sharding.split_of(wholes[exchange.mine[k]])
            copy_in(computed[k], shape, rows, 0, result)

        self.inner.apply(owned, lambda k: assembled[k], lambda k, whole: function(indices[exchange.mine[k]], whole),
                         dtype, padded)
        for j, part in enumerate(exchange.from_owners(computed)):
            use(indices[j], part.view_as(shards[j]))
        self.sharding.bytes_moved += exchange.bytes_moved
