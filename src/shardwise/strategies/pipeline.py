"""Pipeline parallel, ours (`pipeline`), and its one-micro-batch case, the naive layer-wise split
(`model-parallel`).

The model's blocks, as its family's parallel plan names them (models/plans.py), are cut into P
contiguous stages, one per rank of a pp group (balanced by parameter count, or at
`parallel.split_points`): the first stage also holds the embeddings, the last the final norm, the
head and the loss, as the plan says. A stage is the model itself with the other stages' modules
removed (`Stage`), running the model's own forward. A stage's parameters live only on its rank.
The one exception is a head tied to the token embedding (the GPT's, GPT-2's): the first and the
last stage each hold it, and after backward their two gradients are summed between them, so both
copies take the same step, as the one tensor does on one device. Being equal, the two copies are
one entry of a checkpoint, under the embedding's name: written once, loaded into both.

Each train.micro_batch of samples is split into M = parallel.micro_batches micro-batches, which
flow through the stages: activations forward, their gradients backward, each sent point to point
to the neighbouring stage. All stages of a replica read the same samples, so a receiver knows
every message's shape ([micro-batch, seq, width]) from its own batch; only the tensor travels.

A schedule is a plain function of one stage's run (`gpipe`, `one_f_one_b`) that calls
`forward(i)` and `backward(i)` in its order. A stage waits only for what it receives, never for
its sends to be taken, so any order that agrees from stage to stage cannot deadlock.

- GPipe: all M forwards, then all M backwards. All M micro-batches' activations are held at once.
- 1F1B: stage s runs P-s-1 warm-up forwards, then alternates one forward and one backward, then
  finishes the backwards: at most P - s micro-batches' activations held at once, P on stage 0.
Both leave each stage idle for (P-1)/(M+P-1) of the step (the bubble): the forwards' fill and the
backwards' drain, when stages have equal work and messages are free.

`model-parallel` is the pipeline with one micro-batch (M = 1): one stage computes at a time, the
others wait; the bubble is (P-1)/P.

The loss is computed on the last stage and broadcast to the replica's other stages, so every rank
(rank 0 included) reports its replica's loss. Under mixed precision every stage runs its forward
under autocast, and fp16's loss scale multiplies the loss on the last stage: every gradient sent
back is scaled with it.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.config import Config, ConfigError, ParallelConfig
from shardwise.dist import DistContext
from shardwise.models.plans import Located
from shardwise.precision import LossScaler, Precision
from shardwise.strategies.base import LossFn
from shardwise.strategies.mesh import MeshStrategy, with_input
from shardwise.strategies.registry import spec
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


class StageRun:
    """One stage's part in one pipeline run of M micro-batches: `forward(i)` and `backward(i)` of
    micro-batch i, with the receives before and the sends after; a schedule calls them in its
    order. Each receive of micro-batch i + 1 is posted when micro-batch i's arrives, so the
    transfer runs while this stage computes instead of when it is needed. `timeline` notes when
    each computed: (forward|backward, i, start, end), perf_counter seconds; the rest of the run
    the stage waited."""

    def __init__(self, stage: Stage, index: int, count: int, group: Group, activations: Activations,
                 inputs: list[torch.Tensor], targets: list[torch.Tensor], loss_fn: LossFn, divisor: int,
                 precision: Precision, scaler: LossScaler | None) -> None:
        self.stage, self.index, self.count, self.group = stage, index, count, group
        self.activations = activations
        self.inputs, self.targets = inputs, targets
        self.loss_fn, self.divisor = loss_fn, divisor
        self.precision, self.scaler = precision, scaler
        self.first, self.last = index == 0, index == count - 1
        self.held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # i -> (stage input, output or loss)
        self.receives: dict[tuple[int, int], tuple[dist.Work, torch.Tensor]] = {}  # (from stage, i) -> posted
        self.sends: list[tuple[dist.Work, torch.Tensor]] = []  # kept until done: the buffer must outlive the send
        self.loss_sum = torch.zeros((), device=activations.device)
        self.timeline: list[tuple[str, int, float, float]] = []

    def _receive(self, stage: int, i: int) -> torch.Tensor:
        """Micro-batch i's activation (from the stage before) or gradient (from the stage after),
        the same shape either way; then post the receive of micro-batch i + 1's."""
        for j in (i, i + 1):
            if j < len(self.inputs) and (stage, j) not in self.receives:
                buffer = self.activations.empty(self.inputs[j])
                self.receives[stage, j] = (post_receive(buffer, stage, self.group), buffer)
        work, buffer = self.receives.pop((stage, i))
        work.wait()
        return buffer

    def forward(self, i: int) -> None:
        x = self.inputs[i] if self.first else self._receive(self.index - 1, i).requires_grad_()
        started = time.perf_counter()
        with self.precision.autocast(self.activations.device):
            out = self.stage(x)
            if self.last:
                out = self.loss_fn(out, self.targets[i])
                self.loss_sum += out.detach()
        self.timeline.append(("forward", i, started, time.perf_counter()))
        if not self.last:
            self.sends.append((send(out.detach(), self.index + 1, self.group), out))
        self.held[i] = (x, out)

    def backward(self, i: int) -> None:
        x, out = self.held.pop(i)
        if self.last:
            out, grad = out / self.divisor, None  # the loss: this micro-batch's share of the step's mean
            if self.scaler:  # fp16: scaled here, every stage's gradients are
                out = self.scaler.scale_loss(out)
        else:
            grad = self._receive(self.index + 1, i)
        started = time.perf_counter()
        torch.autograd.backward(out, grad)
        self.timeline.append(("backward", i, started, time.perf_counter()))
        if not self.first:
            self.sends.append((send(x.grad, self.index - 1, self.group), x.grad))

    def finish(self) -> None:
        """Wait for the sends still in flight."""
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()


Schedule = Callable[[StageRun, int], None]


def gpipe(run: StageRun, micro_batches: int) -> None:
    """All forwards, then all backwards (GPipe)."""
    for i in range(micro_batches):
        run.forward(i)
    for i in range(micro_batches):
        run.backward(i)


def one_f_one_b(run: StageRun, micro_batches: int) -> None:
    """Warm-up forwards, then one forward one backward, then the remaining backwards (1F1B):
    stage s starts micro-batch i's backward before micro-batch i + P - s's forward."""
    warmup = min(run.count - run.index - 1, micro_batches)
    for i in range(warmup):
        run.forward(i)
    for i in range(micro_batches - warmup):
        run.forward(warmup + i)
        run.backward(i)
    for i in range(micro_batches - warmup, micro_batches):
        run.backward(i)


SCHEDULES: dict[str, Schedule] = {"gpipe": gpipe, "1f1b": one_f_one_b}


class PipelineModule(nn.Module):
    """What the trainer holds: this rank's stage, and for evaluation a forward through the whole
    pipeline, whose logits the last stage broadcasts to the others so every rank can compute the
    loss like any model's. Training runs the schedule instead (Strategy.forward_backward)."""

    def __init__(self, stage: Stage, index: int, count: int, group: Group, activations: Activations,
                 vocab_size: int) -> None:
        super().__init__()
        self.stage = stage
        self.index, self.count, self.group = index, count, group
        self.activations = activations
        self.vocab_size = vocab_size

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            raise RuntimeError("a pipeline trains through its schedule (Strategy.forward_backward); "
                               "its forward runs under torch.no_grad() only")
        x = idx
        if not self.stage.first:
            x = self.activations.empty(idx)
            post_receive(x, self.index - 1, self.group).wait()
        out = self.stage(x)
        # Logits travel in the activations' dtype, which every stage knows: under autocast the
        # head computes in 16 bits, and the float32 they come to holds them exactly.
        if self.stage.last:
            out = out.to(self.activations.dtype)
        else:
            send(out, self.index + 1, self.group).wait()
            out = torch.empty((*idx.shape, self.vocab_size), dtype=self.activations.dtype, device=out.device)
        dist.broadcast(out, group=self.group, group_src=self.count - 1)
        return out


class Pipeline(MeshStrategy):
    @classmethod
    def check_split(cls, cfg: Config, dp: int, pp: int, tp: int) -> None:
        m, p = cfg.model, cfg.parallel
        if pp < 2:
            raise ConfigError(f"parallel.pp = {pp}: a pipeline needs at least 2 stages; "
                              "for data parallel alone use --strategy ddp")
        if pp > m.n_layer:
            raise ConfigError(f"parallel.pp = {pp}: more pipeline stages than the model's {m.n_layer} blocks "
                              "(model.n_layer); every stage needs at least one block")
        points = p.split_points
        if points is not None and (len(points) != pp - 1 or points != sorted(set(points))
                                   or not 0 < points[0] <= points[-1] < m.n_layer):
            raise ConfigError(
                f"parallel.split_points = {points}: expected {pp - 1} increasing block indices in "
                f"[1, {m.n_layer - 1}], the first block of stages 2..{pp}"
            )
        if spec(p.strategy).pipelined and cfg.train.micro_batch % p.micro_batches:
            raise ConfigError(
                f"parallel.micro_batches = {p.micro_batches}: must divide train.micro_batch = "
                f"{cfg.train.micro_batch}, the per-replica batch one pipeline run splits into micro-batches"
            )

    def __init__(self, ctx: DistContext, cfg: ParallelConfig) -> None:
        super().__init__(ctx, cfg)
        self.micro_batches = cfg.micro_batches
        self.schedule = SCHEDULES[cfg.schedule]
        self.timeline: list[tuple[str, int, float, float]] = []  # the last step's, all its runs
        self.window = (0.0, 0.0)  # the last step's forward_backward: perf_counter start and end
        self._tied: tuple[list[nn.Parameter], Group] | None = None  # see _tie_first_and_last

    def wrap(self, model: nn.Module) -> nn.Module:
        # A meta-built model stays on meta until the stage is cut out of it: then only the stage's
        # blocks (each split as soon as it is real under tp) and what it keeps outside them are made real.
        model = self.prepare(model, materialise=False)
        located = self.locate(model)
        blocks = located.blocks
        starts = [0, *(self.cfg.split_points or balanced_split(block_costs(located), self.pp))]
        self.stage_blocks = list(zip(starts, [*starts[1:], len(blocks)], strict=True))  # [start, stop) per stage
        self.record_layout(model, stage_holds(located, self.stage_blocks))
        first, last = list(located.first.values()), list(located.last.values())
        embedding = first[0]
        self.activations = Activations(embedding.embedding_dim, embedding.weight.dtype, self.ctx.device)
        vocab_size = located.head.weight.shape[0]
        start, stop = self.stage_blocks[self.pp_rank]
        # From here the other stages' modules are out of the model: their parameters are freed.
        self.stage = Stage(located, start, stop, first=self.pp_rank == 0, last=self.pp_rank == self.pp - 1)
        self.materialise_outside_blocks(model)
        if self.tp > 1:
            self.tensor_shards, self.sequence_split = parallelize_blocks(
                blocks[start:stop], located.plan, TensorParallelGroup(self.tp_group), self.cfg.sequence_parallel,
                functools.partial(self.materialised, model))
        else:
            self.materialise_whole(model, blocks[start:stop])
        # After materialising (it installs new parameters, in the removed modules too, a tie kept).
        first_params = {id(p) for m in first for p in m.parameters()}
        tied = [p for m in last for p in m.parameters() if id(p) in first_params]
        self.record_local_state(model)
        self._tie_first_and_last(tied)
        self.module = PipelineModule(self.stage, self.pp_rank, self.pp, self.pp_group, self.activations, vocab_size)
        return self.module

    def _tie_first_and_last(self, shared: list[nn.Parameter]) -> None:
        """For parameters the first and the last stage both hold (an embedding tied to the head), a
        process group per replica and tp rank to sum their gradients between the two."""
        if not shared:
            return
        # new_group is collective over the world: every rank makes every pair, in the same order.
        pairs = {(d, t): dist.new_group([int(self.mesh.mesh[d, 0, t]), int(self.mesh.mesh[d, -1, t])])
                 for d in range(self.dp) for t in range(self.tp)}
        if self.pp_rank in (0, self.pp - 1):
            self._tied = (shared, pairs[self.dp_rank, self.tp_rank])
        if self.pp_rank == self.pp - 1:
            self.duplicates = {id(p) for p in shared}

    def local_parameters(self) -> list[nn.Parameter]:
        return list(self.stage.parameters())

    def forward_backward(self, model: nn.Module, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                         loss_fn: LossFn, accum: int) -> torch.Tensor:
        """Each of the `accum` batches runs the schedule over its M micro-batches; then tied
        gradients are summed and the replicas' averaged. Returns the replica's loss sum on every
        stage."""
        loss_sum = torch.zeros((), device=self.ctx.device)
        self.timeline = []
        started = time.perf_counter()
        for inputs, targets in micro_batches:
            run = StageRun(self.stage, self.pp_rank, self.pp, self.pp_group, self.activations,
                           self._split(inputs), self._split(targets), loss_fn, accum * self.micro_batches,
                           self.precision, self.scaler)
            self.schedule(run, self.micro_batches)
            run.finish()
            loss_sum += run.loss_sum / self.micro_batches
            self.timeline += run.timeline
        dist.broadcast(loss_sum, group=self.pp_group, group_src=self.pp - 1)
        if self._tied is not None:
            params, group = self._tied
            for param in params:
                dist.all_reduce(param.grad, group=group)
        self.synchronize_gradients()
        self.window = (started, time.perf_counter())
        return loss_sum

    def stage_timeline(self) -> list[dict[str, Any]]:
        """The last step's `timeline` of every rank, gathered (a collective), for metrics: each
        rank's stage, replica and tp rank, its forward_backward `window` and its compute
        `intervals` [kind, micro-batch, start, end], in seconds from the earliest window start.
        Times go through the wall clock, which every process of a host (and NTP-synced hosts) shares."""
        offset = time.time() - time.perf_counter()
        mine = {"rank": self.ctx.rank, "stage": self.pp_rank, "replica": self.dp_rank, "tp_rank": self.tp_rank,
                "window": [t + offset for t in self.window],
                "intervals": [[kind, i, start + offset, end + offset] for kind, i, start, end in self.timeline]}
        ranks = self.ctx.all_gather_object(mine)
        origin = min(rank["window"][0] for rank in ranks)
        for rank in ranks:  # microseconds are plenty, and keep the record short
            rank["window"] = [round(t - origin, 6) for t in rank["window"]]
            rank["intervals"] = [[kind, i, round(start - origin, 6), round(end - origin, 6)]
                                 for kind, i, start, end in rank["intervals"]]
        return ranks

    def _split(self, batch: torch.Tensor) -> list[torch.Tensor]:
        # Copies, not views of one storage: a micro-batch's saved inputs are freed (and counted) with it.
        return [part.clone() for part in batch.chunk(self.micro_batches)]


class ModelParallel(Pipeline):
    """`model-parallel`: the layer-wise split people try first, the pipeline with one micro-batch.
    Each stage waits while the others compute."""

    def __init__(self, ctx: DistContext, cfg: ParallelConfig) -> None:
        super().__init__(ctx, cfg)
        self.micro_batches = 1
        self.schedule = gpipe
