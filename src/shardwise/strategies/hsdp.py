"""Hybrid sharded data parallel, ours (`hsdp`): shard within a node, replicate across nodes.

The world is a 2-D device mesh, replicate x shard = nodes x processes per node (torchrun numbers
a node's processes contiguously, so a mesh row is one node). Within a row this is our `fsdp`
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

import os

from torch.distributed.device_mesh import init_device_mesh

from shardwise.gradients import all_reduce_packed
from shardwise.strategies.fsdp import ShardedDataParallel


def node_size(world_size: int) -> int:
    """Processes per node: torchrun's LOCAL_WORLD_SIZE (the whole world when not under torchrun)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


class HSDP(ShardedDataParallel):
    def _init_mesh(self) -> None:
        shard = node_size(self.ctx.world_size)
        if self.ctx.world_size % shard:
            raise ValueError(f"hsdp: world size {self.ctx.world_size} is not a whole number of nodes of {shard} "
                             "processes (LOCAL_WORLD_SIZE); every node must run the same --nproc")
        self.replicas = self.ctx.world_size // shard
        self._mesh = init_device_mesh(self.ctx.device.type, (self.replicas, shard),
                                      mesh_dim_names=("replicate", "shard"))
        self.group = self._mesh.get_group("shard")
        self.replicate_group = self._mesh.get_group("replicate")
        self.world, self.rank = shard, self._mesh.get_local_rank("shard")
        self.replica = self._mesh.get_local_rank("replicate")
        from torch.distributed.tensor import Replicate, Shard  # not at the top: see fsdp's _init_mesh

        self._placements = [Replicate(), Shard(0)]

    def _finish_backward(self) -> None:
        super()._finish_backward()  # reduce-scattered within the node: each rank's shard, averaged there
        if self._sync and self.replicas > 1:
            self._average_over_replicas()

    def _average_over_replicas(self) -> None:
        """Average every gradient shard over the nodes."""
        self.bytes_moved += all_reduce_packed(self.local_grads(), self.replicate_group)
