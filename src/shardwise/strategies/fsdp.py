"""Sharded data parallel, ours: ZeRO stage 1 (`zero1`), 2 (`zero2`) and 3 (`fsdp`).

Every rank owns 1/N of each parameter: its dim-0 chunk (torch.chunk semantics, zero-padded so
every rank's chunk has the same number of rows). These shards are the master weights, in the
precision's storage dtype (fp32, or bf16 under bf16-true); the optimizer is an ordinary
torch.optim optimizer over them, so its state is sharded too. The rest is the stage's, in the
*working* dtype: mixed precision's compute dtype, else the storage dtype.

- zero1: the whole parameters in the working dtype, in one flat buffer per unit (parameter
  after parameter, each padded to N times its shard's rows; the model's parameters are views
  into it), and the whole gradients in a second buffer laid out alike, which autograd
  accumulates into. At the end of backward every unit's gradients are packed and
  reduce-scattered (averaged) into this rank's shard gradients, which then live in that same
  gradient buffer (what it held is spent once packed); after the optimizer step the updated
  shards are all-gathered, in the working dtype, into the whole parameters.
- zero2: as zero1 without the gradient buffer: each unit's gradients are reduce-scattered as
  soon as its backward is done and freed, into shard gradients of their own.
- fsdp: parameters are sharded too. A unit's full parameters exist only while it computes: one
  all-gather of its packed shards before its forward, freed after (unless
  `reshard_after_forward = false`), gathered again before its backward, freed after. The next
  unit's all-gather is issued while the current one computes (`prefetch` units ahead), forward
  and backward.

Where the working dtype is the storage dtype (fp32, bf16-true) and nothing is offloaded,
zero1's and zero2's shards are views into the whole parameters' buffer (this rank's rows of
each parameter), not copies. Under mixed precision they are a buffer of their own, in fp32.

`parallel.offload = "optimizer"` (ZeRO-Offload): the master shards, their gradients and the
optimizer state live in host memory and the optimizer steps there; shard gradients are copied
to the host after the reduce-scatter, and the updated shards go back to the device, cast to
the working dtype, as the all-gather's input.

Units are the modules whose class is `parallel.block` (the GPT's `Block`), plus the root:
every parameter not in a unit (embeddings, final norm). The root is gathered for the whole of
forward and backward. Under expert parallel (`parallel.ep`) a block's experts, which differ from
one ep rank to the next, are a unit of their own, sharded over the ranks that hold the same
experts instead (`ShardGroup`; parallel/experts.py).

Freeing releases storage (`untyped_storage().resize_(0)`), not just a reference: autograd keeps
views of parameters (`weight.t()`) for backward, which would otherwise keep the memory alive.
Gathering refills the same storage, so those views see the data again.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardwise.config import Config, ConfigError, ParallelConfig
from shardwise.dist import DistContext, broadcast_from_rank0
from shardwise.gradients import all_reduce_packed, clip_grad_norm_
from shardwise.materialise import Materialiser
from shardwise.memory import (
    MemoryBreakdown,
    count_memory,
    exact_storage,
    optimizer_state_tensors,
    return_free_memory,
    storage_bytes,
)
from shardwise.models.plans import locate
from shardwise.parallel.comm import gather_in_place
from shardwise.parallel.tensor import BlockSplitter, TensorParallelGroup, TensorShard
from shardwise.strategies.base import HookedStrategy, OptimizerFactory
from shardwise.strategies.mesh import check_model_split
from shardwise.strategies.registry import spec
from shardwise.strategies.sync_batchnorm import convert_sync_batchnorm

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement

HOST = torch.device("cpu")


def _row_numel(param: torch.Tensor) -> int:
    """Elements in one dim-0 row of `param` (from its shape: its storage may be freed)."""
    return math.prod(param.shape[1:])


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


@dataclass
class Unit:
    """Parameters gathered, freed and reduced together, and their shards packed in one buffer."""

    over: ShardGroup
    params: list[nn.Parameter]
    rows: list[int]  # rows of each parameter's shard (its padded dim 0 / world size)
    offsets: list[int]  # where each parameter's shard starts among this rank's packed shards
    shard_numel: int  # elements of this rank's packed shards (and of each rank's part of a gather)
    full_dtype: torch.dtype  # the working dtype: what the full parameters are gathered and computed in
    shards: list[nn.Parameter]  # this rank's master shards, shaped [rows, *rest]
    shard_buffer: torch.Tensor | None  # the shards packed, where they are a buffer of their own
    full: torch.Tensor | None = None  # zero1, zero2: the whole parameters, padded, the parameters views into it
    grads: torch.Tensor | None = None  # zero1: the whole gradients, laid out as `full`; then the shard gradients
    grads_spent: bool = False  # zero1: `grads` holds shard gradients now, not gradients to accumulate into
    gathered: bool = True
    pending_gather: tuple[dist.Work, torch.Tensor] | None = None
    ready: set[int] = field(default_factory=set)

    @property
    def full_bytes(self) -> int:
        if self.full is not None:
            return self.full.nbytes
        return sum(p.numel() * p.element_size() for p in self.params)


class ShardedDataParallel(HookedStrategy):
    """zero1, zero2 and fsdp: which of them is the registry's ZeRO stage for the configured name."""

    @classmethod
    def check_config(cls, cfg: Config, world: int) -> None:
        """Over tensor parallel (parallel.tp > 1): the model splits as tensor's does."""
        p = cfg.parallel
        dp, pp, tp = p.mesh_shape(world)
        if tp > 1 or p.sequence_parallel:
            check_model_split(cfg, world)
        if spec(p.strategy).across_nodes and cfg.launch.nproc % (p.cp * pp * tp):
            raise ConfigError(f"parallel.tp = {tp}: {p.strategy} keeps a replica's tensor-parallel ranks within a "
                              f"node; launch.nproc = {cfg.launch.nproc} must be a multiple of it")

    def __init__(self, ctx: DistContext, cfg: ParallelConfig) -> None:
        super().__init__(ctx, cfg)
        self.stage = spec(cfg.strategy).zero_stage
        self.offload = cfg.offload == "optimizer"
        self.master_device = HOST if self.offload else ctx.device  # where master shards and optimizer state live

    def wrap(self, model: nn.Module) -> nn.Module:
        if self.cfg.sync_batchnorm:
            model = convert_sync_batchnorm(model)
        # zero1 and zero2 keep the full parameters: a meta-built model is materialised whole; fsdp
        # materialises it one unit at a time (_make_units), as all of them do over tensor parallel,
        # which splits each block as it is made.
        self.tp, self.tp_rank = (self.mesh.size("tp"), self.mesh.rank("tp")) if self.mesh is not None else (1, 0)
        self.module = self.prepare(model, materialise=self.stage < 3 and self.tp == 1)
        scalars = [name for name, p in self.module.named_parameters() if p.dim() == 0]
        if scalars:
            raise ValueError(f"{self.cfg.strategy}: parameters {', '.join(scalars)} are 0-dim; sharding splits dim 0")
        self._init_mesh()
        if self.materialiser is None:  # an ordinary model: rank 0's values (meta-built ones agree by construction)
            broadcast_from_rank0([*(p for p in self.module.parameters() if not self._is_expert(p)),
                                  *self.module.buffers()])
            if self.experts is not None:
                self.experts.broadcast()
        self.splitter = self._tensor_splitter()
        self._shard({}, [])
        if self.splitter is not None:
            self.tensor_shards, self.tp_partial = self.splitter.shards, self.splitter.finish()
        for unit in self.units:
            for param in unit.params:
                param.register_post_accumulate_grad_hook(self._on_grad_ready)
        self._init_backward_state()
        if self.stage == 3:
            self._install_gather_hooks()
            self.peak_gathered_bytes = 0  # the peak counts from the first step
        return self.module

    def _shard(self, tensor_shards: dict[int, TensorShard], tp_partial: list[nn.Parameter],
               named: dict[str, nn.Parameter] | None = None) -> None:
        """Make the units of `self.module` and the maps from each parameter (by `named`, its name in
        checkpoints; by default the module's, once the units are made) to its unit and its shard."""
        self.gathered_bytes = self.peak_gathered_bytes = 0
        self.units = self._make_units()
        self.tensor_shards = tensor_shards  # id(parameter) -> how tensor parallel split it
        self.tp_partial = tp_partial  # parameters whole on every tp rank, their gradients partial over tp
        self.root = self.units[-1]
        self._unit_of = {id(p): unit for unit in self.units for p in unit.params}
        rows_of = {id(p): rows for unit in self.units for p, rows in zip(unit.params, unit.rows, strict=True)}
        self._shard_of = {id(p): (shard, rows_of[id(p)]) for unit in self.units
                          for p, shard in zip(unit.params, unit.shards, strict=True)}
        named = dict(self.module.named_parameters()) if named is None else named
        self._layout = {name: (p, rows_of[id(p)]) for name, p in named.items()}
        self._reductions: list[tuple[dist.Work, Unit, torch.Tensor, torch.Tensor]] = []
        self.bytes_moved = 0  # by all-gathers and reduce-scatters, input + output, for bus bandwidth
        self.bytes_gathered = 0  # the all-gathers' part of it

    def shard_stages(self, stages: nn.Module, block: str, named: dict[str, nn.Parameter], full: dict[str, torch.Tensor],
                     tensor_shards: dict[int, TensorShard], tp_partial: list[nn.Parameter]) -> None:
        """Shard a pipeline rank's `stages` (real, split over tp already) over the data-parallel
        ranks of its stage, a unit per `block` and one for the rest, with no hooks: the pipeline
        calls `begin_step` before its schedule and `end_step` after it.
        `named`: each parameter by its name in the plain model; `full`: the plain model's tensors on
        meta, by name."""
        self.module, self.cfg = stages, dataclasses.replace(self.cfg, block=block)
        self.tp, self.tp_rank = self.mesh.size("tp"), self.mesh.rank("tp")
        self._init_mesh()
        self.splitter, self._full = None, full
        self._shard(tensor_shards, tp_partial, named)
        self.peak_gathered_bytes = self.gathered_bytes

    def begin_step(self) -> None:
        """Under a pipeline, before a step's schedule: fsdp's full parameters, for all of the step's
        micro-batches; zero1's gradient buffers, for them to accumulate into."""
        self.gather_units()
        if self.stage == 1:
            self._attach_full_grads()

    def end_step(self) -> None:
        """Under a pipeline, after a step's schedule: every unit's gradients reduce-scattered into
        this rank's shards; fsdp's full parameters freed."""
        self._finish_backward()

    def gather_units(self) -> None:
        """fsdp: every unit's full parameters (one all-gather a unit, the next in flight while one
        is copied out). zero1 and zero2 hold them always."""
        if self.stage == 3:
            self._gather_all()

    def free_units(self) -> None:
        """fsdp: every unit's full parameters freed."""
        if self.stage == 3:
            for unit in self.units:
                self._free(unit)

    def shard_of(self, param: nn.Parameter) -> nn.Parameter:
        """This rank's master shard of `param`."""
        return self._shard_of[id(param)][0]

    def _init_mesh(self) -> None:
        """Shard over the mesh's dp_shard x cp ranks (every rank, unless hsdp replicates across
        nodes): `group` is what parameters are split over, `world` its size and `rank` this rank's
        place in it, `replica` which copy of the shards its group holds; checkpoints see each shard
        as a DTensor with `placements` on `_mesh`."""
        self.group = self.mesh.group("dp_shard_cp")
        self.world, self.rank = self.mesh.size("dp_shard_cp"), self.mesh.rank("dp_shard_cp")
        self.replica = self.mesh.rank("dp_replicate")
        self._mesh: DeviceMesh = self.mesh["dp_shard_cp"]
        # Imported here and in as_global, not at the top: torch.distributed.tensor takes 0.6 s to
        # import, and `shardwise plan` checks thousands of configs of this class without running one.
        from torch.distributed.tensor import Shard

        self._placements: list[Placement] = [Shard(0)]

    def _shard_groups(self) -> tuple[ShardGroup, ShardGroup | None]:
        """What dense units are sharded over (`_init_mesh`'s group), and experts split over ep (the
        edp ranks); None without expert parallel."""
        dense = ShardGroup(self.group, self.world, self.rank, self._mesh, tuple(self._placements))
        if self.experts is None:
            return dense, None
        edp = self.mesh["edp"]
        return dense, ShardGroup(edp.get_group(), edp.size(), edp.get_local_rank(), edp, tuple(self._placements),
                                 1 / self.experts.size, experts=True)

    def _tensor_splitter(self) -> BlockSplitter | None:
        """Over a mesh with tp ranks: what splits each block over them as its family's plan lays
        it out (tensor.py), before the block is sharded as a unit over the data-parallel ranks; the
        plain model's state (`_full`, on meta) noted first. None without tp."""
        if self.tp == 1:
            return None
        located = locate(self.module)
        self._full = {name: t.detach().to("meta") for name, t in self.module.state_dict(keep_vars=True).items()}
        return BlockSplitter(located.plan, TensorParallelGroup(self.mesh.group("tp")), self.cfg.sequence_parallel)

    # --- sharding layout ------------------------------------------------------------------

    def _make_units(self) -> list[Unit]:
        """A unit per block (the parameters under a module of class `parallel.block` that no
        earlier block holds), then the root, as materialise.py groups them. fsdp materialises a
        meta-built model unit by unit, keeping each unit's shards only, so setup holds at most the
        shards made so far and one whole unit (`setup_peak_bytes`, counted)."""
        grouping = self.materialiser or Materialiser(self.module, self.cfg.block, self.seed)
        dense, experts = self._shard_groups()
        self._unit_modules, self._block_units = [], []
        self.setup_peak_bytes = 0
        units = []
        for group in grouping.groups:
            if self.materialiser is not None and (self.stage == 3 or self.splitter is not None):
                self.materialiser.materialise(group, self.ctx.device, self.precision.param_dtype)
                if self.experts is not None and group.block is not None:
                    self.experts.split(group.block)
            if self.splitter is not None and group.block is not None:
                self.splitter.split(group.block)  # the block's layers now hold this rank's tp shards
                if self.materialiser is not None:
                    self.materialiser.release(group, self.module)
                params = [p for p in group.block.parameters() if p.requires_grad]
            else:
                params = [p for p in grouping.parameters(group) if p.requires_grad]
            if not params and group.block is not None:
                continue
            # Experts split over ep are a unit of their own, sharded over the ranks holding the same experts.
            by_group = [(dense, [p for p in params if not self._is_expert(p)]),
                        (experts, [p for p in params if self._is_expert(p)])]
            made = [self._make_unit(over, held) for over, held in by_group if held]
            if group.block is not None:
                self._unit_modules.append(group.block)
                self._block_units.append(made)
            for unit in made:
                units.append(unit)
                self.setup_peak_bytes = max(self.setup_peak_bytes, self._live_bytes(units))
                if self.stage == 3:
                    self._keep_shards_only(unit)
                else:
                    self._count_gathered(unit.full_bytes)
        return units

    def _is_expert(self, param: nn.Parameter) -> bool:
        return self.experts is not None and self.experts.is_expert(param)

    def _keep_shards_only(self, unit: Unit) -> None:
        """fsdp: free the unit's full parameters, which exist only while it computes (gathered in
        the compute dtype under mixed precision; a parameter mapped from a file is copied first,
        since fsdp frees and refills its storage)."""
        for param in unit.params:
            if self.precision.mixed:
                param.data = param.data.to(self.precision.compute_dtype)
            elif not param.untyped_storage().resizable():
                param.data = param.data.clone()
        self._count_gathered(unit.full_bytes)
        self._free(unit)
        return_free_memory()

    def _live_bytes(self, units: list[Unit]) -> int:
        """Bytes of real storage this rank holds now: the model's tensors that are not meta (nor
        freed; zero1's and zero2's whole parameters are views into their units' buffers), the
        units' shards and zero1's gradient buffers."""
        tensors = [t for t in (*self.module.parameters(), *self.module.buffers()) if not t.is_meta]
        buffers = [b for unit in units for b in (unit.shard_buffer, unit.grads) if b is not None]
        return storage_bytes(tensors + buffers)

    def _make_unit(self, over: ShardGroup, params: list[nn.Parameter]) -> Unit:
        rows = [math.ceil(p.shape[0] / over.world) for p in params]
        lengths = [r * _row_numel(p) for r, p in zip(rows, params, strict=True)]
        offsets = [sum(lengths[:i]) for i in range(len(lengths))]
        master = self.precision.param_dtype
        working = self.precision.compute_dtype if self.precision.mixed else master
        unit = Unit(over, params, rows, offsets, sum(lengths), working, shards=[], shard_buffer=None)
        if self.stage == 3 or working != master or self.offload:
            unit.shard_buffer = torch.zeros(unit.shard_numel, dtype=master, device=self.master_device)
            for param, r, offset, length in zip(params, rows, offsets, lengths, strict=True):
                view = unit.shard_buffer[offset : offset + length].view(r, *param.shape[1:])
                chunk = param.detach()[over.rank * r : (over.rank + 1) * r]
                view[: chunk.shape[0]].copy_(chunk)
                unit.shards.append(nn.Parameter(view))
        if self.stage < 3:
            unit.full = self._flatten(params, rows, working, over.world)
            if unit.shard_buffer is None:  # the master shards are this rank's rows of the whole parameters
                unit.shards = [nn.Parameter(region[over.rank].view(r, *p.shape[1:]))
                               for region, r, p in zip(self._regions(unit, unit.full), rows, params, strict=True)]
        if self.stage == 1:
            # Large enough to hold the shard gradients too, in the master dtype (only one rank needs more).
            as_working = unit.shard_numel * master.itemsize // working.itemsize
            unit.grads = torch.zeros(max(unit.full.numel(), as_working), dtype=working, device=self.ctx.device)
        return unit

    def _flatten(self, params: list[nn.Parameter], rows: list[int], dtype: torch.dtype, world: int) -> torch.Tensor:
        """One buffer holding `params` in `dtype`, each padded to `world` x its shard's rows, and each
        parameter made a view into it."""
        padded = [world * r * _row_numel(p) for r, p in zip(rows, params, strict=True)]
        full = torch.zeros(sum(padded), dtype=dtype, device=self.ctx.device)
        start = 0
        for param, length in zip(params, padded, strict=True):
            view = full[start : start + param.numel()].view_as(param)
            view.copy_(param.detach())
            param.data = view
            start += length
        return full

    def _regions(self, unit: Unit, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's place in `buffer` (laid out as `Unit.full`) as [world, shard elements]:
        row r is rank r's shard of it."""
        regions, start, world = [], 0, unit.over.world
        for param, rows in zip(unit.params, unit.rows, strict=True):
            length = rows * _row_numel(param)
            regions.append(buffer[start : start + world * length].view(world, length))
            start += world * length
        return regions

    @staticmethod
    def _real_rows(param: torch.Tensor, rows: int, rank: int) -> int:
        """Rows of `rank`'s shard that hold `param`'s data; the rest are padding."""
        return max(0, min(rows, param.shape[0] - rank * rows))

    def _rank_spans(self, param: torch.Tensor, rows: int, world: int) -> list[tuple[int, int]]:
        """For each of `world` ranks, (start, length) of its chunk in `param` flattened."""
        row_numel = _row_numel(param)
        return [(rank * rows * row_numel, self._real_rows(param, rows, rank) * row_numel)
                for rank in range(world)]

    # --- gather / free --------------------------------------------------------------------

    def _start_gather(self, unit: Unit) -> None:
        """Issue the all-gather of every rank's shards of the unit, in the working dtype."""
        if unit.gathered or unit.pending_gather is not None:
            return
        send = self._packed_shards(unit, unit.full_dtype)
        out = torch.empty(unit.over.world * send.numel(), dtype=send.dtype, device=send.device)
        work = dist.all_gather_single(out, send, group=unit.over.group, async_op=True)
        moved = (out.numel() + send.numel()) * out.element_size()
        self.bytes_moved += moved
        self.bytes_gathered += moved
        unit.pending_gather = (work, out)
        self._count_gathered(out.numel() * out.element_size())

    def _packed_shards(self, unit: Unit, dtype: torch.dtype) -> torch.Tensor:
        """This rank's shards of the unit, packed, in `dtype`, on the device: what an all-gather sends."""
        if unit.shard_buffer is not None:
            return unit.shard_buffer.to(self.ctx.device, dtype)
        packed = torch.empty(unit.shard_numel, dtype=dtype, device=self.ctx.device)
        for region, offset in zip(self._regions(unit, unit.full), unit.offsets, strict=True):
            packed[offset : offset + region.shape[1]].copy_(region[unit.over.rank])
        return packed

    def _finish_gather(self, unit: Unit) -> None:
        """Wait for the unit's all-gather and copy each rank's chunk into the full parameters."""
        if unit.gathered:
            return
        self._start_gather(unit)
        work, out = unit.pending_gather
        work.wait()
        per_rank = out.view(unit.over.world, -1)
        if unit.full is not None:  # zero1, zero2: one copy per parameter, padding included
            for region, offset in zip(self._regions(unit, unit.full), unit.offsets, strict=True):
                region.copy_(per_rank[:, offset : offset + region.shape[1]])
        else:  # fsdp: refill each parameter's freed storage
            for param, rows, offset in zip(unit.params, unit.rows, unit.offsets, strict=True):
                storage = param.untyped_storage()
                if storage.size() == 0:
                    storage.resize_(param.numel() * param.element_size())
                self._copy_out(param.data, rows, offset, per_rank)
        if self.stage == 3:
            unit.gathered = True
            self._count_gathered(unit.full_bytes)  # both the parameters and the gather buffer are alive here
        unit.pending_gather = None
        self._count_gathered(-out.numel() * out.element_size())

    def _count_gathered(self, nbytes: int) -> None:
        """Track full-parameter bytes alive: unsharded parameters and all-gather buffers in flight."""
        self.gathered_bytes += nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    def _copy_out(self, full: torch.Tensor, rows: int, offset: int, per_rank: torch.Tensor) -> None:
        """Fill `full` (a parameter's whole value) from every rank's packed shards."""
        flat = full.view(-1)
        for rank, (start, n) in enumerate(self._rank_spans(full, rows, per_rank.shape[0])):
            flat[start : start + n].copy_(per_rank[rank, offset : offset + n])

    def _free(self, unit: Unit) -> None:
        if not unit.gathered:
            return
        for param in unit.params:
            param.untyped_storage().resize_(0)
        unit.gathered = False
        self._count_gathered(-unit.full_bytes)

    # --- fsdp hooks: gather before use, free after, prefetch ahead -------------------------

    def _install_gather_hooks(self) -> None:
        blocks = self._block_units
        self.module.register_forward_pre_hook(self._before_root_forward)
        self.module.register_forward_hook(self._after_root_forward)
        for index, module in enumerate(self._unit_modules):
            module.register_forward_pre_hook(lambda m, args, i=index: self._before_unit_forward(blocks, i))
            module.register_forward_hook(lambda m, args, out, i=index: self._after_unit_forward(blocks, i, out))

    def _before_root_forward(self, module: nn.Module, args: object) -> None:
        self._finish_gather(self.root)
        for unit in self._block_units[0] if self._block_units else []:
            self._start_gather(unit)

    def _before_unit_forward(self, blocks: list[list[Unit]], index: int) -> None:
        for unit in blocks[index]:
            self._finish_gather(unit)
        for ahead in blocks[index + 1 : index + 1 + self.cfg.prefetch]:
            for unit in ahead:
                self._start_gather(unit)

    def _after_unit_forward(self, blocks: list[list[Unit]], index: int, output: object) -> None:
        if self.cfg.reshard_after_forward:
            for unit in blocks[index]:
                self._free(unit)
        # A unit may return a tuple or a dict (many transformers layers do): the first gradient to
        # reach any of its tensors gathers it again, the others find it gathered.
        for tensor in pytree.tree_leaves(output):
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(lambda grad, i=index: self._before_unit_backward(blocks, i))

    def _after_root_forward(self, module: nn.Module, args: object, output: object) -> None:
        if not torch.is_grad_enabled():  # no backward will follow (evaluation)
            self._free(self.root)

    def _before_unit_backward(self, blocks: list[list[Unit]], index: int) -> None:
        for unit in blocks[index]:
            self._finish_gather(unit)
        for behind in blocks[max(0, index - self.cfg.prefetch) : index][::-1]:
            for unit in behind:
                self._start_gather(unit)

    # --- backward: reduce-scatter gradients ----------------------------------------------

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        self._queue_finish_once()
        unit = self._unit_of[id(param)]
        unit.ready.add(id(param))
        if len(unit.ready) == len(unit.params) and unit is not self.root:
            self._unit_backward_done(unit)

    def _unit_backward_done(self, unit: Unit) -> None:
        # Experts' units wait for the end of backward: an expert no token reached on a rank may get
        # no gradient there, and their reduce-scatters must come in the same order on every rank.
        if self._sync and self.stage >= 2 and not unit.over.experts:
            self._start_reduce_scatter(unit)
        if self.stage == 3:
            self._free(unit)

    def backward(self, loss: torch.Tensor) -> None:
        if self.stage == 1:
            self._attach_full_grads()
        loss.backward()

    def _attach_full_grads(self) -> None:
        """zero1: point every parameter's `.grad` at its place in its unit's gradient buffer, zeroed
        at the first backward of a step (when the buffer holds the last step's shard gradients)."""
        for unit in self.units:
            if unit.grads_spent or any(p.grad is None for p in unit.params):
                unit.grads.zero_()
                for param, region in zip(unit.params, self._regions(unit, unit.grads), strict=True):
                    param.grad = region.view(-1)[: param.numel()].view_as(param)
                unit.grads_spent = False

    def _start_reduce_scatter(self, unit: Unit) -> None:
        """Average the unit's full gradients over ranks, packed in the reduce dtype, into this rank's
        shard gradients; the full gradients are spent (zero1) or freed (zero2, fsdp). The previous
        unit's reduce-scatter is waited for first: it has had this unit's whole backward to finish,
        and its packed gradients (a unit's worth) need not live beside these."""
        self._settle_reductions()
        world = unit.over.world
        packed = torch.empty(world, unit.shard_numel, dtype=self.precision.reduce_dtype, device=self.ctx.device)
        if unit.grads is not None:  # zero1: its gradient buffer, padded as the shards are
            for region, offset in zip(self._regions(unit, unit.grads), unit.offsets, strict=True):
                packed[:, offset : offset + region.shape[1]].copy_(region)
            unit.grads_spent = True
        else:
            for param, rows, offset in zip(unit.params, unit.rows, unit.offsets, strict=True):
                part = packed[:, offset : offset + rows * _row_numel(param)]
                if param.grad is not None and param.numel() == part.numel():  # no padding: one copy
                    part.copy_(param.grad.view(world, -1))
                    continue
                part.zero_()  # padding, or no gradient on this rank: it contributes zeros
                if param.grad is not None:
                    flat = param.grad.view(-1)
                    for rank, (start, n) in enumerate(self._rank_spans(param, rows, world)):
                        packed[rank, offset : offset + n].copy_(flat[start : start + n])
        for param in unit.params:
            param.grad = None
        home = self._shard_grad_buffer(unit)
        same = home.dtype == packed.dtype and home.device == packed.device
        shard_grad = home if same else torch.empty(unit.shard_numel, dtype=packed.dtype, device=packed.device)
        work = dist.reduce_scatter_single(shard_grad, packed.view(-1), op=dist.ReduceOp.AVG, group=unit.over.group,
                                          async_op=True)
        self.bytes_moved += (packed.numel() + unit.shard_numel) * packed.element_size()
        self._reductions.append((work, unit, shard_grad, home))

    def _settle_reductions(self) -> None:
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

    def _sum_tp_partial(self) -> None:
        """The shard gradients of the blocks' parameters every tp rank holds whole but trains on its
        positions (sequence parallel: norms, row-parallel biases) or its heads (Qwen3's q and k
        norms) only hold this rank's share; sum them over tp."""
        grads = [self._shard_of[id(p)][0].grad for p in self.tp_partial]
        if grads:
            all_reduce_packed([g for g in grads if g is not None], self.mesh.group("tp"), average=False)

    def _shard_grad_buffer(self, unit: Unit) -> torch.Tensor:
        """Where this rank's shard gradients of the unit go, packed, in the master dtype: zero1's
        spent gradient buffer (unless offloaded), else a buffer of their own beside the shards."""
        master = self.precision.param_dtype
        if unit.grads is not None and not self.offload:
            return unit.grads[: unit.shard_numel * master.itemsize // unit.grads.element_size()].view(master)
        return torch.empty(unit.shard_numel, dtype=master, device=self.master_device)

    def _finish_backward(self) -> None:
        if self._sync:
            for unit in self.units:
                if unit is self.root or len(unit.ready) < len(unit.params) or self.stage == 1 or unit.over.experts:
                    self._start_reduce_scatter(unit)  # root, units with unused params, zero1, or experts
            self._settle_reductions()
            self._sum_tp_partial()
        if self.stage == 3:
            for unit in self.units:
                self._free(unit)
        for unit in self.units:
            unit.ready.clear()

    # --- optimizer, clipping, memory, state -----------------------------------------------

    def local_parameters(self) -> list[nn.Parameter]:
        return [shard for unit in self.units for shard in unit.shards]

    def optimizer(self, make: OptimizerFactory) -> torch.optim.Optimizer:
        optimizer = super().optimizer(make)
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self._after_step())
        return optimizer

    def _after_step(self) -> None:
        if self.stage < 3:
            self._gather_all()

    def _gather_all(self) -> None:
        """Bring every rank's shards into the full parameters (zero1 / zero2 after each step), one
        unit's all-gather in flight while the previous one is copied out (two gather buffers at
        most)."""
        if self.stage < 3:
            for unit in self.units:
                unit.gathered = False
        self._start_gather(self.units[0])
        for unit, following in zip(self.units, self.units[1:] + [None], strict=True):
            if following is not None:
                self._start_gather(following)
            self._finish_gather(unit)
            unit.gathered = True

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global norm: squares summed over this rank's shards (padding is zero),
        then over the data-parallel ranks sharding them; over tensor parallel, a tp shard's on
        every tp rank and a tensor every tp rank holds whole on tp rank 0's only, then summed over
        the tp ranks. So each parameter counts once."""
        grads = self.local_grads()
        if self.tp == 1:
            return clip_grad_norm_(grads, grads, max_norm, self.ctx.device, (self.group,))
        counted = [shard.grad for unit in self.units for param, shard in zip(unit.params, unit.shards, strict=True)
                   if shard.grad is not None and (self.tp_rank == 0 or id(param) in self.tensor_shards)]
        return clip_grad_norm_(counted, grads, max_norm, self.ctx.device, (self.group, self.mesh.group("tp")))

    def memory(self, activations: int) -> MemoryBreakdown:
        """Master shards, whatever full parameters and full gradients are alive right now, and
        zero1's gradient buffer. Offloaded, the master shards, their gradients and the optimizer
        state are counted as `host`, not in the device's categories."""
        shards = self.local_parameters()
        shard_grads = [s.grad for s in shards if s.grad is not None]
        full = [p for unit in self.units for p in unit.params if p.untyped_storage().size() > 0]
        full_grads = [p.grad for unit in self.units for p in unit.params if p.grad is not None]
        full_grads += [unit.grads for unit in self.units if unit.grads is not None]
        breakdown = count_memory(shards, self.optim, activations, self.ctx.device)
        if self.offload:
            breakdown.host = storage_bytes([*shards, *shard_grads, *optimizer_state_tensors(self.optim)])
            breakdown.params, breakdown.grads, breakdown.optimizer = storage_bytes(full), storage_bytes(full_grads), 0
        else:
            breakdown.params = storage_bytes(shards + full)
            breakdown.grads = storage_bytes(shard_grads + full_grads)
        breakdown.gathered_peak = self.peak_gathered_bytes
        return breakdown

    def full_tensors(self, names: list[str]) -> Iterator[torch.Tensor | None]:
        """A parameter gathered from its master shards to rank 0 (in their dtype, whatever the
        compute dtype): every rank's padded shard, the first rows of which are the whole; a buffer
        is whole on every rank already. Under hsdp the first replica's shard group gathers; over
        tensor parallel the first data-parallel rank of each tp rank gathers its tp shard, and the
        tp shards are then gathered and joined (a tensor every tp rank holds whole, from tp rank 0)."""
        state = self.module.state_dict(keep_vars=True)
        for name in names:
            if id(state[name]) not in self._shard_of:  # a buffer or a frozen parameter: whole on every rank
                yield state[name].detach() if self.ctx.is_main else None
            else:
                whole = self.whole(state[name])
                yield whole if self.ctx.is_main else None

    def whole(self, param: nn.Parameter) -> torch.Tensor | None:
        """`param` whole on the first rank of the first replica's shard group at tp rank 0, None on
        the others: collective over the ranks that hold a shard of it."""
        shard, rows = self._shard_of[id(param)]
        over = self._unit_of[id(param)].over
        split = self.tensor_shards.get(id(param))
        if self.replica != 0 or (split is None and self.tp_rank != 0):
            return None
        whole = self._gather_to_first(param, shard, rows, over)
        if self._is_expert(param):  # the first of each expert group's edp ranks holds its experts: join them
            return self.experts.gather(whole) if over.rank == 0 else None
        if split is not None and over.rank == 0:
            parts = [torch.empty_like(whole) for _ in range(self.tp)] if self.tp_rank == 0 else None
            gather_in_place(whole, parts, self.mesh.group("tp"))
            whole = split.join(parts) if parts is not None else None
        return whole

    def _gather_to_first(self, param: nn.Parameter, shard: nn.Parameter, rows: int,
                         over: ShardGroup) -> torch.Tensor | None:
        """`param`'s whole value on rank 0 of its shard group, from every rank's `shard` of it."""
        send = shard.detach().to(self.ctx.device).reshape(-1)
        if over.rank != 0:
            gather_in_place(send, None, over.group)
            return None
        gathered = torch.empty(over.world * send.numel(), dtype=send.dtype, device=send.device)
        gather_in_place(send, list(gathered.view(over.world, -1)), over.group)
        return gathered.view(over.world * rows, *param.shape[1:])[: param.shape[0]]

    def named_local_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(name, self._shard_of[id(param)][0]) for name, param in self.module.named_parameters()]

    def as_global(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """This rank's shard as a DTensor sharded along dim 0 over the data-parallel ranks, padding
        dropped: torch.chunk's layout, which is DTensor's, so checkpoints reshard to any world
        size. Over tensor parallel, a tp shard's rows are pieces of the whole tensor wherever its
        split puts them (qkv's rows of q and k, a row-parallel layer's columns): they are named
        with their offsets there (TensorShard.pieces), and load into any other layout alike."""
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

        param, rows = self._layout[name]
        over = self._unit_of[id(param)].over
        real = local[: self._real_rows(param, rows, over.rank)]
        if self._is_expert(param):  # rows of this ep rank's experts: where they lie among all the experts
            full = torch.empty(self.experts.full_shapes[name], device="meta")
            start = self.experts.rank * param.shape[0] + over.rank * rows
            wrapper = LocalShardsWrapper([exact_storage(real)], [(start,) + (0,) * (param.dim() - 1)])
            return DTensor.from_local(wrapper, self.mesh["ep"], [Shard(0)], run_check=False, shape=full.shape,
                                      stride=full.stride())
        split = self.tensor_shards.get(id(param))
        if split is None:
            return DTensor.from_local(exact_storage(real), over.mesh, over.placements, run_check=False,
                                      shape=param.shape, stride=param.stride())
        full = self._full[name]
        pieces = split.pieces(real, over.rank * rows, full.shape, self.tp_rank, self.tp)
        if not pieces:
            raise ValueError(f"{self.cfg.strategy} over tensor parallel: {name} has {param.shape[0]} rows on each of "
                             f"the {self.tp} tp ranks, fewer than the {self.world} data-parallel ranks sharding them")
        wrapper = LocalShardsWrapper([exact_storage(piece) for piece, _ in pieces], [offset for _, offset in pieces])
        return DTensor.from_local(wrapper, self.mesh["tp"], [Shard(split.dim)], run_check=False, shape=full.shape,
                                  stride=full.stride())

    def after_state_loaded(self) -> None:
        if self.stage < 3:
            self._gather_all()
