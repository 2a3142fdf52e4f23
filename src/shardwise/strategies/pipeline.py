"""Pipeline parallel, ours (`pipeline`), and its one-micro-batch case, the naive layer-wise split
(`model-parallel`).

The model's blocks, as its family's parallel plan names them (models/plans.py), are cut into
S = P x V contiguous stages (balanced by parameter count, or at `parallel.split_points`), V on
each of the P ranks of a pp group as the schedule lays them out (pipeline_schedules.py: stage k on
rank k mod P; on a V, stages k and 2P-1-k on rank k): the first stage also holds the embeddings,
the last the final norm, the head and the loss, as the plan says. A stage is the model itself
with the other stages' modules removed (`Stage`), running the model's own forward; a rank with
several stages cuts each from its own copy of the model's module tree (`separate`), which shares
everything else. A stage's parameters live only on its rank. The one exception is a head tied to
the token embedding (the GPT's, GPT-2's): where the first and the last stage are on two ranks,
each holds it, and after backward their two gradients are summed between them, so both copies
take the same step, as the one tensor does on one device. Being equal, the two copies are one
entry of a checkpoint, under the embedding's name: written once, loaded into both.

Each train.micro_batch of samples is split into M = parallel.micro_batches micro-batches, which
flow through the stages: activations forward, their gradients backward, each sent point to point
to the rank of the neighbouring stage (or handed over between two stages of one rank). All ranks
of a replica read the same samples, so a receiver knows every message's shape ([micro-batch,
seq, width]) from its own batch; only the tensor travels.

A schedule is data: this rank's list of actions (pipeline_schedules.build: F, B, W, BW and the
sends and receives), the lists the simulator predicts and the validator proved free of deadlock,
which `PipelineRun` runs in order. A send never waits; receives are posted in the order their
sender sends (known from its list), so messages between two ranks match, whatever order they are
waited for in. A split backward (`zb-h1`, `zbv`, `dualpipev`) runs B as
split_backward.backward_input, the gradient of the stage's first block's input only, and W later
from what B kept; recomputed blocks are then checkpointed with recompute.RecomputedOnce, so that
B recomputes them and W uses what B recomputed.

`model-parallel` is the pipeline with one micro-batch (M = 1) on GPipe's lists: one stage
computes at a time, the others wait; the bubble is (P-1)/P.

The loss is computed on the last stage's rank and broadcast to the replica's other ranks, so
every rank (rank 0 included) reports its replica's loss. Under mixed precision every stage runs
its forward under autocast, and fp16's loss scale multiplies the loss on the last stage: every
gradient sent back is scaled with it. A step's gradients are whole when the lists end, every W
done: then the tied weight's are summed and the replicas' averaged, and clipping and fp16's inf
check see them all.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.config import Config, ConfigError, ParallelConfig
from shardwise.dist import DistContext
from shardwise.models import moe
from shardwise.models.plans import Located
from shardwise.pipeline_schedules import (
    BW,
    RECV_B,
    RECV_F,
    SCHEDULES,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    Schedule,
    ScheduleError,
    W,
    build,
    check_micro_batches,
    incoming,
    message,
    virtual_stages,
)
from shardwise.precision import LossScaler, Precision
from shardwise.split_backward import WeightGradients, backward_input
from shardwise.strategies.base import LossFn
from shardwise.strategies.mesh import MeshStrategy, module_input, with_input
from shardwise.strategies.tensor import TensorParallelGroup, parallelize_blocks

Group = dist.ProcessGroup


def balanced_split(sizes: list[int], stages: int) -> list[int]:
    """Where stages 2..P start in `sizes` (a cost per block), so that the costliest stage costs as
    little as it can; every stage gets at least one block."""
    prefix = [0, *itertools.accumulate(sizes)]

    @functools.cache
    def best(start: int, parts: int) -> tuple[int, tuple[int, ...]]:
        """(cost of the costliest stage, stage starts) for blocks start.. in `parts` stages."""
        if parts == 1:
            return prefix[-1] - prefix[start], ()
        options = []
        for end in range(start + 1, len(sizes) - parts + 2):
            rest, starts = best(end, parts - 1)
            options.append((max(prefix[end] - prefix[start], rest), (end, *starts)))
        return min(options)

    return list(best(0, stages)[1])


def block_costs(located: Located) -> list[int]:
    """Parameters per block, the first counting the first stage's embeddings and the last the last
    stage's final norm and head (a head tied to the embedding again: the last stage holds a copy)."""
    counts = [sum(p.numel() for p in block.parameters()) for block in located.blocks]
    counts[0] += sum(p.numel() for m in located.first.values() for p in m.parameters())
    counts[-1] += sum(p.numel() for m in located.last.values() for p in m.parameters())
    return counts


def stage_holds(located: Located, bounds: list[tuple[int, int]]) -> list[set[int]]:
    """Ids of the state tensors each stage of blocks [start, stop) holds: its blocks', the first
    stage's embeddings, the last stage's final norm and head, and on every stage whatever else lies
    outside the blocks."""

    def ids(modules: Iterable[nn.Module]) -> set[int]:
        return {id(t) for m in modules for t in m.state_dict(keep_vars=True).values()}

    first, last = ids(located.first.values()), ids(located.last.values())
    everywhere = ids([located.model]) - ids(located.blocks) - first - last
    return [ids(located.blocks[start:stop]) | everywhere | (first if s == 0 else set())
            | (last if s == len(bounds) - 1 else set()) for s, (start, stop) in enumerate(bounds)]


class KeptLayers(nn.ModuleList):
    """Some entries of a model's ModuleList of blocks under their own indices (`layers.5`), so that a
    stage's state dict names them as the whole model's does; iterated, sliced and indexed by
    position, as a model's forward uses its list."""

    def __init__(self, blocks: dict[int, nn.Module]) -> None:
        super().__init__()
        for index, block in blocks.items():
            self.add_module(str(index), block)

    def __getitem__(self, idx: int | slice) -> nn.Module:
        kept = list(self._modules.values())
        return nn.ModuleList(kept[idx]) if isinstance(idx, slice) else kept[idx]


class EmptyEmbedding(nn.Module):
    """Stands in, on a later stage, for an embedding only the first stage holds: zeros of its width
    and dtype, so the model's code before its first block runs as it is, on shapes alone; the
    stage's first block then takes the activations received in their place."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.width, self.dtype = embedding.embedding_dim, embedding.weight.dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.width, dtype=self.dtype, device=ids.device)


class Stage(nn.Module):
    """One pipeline stage: the model itself, with the other stages' modules removed. It keeps its
    blocks [start, stop) under their own names, the first stage's embeddings if it is the first and
    the last stage's final norm and head if it is the last; the others' are replaced by stand-ins
    without parameters (`EmptyEmbedding`, identities). The model's own forward runs: the first
    stage's from token ids, a later stage's from activations, which enter at its first block in
    place of what the stand-ins made; to logits on the last stage, to activations on the others."""

    def __init__(self, located: Located, start: int, stop: int, first: bool, last: bool) -> None:
        super().__init__()
        self.model, self.first, self.last = located.model, first, last
        self._entering: torch.Tensor | None = None  # a later stage's activations, during its forward
        blocks = located.blocks
        located.replace(located.layers, KeptLayers({i: blocks[i] for i in range(start, stop)}))
        if not first:
            for name, embedding in located.first.items():
                located.replace(name, EmptyEmbedding(embedding))
            blocks[start].register_forward_pre_hook(self._enter, with_kwargs=True)
        if not last:
            for name in located.last:
                located.replace(name, nn.Identity())

    def _enter(self, block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return with_input(block, args, kwargs, self._entering)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """First stage: token ids -> activations; last: activations -> logits; others: activations.
        A model returning an output object (transformers') gives its `logits`."""
        if not self.first:  # the embeddings' stand-ins need the token ids' shape only
            self._entering, x = x, torch.zeros(x.shape[:-1], dtype=torch.long, device=x.device)
        try:
            out = self.model(x)
        finally:
            self._entering = None
        return out if isinstance(out, torch.Tensor) else out.logits


@dataclass(frozen=True)
class Activations:
    """What crosses between stages: [micro-batch, seq, width] activations or their gradients."""

    width: int
    dtype: torch.dtype
    device: torch.device

    def empty(self, tokens: torch.Tensor) -> torch.Tensor:
        """A buffer for the activations of the micro-batch whose token ids are `tokens`."""
        return torch.empty(*tokens.shape, self.width, dtype=self.dtype, device=self.device)


def send(tensor: torch.Tensor, stage: int, group: Group) -> dist.Work:
    return dist.isend(tensor.contiguous(), group=group, group_dst=stage)


def post_receive(buffer: torch.Tensor, stage: int, group: Group) -> dist.Work:
    return dist.irecv(buffer, group=group, group_src=stage)


def separate(located: Located) -> Located:
    """The same model found in a copy of its module tree along the paths a `Stage` replaces (the
    blocks' list, the first and the last stage's modules), every other module shared: cutting one
    stage from the copy leaves the original whole, so that one rank can cut several stages."""
    def shallow(module: nn.Module) -> nn.Module:
        twin = copy.copy(module)
        twin._modules = dict(module._modules)  # its own children: replacing one leaves the original's
        return twin

    copies = {"": shallow(located.model)}
    for name in (located.layers, *located.first, *located.last):
        path = name.split(".")[:-1]
        for depth in range(1, len(path) + 1):
            prefix, parent = ".".join(path[:depth]), ".".join(path[:depth - 1])
            if prefix not in copies:
                copies[prefix] = shallow(copies[parent]._modules[path[depth - 1]])
                copies[parent]._modules[path[depth - 1]] = copies[prefix]
    return dataclasses.replace(located, model=copies[""], first=dict(located.first), last=dict(located.last))


class PipelineRun:
    """This rank's part in one pipeline run of M micro-batches: its list of the schedule's actions,
    run in order on its stages. `timeline` notes when each compute ran: (kind, micro-batch, stage,
    start, end), perf_counter seconds; the rest of the run the rank waited."""

    def __init__(self, schedule: Schedule, rank: int, stages: dict[int, Stage], first_blocks: dict[int, nn.Module],
                 group: Group,
                 activations: Activations, inputs: list[torch.Tensor], targets: list[torch.Tensor], loss_fn: LossFn,
                 divisor: int, precision: Precision, scaler: LossScaler | None) -> None:
        self.schedule, self.rank, self.stages, self.group = schedule, rank, stages, group
        self.first_blocks = first_blocks  # each stage's first block, whose input B's gradient is of
        self.activations = activations
        self.inputs, self.targets = inputs, targets
        self.loss_fn, self.divisor = loss_fn, divisor
        self.precision, self.scaler = precision, scaler
        self.last = schedule.layout.stages - 1
        self.ready: dict[tuple[str, int, int], torch.Tensor] = {}  # a message here: to send, or to use
        # F's (input, first block's input, output or loss), until the backward
        self.held: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.weights: dict[tuple[int, int], WeightGradients] = {}  # B's, until W
        self.expected = incoming(schedule, rank)  # per peer, the messages not yet posted, in its send order
        self.posted: dict[tuple[str, int, int], tuple[dist.Work, torch.Tensor]] = {}
        self.sends: list[tuple[dist.Work, torch.Tensor]] = []  # kept until done: the buffer must outlive the send
        self.loss_sum = torch.zeros((), device=activations.device)
        self.timeline: list[tuple[str, int, int, float, float]] = []
        self._entered: list[torch.Tensor] = []  # the first block's input, caught in each forward

    def run(self) -> None:
        do = {F: self._forward, BW: self._backward, B: self._input_backward, W: self._weight_backward,
              SEND_F: self._send, SEND_B: self._send, RECV_F: self._receive, RECV_B: self._receive}
        hooks = [block.register_forward_pre_hook(self._enter, with_kwargs=True) for block in self.first_blocks.values()]
        try:
            for action in self.schedule.actions[self.rank]:
                do[action.kind](action)
        finally:
            for hook in hooks:
                hook.remove()
        for work, _ in self.sends:
            work.wait()

    def _enter(self, block: nn.Module, args: tuple, kwargs: dict) -> None:
        """After a later stage's own hook put the stage's input in: the tensor the block computes from."""
        self._entered.append(module_input(block, args, kwargs))

    def _forward(self, a: Action) -> None:
        i, s = a.micro_batch, a.stage
        x = self.inputs[i] if s == 0 else self.ready.pop(message(a)).requires_grad_()
        started = time.perf_counter()
        # A Mixture-of-Experts layer's auxiliary loss is backpropagated as this micro-batch's loss is.
        scale = (self.scaler.scale if self.scaler else 1.0) / self.divisor
        with self.precision.autocast(self.activations.device), moe.loss_scale(scale):
            out = self.stages[s](x)
            if s == self.last:
                out = self.loss_fn(out, self.targets[i])
                self.loss_sum += out.detach()
        self.timeline.append((F, i, s, started, time.perf_counter()))
        if s != self.last:
            self.ready["act", i, s] = out.detach()  # the next stage's input, sent or handed over
        self.held[i, s] = (x, self._entered.pop(), out)

    def _backward_from(self, a: Action) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The forward's input, first block's input and output, and the output's gradient."""
        i, s = a.micro_batch, a.stage
        x, entered, out = self.held.pop((i, s))
        if s != self.last:
            return x, entered, out, self.ready.pop(message(a))
        out = out / self.divisor  # the loss: this micro-batch's share of the step's mean
        return x, entered, self.scaler.scale_loss(out) if self.scaler else out, None  # fp16: every stage's scaled

    def _backward(self, a: Action) -> None:
        x, _, out, grad = self._backward_from(a)
        started = time.perf_counter()
        torch.autograd.backward(out, grad)
        self.timeline.append((BW, a.micro_batch, a.stage, started, time.perf_counter()))
        if a.stage > 0:
            self.ready["grad", a.micro_batch, a.stage] = x.grad

    def _input_backward(self, a: Action) -> None:
        _, entered, out, grad = self._backward_from(a)
        started = time.perf_counter()
        (entered_grad,), weights = backward_input(out, grad, [entered], self.stages[a.stage].parameters())
        self.timeline.append((B, a.micro_batch, a.stage, started, time.perf_counter()))
        self.weights[a.micro_batch, a.stage] = weights
        if a.stage > 0:  # a later stage's first block takes the stage's input itself
            self.ready["grad", a.micro_batch, a.stage] = entered_grad

    def _weight_backward(self, a: Action) -> None:
        started = time.perf_counter()
        self.weights.pop((a.micro_batch, a.stage)).run()
        self.timeline.append((W, a.micro_batch, a.stage, started, time.perf_counter()))

    def _send(self, a: Action) -> None:
        tensor = self.ready.pop(message(a))
        self.sends.append((send(tensor, self.schedule.layout.peer(a), self.group), tensor))

    def _receive(self, a: Action) -> None:
        """Wait for `a`'s message, having posted the receives of all its sender sends before it, and
        post the one after, so that it travels while this rank computes."""
        peer, wanted = self.schedule.layout.peer(a), message(a)
        while wanted not in self.posted:
            self._post_next(peer)
        work, buffer = self.posted.pop(wanted)
        self._post_next(peer)
        work.wait()
        self.ready[wanted] = buffer

    def _post_next(self, peer: int) -> None:
        if self.expected[peer]:
            item = self.expected[peer].pop(0)
            buffer = self.activations.empty(self.inputs[item[1]])
            self.posted[item] = (post_receive(buffer, peer, self.group), buffer)


class PipelineModule(nn.Module):
    """What the trainer holds: this rank's stages, and for evaluation a forward through the whole
    pipeline, whose logits the last stage's rank broadcasts to the others so every rank can compute
    the loss like any model's. Training runs the schedule instead (Strategy.forward_backward)."""

    def __init__(self, stages: dict[int, Stage], schedule: Schedule, rank: int, group: Group,
                 activations: Activations, vocab_size: int) -> None:
        super().__init__()
        self.stages = nn.ModuleDict({str(s): stage for s, stage in stages.items()})
        self.layout, self.rank, self.group = schedule.layout, rank, group
        self.activations = activations
        self.vocab_size = vocab_size

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            raise RuntimeError("a pipeline trains through its schedule (Strategy.forward_backward); "
                               "its forward runs under torch.no_grad() only")
        last = self.layout.stages - 1
        out = idx
        for s in self.layout.stages_of(self.rank):  # in the order the data meets them
            x = idx if s == 0 else out
            if s > 0 and self.layout.rank_of(s - 1) != self.rank:
                x = self.activations.empty(idx)
                post_receive(x, self.layout.rank_of(s - 1), self.group).wait()
            out = self.stages[str(s)](x)
            if s != last and self.layout.rank_of(s + 1) != self.rank:
                send(out, self.layout.rank_of(s + 1), self.group).wait()
        # Logits travel in the activations' dtype, which every stage knows: under autocast the
        # head computes in 16 bits, and the float32 they come to holds them exactly.
        holder = self.layout.rank_of(last)
        if self.rank == holder:
            out = out.to(self.activations.dtype)
        else:
            out = torch.empty((*idx.shape, self.vocab_size), dtype=self.activations.dtype, device=idx.device)
        dist.broadcast(out, group=self.group, group_src=holder)
        return out


class Pipeline(MeshStrategy):
    runs_schedule = True  # micro-batches through parallel.schedule (model-parallel: one, on GPipe's lists)

    @classmethod
    def check_split(cls, cfg: Config, dp: int, pp: int, tp: int) -> None:
        m, p = cfg.model, cfg.parallel
        pipelined = cls.runs_schedule
        if pp < 2:
            raise ConfigError(f"parallel.pp = {pp}: a pipeline needs at least 2 stages; "
                              "for data parallel alone use --strategy ddp")
        v = virtual_stages(p.schedule, p.virtual_stages) if pipelined else 1
        stages = pp * v
        if stages > m.n_layer:
            count = f" x parallel.virtual_stages = {v} ({p.schedule}): {stages} stages," if v > 1 else ":"
            raise ConfigError(f"parallel.pp = {pp}{count} more pipeline stages than the model's {m.n_layer} blocks "
                              "(model.n_layer); every stage needs at least one block")
        points = p.split_points
        if points is not None and (len(points) != stages - 1 or points != sorted(set(points))
                                   or not 0 < points[0] <= points[-1] < m.n_layer):
            raise ConfigError(
                f"parallel.split_points = {points}: expected {stages - 1} increasing block indices in "
                f"[1, {m.n_layer - 1}], the first block of stages 2..{stages}"
            )
        if not pipelined:
            return
        if cfg.train.micro_batch % p.micro_batches:
            raise ConfigError(
                f"parallel.micro_batches = {p.micro_batches}: must divide train.micro_batch = "
                f"{cfg.train.micro_batch}, the per-replica batch one pipeline run splits into micro-batches"
            )
        try:
            check_micro_batches(p.schedule, pp, p.micro_batches)
        except ScheduleError as exc:
            raise ConfigError(f"parallel.schedule = {p.schedule!r}: {exc}; raise parallel.micro_batches") from None
        if SCHEDULES[p.schedule].splits_backward and p.recompute == "selective":
            raise ConfigError(f"parallel.recompute = 'selective': does not compose with {p.schedule}'s split "
                              "backward (its weight gradients run later, from what B kept); use blocks or every:K")

    def __init__(self, ctx: DistContext, cfg: ParallelConfig) -> None:
        super().__init__(ctx, cfg)
        self.micro_batches = cfg.micro_batches
        self.schedule = build(cfg.schedule, self.pp, cfg.micro_batches, cfg.virtual_stages)
        self.timeline: list[tuple[str, int, int, float, float]] = []  # the last step's, all its runs
        self.window = (0.0, 0.0)  # the last step's forward_backward: perf_counter start and end
        self._tied: tuple[list[nn.Parameter], Group] | None = None  # see _tie_first_and_last

    @property
    def recompute_once(self) -> bool:
        return self.schedule.splits_backward

    def wrap(self, model: nn.Module) -> nn.Module:
        # A meta-built model stays on meta until the stage is cut out of it: then only the stage's
        # blocks (each split as soon as it is real under tp) and what it keeps outside them are made real.
        model = self.prepare(model, materialise=False)
        located = self.locate(model)
        layout = self.schedule.layout
        blocks = located.blocks
        starts = [0, *(self.cfg.split_points or balanced_split(block_costs(located), layout.stages))]
        self.stage_blocks = list(zip(starts, [*starts[1:], len(blocks)], strict=True))  # [start, stop) per stage
        holds = stage_holds(located, self.stage_blocks)
        self.record_layout(model, [set().union(*(holds[s] for s in layout.stages_of(r))) for r in range(self.pp)])
        first, last = list(located.first.values()), list(located.last.values())
        embedding = first[0]
        self.activations = Activations(embedding.embedding_dim, embedding.weight.dtype, self.ctx.device)
        vocab_size = located.head.weight.shape[0]
        mine = layout.stages_of(self.pp_rank)
        models = [located, *(separate(located) for _ in mine[1:])]  # copies before the first stage is cut
        # From here the other stages' modules are out of the model: their parameters are freed.
        self.stages = {s: Stage(each, *self.stage_blocks[s], first=s == 0, last=s == layout.stages - 1)
                       for s, each in zip(mine, models, strict=True)}
        self.first_blocks = {s: blocks[self.stage_blocks[s][0]] for s in mine}
        # This rank's part: its stages' models (copies of one tree, sharing the modules they keep).
        part = nn.ModuleList(stage.model for stage in self.stages.values())
        mine_blocks = [block for s in mine for block in blocks[slice(*self.stage_blocks[s])]]
        self.materialise_outside_blocks(part)
        if self.tp > 1:
            self.tensor_shards, self.tp_partial = parallelize_blocks(
                mine_blocks, located.plan, TensorParallelGroup(self.tp_group), self.cfg.sequence_parallel,
                functools.partial(self.materialised, part))
        else:
            self.materialise_whole(part, mine_blocks)
        # After materialising (it installs new parameters, in the removed modules too, a tie kept).
        first_params = {id(p) for m in first for p in m.parameters()}
        tied = [p for m in last for p in m.parameters() if id(p) in first_params]
        self.record_local_state(*part)
        self._tie_first_and_last(tied)
        self.module = PipelineModule(self.stages, self.schedule, self.pp_rank, self.pp_group, self.activations,
                                     vocab_size)
        return self.module

    def _tie_first_and_last(self, shared: list[nn.Parameter]) -> None:
        """For parameters the first and the last stage both hold (an embedding tied to the head):
        where the two stages are on two ranks, a process group per replica and tp rank to sum their
        gradients between the two. On one rank (a V) they are one tensor, whose gradient adds up."""
        layout = self.schedule.layout
        holders = (layout.rank_of(0), layout.rank_of(layout.stages - 1))
        if not shared or holders[0] == holders[1]:
            return
        # new_group is collective over the world: every rank makes every pair, in the same order.
        replicas = [(r, s) for r in range(self.mesh.size("dp_replicate")) for s in range(self.mesh.size("dp_shard"))]
        pairs = {(d, t): dist.new_group([self.mesh.global_rank(dp_replicate=r, dp_shard=s, cp=0, pp=stage, tp=t)
                                         for stage in holders])
                 for d, (r, s) in enumerate(replicas) for t in range(self.tp)}
        if self.pp_rank in holders:
            self._tied = (shared, pairs[self.dp_rank, self.tp_rank])
        if self.pp_rank == holders[1]:
            self.duplicates = {id(p) for p in shared}

    def local_parameters(self) -> list[nn.Parameter]:
        return list(self.module.parameters())

    def forward_backward(self, model: nn.Module, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                         loss_fn: LossFn, accum: int) -> torch.Tensor:
        """Each of the `accum` batches runs the schedule over its M micro-batches; then tied
        gradients are summed and the replicas' averaged. Returns the replica's loss sum on every
        rank."""
        loss_sum = torch.zeros((), device=self.ctx.device)
        self.timeline = []
        started = time.perf_counter()
        for inputs, targets in micro_batches:
            run = PipelineRun(self.schedule, self.pp_rank, self.stages, self.first_blocks, self.pp_group,
                              self.activations, self._split(inputs), self._split(targets), loss_fn,
                              accum * self.micro_batches, self.precision, self.scaler)
            run.run()
            loss_sum += run.loss_sum / self.micro_batches
            self.timeline += run.timeline
        layout = self.schedule.layout
        dist.broadcast(loss_sum, group=self.pp_group, group_src=layout.rank_of(layout.stages - 1))
        if self._tied is not None:
            params, group = self._tied
            for param in params:
                dist.all_reduce(param.grad, group=group)
        self.synchronize_gradients()
        self.window = (started, time.perf_counter())
        return loss_sum

    def model_router_counts(self, routed: torch.Tensor) -> torch.Tensor:
        """Every stage's MoE layers' counts, gathered over pp in stage order (a collective): rank
        0 writes the router record of the whole model, not of its stages only."""
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

    def _split(self, batch: torch.Tensor) -> list[torch.Tensor]:
        # Copies, not views of one storage: a micro-batch's saved inputs are freed (and counted) with it.
        return [part.clone() for part in batch.chunk(self.micro_batches)]


class ModelParallel(Pipeline):
    """`model-parallel`: the layer-wise split people try first, the pipeline with one micro-batch
    on GPipe's lists. Each stage waits while the others compute."""

    runs_schedule = False

    def __init__(self, ctx: DistContext, cfg: ParallelConfig) -> None:
        super().__init__(ctx, dataclasses.replace(cfg, micro_batches=1, schedule="gpipe", virtual_stages=None))
