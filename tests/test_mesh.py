"""The run's device mesh: the sizes each strategy's config gives it, every rank's coordinates, and
each process group's ranks, on real Gloo ranks."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from distributed import run_ranks

from shardwise.config.schema import ParallelConfig
from shardwise.dist import DistContext
from shardwise.parallel.dims import FLATTENED, MESH_DIMS, Mesh, MeshShape
from shardwise.strategies.base import mesh_of


@pytest.mark.parametrize(("settings", "world", "node", "shape"), [
    ({"strategy": "ddp"}, 4, None, MeshShape(dp_replicate=4)),
    ({"strategy": "fsdp"}, 4, None, MeshShape(dp_shard=4)),
    ({"strategy": "zero2", "cp": 2}, 8, None, MeshShape(dp_shard=4, cp=2)),
    ({"strategy": "hsdp"}, 8, 4, MeshShape(dp_replicate=2, dp_shard=4)),
    ({"strategy": "tensor", "dp": 2}, 8, None, MeshShape(dp_replicate=2, tp=4)),
    ({"strategy": "pipeline", "tp": 2}, 8, None, MeshShape(pp=4, tp=2)),
    ({"strategy": "tensor", "cp": 2}, 8, None, MeshShape(cp=2, tp=4)),
], ids=["ddp", "fsdp", "zero2-cp", "hsdp", "tensor-dp", "pipeline-tp", "tensor-cp"])
def test_each_strategy_gets_its_mesh_from_the_config(settings, world, node, shape):
    assert mesh_of(ParallelConfig(**settings), world, node) == shape


def coordinates(rank: int, shape: MeshShape) -> dict[str, int]:
    """Rank = (((r S + s) C + c) P + p) T + t, read back."""
    found = {}
    for dim, size in reversed(list(zip(MESH_DIMS, shape.sizes, strict=True))):
        rank, found[dim] = divmod(rank, size)
    return found


def mesh_groups(ctx: DistContext, shapes: list[MeshShape]) -> list[dict]:
    seen = []
    for shape in shapes:
        mesh = Mesh(ctx, shape)
        seen.append({"coordinates": {dim: mesh.rank(dim) for dim in MESH_DIMS},
                     "groups": {dim: sorted(dist.get_process_group_ranks(mesh.group(dim)))
                                for dim in (*MESH_DIMS, *FLATTENED)},
                     "first of my stage": mesh.global_rank(dp_replicate=0, dp_shard=0, cp=0, tp=0)})
    return seen


def test_every_rank_finds_its_coordinates_and_the_ranks_of_each_group():
    shapes = [MeshShape(dp_replicate=2, dp_shard=2), MeshShape(dp_shard=2, cp=2), MeshShape(pp=2, tp=2),
              MeshShape(dp_replicate=2, tp=2)]
    for rank, seen in enumerate(run_ranks(mesh_groups, 4, shapes)):
        for shape, mine in zip(shapes, seen, strict=True):
            assert mine["coordinates"] == coordinates(rank, shape), shape
            for group, dims in {**{dim: (dim,) for dim in MESH_DIMS}, **FLATTENED}.items():
                # the ranks that differ from this one along `dims` only
                members = [other for other in range(4) if all(
                    coordinates(other, shape)[dim] == coordinates(rank, shape)[dim]
                    for dim in MESH_DIMS if dim not in dims)]
                assert mine["groups"][group] == members, (shape, rank, group)
            stage = {**coordinates(rank, shape), "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 0}
            assert mine["first of my stage"] == next(
                other for other in range(4) if coordinates(other, shape) == stage)


def test_a_mesh_that_does_not_cover_the_world_is_refused():
    ctx = DistContext(rank=0, world_size=4, local_rank=0, device=None, backend="gloo")  # no group needed to refuse
    with pytest.raises(ValueError, match="mesh dp_shard 2 x tp 3: 6 ranks, but the world has 4"):
        Mesh(ctx, MeshShape(dp_shard=2, tp=3))
