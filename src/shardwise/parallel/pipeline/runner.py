"""Running a pipeline schedule: micro-batches through this rank's stages, activations and their
gradients sent point to point to the neighbouring stages' ranks.

Each micro-batch flows through the stages: activations forward, their gradients backward, each
sent to the rank of the neighbouring stage (or handed over between two stages of one rank). All
ranks of a replica read the same samples, so a receiver knows every message's shape
([micro-batch, seq, width]) from its own batch; only the tensor travels.

A schedule is data: this rank's list of actions (schedules.build: F, B, W, BW and the sends and
receives), the lists the simulator predicts and the validator proved free of deadlock, which
`PipelineRun` runs in order. A send never waits; receives are posted in the order their sender
sends (known from its list), so messages between two ranks match, whatever order they are waited
for in. A split backward (`zb-h1`, `zbv`, `dualpipev`) runs B as split_backward.backward_input,
the gradient of the stage's first block's input only, and W later from what B kept; recomputed
blocks are then checkpointed with recompute.RecomputedOnce, so that B recomputes them and W uses
what B recomputed.

The loss is computed on the last stage. Under mixed precision every stage runs its forward under
autocast, and fp16's loss scale multiplies the loss on the last stage: every gradient sent back
is scaled with it. `PipelineModule` is what a pipeline's caller holds: for evaluation, a forward
through all the stages, the logits broadcast to every rank of the replica.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from shardwise.models import moe
from shardwise.parallel.context.split import ContextParallel
from shardwise.parallel.module_input import module_input
from shardwise.parallel.pipeline.schedules import (
    BW,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    Schedule,
    W,
    incoming,
    message,
)
from shardwise.parallel.pipeline.split_backward import WeightGradients, backward_input
from shardwise.parallel.pipeline.stages import Stage
from shardwise.precision import LossScaler, Precision

Group = dist.ProcessGroup
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, targets) -> mean loss


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


class PipelineRun:
    """This rank's part in one pipeline run of M micro-batches: its list of the schedule's actions,
    run in order on its stages. `timeline` notes when each compute ran: (kind, micro-batch, stage,
    start, end), perf_counter seconds; the rest of the run the rank waited."""

    def __init__(self, schedule: Schedule, rank: int, stages: dict[int, Stage], first_blocks: dict[int, nn.Module],
                 group: Group,
                 activations: Activations, inputs: list[torch.Tensor], targets: list[torch.Tensor], loss_fn: LossFn,
                 divisor: int, precision: Precision, scaler: LossScaler | None,
                 documents: tuple[ContextParallel, list[torch.Tensor]] | None = None) -> None:
        self.schedule, self.rank, self.stages, self.group = schedule, rank, stages, group
        self.first_blocks = first_blocks  # each stage's first block, whose input B's gradient is of
        self.activations = activations
        self.inputs, self.targets = inputs, targets
        self.loss_fn, self.divisor = loss_fn, divisor
        self.precision, self.scaler = precision, scaler
        self.documents = documents  # packed documents: the context whose attention masks them, each micro-batch's
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

    @contextmanager
    def _attending(self, i: int) -> Iterator[None]:
        """Micro-batch `i`'s documents where attention looks for them (its forward, and a backward
        that recomputes blocks)."""
        if self.documents is None:
            yield
            return
        context, each = self.documents
        whole, context.documents = context.documents, each[i]
        try:
            yield
        finally:
            context.documents = whole

    def _enter(self, block: nn.Module, args: tuple, kwargs: dict) -> None:
        """After a later stage's own hook put the stage's input in: the tensor the block computes from."""
        self._entered.append(module_input(block, args, kwargs))

    def _forward(self, a: Action) -> None:
        i, s = a.micro_batch, a.stage
        x = self.inputs[i] if s == 0 else self.ready.pop(message(a)).requires_grad_()
        started = time.perf_counter()
        # A Mixture-of-Experts layer's auxiliary loss is backpropagated as this micro-batch's loss is.
        scale = (self.scaler.scale if self.scaler else 1.0) / self.divisor
        with self.precision.autocast(self.activations.device), moe.loss_scale(self.stages[s], scale), \
                self._attending(i):
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
        with self._attending(a.micro_batch):
            torch.autograd.backward(out, grad)
        self.timeline.append((BW, a.micro_batch, a.stage, started, time.perf_counter()))
        if a.stage > 0:
            self.ready["grad", a.micro_batch, a.stage] = x.grad

    def _input_backward(self, a: Action) -> None:
        _, entered, out, grad = self._backward_from(a)
        started = time.perf_counter()
        with self._attending(a.micro_batch):
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
