"""Pipeline parallel, ours (`pipeline`), and its one-micro-batch case, the naive layer-wise split
(`model-parallel`): the model's blocks cut into stages (parallel/pipeline/stages.py), each rank's
stages split over tp where the mesh has tp ranks (parallel/tensor.py), micro-batches run through
the configured schedule (parallel/pipeline/runner.py).

Each train.micro_batch of samples is split into M = parallel.pipeline.micro_batches micro-batches. The
head tied to the token embedding (the GPT's, GPT-2's), where the first and the last stage are on
two ranks, is held by each: after backward their two gradients are summed between them, so both
copies take the same step, as the one tensor does on one device. Being equal, the two copies are
one entry of a checkpoint, under the embedding's name: written once, loaded into both.

`model-parallel` is the pipeline with one micro-batch (M = 1) on GPipe's lists: one stage
computes at a time, the others wait; the bubble is (P-1)/P.

The loss is broadcast from the last stage's rank to the replica's other ranks, so every rank
(rank 0 included) reports its replica's loss. A step's gradients are whole when the lists end,
every W done: then the tied weight's are summed and the replicas' averaged, and clipping and
fp16's inf check see them all.

**Data parallel over the stages** is the strategy's name's flavour, composed after the cut and
tp: `pipeline`'s replicas average their gradients after the schedule (mesh.py's one packed
all-reduce); under `zero1`, `zero2`, `fsdp` and `hsdp` with `parallel.pp > 1`, each rank's stages
are sharded over their stage's data-parallel (and context-parallel) ranks by
parallel/sharded_model.py, the library fsdp composes over a whole model: a unit per block, one for
the rest of the stage; a block's experts, already cut to this rank's share, over the stage's ranks
holding the same ones; hsdp within a node, averaged across nodes. A stage's parameters are used
by every micro-batch, forward and backward (a split backward's W long after its B), so the
sharding acts around the whole schedule, not around each use, as torchtitan's FSDP x PP does:

- before the schedule, fsdp gathers every unit of the rank's stages (the next unit's all-gather in
  flight while one is copied out) and keeps them for the step: gathering them per micro-batch
  would move the stage M times over;
- the micro-batches' gradients accumulate in the full gradients (zero1: its gradient buffers);
- after the schedule (and the tied head's sum) every unit's gradients are reduce-scattered into
  this rank's shards, averaged over the stage's data-parallel ranks; fsdp then frees the full
  parameters and gradients;
- the optimizer steps on the shards; zero1 and zero2 all-gather the updated shards after it, fsdp
  before the next step.

So between steps fsdp holds its shards, and during one the whole stage (its tp part) and its
gradients; zero2 holds what zero1 does here (no gradient can be freed before the last
micro-batch). Evaluation gathers before the pipeline's forward and frees after it. Checkpoints
name each shard as fsdp over tensor parallel does, so they load into any strategy and mesh.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.config.registry import spec
from shardwise.config.schema import Config, ConfigError, ParallelConfig, PipelineConfig
from shardwise.dist import DistContext, world_timeout
from shardwise.gradients import clip_grad_norm_, local_grads
from shardwise.materialise import Materialiser
from shardwise.memory import MemoryBreakdown
from shardwise.models import moe
from shardwise.parallel.experts import balance_routers
from shardwise.parallel.pipeline.runner import Activations, PipelineModule, PipelineRun
from shardwise.parallel.pipeline.schedules import SCHEDULES, ScheduleError, build, check_micro_batches, virtual_stages
from shardwise.parallel.pipeline.stages import Stage, balanced_split, block_costs, separate, stage_holds
from shardwise.parallel.sharded_model import ShardedModel
from shardwise.parallel.tensor import parallelize_blocks
from shardwise.parallel.tensor_group import TensorParallelGroup
from shardwise.state_view import ShardedSplitView, ShardedView
from shardwise.strategies.base import LossFn, OptimizerFactory, routing_groups
from shardwise.strategies.fsdp import sharded_model
from shardwise.strategies.mesh import MeshStrategy

Group = dist.ProcessGroup


class Pipeline(MeshStrategy):
    runs_schedule = True  # micro-batches through parallel.pipeline.schedule (model-parallel: one, on GPipe's lists)

    @classmethod
    def check_config(cls, cfg: Config, world: int) -> None:
        """First, what the sharded flavour asks of the stages (the mesh's and model's checks after)."""
        p = cfg.parallel
        if spec(p.strategy).across_nodes and cfg.launch.nproc % (p.pp * (p.tp or 1) * p.cp):
            raise ConfigError(f"parallel.pp = {p.pp}: {p.strategy} keeps a replica's pipeline stages (and their "
                              f"tensor- and context-parallel ranks) within a node; launch.nproc = "
                              f"{cfg.launch.nproc} must be a multiple of pp x tp x cp")
        if p.sharding.offload != "none":
            raise ConfigError(f"parallel.sharding.offload = {p.sharding.offload!r}: not over pipeline stages "
                              f"(parallel.pp = {p.pp})")
        super().check_config(cfg, world)

    @classmethod
    def check_split(cls, cfg: Config, dp: int, pp: int, tp: int) -> None:
        m, p = cfg.model, cfg.parallel
        pipelined = cls.runs_schedule
        if pp < 2:
            raise ConfigError(f"parallel.pp = {pp}: a pipeline needs at least 2 stages; "
                              "for data parallel alone use --strategy ddp")
        v = virtual_stages(p.pipeline.schedule, p.pipeline.virtual_stages) if pipelined else 1
        stages = pp * v
        if stages > m.n_layer:
            count = (f" x parallel.pipeline.virtual_stages = {v} ({p.pipeline.schedule}): {stages} stages,"
                     if v > 1 else ":")
            raise ConfigError(f"parallel.pp = {pp}{count} more pipeline stages than the model's {m.n_layer} blocks "
                              "(model.n_layer); every stage needs at least one block")
        points = p.pipeline.split_points
        if points is not None and (len(points) != stages - 1 or points != sorted(set(points))
                                   or not 0 < points[0] <= points[-1] < m.n_layer):
            raise ConfigError(
                f"parallel.pipeline.split_points = {points}: expected {stages - 1} increasing block indices in "
                f"[1, {m.n_layer - 1}], the first block of stages 2..{stages}"
            )
        if not pipelined:
            return
        if cfg.train.micro_batch % p.pipeline.micro_batches:
            raise ConfigError(
                f"parallel.pipeline.micro_batches = {p.pipeline.micro_batches}: must divide train.micro_batch = "
                f"{cfg.train.micro_batch}, the per-replica batch one pipeline run splits into micro-batches"
            )
        try:
            check_micro_batches(p.pipeline.schedule, pp, p.pipeline.micro_batches)
        except ScheduleError as exc:
            raise ConfigError(f"parallel.pipeline.schedule = {p.pipeline.schedule!r}: {exc}; raise "
                              "parallel.pipeline.micro_batches") from None
        if SCHEDULES[p.pipeline.schedule].splits_backward and p.recompute == "selective":
            raise ConfigError(f"parallel.recompute = 'selective': does not compose with {p.pipeline.schedule}'s split "
                              "backward (its weight gradients run later, from what B kept); use blocks or every:K")

    def __init__(self, ctx: DistContext, cfg: ParallelConfig) -> None:
        super().__init__(ctx, cfg)
        self.micro_batches = cfg.pipeline.micro_batches
        self.schedule = build(cfg.pipeline.schedule, self.pp, cfg.pipeline.micro_batches, cfg.pipeline.virtual_stages)
        self.timeline: list[tuple[str, int, int, float, float]] = []  # the last step's, all its runs
        self.window = (0.0, 0.0)  # the last step's forward_backward: perf_counter start and end
        self._tied: tuple[list[nn.Parameter], Group] | None = None  # see _tie_first_and_last
        # The sharded flavour of data parallel over the stages (see the module's docstring): the stages'
        # units (within a node under hsdp, replicated across), made by wrap; None: replicated.
        self.sharded: ShardedModel | None = None
        if spec(cfg.strategy).shards_split_model:
            self.view = ShardedSplitView(self)

    @property
    def recompute_once(self) -> bool:
        return self.schedule.splits_backward

    def _cut(self, model: nn.Module) -> nn.Module:
        """This rank's stages (a model each, copies of one tree sharing the modules they keep), the
        other stages' modules dropped; a meta-built model still on meta."""
        located = self.locate(model)
        self.has_moe = bool(moe.moe_layers(model))  # before the cut: a stage may hold none of them
        layout = self.schedule.layout
        blocks = located.blocks
        self.block_names = {id(module): name for name, module in model.named_modules() if module in blocks}
        starts = [0, *(self.cfg.pipeline.split_points or balanced_split(block_costs(located), layout.stages))]
        self.stage_blocks = list(zip(starts, [*starts[1:], len(blocks)], strict=True))  # [start, stop) per stage
        holds = stage_holds(located, self.stage_blocks)
        self.view.record_layout(model, [set().union(*(holds[s] for s in layout.stages_of(r))) for r in range(self.pp)])
        first, last = list(located.first.values()), list(located.last.values())
        embedding = first[0]
        self.activations = Activations(embedding.embedding_dim, embedding.weight.dtype, self.ctx.device)
        self.vocab_size = located.head.weight.shape[0]
        self.ends = (first, last)  # the modules at either end, before the cut: a tie between them is summed
        mine = layout.stages_of(self.pp_rank)
        models = [located, *(separate(located) for _ in mine[1:])]  # copies before the first stage is cut
        # From here the other stages' modules are out of the model: their parameters are freed.
        self.stages = {s: Stage(each, *self.stage_blocks[s], first=s == 0, last=s == layout.stages - 1)
                       for s, each in zip(mine, models, strict=True)}
        self.first_blocks = {s: blocks[self.stage_blocks[s][0]] for s in mine}
        self.plan = located.plan
        self.mine_blocks = [block for s in mine for block in blocks[slice(*self.stage_blocks[s])]]
        return nn.ModuleList(stage.model for stage in self.stages.values())

    def _split(self, part: nn.ModuleList) -> None:
        """The stages' blocks made real one by one (a meta-built model) and, under tp, each split as
        soon as it is real; then what the stages keep outside their blocks."""
        self.materialise_outside_blocks(part)
        if self.tp > 1:
            self.tensor_shards, self.tp_partial = parallelize_blocks(
                self.mine_blocks, self.plan, TensorParallelGroup(self.tp_group), self.cfg.sequence_parallel,
                functools.partial(self.materialised, part))
        else:
            self.materialise_whole(part, self.mine_blocks)
        self.view.record_local_state(*part)

    def _distribute(self, part: nn.ModuleList) -> nn.Module:
        """The stages joined by the schedule (activations sent between ranks), an embedding tied to the
        head summed between the two stages that hold it, and under the sharded strategies the stages
        sharded over the dp ranks."""
        # After materialising (it installs new parameters, in the removed modules too, a tie kept).
        first, last = self.ends
        first_params = {id(p) for m in first for p in m.parameters()}
        self._tie_first_and_last([p for m in last for p in m.parameters() if id(p) in first_params])
        self.module = PipelineModule(self.stages, self.schedule, self.pp_rank, self.pp_group, self.activations,
                                     self.vocab_size)
        if spec(self.cfg.strategy).shards_split_model:
            self._shard_stages(part)
        return self.module

    def _shard_stages(self, part: nn.ModuleList) -> None:
        """This rank's stages (real, split over tp already, their experts cut to this rank's share)
        sharded into units (parallel/sharded_model.py), a unit per block and one for the rest, with
        no hooks: gathered before the pipeline's forward (evaluation's too) and freed after it;
        around a step's schedule, `forward_backward` gathers and reduce-scatters. A stage sends its
        activations in the working dtype the units gather in (mixed precision's compute dtype)."""
        self.sharded = sharded_model(self, part)
        grouping = Materialiser(part, self.cfg.block, self.seed)
        for group in grouping.groups:
            self.sharded.add([group.block] if group.block is not None else [], grouping.parameters(group))
        self.sharded.tensor_shards, self.sharded.tp_partial = self.tensor_shards, self.tp_partial
        self.view.sharded = ShardedView(self.sharded, dict(self.view.held_parameters()), self.view.full)
        sharding = self.sharded.sharding
        sharding.peak_gathered_bytes = sharding.gathered_bytes
        self.activations = self.module.activations = Activations(self.activations.width, sharding.working_dtype,
                                                                  self.ctx.device)
        self.module.register_forward_pre_hook(lambda m, args: self.sharded.gather_all())
        self.module.register_forward_hook(lambda m, args, out: self.sharded.free_all())

    def _tie_first_and_last(self, shared: list[nn.Parameter]) -> None:
        """For parameters the first and the last stage both hold (an embedding tied to the head):
        where the two stages are on two ranks, a process group per replica, cp and tp rank to sum their
        gradients between the two. On one rank (a V) they are one tensor, whose gradient adds up."""
        layout = self.schedule.layout
        holders = (layout.rank_of(0), layout.rank_of(layout.stages - 1))
        if not shared or holders[0] == holders[1]:
            return
        # new_group is collective over the world: every rank makes every pair, in the same order.
        replicas = [(r, s) for r in range(self.mesh.size("dp_replicate")) for s in range(self.mesh.size("dp_shard"))]
        timeout = world_timeout()
        pairs = {(d, c, t): dist.new_group([self.mesh.global_rank(dp_replicate=r, dp_shard=s, cp=c, pp=stage, tp=t)
                                            for stage in holders], timeout=timeout)
                 for d, (r, s) in enumerate(replicas) for c in range(self.mesh.size("cp")) for t in range(self.tp)}
        if self.pp_rank in holders:
            self._tied = (shared, pairs[self.dp_rank, self.mesh.rank("cp"), self.tp_rank])
        if self.pp_rank == holders[1]:
            self.duplicates = {id(p) for p in shared}

    def local_parameters(self) -> list[nn.Parameter]:
        return self.sharded.shards() if self.sharded is not None else list(self.module.parameters())

    def optimizer(self, make: OptimizerFactory) -> torch.optim.Optimizer:
        self.optim = self.sharded.optimizer(make) if self.sharded is not None else super().optimizer(make)
        return self.optim

    def forward_backward(self, model: nn.Module, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                         loss_fn: LossFn, accum: int) -> torch.Tensor:
        """Each of the `accum` batches runs the schedule over its M micro-batches; then tied
        gradients are summed and the replicas' averaged. Returns the replica's loss sum on every
        rank."""
        loss_sum = torch.zeros((), device=self.ctx.device)
        self.timeline = []
        started = time.perf_counter()
        if self.sharded is not None:  # fsdp's full parameters for all the micro-batches; zero1's gradient buffers
            self.sharded.begin_step()
        for batch in micro_batches:
            if len(batch[0]) % self.micro_batches:  # `shardwise train` checks train.micro_batch before launch
                raise ConfigError(f"parallel.pipeline.micro_batches = {self.micro_batches}: must divide the "
                                  f"{len(batch[0])} samples of each batch this rank runs through the pipeline (its "
                                  "micro-batch); unequal parts would weigh their samples unequally")
            # Under context parallel each of a stage's cp ranks runs the schedule on its tokens, its
            # attention over the group (the context stays open through the backward's recomputation).
            with self.context.split(batch) as (inputs, targets):
                packed = self.context.documents  # each token's document: every micro-batch's its own rows'
                documents = None if packed is None else (self.context, self._micro_batches(packed))
                run = PipelineRun(self.schedule, self.pp_rank, self.stages, self.first_blocks, self.pp_group,
                                  self.activations, self._micro_batches(inputs), self._micro_batches(targets), loss_fn,
                                  accum * self.micro_batches, self.precision, self.scaler, documents)
                run.run()
            loss_sum += run.loss_sum / self.micro_batches
            self.timeline += run.timeline
        layout = self.schedule.layout
        dist.broadcast(loss_sum, group=self.pp_group, group_src=layout.rank_of(layout.stages - 1))
        if self._tied is not None:
            params, group = self._tied
            for param in params:
                if param.requires_grad:  # a frozen tie (LoRA) has no gradient to sum
                    dist.all_reduce(param.grad, group=group)
        self.synchronize_gradients()
        self.window = (started, time.perf_counter())
        return loss_sum

    def synchronize_gradients(self) -> None:
        """Replicated: mesh.py's average; sharded: every unit's gradients reduce-scattered."""
        if self.sharded is None:
            super().synchronize_gradients()
        else:  # every unit's gradients reduce-scattered; fsdp's full parameters freed
            self.sharded.finish_backward(sync=True)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Sharded, a shard counts where its parameter would in a replicated pipeline (a tp shard on
        every tp rank, what tp ranks hold whole on tp rank 0, a tied weight on the first stage), then
        summed over the stage's data-parallel ranks, its tp ranks and the stages."""
        if self.sharded is None:
            return super().clip_grad_norm_(max_norm)
        sharding = self.sharded.sharding
        counted = [sharding.shard_of(p).grad for _, p in self.view.held_parameters()
                   if sharding.holds(p) and sharding.shard_of(p).grad is not None and id(p) not in self.duplicates
                   and (id(p) in self.tensor_shards or self.tp_rank == 0)]
        return clip_grad_norm_(counted, local_grads(self.local_parameters()), max_norm, self.ctx.device,
                               (self.sharded.group, self.tp_group, self.pp_group))

    def memory(self, activations: int) -> MemoryBreakdown:
        return self.sharded.memory(activations) if self.sharded is not None else super().memory(activations)

    def update_routers(self) -> None:
        """The router record is of the whole model, not of this rank's stages only: its stages'
        counts are gathered over pp (`_every_stage_counts`)."""
        if not self.has_moe:
            return
        self.router_stats = balance_routers(self.module, routing_groups(self.mesh, self.cfg), self.experts,
                                            self.ctx.device, self._every_stage_counts)

    def _every_stage_counts(self, routed: torch.Tensor) -> torch.Tensor:
        """Every stage's MoE layers' counts from this rank's (`routed`), gathered over pp in stage
        order (a collective)."""
        rows = iter(routed.cpu())
        mine = {s: [next(rows) for _ in moe.moe_layers(stage.model)] for s, stage in self.stages.items()}
        every: list[dict[int, list[torch.Tensor]]] = [{} for _ in range(self.pp)]
        dist.all_gather_object(every, mine, group=self.pp_group)
        by_stage = {s: counts for held in every for s, counts in held.items()}
        return torch.stack([c for s in sorted(by_stage) for c in by_stage[s]]).to(routed.device)

    def stage_timeline(self) -> list[dict[str, Any]]:
        """The last step's `timeline` of every rank, gathered (a collective), for metrics: each
        rank's place in the pipeline (`stage`, its pp rank, and the `stages` it holds), replica and
        tp rank, its forward_backward `window` and its compute `intervals` [kind (F, B, W, BW),
        micro-batch, stage, start, end], in seconds from the earliest window start. Times go
        through the wall clock, which every process of a host (and NTP-synced hosts) shares."""
        offset = time.time() - time.perf_counter()
        mine = {"rank": self.ctx.rank, "stage": self.pp_rank, "stages": list(self.stages), "replica": self.dp_rank,
                "tp_rank": self.tp_rank, "window": [t + offset for t in self.window],
                "intervals": [[kind, i, s, start + offset, end + offset] for kind, i, s, start, end in self.timeline]}
        ranks = self.ctx.all_gather_object(mine)
        origin = min(rank["window"][0] for rank in ranks)
        for rank in ranks:  # microseconds are plenty, and keep the record short
            rank["window"] = [round(t - origin, 6) for t in rank["window"]]
            rank["intervals"] = [[kind, i, s, round(start - origin, 6), round(end - origin, 6)]
                                 for kind, i, s, start, end in rank["intervals"]]
        return ranks

    def _micro_batches(self, batch: torch.Tensor) -> list[torch.Tensor]:
        # Copies, not views of one storage: a micro-batch's saved inputs are freed (and counted) with it.
        return [part.clone() for part in batch.chunk(self.micro_batches)]


class ModelParallel(Pipeline):
    """`model-parallel`: the layer-wise split people try first, the pipeline with one micro-batch
    on GPipe's lists. Each stage waits while the others compute."""

    runs_schedule = False

    def __init__(self, ctx: DistContext, cfg: ParallelConfig) -> None:
        super().__init__(ctx, dataclasses.replace(cfg, pipeline=PipelineConfig(micro_batches=1, schedule="gpipe")))
