"""Cutting a model into pipeline stages: where the cuts go, and a stage as the model itself.

The model's blocks, as its family's parallel plan names them (models/plans.py), are cut into
S = P x V contiguous stages, balanced by parameter count (`balanced_split`, `block_costs`) or
where the user says; the schedule puts them on the P ranks of a pp group (schedules.py: stage k
on rank k mod P; on a V, stages k and 2P-1-k on rank k). The first stage also holds the
embeddings, the last the final norm and the head, as the plan says. A stage is the model itself
with the other stages' modules removed (`Stage`), running the model's own forward; a rank with
several stages cuts each from its own copy of the model's module tree (`separate`), which shares
everything else. So a stage's parameters live only on its rank, but for a head tied to the token
embedding (the GPT's, GPT-2's), which the first and the last stage both hold.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
from collections.abc import Iterable

import torch
from torch import nn

from shardwise.models.plans import Located
from shardwise.parallel.module_input import with_input


def balanced_split(sizes: list[int], stages: int) -> list[int]:
    """Where stages 2..P start in `sizes` (a cost per block), so that the costliest stage costs as
    little as it can; every stage gets at least one block."""
    prefix = [0, *itertools.accumulate(sizes)]

    @functools.cache
    def best(start: int, parts: int) -> tuple[int, tuple[int, ...]]:
        """(cost of the costliest stage, stage starts) for blocks start.. in `parts` stages."""
        if parts == 1:
            return prefix[-1] - prefix[start], ()
        options = []
        for end in range(start + 1, len(sizes) - parts + 2):
            rest, starts = best(end, parts - 1)
            options.append((max(prefix[end] - prefix[start], rest), (end, *starts)))
        return min(options)

    return list(best(0, stages)[1])


def block_costs(located: Located) -> list[int]:
    """Parameters per block, the first counting the first stage's embeddings and the last the last
    stage's final norm and head (a head tied to the embedding again: the last stage holds a copy)."""
    counts = [sum(p.numel() for p in block.parameters()) for block in located.blocks]
    counts[0] += sum(p.numel() for m in located.first.values() for p in m.parameters())
    counts[-1] += sum(p.numel() for m in located.last.values() for p in m.parameters())
    return counts


def stage_holds(located: Located, bounds: list[tuple[int, int]]) -> list[set[int]]:
    """Ids of the state tensors each stage of blocks [start, stop) holds: its blocks', the first
    stage's embeddings, the last stage's final norm and head, and on every stage whatever else lies
    outside the blocks."""

    def ids(modules: Iterable[nn.Module]) -> set[int]:
        return {id(t) for m in modules for t in m.state_dict(keep_vars=True).values()}

    first, last = ids(located.first.values()), ids(located.last.values())
    everywhere = ids([located.model]) - ids(located.blocks) - first - last
    return [ids(located.blocks[start:stop]) | everywhere | (first if s == 0 else set())
            | (last if s == len(bounds) - 1 else set()) for s, (start, stop) in enumerate(bounds)]


class KeptLayers(nn.ModuleList):
    """Some entries of a model's ModuleList of blocks under their own indices (`layers.5`), so that a
    stage's state dict names them as the whole model's does; iterated, sliced and indexed by
    position, as a model's forward uses its list."""

    def __init__(self, blocks: dict[int, nn.Module]) -> None:
        super().__init__()
        for index, block in blocks.items():
            self.add_module(str(index), block)

    def __getitem__(self, idx: int | slice) -> nn.Module:
        kept = list(self._modules.values())
        return nn.ModuleList(kept[idx]) if isinstance(idx, slice) else kept[idx]


class EmptyEmbedding(nn.Module):
    """Stands in, on a later stage, for an embedding only the first stage holds: zeros of its width
    and dtype, so the model's code before its first block runs as it is, on shapes alone; the
    stage's first block then takes the activations received in their place."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.width, self.dtype = embedding.embedding_dim, embedding.weight.dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.width, dtype=self.dtype, device=ids.device)


class Stage(nn.Module):
    """One pipeline stage: the model itself, with the other stages' modules removed. It keeps its
    blocks [start, stop) under their own names, the first stage's embeddings if it is the first and
    the last stage's final norm and head if it is the last; the others' are replaced by stand-ins
    without parameters (`EmptyEmbedding`, identities). The model's own forward runs: the first
    stage's from token ids, a later stage's from activations, which enter at its first block in
    place of what the stand-ins made; to logits on the last stage, to activations on the others."""

    def __init__(self, located: Located, start: int, stop: int, first: bool, last: bool) -> None:
        super().__init__()
        self.model, self.first, self.last = located.model, first, last
        self._entering: torch.Tensor | None = None  # a later stage's activations, during its forward
        blocks = located.blocks
        located.replace(located.layers, KeptLayers({i: blocks[i] for i in range(start, stop)}))
        if not first:
            for name, embedding in located.first.items():
                located.replace(name, EmptyEmbedding(embedding))
            blocks[start].register_forward_pre_hook(self._enter, with_kwargs=True)
        if not last:
            for name in located.last:
                located.replace(name, nn.Identity())

    def _enter(self, block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return with_input(block, args, kwargs, self._entering)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """First stage: token ids -> activations; last: activations -> logits; others: activations.
        A model returning an output object (transformers') gives its `logits`."""
        if not self.first:  # the embeddings' stand-ins need the token ids' shape only
            self._entering, x = x, torch.zeros(x.shape[:-1], dtype=torch.long, device=x.device)
        try:
            out = self.model(x)
        finally:
            self._entering = None
        return out if isinstance(out, torch.Tensor) else out.logits


def separate(located: Located) -> Located:
    """The same model found in a copy of its module tree along the paths a `Stage` replaces (the
    blocks' list, the first and the last stage's modules), every other module shared: cutting one
    stage from the copy leaves the original whole, so that one rank can cut several stages."""
    def shallow(module: nn.Module) -> nn.Module:
        twin = copy.copy(module)
        twin._modules = dict(module._modules)  # its own children: replacing one leaves the original's
        return twin

    copies = {"": shallow(located.model)}
    for name in (located.layers, *located.first, *located.last):
        path = name.split(".")[:-1]
        for depth in range(1, len(path) + 1):
            prefix, parent = ".".join(path[:depth]), ".".join(path[:depth - 1])
            if prefix not in copies:
                copies[prefix] = shallow(copies[parent]._modules[path[depth - 1]])
                copies[parent]._modules[path[depth - 1]] = copies[prefix]
    return dataclasses.replace(located, model=copies[""], first=dict(located.first), last=dict(located.last))
