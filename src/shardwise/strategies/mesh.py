"""What the strategies that split the model share (`pipeline`, `model-parallel`, `tensor`): a
dp x pp x tp device mesh, one process group per dimension, and the three things a split model
needs done across it.

- Data: the ranks of one model replica (its pipeline stages and tensor shards) read the same share
  of the global batch; the dp dimension says which share.
- Gradients: averaged over the replicas (the dp group) once, after the step's last micro-batch.
  One all-reduce of all this rank's gradients, packed, after backward (not overlapped with it, as
  `ddp` does: a replica's backward is already split between stages and shards).
- Clipping: the global norm counts every parameter of the whole model once: a tensor shard on each
  of its tp ranks, a replicated parameter (layer norms, embeddings) on tp rank 0 only, a parameter
  held by two stages (the GPT's tied embedding and head) on the first only; then the sum goes over
  the tp and pp groups. The norm is then the one a single device computes.
- State: `full_state_dict` gathers tensor shards within each tp group and sends each stage's
  tensors to rank 0, which gets the plain model's complete state.
- Checkpoints: `state_dict` names each entry this rank holds by the plain model's name, a tensor
  shard as a DTensor of the whole parameter on the tp dimension. Whatever is held whole on several
  ranks (a replicated parameter on each tp rank, every entry on each dp replica, the tied weight on
  the first and the last stage) is the same tensor on each: DCP writes it once and loads it into
  every rank that holds it. So a checkpoint loads into any strategy and mesh.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from shardwise.config import ParallelConfig
from shardwise.dist import DistContext, init_mesh
from shardwise.strategies.base import DeferrableSync

if TYPE_CHECKING:
    from shardwise.strategies.tensor import TensorShard


def find_blocks(model: nn.Module, block: str) -> list[nn.Module]:
    """The model's repeated blocks (modules of class `block`), in order."""
    blocks = [m for m in model.modules() if type(m).__name__ == block]
    if not blocks:
        raise ValueError(f"parallel.block = {block!r}: the model has no module of that class")
    return blocks


class MeshStrategy(DeferrableSync):
    def __init__(self, ctx: DistContext, cfg: ParallelConfig) -> None:
        super().__init__(ctx, cfg)
        self.dp, self.pp, self.tp = cfg.mesh_shape(ctx.world_size)
        self.mesh = init_mesh(ctx, self.dp, self.pp, self.tp)
        self.dp_group, self.pp_group, self.tp_group = (self.mesh.get_group(dim) for dim in ("dp", "pp", "tp"))
        self.dp_rank, self.pp_rank, self.tp_rank = (self.mesh.get_local_rank(dim) for dim in ("dp", "pp", "tp"))
        self.tp_mesh = self.mesh["tp"]  # what tensor shards are DTensors over, in checkpoints
        self.tensor_shards: dict[int, TensorShard] = {}  # id(parameter) -> how it is split over tp
        self.duplicates: set[int] = set()  # ids of parameters an earlier stage also holds (a tied head)

    @property
    def data_rank(self) -> int:
        return self.dp_rank

    @property
    def data_size(self) -> int:
        return self.dp

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if self._sync:
            self.average_over_replicas()

    def average_over_replicas(self) -> None:
        """Average every gradient over the dp group: one all-reduce of them all, packed."""
        if self.dp == 1:
            return
        grads = [p.grad for p in self.local_parameters() if p.grad is not None]
        packed = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(packed, op=dist.ReduceOp.AVG, group=self.dp_group)
        for grad, part in zip(grads, packed.split([g.numel() for g in grads]), strict=True):
            grad.copy_(part.view_as(grad))

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        params = [p for p in self.local_parameters() if p.grad is not None]
        counted = [p.grad for p in params if id(p) not in self.duplicates
                   and (id(p) in self.tensor_shards or self.tp_rank == 0)]
        squares = torch.zeros((), device=self.ctx.device)
        if counted:
            squares = torch.stack([g.float().pow(2).sum() for g in counted]).sum()  # bf16-true's too, in fp32
        dist.all_reduce(squares, group=self.tp_group)
        dist.all_reduce(squares, group=self.pp_group)
        norm = squares.sqrt()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for param in params:
            param.grad.mul_(scale)
        return norm

    # --- the plain model's layout, and this rank's part of it -----------------------------

    def record_layout(self, model: nn.Module, stages: list[nn.Module]) -> None:
        """Note, before the model is split, each state entry's full shape, stride and dtype (as a
        meta tensor), which stage owns it (the first that holds it) and which names are aliases (a
        tied weight's second name)."""
        self._full = {name: t.detach().to("meta") for name, t in model.state_dict(keep_vars=True).items()}
        first_name: dict[int, str] = {}
        self._canonical = {name: first_name.setdefault(id(t), name)
                           for name, t in model.state_dict(keep_vars=True).items()}
        stage_ids = [{id(t) for t in stage.state_dict(keep_vars=True).values()} for stage in stages]
        self._owner = {name: next(s for s, ids in enumerate(stage_ids) if id(t) in ids)
                       for name, t in model.state_dict(keep_vars=True).items() if self._canonical[name] == name}

    def record_local_state(self, model: nn.Module, stage: nn.Module) -> None:
        """After splitting: the entries of the state this rank's `stage` holds (shards where tensor
        parallel), by full name; a tied weight under its first name, on each stage that holds it."""
        held = {id(t) for t in stage.state_dict(keep_vars=True).values()}
        self._local = {name: t for name, t in model.state_dict(keep_vars=True).items()
                       if self._canonical[name] == name and id(t) in held}

    # --- checkpoints: the state by the plain model's names ------------------------------

    def named_local_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(name, t) for name, t in self._local.items() if isinstance(t, nn.Parameter)]

    def named_local_buffers(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, t) for name, t in self._local.items() if not isinstance(t, nn.Parameter)]

    def as_global(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """A tensor shard as a DTensor of the whole parameter on the tp dimension; anything else is
        whole already."""
        shard = self.tensor_shards.get(id(self._local[name]))
        return local if shard is None else shard.as_dtensor(local, self._full[name], self.tp_mesh)

    # --- the plain model's state, gathered on rank 0 --------------------------------------

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        state = {}
        for name, tensor in self._local.items():
            shard = self.tensor_shards.get(id(tensor))
            state[name] = tensor.detach() if shard is None else self._gather_shards(tensor.detach(), shard)
        self._send_stages_to_rank0(state)
        for name, canonical in self._canonical.items():
            if canonical in state:
                state[name] = state[canonical]
        return {name: t.cpu() for name, t in state.items()}

    def _gather_shards(self, shard_tensor: torch.Tensor, shard: TensorShard) -> torch.Tensor:
        parts = [torch.empty_like(shard_tensor) for _ in range(self.tp)]
        dist.all_gather(parts, shard_tensor.contiguous(), group=self.tp_group)
        return shard.join(parts)

    def _send_stages_to_rank0(self, state: dict[str, torch.Tensor]) -> None:
        """Every later stage's entries, from its first replica's first tp rank, to rank 0, name by name."""
        for stage in range(1, self.pp):
            source = int(self.mesh.mesh[0, stage, 0])
            names = [name for name, owner in self._owner.items() if owner == stage]
            for name in names:
                if self.ctx.rank == source:
                    dist.send(state[name].contiguous(), dst=0)
                elif self.ctx.rank == 0:
                    state[name] = torch.empty_like(self._full[name], device=self.ctx.device)
                    dist.recv(state[name], src=source)
