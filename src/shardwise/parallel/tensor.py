"""Tensor parallel, ours (`tensor`): every block of the model split over the tp ranks of one model
replica (Megatron-LM's scheme), laid out by the model family's plan (models/plans.py), so each
rank holds and computes 1/tp of every block.

The plan names each block's tensor-parallel regions (attention, the MLP): a module whose input
enters column-parallel layers and whose output leaves a row-parallel layer.
- Column-parallel layer: the weight's output features split; each rank computes its slice of the
  output from the whole input. A layer computing q, k and v at once has each of the three split
  on its own, so a rank holds the same heads of each; Llama's separate q, k and v are split by
  heads and by key/value heads alike, so the query heads of a rank find their key/value heads on it.
- Row-parallel layer: the weight's input features split; each rank multiplies its slice of the
  input and `reduce_from_tp` (all-reduce forward, identity backward) sums the partial outputs.
  Its bias is added once, after the sum.
- A region's input enters through `copy_to_tp` (identity forward, all-reduce backward): every
  rank's column layers used the whole input, so its gradient is the sum of theirs.
- Attention runs on this rank's heads without talking: it counts them from its layers' outputs
  (the plan divides by tp whatever sizes a family's attention keeps instead, GPT-2's).
So a block's forward has two all-reduces (after attention, after the MLP), and so does its
backward (at the two region inputs), each of one activation's size.

Sequence parallel (`parallel.sequence_parallel`; Korthikanti et al. 2022, Megatron-LM's): between
the regions, the residual stream and the norms are split along the sequence too, each rank
holding seq/tp positions of them. A region's input is all-gathered along the sequence (its
gradient reduce-scattered) and the row-parallel layer reduce-scatters its partial outputs instead
of all-reducing them (its gradient all-gathered): the same bytes on the wire as the all-reduces
they replace, a ring all-reduce being a reduce-scatter and an all-gather. The column-parallel
layers keep for backward only this rank's part of their input and all-gather it again there,
once per region (one all-gather more per region, for the memory), so a block saves 1/tp of
everything it saves on one device. The stream is split before the first block and
gathered after the last (their gradients the converse), so embeddings, final norm, head and loss
see the whole sequence. The block's parameters every rank holds whole (norms, the row layers'
biases) then get gradients from this rank's positions only: the strategy sums them over the tp
ranks after backward (`MeshStrategy.synchronize_gradients`). So it does, with or without sequence
parallel, for a parameter a region holds whole besides its layers (Qwen3's q and k norms, shared
by the heads): its gradient comes from this rank's heads only.

Embeddings, norms outside the blocks, the head and the loss are *replicated*, not
vocabulary-parallel: every tp rank computes them on the same activations, so their gradients come
out equal on every rank without communication. With the byte-level vocabulary of 256, splitting
them would save little and add two collectives.

Applied from outside: `parallelize_blocks` swaps the regions' layers for these, keeping parameter
names, so the state dict reads like the plain model's (shards instead of whole tensors;
`full_tensors` joins them). In checkpoints each shard is a DTensor of the whole parameter,
`Shard(dim)` over the tp ranks (`TensorShard.as_dtensor`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.models.plans import ParallelPlan, PlanError, Region, StackedExperts, has_module, matches
from shardwise.parallel.float8 import float8_linear, float8_split
from shardwise.parallel.module_input import module_input, with_input
from shardwise.parallel.tensor_group import (
    Ctx,
    GatherAlong,
    SplitAlong,
    TensorParallelGroup,
    TensorShard,
    copy_to_tp,
    reduce_from_tp,
)


class EnterRegion(torch.autograd.Function):
    """A region's input under sequence parallel: all-gather of the sequence forward; backward,
    reduce-scatter of the gradient (each rank's column layers give part of it), after which the
    region's input gathered again for its column layers' backward is dropped."""

    @staticmethod
    def forward(ctx: Ctx, x: torch.Tensor, region: TensorParallelRegion) -> torch.Tensor:
        ctx.region = region
        return region.tp.gather(x)

    @staticmethod
    def backward(ctx: Ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.region.regathered = None
        return ctx.region.tp.reduce_scatter_sequence(grad), None


class LeaveRegion(torch.autograd.Function):
    """A row-parallel layer's partial outputs under sequence parallel: reduce-scatter along the
    sequence forward, all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx: Ctx, x: torch.Tensor, tp: TensorParallelGroup) -> torch.Tensor:
        ctx.tp = tp
        return tp.reduce_scatter_sequence(x)

    @staticmethod
    def backward(ctx: Ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.tp.gather(grad), None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, in_out: bool) -> torch.Tensor:
    """x W^T + b for an nn.Linear's [out, in] weight, x W + b for a Conv1D's [in, out] one."""
    return F.linear(x, weight.t() if in_out else weight, bias)


def split_linear(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A split layer's matmul: `linear`, or in float8 where the layer split was a float8 one
    (parallel.float8; its scales spanning the split: float8.py's Float8Split)."""
    if layer.float8 is not None:
        return float8_linear(x, layer.weight, bias, layer.float8)
    return linear(x, layer.weight, bias, layer.in_out)


class ColumnOverSequence(torch.autograd.Function):
    """A column-parallel layer over its region's gathered input that saves, for the weight's
    gradient, only this rank's part of that input, gathering it again in backward (once per
    region: the region keeps it for its other column layers)."""

    @staticmethod
    def forward(ctx: Ctx, full: torch.Tensor, local: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                layer: ColumnParallelLinear) -> torch.Tensor:
        out = linear(full, weight, bias, layer.in_out)  # the input cast to the weight's dtype under autocast
        ctx.save_for_backward(local, weight)
        ctx.layer, ctx.dtype, ctx.full_dtype = layer, out.dtype, full.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx: Ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        local, weight = ctx.saved_tensors
        region = ctx.layer.region
        if region.regathered is None or region.regathered[0] is not local:
            region.regathered = (local, region.tp.gather(local))
        # In the forward's compute dtype, each gradient cast back to its tensor's, as autocast's matmul.
        x, w = region.regathered[1].to(ctx.dtype).flatten(0, -2), weight.to(ctx.dtype)
        g = grad.to(ctx.dtype)
        flat = g.flatten(0, -2)
        if ctx.layer.in_out:
            grad_x, grad_w = g @ w.t(), x.t() @ flat
        else:
            grad_x, grad_w = g @ w, flat.t() @ x
        grad_b = None if ctx.bias_dtype is None else flat.sum(0).to(ctx.bias_dtype)
        return grad_x.to(ctx.full_dtype), None, grad_w.to(weight.dtype), grad_b, None


class TensorParallelRegion:
    """A region's input side: a hook that hands its module the input its column layers take (through
    `copy_to_tp`, or gathered along the sequence), and under sequence parallel the two forms of the
    input of the forward under way, for those layers, and the one gathered again in backward."""

    def __init__(self, module: nn.Module, tp: TensorParallelGroup, sequence_parallel: bool) -> None:
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.local: torch.Tensor | None = None  # this rank's part of the sequence ...
        self.full: torch.Tensor | None = None  # ... and all of it, while the region's forward runs
        self.regathered: tuple[torch.Tensor, torch.Tensor] | None = None  # (local, full) in backward
        module.register_forward_pre_hook(self._enter, with_kwargs=True)
        if sequence_parallel:
            module.register_forward_hook(self._leave)

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        x = module_input(module, args, kwargs)
        if not self.sequence_parallel:
            return with_input(module, args, kwargs, copy_to_tp(x, self.tp))
        self.local, self.full = x, EnterRegion.apply(x, self)
        return with_input(module, args, kwargs, self.full)

    def _leave(self, module: nn.Module, args: tuple, output: object) -> None:
        self.local = self.full = None  # the gathered input is not kept past the forward


class ColumnParallelLinear(nn.Module):
    """`layer` (nn.Linear, or Conv1D with `in_out`) with its output features split over the tp
    ranks: this rank's slice of the output."""

    def __init__(self, layer: nn.Module, parts: int, region: TensorParallelRegion, in_out: bool) -> None:
        super().__init__()
        self.region, self.in_out = region, in_out
        self.float8 = float8_split(layer, region.tp.group, column=True)
        rank, size = region.tp.rank, region.tp.size
        self.shards = {"weight": TensorShard(1 if in_out else 0, parts), "bias": TensorShard(0, parts)}
        self.weight = _split(layer.weight, self.shards["weight"], rank, size)
        bias = layer.bias
        self.bias = None if bias is None else _split(bias, self.shards["bias"], rank, size)
        # LoRA's adapter (lora.py): B's rows split as the weight's, A whole (its gradient partial over tp)
        self.lora = _split_adapter(layer, "B", self.shards, TensorShard(0, parts), rank, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.region.sequence_parallel:
            y = split_linear(self, x, self.bias)
            return y if self.lora is None else y + self.lora(x)
        if x is not self.region.full:
            raise RuntimeError("sequence parallel: a column-parallel layer was called on something other than its "
                               "region's input; the plan's region must be the module whose input all its column "
                               "layers take")
        weight, bias = self.weight, self.bias
        device = x.device.type
        if torch.is_autocast_enabled(device):  # cast as autocast's matmul does, its weight copy kept for backward
            dtype = torch.get_autocast_dtype(device)
            weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
        y = ColumnOverSequence.apply(x, self.region.local, weight, bias, self)
        return y if self.lora is None else y + self.lora(x)  # over the gathered sequence, as the layer


class RowParallelLinear(nn.Module):
    """`layer` with its input features split over the tp ranks: takes this rank's slice of the input,
    returns the whole output summed over ranks (under sequence parallel, this rank's part of the
    sequence of it)."""

    def __init__(self, layer: nn.Module, tp: TensorParallelGroup, sequence_parallel: bool, in_out: bool) -> None:
        super().__init__()
        self.tp, self.sequence_parallel, self.in_out = tp, sequence_parallel, in_out
        self.float8 = float8_split(layer, tp.group, column=False)
        rank, size = tp.rank, tp.size
        self.shards = {"weight": TensorShard(0 if in_out else 1)}  # the bias is added after the sum: replicated
        self.weight = _split(layer.weight, self.shards["weight"], rank, size)
        bias = layer.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
        # LoRA's adapter: A's columns split as the weight's, B whole (its gradient partial over tp); its
        # update joins the partial output before the sum, which is then B's update of the whole input
        self.lora = _split_adapter(layer, "A", self.shards, TensorShard(1), rank, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = split_linear(self, x, None)
        if self.lora is not None:
            partial = partial + self.lora(x)
        y = LeaveRegion.apply(partial, self.tp) if self.sequence_parallel else reduce_from_tp(partial, self.tp)
        return y if self.bias is None else y + self.bias


class GatheredColumnLinear(nn.Module):
    """`layer` with its output features split over the tp ranks and gathered after (transformers'
    `colwise_gather_output`): every rank gets the whole output; the input, the same on every rank,
    has its gradient summed over them (each rank's is its features' share)."""

    def __init__(self, layer: nn.Module, tp: TensorParallelGroup, in_out: bool) -> None:
        super().__init__()
        self.tp, self.in_out = tp, in_out
        self.float8 = float8_split(layer, tp.group, column=True)
        self.shards = {"weight": TensorShard(1 if in_out else 0), "bias": TensorShard(0)}
        self.weight = _split(layer.weight, self.shards["weight"], tp.rank, tp.size)
        bias = layer.bias
        self.bias = None if bias is None else _split(bias, self.shards["bias"], tp.rank, tp.size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return GatherAlong.apply(split_linear(self, copy_to_tp(x, self.tp), self.bias), self.tp, -1)


class SplitInputRowLinear(nn.Module):
    """`layer` with its input features split over the tp ranks, each taking its slice of an input
    every rank holds whole (transformers' `rowwise_split_input`): the partial outputs summed, the
    bias added after; the input's gradient gathered whole on every rank."""

    def __init__(self, layer: nn.Module, tp: TensorParallelGroup, in_out: bool) -> None:
        super().__init__()
        self.tp, self.in_out = tp, in_out
        self.float8 = float8_split(layer, tp.group, column=False)
        self.shards = {"weight": TensorShard(0 if in_out else 1)}
        self.weight = _split(layer.weight, self.shards["weight"], tp.rank, tp.size)
        bias = layer.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(split_linear(self, SplitAlong.apply(x, self.tp, -1), None), self.tp)
        return y if self.bias is None else y + self.bias


def split_alone(block: nn.Module, name: str, plan: ParallelPlan, tp: TensorParallelGroup) -> dict[int, TensorShard]:
    """Split `block`'s layer `name`, one of the plan's layers split on their own (`gathered`,
    `split_input`), in place. Returns how each new parameter is split, by id."""
    layer, in_out = block.get_submodule(name), plan.weights_in_out
    if getattr(layer, "lora", None) is not None:
        raise PlanError(f"{plan.family}: {name} carries LoRA adapters; shardwise does not split adapters on a layer "
                        "split on its own yet (leave it out of lora.targets)")
    gathered = name in plan.gathered
    width = layer.weight.shape[(1 if in_out else 0) if gathered else (0 if in_out else 1)]
    if width % tp.size:
        raise PlanError(f"tensor parallel over {tp.size} ranks: must divide {name}'s {width} "
                        f"{'output' if gathered else 'input'} features ({plan.family} plan)")
    split = GatheredColumnLinear(layer, tp, in_out) if gathered else SplitInputRowLinear(layer, tp, in_out)
    _put(block, name, split)
    return _shards_of(split)


class VocabParallelEmbedding(nn.Module):
    """An embedding with its vocabulary (rows) split over the tp ranks (transformers'
    `embedding_rowwise`, Megatron's vocabulary-parallel embedding): each rank looks up the ids in
    its rows, the others' read as zeros, and the results are summed; each row's gradient stays on
    the rank that holds it."""

    def __init__(self, embedding: nn.Embedding, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp, self.shards = tp, {"weight": TensorShard(0)}
        rows = embedding.num_embeddings // tp.size
        self.start, self.stop = tp.rank * rows, (tp.rank + 1) * rows
        self.weight = _split(embedding.weight, self.shards["weight"], tp.rank, tp.size)
        padding = embedding.padding_idx
        self.padding_idx = padding - self.start if padding is not None and self.start <= padding < self.stop else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.stop)
        found = F.embedding(torch.where(outside, 0, ids - self.start), self.weight, self.padding_idx)
        return reduce_from_tp(found.masked_fill(outside.unsqueeze(-1), 0), self.tp)


def split_vocabulary(model: nn.Module, plan: ParallelPlan, tp: TensorParallelGroup) -> dict[int, TensorShard]:
    """Split `model`'s embeddings the plan names (`vocabulary`) along their rows, in place; a head
    tied to one (the same weight) becomes its column-parallel layer over the vocabulary, the logits
    gathered, sharing the split weight. Returns how each new parameter is split, by id."""
    shards: dict[int, TensorShard] = {}
    named = dict(model.named_modules())
    for pattern in plan.vocabulary:
        name = next((n for n in named if n and matches(n, pattern)), None)
        if name is None:
            continue  # a pipeline stage without it
        embedding = named[name]
        if embedding.num_embeddings % tp.size or embedding.max_norm is not None or embedding.sparse:
            raise PlanError(f"{plan.family}: {name} ({embedding.num_embeddings} rows) does not split over {tp.size} "
                            "tp ranks along its vocabulary (rows not divisible, or max_norm or sparse set)")
        split = VocabParallelEmbedding(embedding, tp)
        tied = [(n, m) for n, m in named.items()
                if m is not embedding and getattr(m, "weight", None) is embedding.weight]
        _put(model, name, split)
        shards |= _shards_of(split)
        for head_name, head in tied:
            if type(head) is not nn.Linear or head.bias is not None:
                raise PlanError(f"{plan.family}: {head_name} shares {name}'s weight but is no nn.Linear without a "
                                "bias; shardwise splits a tied head as a column-parallel layer over the vocabulary")
            gathered = GatheredColumnLinear(head, tp, in_out=False)
            gathered.weight = split.weight  # the tie kept: one shard, both uses
            _put(model, head_name, gathered)
    return shards


def split_experts(module: nn.Module, stacked: StackedExperts, plan: ParallelPlan, tp: TensorParallelGroup
                  ) -> dict[int, TensorShard]:
    """Split a module of stacked experts (`plan.experts`) over the tp ranks, in place: each stacked
    parameter (and its bias) along the experts' hidden features, so each rank computes every expert
    on its slice of them, as a region computes its heads. Its floating-point inputs (the tokens,
    their routing weights) enter as a region's does (`copy_to_tp`), its partial output is summed
    (`reduce_from_tp`). Returns how each new parameter is split, by id."""
    shards: dict[int, TensorShard] = {}
    for name, dim, parts in stacked.params:
        for key, split in ((name, TensorShard(dim, parts)), (f"{name}_bias", TensorShard(1, parts))):
            param = getattr(module, key, None)
            if param is None:
                continue
            if param.shape[split.dim] % (split.parts * tp.size):
                raise PlanError(f"tensor parallel over {tp.size} ranks: must divide the {param.shape[split.dim]} "
                                f"hidden features of {stacked.module}.{key} ({plan.family} plan)")
            shards |= _split_in_place(module, key, split, tp)

    def enter(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        def each(x: object) -> object:
            return copy_to_tp(x, tp) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
        return tuple(map(each, args)), {k: each(v) for k, v in kwargs.items()}

    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(lambda module, args, out: reduce_from_tp(out, tp))
    return shards


def _split_in_place(module: nn.Module, key: str, split: TensorShard, tp: TensorParallelGroup
                    ) -> dict[int, TensorShard]:
    """`module`'s parameter `key` replaced by this rank's shard of it; how the shard is split, by id."""
    shard = _split(getattr(module, key), split, tp.rank, tp.size)
    setattr(module, key, shard)
    return {id(shard): split}


def _shards_of(layer: nn.Module) -> dict[int, TensorShard]:
    """How each split parameter of a layer made here (its `shards`, by name) is split, by id."""
    return {id(param): layer.shards[key] for key, param in layer.named_parameters() if key in layer.shards}


def _split(param: nn.Parameter, split: TensorShard, rank: int, size: int) -> nn.Parameter:
    """This rank's shard of `param`, a parameter that trains if `param` does (LoRA freezes the weights)."""
    return nn.Parameter(split.take(param.detach(), rank, size), requires_grad=param.requires_grad)


def _split_adapter(layer: nn.Module, matrix: str, shards: dict[str, TensorShard], split: TensorShard, rank: int,
                   size: int) -> nn.Module | None:
    """`layer`'s LoRA adapter (its `lora` child, where it has one) with `matrix` ("A" or "B") split
    as `split` says, noted in `shards` as the layer's own parameters are; None without one."""
    adapter = getattr(layer, "lora", None)
    if adapter is None:
        return None
    setattr(adapter, matrix, _split(getattr(adapter, matrix), split, rank, size))
    shards[f"lora.{matrix}"] = split
    return adapter


def _attribute(obj: object, path: str) -> object:
    return functools.reduce(getattr, path.split("."), obj)


def _check_heads(region: Region, module: nn.Module, family: str, size: int) -> None:
    for kind, path in (("heads", region.heads), ("key/value heads", region.kv_heads or region.heads)):
        count = None if path is None else _attribute(module, path)
        if count is not None and count % size:
            raise PlanError(f"tensor parallel over {size} ranks: must divide the attention's {count} {kind} "
                            f"({family} plan: {region.module}.{path}); each rank computes an equal share")


def _check_width(width: int, size: int, region: Region, name: str, what: str, family: str) -> None:
    if width % size:
        raise PlanError(f"tensor parallel over {size} ranks: must divide {region.module}.{name}'s {width} {what} "
                        f"({family} plan)")


def _put(module: nn.Module, name: str, layer: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(module.get_submodule(parent), attr, layer)


def split_region(module: nn.Module, region: Region, plan: ParallelPlan, tp: TensorParallelGroup,
                 sequence_parallel: bool) -> dict[int, TensorShard]:
    """Split one region of a block over the tp ranks, in place: its column and row layers replaced by
    this rank's shards, its input hooked, its per-rank sizes divided. Returns how each new
    parameter is split, by id."""
    size, in_out = tp.size, plan.weights_in_out
    _check_heads(region, module, plan.family, size)
    entry = TensorParallelRegion(module, tp, sequence_parallel)
    splits: dict[str, ColumnParallelLinear | RowParallelLinear] = {}
    shards: dict[int, TensorShard] = {}
    for column in region.columns:
        param = getattr(module, column.name, None)
        if isinstance(param, nn.Parameter):  # a bare per-head parameter (attention sinks): split as the heads
            _check_width(param.shape[0] // column.parts, size, region, column.name, "entries", plan.family)
            shards |= _split_in_place(module, column.name, TensorShard(0, column.parts), tp)
            continue
        layer = module.get_submodule(column.name)
        _check_width(layer.weight.shape[1 if in_out else 0] // column.parts, size, region, column.name,
                     "output features" + (f" per part (of {column.parts})" if column.parts > 1 else ""), plan.family)
        splits[column.name] = ColumnParallelLinear(layer, column.parts, entry, in_out)
    row = module.get_submodule(region.row)
    _check_width(row.weight.shape[0 if in_out else 1], size, region, region.row, "input features", plan.family)
    splits[region.row] = RowParallelLinear(row, tp, sequence_parallel, in_out)
    for name, split in splits.items():
        _put(module, name, split)
    for attribute in region.per_rank:
        owner, _, leaf = attribute.rpartition(".")
        target = _attribute(module, owner) if owner else module
        setattr(target, leaf, getattr(target, leaf) // size)
    for split in splits.values():
        shards |= _shards_of(split)
    return shards


def split_sequence_around(blocks: list[nn.Module], tp: TensorParallelGroup) -> None:
    """Sequence parallel's ends: this rank's part of the sequence enters the first block, the whole
    sequence is gathered from the last."""

    def split(block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return with_input(block, args, kwargs, SplitAlong.apply(module_input(block, args, kwargs), tp, 1))

    def gather(block: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return GatherAlong.apply(out, tp, 1)

    blocks[0].register_forward_pre_hook(split, with_kwargs=True)
    blocks[-1].register_forward_hook(gather)


class BlockSplitter:
    """Splits a model's blocks over the tp ranks one at a time, as a plan lays them out
    (`parallelize_blocks`' state between its blocks)."""

    def __init__(self, plan: ParallelPlan, tp: TensorParallelGroup, sequence_parallel: bool) -> None:
        alone = plan.gathered + plan.split_input + tuple(experts.module for experts in plan.experts)
        if sequence_parallel and alone:
            raise PlanError(f"{plan.family}: sequence parallel does not compose with {alone[0]} split on its own, "
                            "which takes its whole input")
        self.plan, self.tp, self.sequence_parallel = plan, tp, sequence_parallel
        self.shards: dict[int, TensorShard] = {}  # how each new parameter is split, by id
        self.blocks: list[nn.Module] = []

    def split(self, block: nn.Module) -> None:
        """Split every region of `block` in place (its layers replaced by this rank's shards)."""
        for region in self.plan.regions_in(block):
            self.shards |= split_region(block.get_submodule(region.module), region, self.plan, self.tp,
                                        self.sequence_parallel)
        for name in self.plan.gathered + self.plan.split_input:
            if not self.plan.where_present or has_module(block, name):
                self.shards |= split_alone(block, name, self.plan, self.tp)
        regions = self.plan.regions_in(block)
        for experts in self.plan.experts:
            if not has_module(block, experts.module):
                continue
            if any(experts.module.startswith(f"{region.module}.") for region in regions):  # its input is the region's
                raise PlanError(f"{self.plan.family}: the experts {experts.module} are inside a region; shardwise "
                                "splits a module of experts only outside the regions")
            self.shards |= split_experts(block.get_submodule(experts.module), experts, self.plan, self.tp)
        self.blocks.append(block)

    def finish(self) -> list[nn.Parameter]:
        """After the last block: under sequence parallel, split the sequence before the first block
        and gather it after the last. Returns the blocks' parameters every rank holds whole whose
        gradients are partial, each rank's share of the sum: under sequence parallel all of them
        (this rank's positions only); otherwise those inside a region other than its row layer's
        (Qwen3's per-head q and k norms: this rank's heads only; LoRA's A beside a column layer and B
        beside a row layer: this rank's share of the update)."""
        if self.sequence_parallel:
            split_sequence_around(self.blocks, self.tp)
            return [p for block in self.blocks for p in block.parameters() if id(p) not in self.shards]
        return [p for block in self.blocks for region in self.plan.regions_in(block)
                for name, p in block.get_submodule(region.module).named_parameters()
                if id(p) not in self.shards and (not name.startswith(f"{region.row}.") or name.endswith(".lora.B"))]


def parallelize_blocks(blocks: list[nn.Module], plan: ParallelPlan, tp: TensorParallelGroup,
                       sequence_parallel: bool,
                       materialised: Callable[[nn.Module], AbstractContextManager] | None = None,
                       model: nn.Module | None = None) -> tuple[dict[int, TensorShard], list[nn.Parameter]]:
    """Split every region of `blocks` (consecutive blocks of a model, or of one pipeline stage) over
    the tp ranks as `plan` lays them out, in place; under sequence parallel, split the sequence before
    the first block and gather it after the last. The one function that applies the tp split: `tensor`,
    `pipeline` and the sharded strategies compose through it, and the planner splits shapes with it.
    Each block is split inside `materialised(block)` where given: what a composer does around the
    split (a meta-built model's block made real for it and the whole freed after; fsdp's unit
    sharded once split), so a rank holds one whole block at a time. Given the `model` (real outside
    the blocks), its embeddings the plan splits along their vocabulary are split first
    (`split_vocabulary`). Returns how each new parameter is split (by id), and the blocks'
    parameters every rank holds whole whose gradients are partial over tp (`BlockSplitter.finish`)."""
    splitter = BlockSplitter(plan, tp, sequence_parallel)
    if model is not None:
        splitter.shards |= split_vocabulary(model, plan, tp)
    for block in blocks:
        with materialised(block) if materialised is not None else nullcontext():
            splitter.split(block)
    return splitter.shards, splitter.finish()
