"""Distributed data parallel, ours (`ddp`): every rank holds the whole model and a slice of the
batch; gradients are averaged with bucketed all-reduces that start while backward is still
running (parallel/replicate.py).

`wrap` broadcasts parameters and buffers from rank 0, then buckets the parameters' gradients;
each parameter's post-accumulate hook hands its gradient to the buckets, and a callback at the
end of the autograd engine's work waits for them all. By default a bucket is averaged by the
backend's all-reduce; with `parallel.ddp.all_reduce = "ring"` by our ring (parallel/comm.py); with
`parallel.ddp.grad_compression` cast to 16 bits or PowerSGD-compressed (parallel/compression.py).
Inside `no_sync()` the hooks do nothing and gradients accumulate locally in the buckets.

Under expert parallel (`parallel.ep`) each rank holds other experts: they are left out of the
buckets and of rank 0's broadcast, and averaged after backward over the ranks that hold the same
experts (parallel/experts.py).
"""

from __future__ import annotations

import functools
import time

import torch
from torch import nn

from shardwise.dist import broadcast_from_rank0
from shardwise.parallel.compression import make_reducer
from shardwise.parallel.replicate import ReplicatedGradients, UnusedParameters
from shardwise.state_view import StateView
from shardwise.strategies.base import HookedStrategy, on_grad_accumulated
from shardwise.strategies.sync_batchnorm import convert_sync_batchnorm


class DDP(HookedStrategy):
    def prepare(self, model: nn.Module) -> nn.Module:
        return super().prepare(convert_sync_batchnorm(model) if self.cfg.sync_batchnorm else model)

    def _distribute(self, part: nn.Module) -> nn.Module:
        self.module = part
        experts = self.experts
        broadcast_from_rank0([*(p for p in self.module.parameters() if not (experts and experts.is_expert(p))),
                              *self.module.buffers()])
        if experts is not None:
            experts.broadcast()
        # Experts split over ep are averaged on their own, after backward (parallel/experts.py).
        trainable = [p for p in self.module.parameters() if p.requires_grad and not (experts and experts.is_expert(p))]
        cfg = self.cfg
        reducer = functools.partial(make_reducer, all_reduce=cfg.ddp.all_reduce, compression=cfg.ddp.grad_compression,
                                    powersgd_rank=cfg.ddp.powersgd_rank,
                                    powersgd_start_step=cfg.ddp.powersgd_start_step)
        # Backward produces gradients roughly in reverse registration order.
        self.gradients = ReplicatedGradients(list(reversed(trainable)), int(cfg.ddp.bucket_mb * 2**20), self.ctx.device,
                                             reducer, {id(p): n for n, p in self.module.named_parameters()},
                                             cfg.ddp.find_unused_parameters)
        self.view = StateView(self, rank_state=self.gradients.reducer.state)  # PowerSGD's error feedback
        for param in trainable:
            on_grad_accumulated(param, self._on_grad_ready)
        self._init_backward_state()
        self.last_wait_s = 0.0  # communication left exposed after the last backward
        self.module.register_forward_pre_hook(self._sync_buffers)
        return self.module

    def _sync_buffers(self, module: nn.Module, args: object) -> None:
        """Rank 0's buffers (BatchNorm running statistics) for every rank, before each training
        forward: ranks see different data, so their running statistics would drift apart.
        (Under SyncBatchNorm they are already equal, and the broadcast changes nothing.)"""
        if module.training:
            broadcast_from_rank0(list(module.buffers()))

    def backward(self, loss: torch.Tensor) -> None:
        self.gradients.attach()
        loss.backward()

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self._sync:
            return
        self._queue_finish_once()
        self.gradients.ready(param)

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has sent averaging gradients since `wrap`."""
        return self.gradients.reducer.bytes_sent

    def _finish_backward(self) -> None:
        """Runs once the autograd engine is done: every bucket averaged, then the experts."""
        started = time.perf_counter()
        try:
            self.gradients.finish()
        except UnusedParameters as unused:
            raise RuntimeError(
                f"ddp: these parameters got no gradient in this backward: {unused}. If the model skips "
                "them on purpose, set parallel.ddp.find_unused_parameters = true (their gradient is then zero "
                "on this rank and averaged like any other)."
            ) from None
        if self.experts is not None:
            self.experts.average_gradients()
        self.last_wait_s = time.perf_counter() - started
