"""`zero1`, `zero2`, `fsdp` and `hsdp` over pipeline stages (`parallel.pp > 1`, with or without
`tp`, `cp` and `ep`): the pipeline of pipeline.py, whose stages' parameters are sharded over the
data-parallel (and context-parallel) ranks of their stage by fsdp.py's units (a unit per block,
one for the rest of the stage; a block's experts, which the pipeline cut to this rank's share, over
the stage's ranks holding the same ones); under hsdp over those of its node, the shards' gradients
then averaged across nodes (hsdp.py).

A pipeline step runs M micro-batches through its schedule, and a stage's parameters are used in
every one of them, forward and backward (and a split backward's W runs long after its B), so the
sharding acts around the whole schedule, not around each use:

- before the schedule, fsdp gathers every unit of the rank's stages (one all-gather a unit, the
  next in flight while one is copied out) and keeps them for the step: gathering them for each
  micro-batch would move the stage M times over (torchtitan's FSDP x PP keeps them too);
- the micro-batches' gradients accumulate in the full gradients (zero1: in its gradient buffers),
  as a plain pipeline's do;
- after the schedule (the tied head's gradients summed between the first and the last stage
  first), every unit's gradients are reduce-scattered into this rank's shard gradients, averaged
  over the stage's data-parallel ranks; fsdp then frees the full parameters and gradients;
- the optimizer steps on the shards; zero1 and zero2 all-gather the updated shards into the full
  parameters after it, fsdp before the next step.

So between steps fsdp holds its shards of the stage, and during one the whole stage (its tp part)
and its gradients; zero2 holds the same as zero1 here (no gradient can be freed before the last
micro-batch). Evaluation gathers before the pipeline's forward and frees after it.

Checkpoints name each shard as fsdp over tensor parallel does (pieces of the whole tensor with their
offsets), so they load into any strategy and mesh; the final weights gather a tensor over its
stage's data-parallel ranks, then its tp ranks, and the pipeline sends it to rank 0.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from shardwise.config.schema import Config, ConfigError, ParallelConfig
from shardwise.dist import DistContext
from shardwise.gradients import clip_grad_norm_, local_grads
from shardwise.memory import MemoryBreakdown
from shardwise.parallel.pipeline.runner import Activations
from shardwise.state_view import ShardedSplitView
from shardwise.strategies.base import LossFn, OptimizerFactory
from shardwise.strategies.fsdp import ShardedDataParallel
from shardwise.strategies.hsdp import HSDP
from shardwise.strategies.pipeline import Pipeline
from shardwise.strategies.registry import spec


class ShardedPipeline(Pipeline):
    @classmethod
    def check_config(cls, cfg: Config, world: int) -> None:
        p = cfg.parallel
        if spec(p.strategy).across_nodes and cfg.launch.nproc % (p.pp * (p.tp or 1) * p.cp):
            raise ConfigError(f"parallel.pp = {p.pp}: {p.strategy} keeps a replica's pipeline stages (and their "
                              f"tensor- and context-parallel ranks) within a node; launch.nproc = "
                              f"{cfg.launch.nproc} must be a multiple of pp x tp x cp")
        if p.sharding.offload != "none":
            raise ConfigError(f"parallel.sharding.offload = {p.sharding.offload!r}: not over pipeline stages "
                              f"(parallel.pp = {p.pp})")
        super().check_config(cfg, world)

    def __init__(self, ctx: DistContext, cfg: ParallelConfig) -> None:
        super().__init__(ctx, cfg)
        # fsdp.py's (hsdp.py's: sharded within a node, replicated across) on the same mesh.
        self.sharded = (HSDP if spec(cfg.strategy).across_nodes else ShardedDataParallel)(ctx, cfg, self.mesh)
        self.view: ShardedSplitView = ShardedSplitView(self)

    def wrap(self, model: nn.Module) -> nn.Module:
        module = super().wrap(model)
        stages = nn.ModuleList(stage.model for stage in self.stages.values())
        self.sharded.experts = self.experts  # this rank's share of each stage's experts, cut as it was made
        self.sharded.shard_stages(stages, self.cfg.block, dict(self.view.held_parameters()), self.view.full,
                                   self.tensor_shards, self.tp_partial)
        self.view.sharded = self.sharded.view
        # What a stage sends: the working dtype its parameters are gathered in (mixed precision's compute dtype).
        working = self.sharded.sharding.working_dtype
        self.activations = self.module.activations = Activations(self.activations.width, working, self.ctx.device)
        module.register_forward_pre_hook(lambda m, args: self.sharded.gather_units())
        module.register_forward_hook(lambda m, args, out: self.sharded.free_units())
        return module

    def local_parameters(self) -> list[nn.Parameter]:
        return self.sharded.local_parameters()

    def optimizer(self, make: OptimizerFactory) -> torch.optim.Optimizer:
        self.optim = self.sharded.optimizer(make)
        return self.optim

    def forward_backward(self, model: nn.Module, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                         loss_fn: LossFn, accum: int) -> torch.Tensor:
        self.sharded.begin_step()
        return super().forward_backward(model, micro_batches, loss_fn, accum)

    def synchronize_gradients(self) -> None:
        """After the schedule (and the tied head's sum): reduce-scatter every unit's gradients."""
        self.sharded.end_step()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """A shard counts where its parameter would in a plain pipeline: a tp shard on every tp rank,
        what tp ranks hold whole on tp rank 0, a tied weight on the first stage; then summed over the
        stage's data-parallel ranks, its tp ranks and the stages."""
        sharding = self.sharded.sharding
        counted = [sharding.shard_of(p).grad for _, p in self.view.held_parameters()
                   if sharding.holds(p) and sharding.shard_of(p).grad is not None and id(p) not in self.duplicates
                   and (id(p) in self.tensor_shards or self.tp_rank == 0)]
        grads = local_grads(self.local_parameters())
        return clip_grad_norm_(counted, grads, max_norm, self.ctx.device,
                               (self.sharded.group, self.tp_group, self.pp_group))

    def memory(self, activations: int) -> MemoryBreakdown:
        return self.sharded.memory(activations)
