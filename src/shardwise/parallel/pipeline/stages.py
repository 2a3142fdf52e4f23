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
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from shardwise.models.plans import Located, PlanError
from shardwise.parallel.module_input import module_input, with_input


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


class OtherStageBlock(nn.Module):
    """Stands in, in a stage's list of blocks, for a block another stage holds: it hands its input
    on. The list keeps every block's index, so that a model's forward that looks a block's kind up
    by its place (`config.layer_types[i]` over `enumerate(self.layers)`) finds each block's own; a
    later stage's stand-ins before its first block compute nothing that is kept."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.input_of = functools.partial(module_input, block)

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        return self.input_of(args, kwargs)


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
    blocks [start, stop) under their own names (the others' places held by `OtherStageBlock`s), the
    first stage's embeddings if it is the first and
    the last stage's final norm and head if it is the last; the others' are replaced by stand-ins
    without parameters (`EmptyEmbedding`, identities). The model's own forward runs: the first
    stage's from token ids, a later stage's from activations, which enter at its first block in
    place of what the stand-ins made; to logits on the last stage. An earlier stage's forward ends
    at its last block, whose output is what it sends on: what the model does after its blocks (a
    scale or a soft cap of the logits) is the last stage's alone."""

    def __init__(self, located: Located, start: int, stop: int, first: bool, last: bool) -> None:
        super().__init__()
        self.model, self.first, self.last = located.model, first, last
        self._entering: torch.Tensor | None = None  # a later stage's activations, during its forward
        self._leaving: list[torch.Tensor] = []  # an earlier stage's: its last block's output, in forward
        self._last_block = None if last else located.blocks[stop - 1]
        blocks = located.blocks
        located.replace(located.layers, nn.ModuleList([block if start <= i < stop else OtherStageBlock(block)
                                                       for i, block in enumerate(blocks)]))
        if not first:
            for name, embedding in located.first.items():
                located.replace(name, EmptyEmbedding(embedding))
            blocks[start].register_forward_pre_hook(self._enter, with_kwargs=True)
        if not last:
            for name in located.last:
                located.replace(name, nn.Identity())

    def _leave(self, block: nn.Module, args: tuple, output: torch.Tensor | tuple) -> None:
        self._leaving.append(output if isinstance(output, torch.Tensor) else output[0])
        raise _StageEnd

    def _enter(self, block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return with_input(block, args, kwargs, self._entering)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """First stage: token ids -> activations; last: activations -> logits; others: activations.
        A model returning an output object (transformers') gives its `logits`."""
        if not self.first:  # the embeddings' stand-ins need the token ids' shape only
            self._entering, x = x, torch.zeros(x.shape[:-1], dtype=torch.long, device=x.device)
        # The last block's output once every other hook of it has run (sequence parallel's gather of the
        # sequence): hooked for this forward only, after them
        leaving = self._last_block.register_forward_hook(self._leave) if self._last_block is not None else None
        try:
            out = self.model(x)
        except _StageEnd:
            return self._leaving.pop()
        finally:
            self._entering = None
            if leaving is not None:
                leaving.remove()
        return out if isinstance(out, torch.Tensor) else out.logits


class _StageEnd(Exception):
    """Raised by an earlier stage's last block once it has its output: the forward stops there."""


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


class _FromFirstStage(TorchFunctionMode):
    """Follows, through a forward, which tensors are computed from what the first stage's modules
    output (the embeddings): those a later stage has no values for."""

    def __init__(self) -> None:
        super().__init__()
        self.derived: dict[int, torch.Tensor] = {}  # id -> the tensor, kept so that its id is not reused

    def mark(self, outputs: object) -> None:
        for tensor in tree_flatten(outputs)[0]:
            if isinstance(tensor, torch.Tensor):
                self.derived[id(tensor)] = tensor

    def holds(self, value: object) -> bool:
        return isinstance(value, torch.Tensor) and self.derived.get(id(value)) is value

    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> object:
        out = func(*args, **(kwargs or {}))
        if any(self.holds(value) for value in tree_flatten((args, kwargs))[0]):
            self.mark(out)
        return out


def check_stage_boundaries(located: Located, tokens: torch.Tensor) -> None:
    """What a cut between two blocks sends is all the later stage needs: one forward on `tokens`
    (fake tensors do) finds each block taking activations shaped [batch, seq, width] (the first
    embedding's width), returning a tensor of that shape, and taking nothing else computed from the
    first stage's modules (a per-layer embedding, a second stream of activations between blocks),
    which a later stage would have only as its stand-ins' zeros. PlanError naming the first that
    does not."""
    family, blocks = located.plan.family, located.blocks
    width = next(iter(located.first.values())).embedding_dim
    shape = (*tokens.shape, width)
    follow, found = _FromFirstStage(), []

    def entering(block: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = module_input(block, args, kwargs)
        others = [value for value in tree_flatten((args, kwargs))[0] if value is not hidden]
        if not isinstance(hidden, torch.Tensor) or tuple(hidden.shape) != shape:
            found.append(f"takes activations of shape {tuple(getattr(hidden, 'shape', ()))}, not [batch, seq, "
                         f"width] = {shape}")
        elif any(follow.holds(value) for value in others):
            found.append("takes more than the activations from the blocks before it (a tensor computed from the "
                         "embeddings: a per-layer input or a second stream)")

    def leaving(block: nn.Module, args: tuple, output: object) -> None:
        if not isinstance(output, torch.Tensor) or tuple(output.shape) != shape:
            what = f"a {type(output).__name__}" if not isinstance(output, torch.Tensor) else tuple(output.shape)
            found.append(f"returns {what}, not activations of shape {shape}")

    hooks = [module.register_forward_hook(lambda m, args, out: follow.mark(out)) for module in located.first.values()]
    hooks += [hook for block in blocks for hook in (block.register_forward_pre_hook(entering, with_kwargs=True),
                                                    block.register_forward_hook(leaving))]
    try:
        with follow, torch.no_grad():
            located.model(tokens)
    finally:
        for hook in hooks:
            hook.remove()
    if found:
        raise PlanError(f"{family}: its {type(blocks[0]).__name__} {found[0]}; a pipeline stage sends the next only "
                        "its last block's activations")
