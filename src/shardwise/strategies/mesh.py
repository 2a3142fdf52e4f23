"""What the strategies that split the model share (`pipeline`, `model-parallel`, `tensor`): a
dp x pp x tp device mesh, one process group per dimension, the model family's parallel plan
(models/plans.py), which says where the model splits, and what a split model needs done across
the mesh.

- Data: the ranks of one model replica (its pipeline stages and tensor shards) read the same share
  of the global batch; the dp dimension says which share.
- Gradients: averaged over the replicas (the dp group), and over the context-parallel ranks that
  split a replica's sequences (the cp group; `tensor` only), once, after the step's last micro-batch.
  One all-reduce of all this rank's gradients, packed, after backward (not overlapped with it, as
  `ddp` does: a replica's backward is already split between stages and shards). Under sequence
  parallel, first summed over the tp group: those of the blocks' parameters each tp rank holds
  whole but computed on its part of the sequence.
- Clipping: the global norm counts every parameter of the whole model once: a tensor shard on each
  of its tp ranks, a replicated parameter (layer norms, embeddings) on tp rank 0 only, a parameter
  held by two stages (a tied embedding and head) on the first only; then the sum goes over
  the tp and pp groups. The norm is then the one a single device computes.
- State: checkpoints and final weights see the model through state_view.py's `SplitView`, which
  `wrap` fills with the plain model's layout before it splits the model and with this rank's part
  after.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from shardwise.config.schema import DEFAULT_BLOCK, HF_MODELS, Config, ConfigError, ModelConfig, ParallelConfig
from shardwise.dist import DistContext
from shardwise.gradients import clip_grad_norm_
from shardwise.materialise import named_tensors
from shardwise.memory import local_tensor, return_free_memory
from shardwise.models.hf import pp_plan_of, tp_plan_of, unsplit_classes_of
from shardwise.models.plans import (
    NEEDS,
    PLANS,
    Located,
    PlanError,
    TpLayout,
    locate,
    plan_for,
    plan_for_name,
    read_tp_plan,
)
from shardwise.parallel.comm import all_reduce_packed
from shardwise.parallel.tensor_group import TensorShard
from shardwise.state_view import SplitView
from shardwise.strategies.base import DeferrableSync


def check_model_split(cfg: Config, world: int) -> None:
    """The mesh fits the world, and the model splits the way it asks: a parallel plan for its
    family, the plan's blocks as units, tp dividing the heads and the MLP (and under sequence
    parallel the sequence). For every strategy that splits a model: tensor and pipeline, and the
    sharded strategies over tensor parallel."""
    m, p = cfg.model, cfg.parallel
    dp, pp, tp = p.mesh_shape(world)
    plan = plan_for_name(m.name)
    if plan is None and m.name in HF_MODELS:  # a transformers family's own plan, as transformers declares it
        _check_transformers_plan(cfg, pp, tp)
    elif plan is None:
        covered = ", ".join(name for each in PLANS for name in each.models)
        theirs = ", ".join(name for name in HF_MODELS if not plan_for_name(name))
        raise ConfigError(f"parallel.strategy = {p.strategy!r}: splits a model as its family's parallel plan says; "
                          f"model.name = {m.name!r} has none (plans exist for {covered}, and every transformers "
                          f"family that declares one: {theirs}). A plan names {NEEDS} (docs/model-families.md)")
    # a plan of ours names its blocks; a transformers family's are among its `_no_split_modules`
    family, blocks = (plan.family, plan.blocks) if plan is not None else (tp_plan_of(m)[0], unsplit_classes_of(m))
    if p.block != DEFAULT_BLOCK and blocks and p.block not in blocks:
        raise ConfigError(f"parallel.block = {p.block!r}: {p.strategy} cuts and splits the {family} plan's "
                          f"blocks ({', '.join(blocks)}); another unit would cut inside a block. Leave "
                          "parallel.block unset")
    check_mesh_fits(p, world)
    for key in ("n_head", "n_kv_head", "d_ff"):
        if getattr(m, key) % tp:
            raise ConfigError(
                f"parallel.tp = {tp}: must divide model.{key} = {getattr(m, key)}; each tp rank computes an equal "
                "share of every block's attention heads, key/value heads and MLP hidden size"
            )
    if p.sequence_parallel and tp < 2:
        raise ConfigError("parallel.sequence_parallel = true: splits the sequence over the tp ranks of each block; "
                          f"needs parallel.tp >= 2 (it is {tp})")
    if p.sequence_parallel and m.seq_len // p.cp % tp:
        of = f"model.seq_len / parallel.cp = {m.seq_len // p.cp}" if p.cp > 1 else f"model.seq_len = {m.seq_len}"
        raise ConfigError(f"parallel.sequence_parallel = true: parallel.tp = {tp} must divide {of}; each tp rank "
                          "holds an equal part of the sequence")


def _check_transformers_plan(cfg: Config, pp: int, tp: int) -> None:
    """A transformers family of no plan of ours, cut into pipeline stages, declares where they lie
    (its base_model_pp_plan); split over tp, it declares a tensor parallel plan shardwise applies
    (models/plans.py's `read_tp_plan`). Its layer list and modules are checked once the model is
    built (cli.py, before launch)."""
    p = cfg.parallel
    family, layout = _transformers_layout(cfg.model.name, cfg.model.hf_config)
    if pp > 1 and not pp_plan_of(cfg.model):
        raise ConfigError(f"parallel.pp = {pp}: cuts a model into pipeline stages as its family's plan says; "
                          f"model.hf_config's family {family!r} declares no base_model_pp_plan in transformers; "
                          "train it under fsdp, or split it over tp (--strategy tensor, or fsdp --tp)")
    if tp < 2:
        return
    if layout is None:
        raise ConfigError(f"parallel.strategy = {p.strategy!r}: splits a model as its family's parallel plan says; "
                          f"model.hf_config's family {family!r} declares no base_model_tp_plan in transformers")
    if isinstance(layout, str):
        raise ConfigError(f"parallel.strategy = {p.strategy!r}: {layout}")
    alone = layout.gathered + layout.split_input + tuple(group.module for group in layout.experts)
    if p.sequence_parallel and alone:
        raise ConfigError(f"parallel.sequence_parallel = true: {family}'s plan splits {alone[0]!r} on its own, which "
                          "takes its whole input; sequence parallel does not compose with it yet")


@functools.cache  # the planner checks each of thousands of candidates against one model
def _transformers_layout(name: str, hf_config: str | None) -> tuple[str, TpLayout | str | None]:
    """A transformers family and its tensor parallel plan as shardwise applies it (read_tp_plan):
    None where it declares none, why not where shardwise does not split one of its layers."""
    family, tp_plan = tp_plan_of(ModelConfig(name=name, hf_config=hf_config))
    if not tp_plan:
        return family, None
    try:
        return family, read_tp_plan(family, tp_plan)
    except PlanError as error:
        return family, str(error)


def check_mesh_fits(p: ParallelConfig, world: int, api: bool = False) -> None:
    """The dp x cp x pp x tp mesh holds every rank of the world: `shardwise train`'s (launch.nproc x
    launch.nnodes), or under the Python API (`api`) the processes torchrun started."""
    dp, pp, tp = p.mesh_shape(world)
    split = p.cp * pp * tp
    if dp * split == world:
        return
    sizes = f"dp x cp x pp x tp = {dp} x {p.cp} x {pp} x {tp}" if p.cp > 1 else f"dp x pp x tp = {dp} x {pp} x {tp}"
    if not api:
        where, remedy = "launch.nproc x launch.nnodes", f"e.g. --nproc {dp * split}"
    else:
        where = "the processes torchrun started"
        remedy = f"give dp = {world // split}" if world % split == 0 else f"start {dp * split} processes"
    raise ConfigError(f"parallel.{sizes} = {dp * split}: must equal the world size {world} ({where}); {remedy}")


class MeshStrategy(DeferrableSync):
    # A meta-built model stays on meta through `prepare`: only what this rank keeps is made real, each
    # block as it is split (`materialised`).
    materialises_whole = False

    @classmethod
    def check_config(cls, cfg: Config, world: int) -> None:
        """The dp x pp x tp mesh fits the world, and the model splits the way it asks."""
        check_model_split(cfg, world)
        cls.check_split(cfg, *cfg.parallel.mesh_shape(world))

    @classmethod
    def check_split(cls, cfg: Config, dp: int, pp: int, tp: int) -> None:
        """What the strategy's own dimension of the mesh asks of the model and the batch."""
        raise NotImplementedError

    def __init__(self, ctx: DistContext, cfg: ParallelConfig) -> None:
        super().__init__(ctx, cfg)
        self.dp, self.pp, self.tp = (self.mesh.size(dim) for dim in ("dp", "pp", "tp"))
        self.dp_group, self.pp_group, self.tp_group = (self.mesh.group(dim) for dim in ("dp", "pp", "tp"))
        self.cp_group = self.mesh.group("cp")
        self.dp_rank, self.pp_rank, self.tp_rank = (self.mesh.rank(dim) for dim in ("dp", "pp", "tp"))
        self.tensor_shards: dict[int, TensorShard] = {}  # id(parameter) -> how it is split over tp
        self.duplicates: set[int] = set()  # ids of parameters an earlier stage also holds (a tied head)
        # The blocks' parameters each tp rank holds whole but trains on its part of the sequence only
        # (sequence parallel: norms, row-parallel biases) or its heads only (Qwen3's q and k norms),
        # whose gradients are summed over tp.
        self.tp_partial: list[nn.Parameter] = []
        # id(block) -> its name in the whole model, noted before a pipeline cuts it (expert parallel names
        # the experts of a block that a later stage on this rank holds by it)
        self.block_names: dict[int, str] = {}
        self.view: SplitView = SplitView(self)  # wrap records the layout before it splits the model

    def locate(self, model: nn.Module) -> Located:
        """The model's parallel plan, found in it; its block class must be the unit `prepare` settled."""
        located = locate(model, plan_for(model, split=self.tp > 1))
        if self.cfg.block not in located.plan.blocks:
            raise PlanError(f"parallel.block = {self.cfg.block!r}: {self.cfg.strategy} cuts and splits the "
                            f"{located.plan.family} plan's blocks ({', '.join(located.plan.blocks)}); another unit "
                            "would cut inside a block. Leave parallel.block unset")
        return located

    # --- a meta-built model: only what this rank holds made real --------------------------------

    def materialise_outside_blocks(self, model: nn.Module) -> None:
        """After the split (`model` holds this rank's part, the rest removed, still on meta): the
        tensors outside the blocks this rank holds made real, as `single` initialises them (a
        stage's embeddings or final norm and head; all of them under `tensor`). Their group is
        initialised whole, the rest freed at once; a rank that holds none of it skips it."""
        if self.materialiser is None:
            return
        root = self.materialiser.groups[-1]
        held = {id(tensor) for _, tensor in named_tensors(model)}
        names = [name for name in root.names if id(self.materialiser.slots[name][0].get()) in held]
        if names:
            self.materialiser.materialise(root, self.ctx.device, self.precision.param_dtype, names=names)
            whole = sum(self.materialiser.meta[name].nbytes for name in root.names if name not in names)
            self._note_setup_bytes(model, whole)

    @contextmanager
    def materialised(self, model: nn.Module, block: nn.Module) -> Iterator[None]:
        """`block`, one of `model`'s blocks, made real (as `single` initialises it) for the `with`,
        which keeps this rank's part of it (tensor parallel: its shards; expert parallel: its share
        of the experts, cut here); after, what `model` no longer holds of it is freed. So setup
        holds this rank's part of the blocks before it and one whole block. (A model that was real
        already had its experts split by `prepare`.)"""
        group = next((g for g in self.materialiser.groups if g.block is block), None) if self.materialiser else None
        if group is None:  # real already: an ordinary model, or a block of another class than parallel.block's
            yield          # (a hybrid's other kind of layer, made real with what lies outside the blocks)
            return
        self.materialiser.materialise(group, self.ctx.device, self.precision.param_dtype)
        self._note_setup_bytes(model)
        if self.experts is not None:  # this rank's share of the block's experts; the rest go with the whole
            self.experts.split(block, self.block_names.get(id(block)))
        yield
        self.materialiser.release(group, model)
        return_free_memory()

    def materialise_whole(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        """`blocks`, which this rank keeps whole (a pipeline stage's without tp), made real one by one."""
        for block in blocks:
            with self.materialised(model, block):
                pass

    def _note_setup_bytes(self, model: nn.Module, passing: int = 0) -> None:
        """`setup_peak_bytes`: the most the model's real tensors (and `passing` bytes beside them) came to."""
        live = sum(tensor.nbytes for _, tensor in named_tensors(model) if not tensor.is_meta) + passing
        self.setup_peak_bytes = max(self.setup_peak_bytes or 0, live)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if self._sync:
            self.synchronize_gradients()

    def synchronize_gradients(self) -> None:
        """After a step's last backward: sum over tp the gradients left partial there (`tp_partial`),
        then average every gradient over the cp group (each rank's are its tokens' share
        of the replica's) and over the dp group."""
        grads = [p.grad for p in self.tp_partial if p.grad is not None]
        if grads:
            all_reduce_packed(grads, self.tp_group, average=False)
        experts = self.experts
        dense = [local_tensor(p.grad) for p in self.local_parameters()
                 if p.grad is not None and not (experts is not None and experts.is_expert(p))]
        if self.cfg.cp > 1:
            all_reduce_packed(dense, self.cp_group)
        if self.dp > 1:
            all_reduce_packed(dense, self.dp_group)
        if experts is not None:  # summed over the ranks holding the same experts, then / (dp x cp)
            experts.average_gradients()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """A tensor shard counts on every tp rank, a replicated tensor on tp rank 0 only, and a
        tied weight on the first stage that holds it; under expert parallel an expert on its ep
        rank (and tp rank 0), a dense parameter (the same on every ep rank) on ep rank 0 only."""
        params = [p for p in self.local_parameters() if p.grad is not None]
        experts, groups = self.experts, (self.tp_group, self.pp_group)
        if experts is not None:
            groups = (*groups, experts.group)

        def counts(param: nn.Parameter) -> bool:
            if experts is not None and experts.is_expert(param):
                return self.tp_rank == 0  # whole on every tp rank, as the MoE layer is
            once = experts is None or experts.rank == 0
            return once and id(param) not in self.duplicates and (id(param) in self.tensor_shards or self.tp_rank == 0)

        return clip_grad_norm_([p.grad for p in params if counts(p)], [p.grad for p in params], max_norm,
                               self.ctx.device, groups)
