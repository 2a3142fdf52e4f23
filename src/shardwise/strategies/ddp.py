"""Distributed data parallel, ours: every rank holds the whole model and a slice of the batch;
gradients are averaged with bucketed all-reduces that start while backward is still running.

How a step goes:
1. `wrap` broadcasts parameters and buffers from rank 0, then packs the parameters into buckets
   (about `bucket_mb` each) in the order their gradients become ready in backward — roughly the
   reverse of registration. Each bucket is one flat buffer, and each parameter's `.grad` is a
   view into it, so autograd accumulates straight into the buffer the all-reduce sends: no
   gradient is ever copied.
2. During backward, a post-accumulate hook on each parameter counts it ready; when every
   parameter of a bucket is ready, that bucket's all-reduce is launched asynchronously. Buckets
   are launched strictly in order, so every rank issues the same collectives in the same order.
   How a bucket is averaged is the reducer's business (parallel/compression.py): by default the
   backend's all-reduce; with `parallel.all_reduce = "ring"` our ring (parallel/comm.py); with
   `parallel.grad_compression` cast to 16 bits or PowerSGD-compressed.
3. When the autograd engine finishes, a final callback waits for all buckets. After
   `backward()` returns, every rank holds the same averaged gradients.

Inside `no_sync()` the hooks do nothing and gradients accumulate locally in the buckets; the
next synchronised backward all-reduces the accumulated sum.

Under expert parallel (`parallel.ep`) each rank holds other experts: they are left out of the
buckets and of rank 0's broadcast, and averaged after backward over the ranks that hold the same
experts (parallel/experts.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from shardwise.dist import broadcast_from_rank0
from shardwise.parallel.compression import Waitable, make_reducer
from shardwise.strategies.base import HookedStrategy
from shardwise.strategies.sync_batchnorm import convert_sync_batchnorm


@dataclass
class Bucket:
    buffer: torch.Tensor
    params: list[nn.Parameter]
    views: list[torch.Tensor]
    ready: set[int] = field(default_factory=set)  # ids of parameters whose gradient is final
    work: Waitable | None = None


def plan_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Group parameters, in the order given, into buckets of at most `bucket_bytes` (a parameter
    larger than that gets a bucket of its own)."""
    buckets: list[list[nn.Parameter]] = [[]]
    size = 0
    for param in params:
        nbytes = param.numel() * param.element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(param)
        size += nbytes
    return buckets


class DDP(HookedStrategy):
    def wrap(self, model: nn.Module) -> nn.Module:
        if self.cfg.sync_batchnorm:
            model = convert_sync_batchnorm(model)
        self.module = self.prepare(model)
        experts = self.experts
        broadcast_from_rank0([*(p for p in self.module.parameters() if not (experts and experts.is_expert(p))),
                              *self.module.buffers()])
        if experts is not None:
            experts.broadcast()
        # Experts split over ep are averaged on their own, after backward (parallel/experts.py).
        trainable = [p for p in self.module.parameters() if p.requires_grad and not (experts and experts.is_expert(p))]
        self._names = {id(p): n for n, p in self.module.named_parameters()}
        # Backward produces gradients roughly in reverse registration order.
        groups = plan_buckets(list(reversed(trainable)), int(self.cfg.bucket_mb * 2**20))
        self.buckets = [self._make_bucket(group) for group in groups]
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket.params}
        self.reducer = make_reducer(self.cfg, [(bucket.buffer, bucket.views) for bucket in self.buckets])
        for param in trainable:
            param.register_post_accumulate_grad_hook(self._on_grad_ready)
        self._init_backward_state()
        self._next_launch = 0
        self.last_wait_s = 0.0  # communication left exposed after the last backward
        self.module.register_forward_pre_hook(self._sync_buffers)
        return self.module

    def _make_bucket(self, params: list[nn.Parameter]) -> Bucket:
        numel = sum(p.numel() for p in params)
        buffer = torch.zeros(numel, dtype=params[0].dtype, device=self.ctx.device)
        views, offset = [], 0
        for param in params:
            views.append(buffer[offset : offset + param.numel()].view_as(param))
            offset += param.numel()
        return Bucket(buffer, params, views)

    def _sync_buffers(self, module: nn.Module, args: object) -> None:
        """Rank 0's buffers (BatchNorm running statistics) for every rank, before each training
        forward: ranks see different data, so their running statistics would drift apart.
        (Under SyncBatchNorm they are already equal, and the broadcast changes nothing.)"""
        if module.training:
            broadcast_from_rank0(list(module.buffers()))

    def _attach_gradient_views(self) -> None:
        """Point every `.grad` back at its bucket view; a step that starts with gradients set to
        None (zero_grad's default) starts from zeroed buckets."""
        for bucket in self.buckets:
            if any(p.grad is None for p in bucket.params):
                bucket.buffer.zero_()
                for param, view in zip(bucket.params, bucket.views, strict=True):
                    param.grad = view

    def backward(self, loss: torch.Tensor) -> None:
        self._attach_gradient_views()
        loss.backward()

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self._sync:
            return
        self._queue_finish_once()
        bucket = self.buckets[self._bucket_of[id(param)]]
        bucket.ready.add(id(param))
        self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if len(bucket.ready) < len(bucket.params):
                return
            bucket.work = self.reducer.launch(self._next_launch)
            self._next_launch += 1

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has sent averaging gradients since `wrap`."""
        return self.reducer.bytes_sent

    def rank_state(self) -> dict[str, torch.Tensor]:
        return self.reducer.state()

    def _finish_backward(self) -> None:
        """Runs once the autograd engine is done: launch what is left, wait for everything."""
        unused = [p for b in self.buckets for p in b.params if id(p) not in b.ready]
        if unused and not self.cfg.find_unused_parameters:
            names = ", ".join(self._names[id(p)] for p in unused)
            self._reset()
            raise RuntimeError(
                f"ddp: these parameters got no gradient in this backward: {names}. If the model skips "
                "them on purpose, set parallel.find_unused_parameters = true (their gradient is then zero "
                "on this rank and averaged like any other)."
            )
        for param in unused:  # their bucket slice stays zero: this rank contributes nothing to them
            self.buckets[self._bucket_of[id(param)]].ready.add(id(param))
        self._launch_ready_buckets()
        started = time.perf_counter()
        for bucket in self.buckets:
            bucket.work.wait()
        if self.experts is not None:
            self.experts.average_gradients()
        self.last_wait_s = time.perf_counter() - started
        self._reset()

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.work = None
        self._next_launch = 0
