"""A model's modules sharded over the data-parallel ranks of a mesh, unit by unit (parallel/shard.py
does a unit's sharding): what `zero1`, `zero2`, `fsdp` and `hsdp` compose over a whole model
(strategies/fsdp.py), and a sharded pipeline over the modules of its rank's stages
(strategies/pipeline.py). The composer decides what a unit is and makes each real, split and cut
before it adds it here (`add`); this module shards it, reduces its gradients and counts it.

**Which ranks shard.** Every data-parallel rank and its context-parallel peers (the mesh's
`dp_shard_cp`), or, across nodes (`hsdp`), the ranks of one node (`dp_shard`; torchrun numbers a
node's processes contiguously, so a mesh row is one node), the nodes holding a replica each
(`dp_replicate`). Within a node every all-gather and reduce-scatter stays on its fast links; after
backward the replicas average their gradient shards with one all-reduce over the column (the
ranks holding the same shard on every node), all that crosses between nodes: 2 (R - 1) / R of
1/N of the gradients per rank once a step, against fsdp's all-gathers (twice a step) and
reduce-scatter of the whole model spanning the slow links. Its price: memory falls by the node's
size N, not by the world size.

**Experts** split over ep differ from one ep rank to the next: a block's experts are a unit of
their own, sharded over the ranks holding the same experts (`edp_cp`; across nodes, a node's
`edp_shard`), averaged across nodes with the dense gradients.

**Tensor parallel.** The blocks' parameters every tp rank holds whole but trains on its positions
(sequence parallel: norms, row-parallel biases) or its heads only (Qwen3's q and k norms) have
partial gradients (`tp_partial`): their shards' gradients are summed over tp.

Checkpoints see each shard as a DTensor with `placements` on `shard_mesh`: (Shard(0),) on
`dp_shard_cp`, or (Replicate(), Shard(0)) on the replicate x shard mesh across nodes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from shardwise.dist import DistContext
from shardwise.gradients import clip_grad_norm_, local_grads
from shardwise.memory import MemoryBreakdown, count_memory, optimizer_state_tensors, storage_bytes
from shardwise.parallel.comm import all_reduce_packed
from shardwise.parallel.dims import Mesh
from shardwise.parallel.experts import ExpertParallel
from shardwise.parallel.float8 import Float8Linear
from shardwise.parallel.float8_gather import Float8Gather
from shardwise.parallel.shard import ShardGroup, Sharding, Unit
from shardwise.parallel.tensor_group import TensorShard

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from torch.distributed.device_mesh import DeviceMesh


class ShardedModel:
    """`module`'s units, added one at a time (`add`), sharded over `mesh`'s data-parallel ranks as
    ZeRO's `sharding.stage` says; `across_nodes`: within a node, replicated across nodes."""

    def __init__(self, module: nn.Module, ctx: DistContext, mesh: Mesh, sharding: Sharding, across_nodes: bool,
                 experts: ExpertParallel | None) -> None:
        self.module, self.ctx, self.mesh, self.sharding, self.experts = module, ctx, mesh, sharding, experts
        self.stage = sharding.stage
        self.optim: torch.optim.Optimizer | None = None  # over the shards; `optimizer` makes it
        self.tp, self.tp_rank = mesh.size("tp"), mesh.rank("tp")
        self.tensor_shards: dict[int, TensorShard] = {}  # id(parameter) -> how tensor parallel split it
        self.tp_partial: list[nn.Parameter] = []  # whole on every tp rank, their gradients partial over tp
        self.setup_peak_bytes = 0  # the most real bytes this rank held while units were added
        self.float8_gathered = 0  # the float8 layers whose weights are gathered as float8 (stage 3, tensorwise)
        # Imported here, not at the top: torch.distributed.tensor takes 0.6 s to import, and
        # `shardwise plan` checks thousands of configs of the strategies that make this without running one.
        from torch.distributed.tensor import Replicate, Shard

        shard_dims = ("dp_shard",) if across_nodes else ("dp_shard_cp",)
        self.group, self.world, self.rank = (f(*shard_dims) for f in (mesh.group, mesh.size, mesh.rank))
        self.replica, self.replicas = mesh.rank("dp_replicate"), mesh.size("dp_replicate")
        # hsdp averages its shards' gradients across nodes; fsdp's dp_shard_cp spans every replica already
        self.replicate_group = mesh.group("dp_replicate") if across_nodes and self.replicas > 1 else None
        self.shard_mesh: DeviceMesh = mesh[("dp_replicate", "dp_shard")] if across_nodes else mesh["dp_shard_cp"]
        self.placements = (Replicate(), Shard(0)) if across_nodes else (Shard(0),)
        self.dense = ShardGroup(self.group, self.world, self.rank, self.shard_mesh, self.placements)
        self.expert_group = None if experts is None else self._expert_group(across_nodes)

    def _expert_group(self, across_nodes: bool) -> ShardGroup:
        """The ranks holding the same experts (edp's, and their cp ranks); across nodes, a node's
        (`edp_shard`): the ranks holding the same expert shards on the other nodes are this rank's
        dp_replicate group, so the gradients average across nodes with the dense ones'."""
        edp = self.mesh["edp_shard"] if across_nodes and self.replicas > 1 else self.mesh["edp_cp"]
        placements = self.placements[-1:] if across_nodes and self.replicas > 1 else self.placements
        return ShardGroup(edp.get_group(), edp.size(), edp.get_local_rank(), edp, placements, 1 / self.experts.size,
                          experts=True)

    def add(self, blocks: list[nn.Module], params: list[nn.Parameter]) -> list[Unit]:
        """`params`, real and split already, as units: consecutive blocks' (`blocks`), or the root's
        (none: every parameter in no block, gathered for the whole of forward and backward). Experts split over
        ep are a unit of their own; frozen parameters (LoRA's model) too, gathered and freed with the
        block, never reduced, and NF4's packed bytes apart from floating ones (a unit's buffer holds
        one dtype). zero1 and zero2 leave frozen parameters whole: they have no gradient to shard."""
        params = [p for p in params if p.requires_grad or self.stage == 3]
        by_group = [(over, frozen, [p for p in params if self.is_expert(p) == expert
                                    and p.requires_grad != frozen and p.is_floating_point() == floating])
                    for over, expert in ((self.dense, False), (self.expert_group, True))
                    for frozen, floating in ((False, True), (True, True), (True, False))]
        made = [self.sharding.add(over, held, frozen, root=not blocks) for over, frozen, held in by_group if held]
        if blocks and self.stage == 3:
            self._gather_in_float8(blocks, made)
        for unit in made:
            self.setup_peak_bytes = max(self.setup_peak_bytes, self._live_bytes())
            self.sharding.settle(unit)
        return made

    def _gather_in_float8(self, blocks: list[nn.Module], units: list[Unit]) -> None:
        """The blocks' tensorwise float8 layers' weights are gathered as float8 (float8_gather.py),
        trained or frozen (LoRA's base)."""
        layers = {id(m.weight): m for block in blocks for m in block.modules()
                  if isinstance(m, Float8Linear) and not m.rule.rowwise}
        for unit in units:
            found = {i: layers[id(p)] for i, p in enumerate(unit.params) if id(p) in layers}
            if found:
                unit.float8 = Float8Gather(unit, found)
                self.float8_gathered += len(found)

    def is_expert(self, param: nn.Parameter) -> bool:
        return self.experts is not None and self.experts.is_expert(param)

    def _live_bytes(self) -> int:
        """Bytes of real storage this rank holds now: the module's tensors that are not meta (nor
        freed; zero1's and zero2's whole parameters are views into their units' buffers), the
        units' shards and zero1's gradient buffers."""
        tensors = [t for t in (*self.module.parameters(), *self.module.buffers()) if not t.is_meta]
        buffers = [b for unit in self.sharding.units for b in (unit.shard_buffer, unit.grads) if b is not None]
        return storage_bytes(tensors + buffers)

    # --- a step: gather, reduce-scatter -------------------------------------------------------

    def begin_step(self) -> None:
        """Before a pipeline's schedule: fsdp's full parameters, for all of the step's micro-batches;
        zero1's gradient buffers, for them to accumulate into."""
        self.gather_all()
        self.sharding.attach_full_grads()

    def gather_all(self) -> None:
        """fsdp: every unit's full parameters (one all-gather a unit, the next in flight while one
        is copied out). zero1 and zero2 hold them always."""
        if self.stage == 3:
            self.sharding.gather_all()

    def free_all(self) -> None:
        """fsdp: every unit's full parameters freed."""
        self.sharding.free_all()

    def finish_backward(self, sync: bool) -> None:
        """After backward: every unit's gradients reduce-scattered into this rank's shards (unless
        `sync` is off: accumulating), then summed over tp where partial, averaged across nodes."""
        self.sharding.finish_backward(sync)
        if not sync:
            return
        partial = [self.sharding.shard_of(p).grad for p in self.tp_partial]
        if partial:
            all_reduce_packed([g for g in partial if g is not None], self.mesh.group("tp"), average=False)
        if self.replicate_group is not None:
            self.sharding.bytes_moved += all_reduce_packed(local_grads(self.shards()), self.replicate_group)

    # --- optimizer, clipping, memory ------------------------------------------------------------

    def shards(self) -> list[nn.Parameter]:
        """The master shards this rank holds and its optimizer steps on."""
        return self.sharding.shards()

    def optimizer(self, make: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]) -> torch.optim.Optimizer:
        """The optimizer over the trained shards; zero1 and zero2 all-gather the updated shards after
        each of its steps (fsdp gathers before the next use)."""
        self.optim = make([p for p in self.shards() if p.requires_grad])
        if self.stage < 3:
            self.optim.register_step_post_hook(lambda opt, args, kwargs: self.sharding.gather_all())
        return self.optim

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global norm: squares summed over this rank's shards (padding is zero),
        then over the ranks sharding them; over tensor parallel, a tp shard's on every tp rank and
        a tensor every tp rank holds whole on tp rank 0's only, then summed over the tp ranks. So
        each parameter counts once."""
        grads = local_grads(self.shards())
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
        shards = self.shards()
        shard_grads = [s.grad for s in shards if s.grad is not None]
        full = [p for unit in units for p in unit.params if p.untyped_storage().size() > 0]
        full += [t for unit in units if unit.float8 is not None for t in unit.float8.tensors()]
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
