"""The checkpoint view of a wrapped model: its state by the plain model's names, whatever part of
it this rank holds and however the strategy laid it out.

Checkpoints (checkpoint.py) save and load `state_dict()`: model and optimizer state by parameter
name, every tensor in its global shape and sharing storage with the live state, a DTensor where
this rank holds a shard, so a load writes in place and a checkpoint loads into any strategy and
world size. Final weights (weights_file.py) are written from `full_tensors()`: each tensor whole on
rank 0 alone, one at a time. Pretrained weights (weights.py) load through `state_dict()` too.

A strategy makes the view that matches how it holds the model (`Strategy.view`), and the view
reads the strategy's live layout (its module, optimizer, mesh, shards) when asked:

- `StateView`: the model whole on every rank (single, dp, ddp, ddp-native, FSDP2's DTensors as
  they are), but for experts split over ep;
- `SplitView`: stages and tensor shards (pipeline, model-parallel, tensor);
- `ShardedView`: ZeRO units sharded over the data-parallel ranks (zero1, zero2, fsdp, hsdp),
  over tensor parallel too;
- `ShardedSplitView`: a pipeline whose stages those units shard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from shardwise.dist import DistContext
from shardwise.materialise import state_buffers
from shardwise.memory import exact_storage
from shardwise.parallel.comm import gather_in_place
from shardwise.parallel.dims import Mesh
from shardwise.parallel.experts import ExpertParallel
from shardwise.parallel.shard import Sharding, real_rows
from shardwise.parallel.tensor_group import TensorShard
from shardwise.parallel.whole_matrices import LocalMatrices, ShardedMatrices, TensorMatrices, WholeMatrices


class Holder(Protocol):
    """What a view reads of the strategy that holds the model."""

    ctx: DistContext
    module: nn.Module | None
    optim: torch.optim.Optimizer | None
    experts: ExpertParallel | None


class SplitHolder(Holder, Protocol):
    mesh: Mesh
    tensor_shards: dict[int, TensorShard]  # id(parameter) -> how tensor parallel split it


class ShardedHolder(SplitHolder, Protocol):
    sharding: Sharding
    stage: int  # ZeRO's
    tp: int
    tp_rank: int
    replica: int  # which copy of the shards this rank's group holds (hsdp: its node)
    world: int  # ranks sharding the dense units


class StateView:
    """The model whole on every rank, but for experts split over ep (an ep rank's experts are a
    DTensor of every expert, gathered for the final weights). `rank_state`: state of this rank
    alone that an exact resume needs (ddp's PowerSGD error feedback), as live tensors."""

    def __init__(self, owner: Holder, rank_state: Callable[[], dict[str, torch.Tensor]] | None = None) -> None:
        self.owner = owner
        self._rank_state = rank_state

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters (or shards) this rank holds by the model's names (a tied weight under its first)."""
        return list(self.owner.module.named_parameters())

    def whole_matrices(self) -> WholeMatrices:
        """How the tensors this rank's optimizer steps on are parts of the model's parameters, for
        an optimizer that computes on whole matrices (Muon): here each is whole."""
        return LocalMatrices()

    def named_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """The buffers this rank holds that are the model's state, by the model's names."""
        return state_buffers(self.owner.module)

    def as_global(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """`local`, a tensor shaped like this rank's part of parameter `name`, as the whole
        parameter's tensor: itself where the rank holds it whole, a DTensor where it holds a part."""
        experts = self.owner.experts
        if experts is not None and experts.holds(name):
            return experts.as_global(name, local)
        return local

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Model and optimizer state by parameter name, every tensor in its global shape and
        sharing storage with the live state: what a checkpoint saves, and loads in place."""
        params = self.named_parameters()
        model = {name: self.as_global(name, p.detach()) for name, p in params}
        model.update(self.named_buffers())
        optimizer = {}
        optim = self.owner.optim
        state = optim.state if optim is not None else {}  # none yet: sampling, loading weights
        for name, param in params:
            for key, value in state.get(param, {}).items():
                optimizer[f"{name}.{key}"] = self.as_global(name, value) if value.shape == param.shape else value
        return {"model": model, "optimizer": optimizer}

    def rank_state(self) -> dict[str, torch.Tensor]:
        """A checkpoint keeps it per rank; only a load at the same world size restores it."""
        return self._rank_state() if self._rank_state is not None else {}

    def after_load(self) -> None:
        """Called once `state_dict()`'s tensors have been overwritten by a load."""

    def names(self) -> list[str]:
        """The plain model's state-dict keys (a tied weight under each of its names)."""
        return list(self.owner.module.state_dict(keep_vars=True))

    def full_tensors(self, names: list[str]) -> Iterator[torch.Tensor | None]:
        """Each of `names` (keys of the plain model's state dict), whole, in the storage dtype, on
        rank 0 (None on the others), one at a time and in the order given: what final weights are
        written from, so no rank ever holds more than its part and one tensor. Collective where the
        model is sharded or split: every rank iterates over the same names."""
        owner = self.owner
        state = owner.module.state_dict(keep_vars=True)
        for name in names:
            tensor = _whole(state[name].detach())
            if owner.experts is not None and owner.experts.holds(name):
                tensor = owner.experts.gather(tensor)
            yield tensor if owner.ctx.is_main else None

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The plain model's complete state dict on rank 0, on CPU (empty on the others): the whole
        model in one process, for tests and small models. Every rank calls it."""
        names = self.names()
        return {name: tensor.cpu() for name, tensor in zip(names, self.full_tensors(names), strict=True)
                if tensor is not None}


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2's parameters) gathered whole on every rank; anything else as it is."""
    from torch.distributed.tensor import DTensor  # not at the top: see ShardedView.as_global

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class SplitView(StateView):
    """A model cut into pipeline stages and split over tp: each entry this rank holds by the plain
    model's name, a tensor shard as a DTensor of the whole parameter on the tp dimension, an ep
    rank's experts as one of every expert on the ep dimension. Whatever is held whole on several
    ranks (a replicated parameter on each tp rank, every entry on each dp replica, the tied weight
    on the first and the last stage) is the same tensor on each: DCP writes it once and loads it
    into every rank that holds it. A full tensor comes from the first replica of the stage that
    owns it: its tp shards gathered to the stage's first tp rank, which sends it to rank 0."""

    owner: SplitHolder

    def record_layout(self, model: nn.Module, stage_holds: list[set[int]]) -> None:
        """Note, before the model is split, each state entry's full shape, stride and dtype (as a
        meta tensor: `full`), which stage owns it (the first whose `stage_holds`, ids of state
        tensors, has it) and which names are aliases (a tied weight's second name)."""
        state = model.state_dict(keep_vars=True)
        self.full = {name: t.detach().to("meta") for name, t in state.items()}
        first_name: dict[int, str] = {}
        self._canonical = {name: first_name.setdefault(id(t), name) for name, t in state.items()}
        self._owner = {name: next(s for s, ids in enumerate(stage_holds) if id(t) in ids)
                       for name, t in state.items() if self._canonical[name] == name}

    def record_local_state(self, *models: nn.Module) -> None:
        """After splitting (which keeps the names of what it keeps): the entries of the state this
        rank holds (shards where tensor parallel) by full name, in the model or models it cut (a
        pipeline rank's several stages); a tied weight under its first name, on each stage that
        holds it."""
        self.local = {self._canonical[name]: t for model in models
                      for name, t in model.state_dict(keep_vars=True).items()}

    def held_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters of the stages this rank holds (tp shards where split), by full name."""
        return [(name, t) for name, t in self.local.items() if isinstance(t, nn.Parameter)]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return self.held_parameters()

    def whole_matrices(self) -> WholeMatrices:
        """A stage's matrices whole on its ranks, or split over its tp ranks (each put together by
        an owner among them)."""
        owner = self.owner
        if owner.mesh.size("tp") == 1:
            return LocalMatrices()
        return TensorMatrices(owner.mesh.group("tp"), owner.tensor_shards)

    def named_buffers(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, t) for name, t in self.local.items() if not isinstance(t, nn.Parameter)]

    def as_global(self, name: str, local: torch.Tensor) -> torch.Tensor:
        experts = self.owner.experts
        if experts is not None and experts.holds(name):
            return experts.as_global(name, local)
        shard = self.owner.tensor_shards.get(id(self.local[name]))
        return local if shard is None else shard.as_dtensor(local, self.full[name], self.owner.mesh["tp"])

    def names(self) -> list[str]:
        return list(self._canonical)

    def full_tensors(self, names: list[str]) -> Iterator[torch.Tensor | None]:
        for name in names:
            yield self._full_tensor(self._canonical[name])

    def _full_tensor(self, name: str) -> torch.Tensor | None:
        ctx, mesh = self.owner.ctx, self.owner.mesh
        stage = self._owner[name]
        tensor = self.whole_in_stage(name) if mesh.rank("pp") == stage else None
        source = mesh.global_rank(dp_replicate=0, dp_shard=0, cp=0, pp=stage, tp=0)
        if source != 0:
            if ctx.rank == source:
                dist.send(tensor.contiguous(), dst=0)
            elif ctx.is_main:
                tensor = torch.empty_like(self.full[name], device=ctx.device)
                dist.recv(tensor, src=source)
        return tensor if ctx.is_main else None

    def whole_in_stage(self, name: str) -> torch.Tensor | None:
        """Tensor `name` whole on its stage's first rank (None on the others): collective over the
        stage's ranks that hold a part of it (here the first replica's tp ranks, or for experts the
        ep ranks beside it, which hold the others)."""
        owner, mesh = self.owner, self.owner.mesh
        tensor = self.local[name].detach()
        if owner.experts is not None and owner.experts.holds(name):
            if mesh.rank("edp") != 0 or mesh.rank("cp") != 0:
                return None
            whole = owner.experts.gather(tensor)  # collective over ep: dp ranks 0 to ep - 1
            return whole if mesh.rank("dp") == 0 else None
        if mesh.rank("dp") != 0 or mesh.rank("cp") != 0:
            return None
        shard = owner.tensor_shards.get(id(self.local[name]))
        return tensor if shard is None else _join_tp(tensor, shard, mesh)


def _expert_pieces(real: torch.Tensor, first: int, shape: torch.Size, expert_offset: int) -> list[
        tuple[torch.Tensor, tuple[int, ...]]]:
    """A shard of an expert parameter (`shape`: this ep rank's experts) as pieces of the whole
    tensor, each with its offset: `real` holds rows `first` onward of the parameter as it was split
    (`sharded_shape`: experts, or their rows folded in when there are fewer experts than ranks),
    and this ep rank's experts start at expert `expert_offset` of all of them. Unfolded, the shard
    is one piece; folded, one per expert it reaches into."""
    if real.dim() == len(shape):
        return [(real, (expert_offset + first, *(0,) * (len(shape) - 1)))]
    per_expert = shape[1]  # folded: rows of [experts x d, ...]
    if not real.shape[0]:  # padding only: an empty piece where this rank's rows would start
        return [(real.view(0, *shape[1:]), (expert_offset + shape[0], *(0,) * (len(shape) - 1)))]
    pieces, row = [], first
    while row < first + real.shape[0]:
        expert, inner = divmod(row, per_expert)
        count = min(per_expert - inner, first + real.shape[0] - row)
        piece = real[row - first : row - first + count].view(1, count, *shape[2:])
        pieces.append((piece, (expert_offset + expert, inner, *(0,) * (len(shape) - 2))))
        row += count
    return pieces


def _join_tp(part: torch.Tensor, split: TensorShard, mesh: Mesh) -> torch.Tensor | None:
    """The whole tensor on the first tp rank from every tp rank's `part`; None on the others."""
    first = mesh.rank("tp") == 0
    parts = [torch.empty_like(part) for _ in range(mesh.size("tp"))] if first else None
    gather_in_place(part, parts, mesh.group("tp"))
    return split.join(parts) if parts is not None else None


class ShardedView(StateView):
    """ZeRO units sharded over the data-parallel ranks: each parameter's shard as a DTensor
    sharded along dim 0 over them, padding dropped, which is torch.chunk's layout and DTensor's, so
    checkpoints reshard to any world size. `named`: each parameter by its name in the plain model;
    `full`: the plain model's tensors on meta, by name (needed over tensor parallel)."""

    owner: ShardedHolder

    def __init__(self, owner: ShardedHolder, named: dict[str, nn.Parameter], full: dict[str, torch.Tensor]) -> None:
        super().__init__(owner)
        self.named, self.full = named, full

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Each parameter's shard; a frozen one zero1 and zero2 hold whole, whole."""
        sharding = self.owner.sharding
        return [(name, sharding.shard_of(param) if sharding.holds(param) else param)
                for name, param in self.owner.module.named_parameters()]

    def whole_matrices(self) -> ShardedMatrices:
        """Each shard's matrix assembled whole by its owner rank (parallel/whole_matrices.py), over
        tensor parallel then from the tp ranks' shards of it."""
        owner = self.owner
        inner = TensorMatrices(owner.mesh.group("tp"), owner.tensor_shards) if owner.tp > 1 else LocalMatrices()
        return ShardedMatrices(owner.sharding, inner)

    def as_global(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """Over tensor parallel, a tp shard's rows are pieces of the whole tensor wherever its
        split puts them (qkv's rows of q and k, a row-parallel layer's columns): they are named
        with their offsets there (TensorShard.pieces), and load into any other layout alike."""
        # Imported here, not at the top: torch.distributed.tensor takes 0.6 s to import, and
        # `shardwise plan` checks thousands of configs of the sharded strategies without running one.
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

        owner = self.owner
        param = self.named[name]
        if not owner.sharding.holds(param):  # frozen and whole on every rank (zero1, zero2)
            return local
        rows, shape = owner.sharding.split_of(param)
        over = owner.sharding.unit_of(param).over
        real = local[: real_rows(shape, rows, over.rank)]
        experts = owner.experts
        if experts is not None and experts.is_expert(param):  # rows of this ep rank's experts among all
            full = torch.empty(experts.full_shapes[name], device="meta")
            pieces = _expert_pieces(real, over.rank * rows, param.shape, experts.rank * param.shape[0])
            wrapper = LocalShardsWrapper([exact_storage(piece) for piece, _ in pieces], [at for _, at in pieces])
            return DTensor.from_local(wrapper, owner.mesh["ep"], [Shard(0)], run_check=False, shape=full.shape,
                                      stride=full.stride())
        split = owner.tensor_shards.get(id(param))
        if split is None:
            return DTensor.from_local(exact_storage(real), over.mesh, over.placements, run_check=False,
                                      shape=param.shape, stride=param.stride())
        full = self.full[name]
        pieces = split.pieces(real, over.rank * rows, full.shape, owner.tp_rank, owner.tp)
        if not pieces:
            raise ValueError(f"sharding over tensor parallel: {name} has {param.shape[0]} rows on each of the "
                             f"{owner.tp} tp ranks, fewer than the {owner.world} data-parallel ranks sharding them")
        wrapper = LocalShardsWrapper([exact_storage(piece) for piece, _ in pieces], [offset for _, offset in pieces])
        return DTensor.from_local(wrapper, owner.mesh["tp"], [Shard(split.dim)], run_check=False, shape=full.shape,
                                  stride=full.stride())

    def after_load(self) -> None:
        if self.owner.stage < 3:  # zero1 and zero2 compute with full parameters: made again from the shards
            self.owner.sharding.gather_all()

    def full_tensors(self, names: list[str]) -> Iterator[torch.Tensor | None]:
        """A parameter gathered from its master shards to rank 0 (in their dtype, whatever the
        compute dtype); a buffer is whole on every rank already."""
        owner = self.owner
        state = owner.module.state_dict(keep_vars=True)
        for name in names:
            held = state[name]
            # a buffer or a frozen parameter is whole on every rank
            whole = self.whole(held) if owner.sharding.holds(held) else held.detach()
            yield whole if owner.ctx.is_main else None

    def whole(self, param: nn.Parameter) -> torch.Tensor | None:
        """`param` whole on the first rank of the first replica's shard group at tp rank 0, None on
        the others: collective over the ranks that hold a shard of it. Under hsdp the first
        replica's shard group gathers; over tensor parallel the first data-parallel rank of each tp
        rank gathers its tp shard, and the tp shards are then joined (a tensor every tp rank holds
        whole, from tp rank 0)."""
        owner = self.owner
        over = owner.sharding.unit_of(param).over
        split = owner.tensor_shards.get(id(param))
        if owner.replica != 0 or (split is None and owner.tp_rank != 0):
            return None
        whole = owner.sharding.gather_to_first(param)
        if owner.experts is not None and owner.experts.is_expert(param):
            # the first of each expert group's edp ranks holds its experts: join them
            return owner.experts.gather(whole) if over.rank == 0 else None
        if split is not None and over.rank == 0:
            whole = _join_tp(whole, split, owner.mesh)
        return whole


class ShardedSplitView(SplitView):
    """A pipeline's stages, their units sharded over each stage's data-parallel ranks: a parameter
    by its shard as the units' view (`sharded`) lays it out, gathered over the stage's data-parallel
    ranks and then its tp ranks; a buffer, whole on every rank, from the first."""

    def __init__(self, owner: SplitHolder) -> None:
        super().__init__(owner)
        self.sharded: ShardedView | None = None  # the units' view, once the stages are sharded

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        sharding = self.sharded.owner.sharding
        return [(name, sharding.shard_of(p) if sharding.holds(p) else p) for name, p in self.held_parameters()]

    def whole_matrices(self) -> ShardedMatrices:
        return self.sharded.whole_matrices()

    def as_global(self, name: str, local: torch.Tensor) -> torch.Tensor:
        return self.sharded.as_global(name, local)

    def after_load(self) -> None:
        self.sharded.after_load()

    def whole_in_stage(self, name: str) -> torch.Tensor | None:
        """A sharded parameter gathered as the units' view does; a buffer, or a frozen parameter
        zero1 and zero2 hold unsharded, as a plain pipeline's stage holds it."""
        held = self.local[name]
        if self.sharded.owner.sharding.holds(held):
            return self.sharded.whole(held)
        return super().whole_in_stage(name)
