"""Hybrid sharded data parallel, ours (`hsdp`): shard within a node, replicate across nodes.

The world is the mesh's dp_replicate x dp_shard = nodes x processes per node (parallel/dims.py; torchrun
numbers a node's processes contiguously, so a mesh row is one node). Within a row this is our `fsdp`
(fsdp.py) over the row's group: parameters, gradients and optimizer state are split in N = the
node's processes, and every all-gather and reduce-scatter stays on the node's fast links. Each
node thus holds a whole replica of the model, sharded; after backward the replicas average their
gradient shards with one all-reduce over the column (the ranks holding the same shard on every
node), which is all that crosses between nodes: 2 (R - 1) / R of 1/N of the gradients per rank,
once a step, against fsdp's all-gathers (twice a step) and reduce-scatter of the whole model
spanning the slow links. The price: memory falls by N, not by the world size.

Checkpoints see each shard as a DTensor placed (Replicate(), Shard(0)) on the mesh: written once,
loadable into any strategy and world size like fsdp's.
"""

from __future__ import annotations

import dataclasses

from shardwise.config.schema import ParallelConfig
from shardwise.dist import DistContext
from shardwise.gradients import local_grads
from shardwise.parallel.comm import all_reduce_packed
from shardwise.parallel.dims import Mesh, node_size
from shardwise.parallel.shard import ShardGroup
from shardwise.strategies.fsdp import ShardedDataParallel


class HSDP(ShardedDataParallel):
    def __init__(self, ctx: DistContext, cfg: ParallelConfig, mesh: Mesh | None = None) -> None:
        if ctx.world_size % node_size(ctx.world_size):
            raise ValueError(f"hsdp: world size {ctx.world_size} is not a whole number of nodes of "
                             f"{node_size(ctx.world_size)} processes (LOCAL_WORLD_SIZE); every node must run "
                             "the same --nproc")
        super().__init__(ctx, cfg, mesh)

    def _init_mesh(self) -> None:
        """Shard over the mesh's dp_shard ranks (a node's), replicate over dp_replicate (the nodes)."""
        self.group, self.replicate_group = self.mesh.group("dp_shard"), self.mesh.group("dp_replicate")
        self.world, self.rank = self.mesh.size("dp_shard"), self.mesh.rank("dp_shard")
        self.replicas, self.replica = self.mesh.size("dp_replicate"), self.mesh.rank("dp_replicate")
        self._mesh = self.mesh[("dp_replicate", "dp_shard")]
        from torch.distributed.tensor import Replicate, Shard  # not at the top: see fsdp's _init_mesh

        self._placements = [Replicate(), Shard(0)]

    def _shard_groups(self) -> tuple[ShardGroup, ShardGroup | None]:
        """Under expert parallel (its ep ranks within a node), a block's experts are sharded over the
        node's ranks holding the same ones (`edp_shard`); the ranks holding the same expert shards on
        the other nodes are this rank's dp_replicate group, so the gradients average across nodes
        with the dense ones'."""
        dense, experts = super()._shard_groups()
        if experts is None or self.replicas == 1:
            return dense, experts
        edp = self.mesh["edp_shard"]
        return dense, dataclasses.replace(experts, group=edp.get_group(), world=edp.size(),
                                          rank=edp.get_local_rank(), mesh=edp, placements=experts.placements[-1:])

    def _finish_backward(self) -> None:
        super()._finish_backward()  # reduce-scattered within the node: each rank's shard, averaged there
        if self._sync and self.replicas > 1:
            self._average_over_replicas()

    def _average_over_replicas(self) -> None:
        """Average every gradient shard over the nodes."""
        self.sharding.bytes_moved += all_reduce_packed(local_grads(self.local_parameters()), self.replicate_group)
