"""Sharded data parallel, ours: ZeRO stage 1 (`zero1`), 2 (`zero2`) and 3 (`fsdp`), the model's
units sharded over the data-parallel ranks by parallel/shard.py.

Units are the modules whose class is `parallel.block` (the GPT's `Block`), plus the root:
every parameter not in a unit (embeddings, final norm). The root is gathered for the whole of
forward and backward. Under expert parallel (`parallel.ep`) a block's experts, which differ from
one ep rank to the next, are a unit of their own, sharded over the ranks that hold the same
experts instead (`ShardGroup`; parallel/experts.py). Over tensor parallel (`parallel.tp`) each
block is split over the tp ranks as it is made (parallel/tensor.py), then sharded as a unit.

A meta-built model is made real unit by unit (materialise.py) under fsdp and over tensor
parallel, each unit's shards kept and the rest freed before the next, so setup holds at most the
shards made so far and one whole unit (`setup_peak_bytes`, counted). `parallel.sharding.offload =
"optimizer"` keeps the master shards, their gradients and the optimizer state on the host
(ZeRO-Offload).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardwise.config.schema import Config, ConfigError, ParallelConfig
from shardwise.dist import DistContext, broadcast_from_rank0
from shardwise.gradients import clip_grad_norm_, local_grads
from shardwise.materialise import Materialiser
from shardwise.memory import MemoryBreakdown, count_memory, optimizer_state_tensors, storage_bytes
from shardwise.models.plans import locate
from shardwise.nf4 import quantize_layers
from shardwise.parallel.comm import all_reduce_packed
from shardwise.parallel.dims import Mesh
from shardwise.parallel.shard import GatherHooks, ShardGroup, Sharding, Unit
from shardwise.parallel.tensor import BlockSplitter, TensorParallelGroup, TensorShard
from shardwise.state_view import ShardedView
from shardwise.strategies.base import HookedStrategy, OptimizerFactory, on_grad_accumulated
from shardwise.strategies.mesh import check_model_split
from shardwise.strategies.registry import spec
from shardwise.strategies.sync_batchnorm import convert_sync_batchnorm

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement


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

    def __init__(self, ctx: DistContext, cfg: ParallelConfig, mesh: Mesh | None = None) -> None:
        super().__init__(ctx, cfg, mesh)
        self.stage = spec(cfg.strategy).zero_stage
        precision = self.precision
        self.sharding = Sharding(self.stage, ctx.device, precision.param_dtype,
                                 precision.compute_dtype if precision.mixed else precision.param_dtype,
                                 precision.reduce_dtype, cfg.sharding.offload == "optimizer", cfg.sharding.prefetch,
                                 cfg.sharding.reshard_after_forward)
        self.tensor_shards: dict[int, TensorShard] = {}  # id(parameter) -> how tensor parallel split it
        self.tp_partial: list[nn.Parameter] = []  # parameters whole on every tp rank, their gradients partial over tp
        self._full: dict[str, torch.Tensor] = {}  # over tp: the plain model's state on meta, noted before the split

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
        splitter = self._tensor_splitter()
        blocks = self._make_units(splitter)
        if splitter is not None:
            self.tensor_shards, self.tp_partial = splitter.shards, splitter.finish()
        self.view = ShardedView(self, dict(self.module.named_parameters()), self._full)
        for unit in self.sharding.units:
            for param in unit.params if not unit.frozen else []:
                on_grad_accumulated(param, self._on_grad_ready)
        self._init_backward_state()
        if self.stage == 3:
            GatherHooks(self.sharding, self.module, blocks)
            self.sharding.peak_gathered_bytes = 0  # the peak counts from the first step
        return self.module

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
        self._make_units(None)
        self.tensor_shards, self.tp_partial = tensor_shards, tp_partial
        self.view = ShardedView(self, named, full)
        self.sharding.peak_gathered_bytes = self.sharding.gathered_bytes

    def begin_step(self) -> None:
        """Under a pipeline, before a step's schedule: fsdp's full parameters, for all of the step's
        micro-batches; zero1's gradient buffers, for them to accumulate into."""
        self.gather_units()
        self.sharding.attach_full_grads()

    def end_step(self) -> None:
        """Under a pipeline, after a step's schedule: every unit's gradients reduce-scattered into
        this rank's shards; fsdp's full parameters freed."""
        self._finish_backward()

    def gather_units(self) -> None:
        """fsdp: every unit's full parameters (one all-gather a unit, the next in flight while one
        is copied out). zero1 and zero2 hold them always."""
        if self.stage == 3:
            self.sharding.gather_all()

    def free_units(self) -> None:
        """fsdp: every unit's full parameters freed."""
        self.sharding.free_all()

    def _init_mesh(self) -> None:
        """Shard over the mesh's dp_shard x cp ranks (every rank, unless hsdp replicates across
        nodes): `group` is what parameters are split over, `world` its size and `rank` this rank's
        place in it, `replica` which copy of the shards its group holds; checkpoints see each shard
        as a DTensor with `placements` on `_mesh`."""
        self.group = self.mesh.group("dp_shard_cp")
        self.world, self.rank = self.mesh.size("dp_shard_cp"), self.mesh.rank("dp_shard_cp")
        self.replica = self.mesh.rank("dp_replicate")
        self._mesh: DeviceMesh = self.mesh["dp_shard_cp"]
        # Imported here, not at the top: torch.distributed.tensor takes 0.6 s to import, and
        # `shardwise plan` checks thousands of configs of this class without running one.
        from torch.distributed.tensor import Shard

        self._placements: list[Placement] = [Shard(0)]

    def _shard_groups(self) -> tuple[ShardGroup, ShardGroup | None]:
        """What dense units are sharded over (`_init_mesh`'s group), and experts split over ep (the
        ranks holding the same experts: edp's, and their cp ranks); None without expert parallel."""
        dense = ShardGroup(self.group, self.world, self.rank, self._mesh, tuple(self._placements))
        if self.experts is None:
            return dense, None
        edp = self.mesh["edp_cp"]
        return dense, ShardGroup(edp.get_group(), edp.size(), edp.get_local_rank(), edp, tuple(self._placements),
                                 1 / self.experts.size, experts=True)

    def _tensor_splitter(self) -> BlockSplitter | None:
        """Over a mesh with tp ranks: what splits each block over them as its family's plan lays
        it out (parallel/tensor.py), before the block is sharded as a unit over the data-parallel
        ranks; the plain model's state (`_full`, on meta) noted first. None without tp."""
        if self.tp == 1:
            return None
        located = locate(self.module)
        self._full = {name: t.detach().to("meta") for name, t in self.module.state_dict(keep_vars=True).items()}
        return BlockSplitter(located.plan, TensorParallelGroup(self.mesh.group("tp")), self.cfg.sequence_parallel)

    def _make_units(self, splitter: BlockSplitter | None) -> list[tuple[nn.Module, list[Unit]]]:
        """A unit per block (the parameters under a module of class `parallel.block` that no
        earlier block holds), then the root, as materialise.py groups them; each block with its
        units, in order. fsdp materialises a meta-built model unit by unit, keeping each unit's
        shards only, so setup holds at most the shards made so far and one whole unit
        (`setup_peak_bytes`, counted)."""
        grouping = self.materialiser or Materialiser(self.module, self.cfg.block, self.seed)
        dense, experts = self._shard_groups()
        blocks = []
        self.setup_peak_bytes = 0
        for group in grouping.groups:
            if self.materialiser is not None and (self.stage == 3 or splitter is not None):
                self.materialiser.materialise(group, self.ctx.device, self.precision.param_dtype)
                quantize_layers(self.module, self.nf4_layers, self.precision.compute_dtype)  # this group's
                if self.experts is not None and group.block is not None:
                    self.experts.split(group.block)
            if splitter is not None and group.block is not None:
                splitter.split(group.block)  # the block's layers now hold this rank's tp shards
                if self.materialiser is not None:
                    self.materialiser.release(group, self.module)
                params = list(group.block.parameters())
            else:
                params = grouping.parameters(group)
            # Frozen parameters (LoRA's model) are sharded by fsdp alone: zero1 and zero2 hold whole
            # parameters anyway, and have no gradient of theirs to shard.
            params = [p for p in params if p.requires_grad or self.stage == 3]
            if not params and group.block is not None:
                continue
            # Experts split over ep are a unit of their own, sharded over the ranks holding the same
            # experts; frozen parameters too, gathered and freed with the block, never reduced, and
            # NF4's packed bytes apart from floating ones (a unit's buffer holds one dtype).
            by_group = [(over, frozen, [p for p in params if self._is_expert(p) == expert
                                        and p.requires_grad != frozen and p.is_floating_point() == floating])
                        for over, expert in ((dense, False), (experts, True))
                        for frozen, floating in ((False, True), (True, True), (True, False))]
            made = [self.sharding.add(over, held, frozen, root=group.block is None)
                    for over, frozen, held in by_group if held]
            if group.block is not None:
                blocks.append((group.block, made))
            for unit in made:
                self.setup_peak_bytes = max(self.setup_peak_bytes, self._live_bytes())
                self.sharding.settle(unit)
        return blocks

    def _is_expert(self, param: nn.Parameter) -> bool:
        return self.experts is not None and self.experts.is_expert(param)

    def _live_bytes(self) -> int:
        """Bytes of real storage this rank holds now: the model's tensors that are not meta (nor
        freed; zero1's and zero2's whole parameters are views into their units' buffers), the
        units' shards and zero1's gradient buffers."""
        tensors = [t for t in (*self.module.parameters(), *self.module.buffers()) if not t.is_meta]
        buffers = [b for unit in self.sharding.units for b in (unit.shard_buffer, unit.grads) if b is not None]
        return storage_bytes(tensors + buffers)

    # --- backward: reduce-scatter gradients ----------------------------------------------

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        self._queue_finish_once()
        self.sharding.grad_ready(param, self._sync)

    def backward(self, loss: torch.Tensor) -> None:
        self.sharding.attach_full_grads()
        loss.backward()

    def _finish_backward(self) -> None:
        self.sharding.finish_backward(self._sync)
        if self._sync:
            self._sum_tp_partial()

    def _sum_tp_partial(self) -> None:
        """The shard gradients of the blocks' parameters every tp rank holds whole but trains on its
        positions (sequence parallel: norms, row-parallel biases) or its heads (Qwen3's q and k
        norms) only hold this rank's share; sum them over tp."""
        grads = [self.sharding.shard_of(p).grad for p in self.tp_partial]
        if grads:
            all_reduce_packed([g for g in grads if g is not None], self.mesh.group("tp"), average=False)

    # --- optimizer, clipping, memory, state -----------------------------------------------

    def local_parameters(self) -> list[nn.Parameter]:
        return self.sharding.shards()

    def optimizer(self, make: OptimizerFactory) -> torch.optim.Optimizer:
        optimizer = super().optimizer(make)
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self._after_step())
        return optimizer

    def _after_step(self) -> None:
        if self.stage < 3:
            self.sharding.gather_all()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global norm: squares summed over this rank's shards (padding is zero),
        then over the data-parallel ranks sharding them; over tensor parallel, a tp shard's on
        every tp rank and a tensor every tp rank holds whole on tp rank 0's only, then summed over
        the tp ranks. So each parameter counts once."""
        grads = local_grads(self.local_parameters())
        if self.tp == 1:
            return clip_grad_norm_(grads, grads, max_norm, self.ctx.device, (self.group,))
        counted = [shard.grad for unit in self.sharding.units
                   for param, shard in zip(unit.params, unit.shards, strict=True)
                   if shard.grad is not None and (self.tp_rank == 0 or id(param) in self.tensor_shards)]
        return clip_grad_norm_(counted, grads, max_norm, self.ctx.device, (self.group, self.mesh.group("tp")))

    def memory(self, activations: int) -> MemoryBreakdown:
        """Master shards, whatever full parameters and full gradients are alive right now, and
        zero1's gradient buffer. Offloaded, the master shards, their gradients and the optimizer
        state are counted as `host`, not in the device's categories."""
        units = self.sharding.units
        shards = self.local_parameters()
        shard_grads = [s.grad for s in shards if s.grad is not None]
        full = [p for unit in units for p in unit.params if p.untyped_storage().size() > 0]
        full += [p for p in self.module.parameters() if not self.sharding.holds(p)]  # zero1's, zero2's frozen ones
        full_grads = [p.grad for unit in units for p in unit.params if p.grad is not None]
        full_grads += [unit.grads for unit in units if unit.grads is not None]
        breakdown = count_memory(shards, self.optim, activations, self.ctx.device)
        if self.sharding.offload:
            breakdown.host = storage_bytes([*shards, *shard_grads, *optimizer_state_tensors(self.optim)])
            breakdown.params, breakdown.grads, breakdown.optimizer = storage_bytes(full), storage_bytes(full_grads), 0
        else:
            breakdown.params = storage_bytes(shards + full)
            breakdown.grads = storage_bytes(shard_grads + full_grads)
        breakdown.gathered_peak = self.sharding.peak_gathered_bytes
        return breakdown
