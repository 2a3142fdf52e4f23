"""Sharded data parallel (ZeRO stages 1, 2 and 3): a model's parameters in units, each unit's
sharded over a group of ranks, gathered to compute and reduce-scattered after backward.

Every rank of a unit's group owns 1/N of each of its parameters: its dim-0 chunk (torch.chunk
semantics, zero-padded so every rank's chunk has the same number of rows). These shards are the
master weights, in the master dtype (fp32, or bf16 under bf16-true); an optimizer over them has
its state sharded too. The rest is in the *working* dtype: mixed precision's compute dtype, else
the master dtype.

- Stage 1 (zero1): the whole parameters in the working dtype, in one flat buffer per unit
  (parameter after parameter, each padded to N times its shard's rows; the model's parameters
  are views into it), and the whole gradients in a second buffer laid out alike, which autograd
  accumulates into (`attach_full_grads`). At the end of backward every unit's gradients are
  packed and reduce-scattered (averaged) into this rank's shard gradients, which then live in
  that same gradient buffer (what it held is spent once packed); after the optimizer step the
  updated shards are all-gathered, in the working dtype, into the whole parameters.
- Stage 2 (zero2): as stage 1 without the gradient buffer: each unit's gradients are
  reduce-scattered as soon as its backward is done and freed, into shard gradients of their own.
- Stage 3 (fsdp): parameters are sharded too. A unit's full parameters exist only while it
  computes: one all-gather of its packed shards before its forward, freed after (unless
  `reshard_after_forward` is off), gathered again before its backward, freed after. The next
  unit's all-gather is issued while the current one computes (`prefetch` units ahead), forward
  and backward (`GatherHooks`).

Where the working dtype is the master dtype and nothing is offloaded, stage 1's and 2's shards
are views into the whole parameters' buffer (this rank's rows of each parameter), not copies.
Otherwise they are a buffer of their own. Offloaded (ZeRO-Offload), the master shards, their
gradients and the optimizer state live in host memory; shard gradients are copied there after
the reduce-scatter, and the updated shards go back to the device, cast to the working dtype, as
the all-gather's input.

Freeing releases storage (`untyped_storage().resize_(0)`), not just a reference: autograd keeps
views of parameters (`weight.t()`) for backward, which would otherwise keep the memory alive.
Gathering refills the same storage, so those views see the data again.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardwise.memory import return_free_memory
from shardwise.parallel.comm import all_gather_single, gather_in_place, reduce_scatter_single
from shardwise.parallel.flat import views

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement

HOST = torch.device("cpu")


def sharded_shape(shape: Sequence[int], world: int, fold: bool = False) -> tuple[int, ...]:
    """The shape a parameter is split along dim 0 in, over `world` ranks: its own; or, with `fold`
    (experts [E, d, ...]), where it has 3 or more dims and fewer dim-0 rows than ranks, its first two
    folded into one, [E x d, ...]. A layer's few experts over many ranks are thus split within each
    expert (torchtitan shards them on dim 1) rather than padded to a whole expert a rank: 1 expert
    of [d, f] over 8 ranks is d / 8 rows each, not 1 row on one rank and padding on 7. (One fold
    only: the checkpoint view names a folded shard by expert and row, state_view's _expert_pieces.)"""
    dims = tuple(shape)
    if fold and len(dims) >= 3 and dims[0] < world:
        return (dims[0] * dims[1], *dims[2:])
    return dims


def row_numel(shape: Sequence[int]) -> int:
    """Elements in one dim-0 row of a tensor of `shape` (a parameter's sharded shape)."""
    return math.prod(shape[1:])


def real_rows(shape: Sequence[int], rows: int, rank: int) -> int:
    """Rows of `rank`'s shard of `rows` rows that hold data of a tensor of (sharded) `shape`; the
    rest are padding."""
    return max(0, min(rows, shape[0] - rank * rows))


@dataclass(frozen=True)
class ShardGroup:
    """The ranks a unit's parameters are sharded over: its process group, their number, this rank's
    place among them, and the DTensor layout checkpoints see a shard in. Experts split over expert
    parallel are sharded over the ranks that hold the same experts (`edp`), and their averaged
    gradients scaled by 1/ep: each already sums what every ep rank's tokens contributed."""

    group: dist.ProcessGroup
    world: int
    rank: int
    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    grad_scale: float = 1.0
    experts: bool = False


class GatherCodec(Protocol):
    """A unit gathered in a form of its own (parallel/float8_gather.py: its float8 weights as float8
    bytes): what this rank sends, how every rank's is put back, what the gathered form holds."""

    @property
    def full_bytes(self) -> int: ...

    def pack(self, shards: torch.Tensor) -> torch.Tensor: ...

    def unpack(self, per_rank: torch.Tensor) -> None: ...

    def release(self) -> None: ...


@dataclass
class Unit:
    """Parameters gathered, freed and reduced together, and their shards packed in one buffer."""

    over: ShardGroup
    params: list[nn.Parameter]
    shapes: list[tuple[int, ...]]  # each parameter's shape as it is split along dim 0 (`sharded_shape`)
    rows: list[int]  # rows of each parameter's shard (its padded dim 0 / world size)
    offsets: list[int]  # where each parameter's shard starts among this rank's packed shards
    shard_numel: int  # elements of this rank's packed shards (and of each rank's part of a gather)
    full_dtype: torch.dtype  # the working dtype: what the full parameters are gathered and computed in
    shards: list[nn.Parameter]  # this rank's master shards, shaped [rows, *rest]
    shard_buffer: torch.Tensor | None  # the shards packed, where they are a buffer of their own
    full: torch.Tensor | None = None  # stages 1, 2: the whole parameters, padded, the parameters views into it
    grads: torch.Tensor | None = None  # stage 1: the whole gradients, laid out as `full`; then the shard gradients
    grads_spent: bool = False  # stage 1: `grads` holds shard gradients now, not gradients to accumulate into
    gathered: bool = True
    # Frozen parameters (LoRA's model): gathered and freed as any, never reduce-scattered, their
    # shards trained by no optimizer.
    frozen: bool = False
    root: bool = False  # what no block holds: gathered for the whole of forward and backward
    # Stage 3: how its float8 weights are gathered as float8 bytes (parallel/float8_gather.py), if any
    float8: GatherCodec | None = None
    pending_gather: tuple[dist.Work, torch.Tensor] | None = None
    ready: set[int] = field(default_factory=set)

    # What a step asks of a unit again and again (each gather, each free) is worked out once: on a
    # GPU the step of a small model is bound by the host's work.

    @property
    def full_bytes(self) -> int:
        if self.full is not None:
            return self.full.nbytes
        if self.float8 is not None:
            return self.float8.full_bytes
        return self.full_numel * self.full_dtype.itemsize  # stage 3 keeps its parameters in that dtype

    @functools.cached_property
    def full_numel(self) -> int:
        return sum(p.numel() for p in self.params)

    @functools.cached_property
    def lengths(self) -> list[int]:
        """Elements of each parameter's shard, as packed."""
        return [rows * row_numel(shape) for shape, rows in zip(self.shapes, self.rows, strict=True)]

    @functools.cached_property
    def padded(self) -> bool:
        """Whether some parameter's rows do not divide evenly among the ranks (its last shards hold
        padding): its whole value is then not its shards laid end to end."""
        return any(shape[0] != rows * self.over.world for shape, rows in zip(self.shapes, self.rows, strict=True))

    @functools.cached_property
    def storages(self) -> list[torch.UntypedStorage]:
        """Stage 3: each parameter's storage, freed (resized to nothing) and refilled in place."""
        return [param.untyped_storage() for param in self.params]

    @functools.cached_property
    def per_rank_views(self) -> list[torch.Tensor]:
        """Stage 3, unpadded: each parameter as [world, its shard's elements], what a gather fills
        (views of the storages above, valid whatever their size between gathers)."""
        return [param.data.view(self.over.world, -1) for param in self.params]

    def regions(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's place in `buffer` (laid out as `full`) as [world, shard elements]: row r
        is rank r's shard of it."""
        regions, start, world = [], 0, self.over.world
        for shape, rows in zip(self.shapes, self.rows, strict=True):
            length = rows * row_numel(shape)
            regions.append(buffer[start : start + world * length].view(world, length))
            start += world * length
        return regions


def whole_ranks(shape: Sequence[int], rows: int) -> tuple[int, int]:
    """How many ranks' shards of a tensor of (sharded) `shape` are whole rows of data (the first
    ones), and the rows of data in the next rank's (0 when none is partial); the ranks after hold
    padding only."""
    return divmod(shape[0], rows)


def flatten(params: list[nn.Parameter], shapes: list[tuple[int, ...]], rows: list[int], dtype: torch.dtype,
            world: int, device: torch.device) -> torch.Tensor:
    """One buffer holding `params` in `dtype`, each padded to `world` x its shard's rows, and each
    parameter made a view into it."""
    padded = [world * r * row_numel(shape) for r, shape in zip(rows, shapes, strict=True)]
    full = torch.zeros(sum(padded), dtype=dtype, device=device)
    for param, view in zip(params, views(full, [p.shape for p in params], padded), strict=True):
        view.copy_(param.detach())
        param.data = view
    return full


def copy_out(full: torch.Tensor, shape: tuple[int, ...], rows: int, offset: int, per_rank: torch.Tensor) -> None:
    """Fill `full` (a parameter's whole value, split as `shape`) from every rank's packed shards
    (`per_rank`, one row each, a parameter's shard at `offset`): one strided copy for the ranks
    whose shards are whole, one for a partial one; a copy per rank would cost a launch per rank,
    64 per parameter at 64."""
    numel, (whole, partial) = row_numel(shape), whole_ranks(shape, rows)
    flat, n = full.view(-1), rows * numel
    flat[: whole * n].view(whole, n).copy_(per_rank[:whole, offset : offset + n])
    if partial:
        flat[whole * n :].copy_(per_rank[whole, offset : offset + partial * numel])


def copy_in(packed: torch.Tensor, shape: tuple[int, ...], rows: int, offset: int, full: torch.Tensor) -> None:
    """`copy_out` reversed: each rank's shard of `full` (a parameter's whole gradient, split as
    `shape`) into its row of `packed` at `offset`, the padding zeroed."""
    numel, (whole, partial) = row_numel(shape), whole_ranks(shape, rows)
    flat, n = full.view(-1), rows * numel
    part = packed[:, offset : offset + n]
    part[:whole].copy_(flat[: whole * n].view(whole, n))
    part[whole:].zero_()
    if partial:
        part[whole, : partial * numel].copy_(flat[whole * n :])


def packed_shards(unit: Unit, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This rank's shards of the unit, packed, in `dtype`, on `device`: what an all-gather sends."""
    if unit.shard_buffer is not None:
        return unit.shard_buffer.to(device, dtype)
    packed = torch.empty(unit.shard_numel, dtype=dtype, device=device)
    for region, offset in zip(unit.regions(unit.full), unit.offsets, strict=True):
        packed[offset : offset + region.shape[1]].copy_(region[unit.over.rank])
    return packed


class Sharding:
    """The units of one model at ZeRO `stage` (1, 2 or 3) on `device`: master shards in
    `master_dtype` (on the host when `offload`), full parameters in `working_dtype`, gradients
    reduced in `reduce_dtype`. Units are added in the model's order, the root (what no block holds)
    last; `bytes_moved` counts what the all-gathers and reduce-scatters put through (input +
    output, for bus bandwidth), `bytes_gathered` the all-gathers' part of it, and
    `peak_gathered_bytes` the most full-parameter bytes alive at once."""

    def __init__(self, stage: int, device: torch.device, master_dtype: torch.dtype, working_dtype: torch.dtype,
                 reduce_dtype: torch.dtype, offload: bool = False, prefetch: int = 1,
                 reshard_after_forward: bool = True) -> None:
        self.stage, self.device, self.offload = stage, device, offload
        self.master_dtype, self.working_dtype, self.reduce_dtype = master_dtype, working_dtype, reduce_dtype
        self.master_device = HOST if offload else device  # where master shards and optimizer state live
        self.prefetch, self.reshard_after_forward = prefetch, reshard_after_forward
        self.units: list[Unit] = []
        self._unit_of: dict[int, Unit] = {}
        self._shard_of: dict[int, tuple[nn.Parameter, int, tuple[int, ...]]] = {}  # shard, rows, sharded shape
        self._reductions: list[tuple[dist.Work, Unit, torch.Tensor, torch.Tensor]] = []
        self.gathered_bytes = self.peak_gathered_bytes = 0
        self.bytes_moved = self.bytes_gathered = 0

    # --- making units ----------------------------------------------------------------------

    def add(self, over: ShardGroup, params: list[nn.Parameter], frozen: bool = False, root: bool = False) -> Unit:
        """`params` (whole, on the device) as a unit sharded over `over`, its shards made; the full
        parameters stay until `settle`. `frozen`: parameters that get no gradient (stage 3 only);
        `root`: parameters no block holds (added last)."""
        unit = self._make_unit(over, params, frozen)
        unit.root = root
        self.units.append(unit)
        self._unit_of.update({id(p): unit for p in params})
        self._shard_of.update({id(p): (shard, rows, shape) for p, shard, rows, shape in zip(
            params, unit.shards, unit.rows, unit.shapes, strict=True)})
        return unit

    def settle(self, unit: Unit) -> None:
        """After a unit is made: stage 3 keeps only its shards, freeing the full parameters (gathered
        in the working dtype from now on; a parameter mapped from a file is copied first, since
        freeing resizes its storage); the other stages keep them, counted as gathered."""
        if self.stage == 3:
            for param in unit.params:
                if param.dtype != unit.full_dtype:
                    param.data = param.data.to(unit.full_dtype)
                elif not param.untyped_storage().resizable():
                    param.data = param.data.clone()
        self.count_gathered(unit.full_bytes)
        if self.stage == 3:
            self.free(unit)
            return_free_memory()

    def _make_unit(self, over: ShardGroup, params: list[nn.Parameter], frozen: bool) -> Unit:
        shapes = [sharded_shape(p.shape, over.world, fold=over.experts) for p in params]
        rows = [math.ceil(shape[0] / over.world) for shape in shapes]
        lengths = [r * row_numel(shape) for r, shape in zip(rows, shapes, strict=True)]
        offsets = [sum(lengths[:i]) for i in range(len(lengths))]
        master, working = self.master_dtype, self.working_dtype
        if not params[0].is_floating_point():  # stored bytes (NF4's): kept, gathered and computed from as they are
            master = working = params[0].dtype
        unit = Unit(over, params, shapes, rows, offsets, sum(lengths), working, shards=[], shard_buffer=None,
                    frozen=frozen)
        if self.stage == 3 or working != master or self.offload:
            unit.shard_buffer = torch.zeros(unit.shard_numel, dtype=master, device=self.master_device)
            for param, shape, r, offset, length in zip(params, shapes, rows, offsets, lengths, strict=True):
                view = unit.shard_buffer[offset : offset + length].view(r, *shape[1:])
                chunk = param.detach().reshape(shape)[over.rank * r : (over.rank + 1) * r]
                view[: chunk.shape[0]].copy_(chunk)
                unit.shards.append(nn.Parameter(view, requires_grad=not frozen))
        if self.stage < 3:
            unit.full = flatten(params, shapes, rows, working, over.world, self.device)
            if unit.shard_buffer is None:  # the master shards are this rank's rows of the whole parameters
                unit.shards = [nn.Parameter(region[over.rank].view(r, *shape[1:]))
                               for region, r, shape in zip(unit.regions(unit.full), rows, shapes, strict=True)]
        if self.stage == 1:
            # Large enough to hold the shard gradients too, in the master dtype (only one rank needs more).
            as_working = unit.shard_numel * master.itemsize // working.itemsize
            unit.grads = torch.zeros(max(unit.full.numel(), as_working), dtype=working, device=self.device)
        return unit

    @property
    def roots(self) -> list[Unit]:
        return [unit for unit in self.units if unit.root]

    def shard_of(self, param: nn.Parameter) -> nn.Parameter:
        """This rank's master shard of `param`."""
        return self._shard_of[id(param)][0]

    def split_of(self, param: nn.Parameter) -> tuple[int, tuple[int, ...]]:
        """Rows of each rank's shard of `param`, and the shape it is split along dim 0 in (`sharded_shape`)."""
        return self._shard_of[id(param)][1:]

    def unit_of(self, param: nn.Parameter) -> Unit:
        return self._unit_of[id(param)]

    def holds(self, param: torch.Tensor) -> bool:
        """Whether `param` is sharded here (a buffer or a frozen parameter is not)."""
        return id(param) in self._shard_of

    def shards(self) -> list[nn.Parameter]:
        """This rank's master shards, every unit's: what its optimizer steps on (those that require
        gradients: a frozen unit's are held, not trained)."""
        return [shard for unit in self.units for shard in unit.shards]

    # --- gather / free --------------------------------------------------------------------

    def start_gather(self, unit: Unit) -> None:
        """Issue the all-gather of every rank's shards of the unit, in the working dtype."""
        if unit.gathered or unit.pending_gather is not None:
            return
        send = packed_shards(unit, unit.full_dtype, self.device)
        if unit.float8 is not None:  # its float8 weights as float8 bytes
            send = unit.float8.pack(send)
        out = torch.empty(unit.over.world * send.numel(), dtype=send.dtype, device=send.device)
        work = all_gather_single(out, send, group=unit.over.group, async_op=True)
        moved = (out.numel() + send.numel()) * out.element_size()
        self.bytes_moved += moved
        self.bytes_gathered += moved
        unit.pending_gather = (work, out)
        self.count_gathered(out.numel() * out.element_size())

    def finish_gather(self, unit: Unit) -> None:
        """Wait for the unit's all-gather and copy each rank's chunk into the full parameters."""
        if unit.gathered:
            return
        self.start_gather(unit)
        work, out = unit.pending_gather
        work.wait()
        per_rank = out.view(unit.over.world, -1)
        if unit.full is not None:  # stages 1, 2: one copy per parameter, padding included
            for region, offset in zip(unit.regions(unit.full), unit.offsets, strict=True):
                region.copy_(per_rank[:, offset : offset + region.shape[1]])
        elif unit.float8 is not None:
            unit.float8.unpack(per_rank)
        else:  # stage 3: refill each parameter's freed storage
            for param, storage in zip(unit.params, unit.storages, strict=True):
                if storage.size() == 0:
                    storage.resize_(param.numel() * param.element_size())
            if unit.padded:
                for param, shape, rows, offset in zip(unit.params, unit.shapes, unit.rows, unit.offsets, strict=True):
                    copy_out(param.data, shape, rows, offset, per_rank)
            else:  # each parameter is its shards end to end: one copy for the whole unit
                torch.split_with_sizes_copy(per_rank, unit.lengths, dim=1, out=unit.per_rank_views)
        if self.stage == 3:
            unit.gathered = True
            self.count_gathered(unit.full_bytes)  # both the parameters and the gather buffer are alive here
        unit.pending_gather = None
        self.count_gathered(-out.numel() * out.element_size())

    def count_gathered(self, nbytes: int) -> None:
        """Track full-parameter bytes alive: unsharded parameters and all-gather buffers in flight."""
        self.gathered_bytes += nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def free(self, unit: Unit) -> None:
        if not unit.gathered:
            return
        for storage in unit.storages:
            storage.resize_(0)
        if unit.float8 is not None:
            unit.float8.release()
        unit.gathered = False
        self.count_gathered(-unit.full_bytes)

    def gather_all(self) -> None:
        """Bring every rank's shards into the full parameters (stages 1 and 2 after each step, a
        pipeline's stage 3 before one), one unit's all-gather in flight while the previous one is
        copied out (two gather buffers at most)."""
        if self.stage < 3:
            for unit in self.units:
                unit.gathered = False
        self.start_gather(self.units[0])
        for unit, following in zip(self.units, self.units[1:] + [None], strict=True):
            if following is not None:
                self.start_gather(following)
            self.finish_gather(unit)
            unit.gathered = True

    def free_all(self) -> None:
        """Stage 3: every unit's full parameters freed."""
        if self.stage == 3:
            for unit in self.units:
                self.free(unit)

    # --- backward: reduce-scatter gradients ----------------------------------------------

    def attach_full_grads(self) -> None:
        """Stage 1, before a backward: point every parameter's `.grad` at its place in its unit's
        gradient buffer, zeroed at the first backward of a step (when the buffer holds the last
        step's shard gradients)."""
        if self.stage != 1:
            return
        for unit in self.units:
            if unit.grads_spent or any(p.grad is None for p in unit.params):
                unit.grads.zero_()
                for param, region in zip(unit.params, unit.regions(unit.grads), strict=True):
                    param.grad = region.view(-1)[: param.numel()].view_as(param)
                unit.grads_spent = False

    def grad_ready(self, param: nn.Parameter, sync: bool) -> None:
        """`param`'s gradient is final: once its unit's all are (the root's and experts' wait for the end
        of backward: an expert no token reached here gets no gradient, and every rank must reduce in
        the same order), stages 2 and 3 reduce-scatter the unit (when `sync`) and stage 3 frees it."""
        unit = self._unit_of[id(param)]
        unit.ready.add(id(param))
        if len(unit.ready) < len(unit.params) or unit.root:
            return
        if sync and self.stage >= 2 and not unit.over.experts:
            self.reduce_scatter(unit)
        if self.stage == 3:
            self.free(unit)

    def reduce_scatter(self, unit: Unit) -> None:
        """Average the unit's full gradients over its ranks, packed in the reduce dtype, into this
        rank's shard gradients; the full gradients are spent (stage 1) or freed (2, 3). The previous
        unit's reduce-scatter is waited for first: it has had this unit's whole backward to finish,
        and its packed gradients (a unit's worth) need not live beside these."""
        self.settle_reductions()
        world = unit.over.world
        packed = torch.empty(world, unit.shard_numel, dtype=self.reduce_dtype, device=self.device)
        if unit.grads is not None:  # stage 1: its gradient buffer, padded as the shards are
            for region, offset in zip(unit.regions(unit.grads), unit.offsets, strict=True):
                packed[:, offset : offset + region.shape[1]].copy_(region)
            unit.grads_spent = True
        elif not unit.padded and not unit.root and all(param.grad is not None for param in unit.params):
            # One copy for the unit; not the root's, whose vocabulary matrices a casting cat would copy first
            torch.cat([param.grad.view(world, -1) for param in unit.params], dim=1, out=packed)
        else:
            for param, shape, rows, offset in zip(unit.params, unit.shapes, unit.rows, unit.offsets, strict=True):
                if param.grad is None:  # no gradient on this rank: it contributes zeros
                    packed[:, offset : offset + rows * row_numel(shape)].zero_()
                else:
                    copy_in(packed, shape, rows, offset, param.grad)
        for param in unit.params:
            param.grad = None
        home = self._shard_grad_buffer(unit)
        same = home.dtype == packed.dtype and home.device == packed.device
        shard_grad = home if same else torch.empty(unit.shard_numel, dtype=packed.dtype, device=packed.device)
        work = reduce_scatter_single(shard_grad, packed.view(-1), op=dist.ReduceOp.AVG, group=unit.over.group,
                                     async_op=True)
        self.bytes_moved += (packed.numel() + unit.shard_numel) * packed.element_size()
        self._reductions.append((work, unit, shard_grad, home))

    def settle_reductions(self) -> None:
        """Wait for the reduce-scatters outstanding and give their shards the gradients. A
        reduction's input (every rank's part of a unit's whole gradients) lives as long as its
        Work: left to the end of backward, all of them, a whole model's gradients, would be alive
        at once."""
        while self._reductions:
            work, unit, shard_grad, home = self._reductions.pop(0)
            work.wait()
            if unit.over.grad_scale != 1.0:
                shard_grad.mul_(unit.over.grad_scale)
            if shard_grad is not home:
                home.copy_(shard_grad)
            for shard, offset in zip(unit.shards, unit.offsets, strict=True):
                shard.grad = home[offset : offset + shard.numel()].view_as(shard)

    def _shard_grad_buffer(self, unit: Unit) -> torch.Tensor:
        """Where this rank's shard gradients of the unit go, packed, in the master dtype: stage 1's
        spent gradient buffer (unless offloaded), else a buffer of their own beside the shards."""
        master = self.master_dtype
        if unit.grads is not None and not self.offload:
            return unit.grads[: unit.shard_numel * master.itemsize // unit.grads.element_size()].view(master)
        return torch.empty(unit.shard_numel, dtype=master, device=self.master_device)

    def finish_backward(self, sync: bool) -> None:
        """At the end of a backward: when `sync`, every unit not reduced yet (the root, units with a
        parameter that got no gradient, stage 1's, experts') reduce-scattered and every reduction
        settled. Stage 3 first frees what is still gathered (the root): the packed gradients need
        not live beside it."""
        self.free_all()
        if sync:
            for unit in self.units:
                if unit.frozen:
                    continue
                if unit.root or len(unit.ready) < len(unit.params) or self.stage == 1 or unit.over.experts:
                    self.reduce_scatter(unit)
            self.settle_reductions()
        for unit in self.units:
            unit.ready.clear()

    # --- state -----------------------------------------------------------------------------

    def gather_to_first(self, param: nn.Parameter) -> torch.Tensor | None:
        """`param`'s whole value (in the master dtype) on rank 0 of its unit's group, from every
        rank's shard of it; None on the others. Collective over that group."""
        shard, rows, shape = self._shard_of[id(param)]
        over = self._unit_of[id(param)].over
        send = shard.detach().to(self.device).reshape(-1)
        if over.rank != 0:
            gather_in_place(send, None, over.group)
            return None
        gathered = torch.empty(over.world * send.numel(), dtype=send.dtype, device=send.device)
        gather_in_place(send, list(gathered.view(over.world, -1)), over.group)
        return gathered.view(over.world * rows, *shape[1:])[: shape[0]].view(param.shape)


class GatherHooks:
    """Stage 3's hooks on a model: the root gathered around the model's forward, each run of
    blocks' units gathered before its forward and again before its backward and freed after each
    (unless `reshard_after_forward` is off), the next `prefetch` runs' all-gathers issued while one
    computes, forward and backward."""

    def __init__(self, sharding: Sharding, module: nn.Module,
                 blocks: list[tuple[list[nn.Module], list[Unit]]]) -> None:
        """`blocks`: each run of consecutive block modules of `module` sharded as units together
        (parallel.sharding.blocks_per_unit), with those units, in forward order. The hooks are on a
        run's first block (before its forward) and its last (after it): its backward starts there."""
        self.sharding = sharding
        units = [made for _, made in blocks]
        module.register_forward_pre_hook(lambda m, args: self._before_root_forward(units))
        module.register_forward_hook(lambda m, args, out: self._after_root_forward())
        for index, (run, _) in enumerate(blocks):
            run[0].register_forward_pre_hook(lambda m, args, i=index: self._before_unit_forward(units, i))
            run[-1].register_forward_hook(lambda m, args, out, i=index: self._after_unit_forward(units, i, out))

    def _before_root_forward(self, blocks: list[list[Unit]]) -> None:
        for unit in self.sharding.roots:
            self.sharding.finish_gather(unit)
        for unit in blocks[0] if blocks else []:
            self.sharding.start_gather(unit)

    def _before_unit_forward(self, blocks: list[list[Unit]], index: int) -> None:
        for unit in blocks[index]:
            self.sharding.finish_gather(unit)
        for ahead in blocks[index + 1 : index + 1 + self.sharding.prefetch]:
            for unit in ahead:
                self.sharding.start_gather(unit)

    def _after_unit_forward(self, blocks: list[list[Unit]], index: int, output: object) -> None:
        if self.sharding.reshard_after_forward:
            for unit in blocks[index]:
                self.sharding.free(unit)
        # A unit may return a tuple or a dict (many transformers layers do): the first gradient to
        # reach any of its tensors gathers it again, the others find it gathered.
        for tensor in pytree.tree_leaves(output):
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(lambda grad, i=index: self._before_unit_backward(blocks, i))

    def _after_root_forward(self) -> None:
        if not torch.is_grad_enabled():  # no backward will follow (evaluation)
            for unit in self.sharding.roots:
                self.sharding.free(unit)

    def _before_unit_backward(self, blocks: list[list[Unit]], index: int) -> None:
        # The block after this one has finished its backward: its frozen units, which no gradient
        # frees (grad_ready), are freed here (block 0's at the end of backward).
        for unit in blocks[index + 1] if index + 1 < len(blocks) else []:
            if unit.frozen:
                self.sharding.free(unit)
        for unit in blocks[index]:
            self.sharding.finish_gather(unit)
        for behind in blocks[max(0, index - self.sharding.prefetch) : index][::-1]:
            for unit in behind:
                self.sharding.start_gather(unit)
