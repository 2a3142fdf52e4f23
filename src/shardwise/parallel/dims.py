"""The device mesh of a run: every rank's place in the run's parallel dimensions, and the process
groups its collectives run over. Made once per run, by the strategy (`Strategy.mesh`), from the
config's sizes (`ParallelConfig.mesh`); every strategy and the checkpoints take their groups here.

The dimensions, outermost first; rank = (((r S + s) C + c) P + p) T + t:

- `dp_replicate` (R): replicas that average their gradients and split nothing (`ddp`; the
  replicas of `tensor` and `pipeline`; `hsdp`'s nodes);
- `dp_shard` (S): ranks that split one replica's parameters, gradients and optimizer state
  (`zero1`, `zero2`, `fsdp`; `hsdp` within a node);
- `cp` (C): ranks that split each sequence (context parallel);
- `pp` (P): pipeline stages, each a cut of the model's blocks;
- `tp` (T): ranks that split each block's matrices (tensor parallel).

tp is innermost: its ranks talk in every layer, so they are neighbours, on one node's fastest
links. Then pp, whose stages pass activations at their borders; then cp, whose ranks pass keys and
values in every attention; the data-parallel dimensions talk once a step or once a unit.

Expert parallel (`ep`, parallel/experts.py) is not a dimension of its own: it splits dp into
dp / ep x ep, so each layer's experts are split over `ep` consecutive dp ranks (within a node where
dp_shard holds them), and `edp` are the dp ranks that hold the same experts.

Flattened groups, for collectives over several dimensions at once:

- `dp` (R x S): ranks that read different shares of the global batch;
- `dp_shard_cp` (S x C): what the sharded strategies split a replica's state over (a cp rank's
  gradients are its tokens' share, averaged as a replica's are);
- `dp_cp` (R x S x C): what a gradient every such rank holds whole is averaged over.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch._C._distributed_c10d import Backend

from shardwise.dist import world_timeout

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from shardwise.dist import DistContext

MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "pp", "tp")  # outermost first, as above


@dataclass(frozen=True)
class MeshShape:
    """The sizes of a run's device mesh, by dimension (above: what each holds)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    pp: int = 1
    tp: int = 1
    # Expert parallel: not a dimension of its own but a split of dp (above); the mesh's sizes leave it out.
    ep: int = 1

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, dim) for dim in MESH_DIMS)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: those that read different shares of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return math.prod(self.sizes)

    def __str__(self) -> str:
        dims = [f"{dim} {size}" for dim, size in zip(MESH_DIMS, self.sizes, strict=True) if size > 1]
        return " x ".join(dims) + (f" (ep {self.ep} of dp)" if self.ep > 1 else "") if dims else "one rank"


def node_size(world_size: int) -> int:
    """Processes per node: torchrun's LOCAL_WORLD_SIZE (the whole world when not under torchrun)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


FLATTENED = {"dp": ("dp_replicate", "dp_shard"), "dp_shard_cp": ("dp_shard", "cp"),
             "dp_cp": ("dp_replicate", "dp_shard", "cp")}


class Mesh:
    """The run's mesh over the process group torchrun made: sizes, this rank's coordinates, and a
    process group per dimension and per flattened group above (made by every rank, in one order).
    Made once per process group and shape (`of`) and passed to whatever needs it."""

    @classmethod
    def of(cls, ctx: DistContext, shape: MeshShape) -> Mesh:
        """The mesh of `shape` over `ctx`'s process group: made the first time, then the same one
        (held by the context, not by this module)."""
        if shape not in ctx.meshes:
            ctx.meshes[shape] = cls(ctx, shape)
        return ctx.meshes[shape]

    def __init__(self, ctx: DistContext, shape: MeshShape) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        if shape.world != ctx.world_size:
            raise ValueError(f"mesh {shape}: {shape.world} ranks, but the world has {ctx.world_size}")
        self.shape = shape
        sizes = dict(zip(MESH_DIMS, shape.sizes, strict=True))
        timeouts = _timeout_options(ctx, {**sizes, **{name: math.prod(sizes[dim] for dim in dims)
                                                       for name, dims in FLATTENED.items()}})
        overrides = {dim: timeouts[dim] for dim in MESH_DIMS if dim in timeouts}
        self.device_mesh = init_device_mesh(ctx.device.type, shape.sizes, mesh_dim_names=MESH_DIMS,
                                            backend_override=overrides)
        self.flattened = {name: self.device_mesh[dims]._flatten(name, timeouts.get(name))
                          for name, dims in FLATTENED.items()}
        if shape.ep > 1:
            self._split_dp_for_experts(ctx, shape)

    def _split_dp_for_experts(self, ctx: DistContext, shape: MeshShape) -> None:
        """The `ep` and `edp` groups: dp's ranks (same cp, pp and tp coordinates) as dp / ep x ep;
        `edp_cp`, every rank holding the same experts (same ep, pp and tp coordinates), which read
        different tokens: edp's ranks and, under context parallel, their cp ranks (`edp` without);
        and where dp_replicate splits dp and ep divides dp_shard, `edp_shard`: edp's ranks within
        one replica."""
        from torch.distributed.device_mesh import DeviceMesh

        grid = self.device_mesh.mesh.reshape(shape.dp // shape.ep, shape.ep, shape.cp, shape.pp, shape.tp)
        groups = {"edp": grid.movedim(0, -1).reshape(-1, grid.shape[0]),
                  "ep": grid.movedim(1, -1).reshape(-1, grid.shape[1])}
        if shape.cp > 1:
            groups["edp_cp"] = grid.permute(1, 3, 4, 0, 2).reshape(-1, grid.shape[0] * shape.cp)
        if shape.dp_replicate > 1 and shape.dp_shard % shape.ep == 0:
            # hsdp's: each replica's (node's) edp ranks; across replicas, the same experts' shards are
            # held by the ranks of a dp_replicate group.
            per_replica = grid.reshape(shape.dp_replicate, shape.dp_shard // shape.ep, *grid.shape[1:])
            groups["edp_shard"] = per_replica.movedim(1, -1).reshape(-1, per_replica.shape[1])
        timeout = world_timeout()
        for name, ranks in groups.items():
            members = ranks.tolist()
            group, _ = dist.new_subgroups_by_enumeration(members, timeout=timeout)
            mine = next(each for each in members if ctx.rank in each)
            self.flattened[name] = DeviceMesh.from_group(group, ctx.device.type, mesh=mine, mesh_dim_names=(name,))
        if shape.cp == 1:
            self.flattened["edp_cp"] = self.flattened["edp"]

    def __getitem__(self, dims: str | tuple[str, ...]) -> DeviceMesh:
        """The sub-mesh of `dims` (a dimension, a flattened group, or several dimensions): what a
        DTensor of this rank's part is laid out on."""
        return self.flattened[dims] if isinstance(dims, str) and dims in self.flattened else self.device_mesh[dims]

    def group(self, dim: str) -> dist.ProcessGroup:
        """The ranks that differ from this one only along `dim` (a dimension or a flattened group)."""
        return self[dim].get_group()

    def size(self, dim: str) -> int:
        return self[dim].size()

    def rank(self, dim: str) -> int:
        """This rank's coordinate along `dim`."""
        return self[dim].get_local_rank()

    def global_rank(self, **coordinates: int) -> int:
        """The rank at `coordinates` (by dimension; those not given, this rank's own)."""
        index = tuple(coordinates.get(dim, self.rank(dim)) for dim in MESH_DIMS)
        return int(self.device_mesh.mesh[index])


def _timeout_options(ctx: DistContext, sizes: dict[str, int]) -> dict[str, Backend.Options]:
    """For each dimension or flattened group of `sizes` that is not the whole world, options that give
    its groups the world's timeout (launch.timeout_s). The device mesh makes those with new_group,
    whose default under Gloo is 30 minutes: a stall in an fsdp all-gather would hold its ranks that
    long. A whole-world one is the default group itself; NCCL's are split from it, its options copied."""
    if ctx.backend != "gloo":
        return {}
    options = Backend.Options("gloo", world_timeout())
    return {name: options for name, size in sizes.items() if size != ctx.world_size}
