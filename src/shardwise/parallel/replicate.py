"""Data parallel by replication (`ddp`'s): every rank holds the whole model and reads its own share
of the batch, and the replicas average their gradients in buckets, each all-reduced while
backward still computes the next (PyTorch DistributedDataParallel's scheme).

1. `ReplicatedGradients` packs the parameters, in the order their gradients become ready in
   backward (roughly the reverse of registration), into buckets of about `bucket_bytes`. Each
   bucket is one flat buffer, and each parameter's `.grad` is a view into it (`attach`), so
   autograd accumulates straight into the buffer the all-reduce sends: no gradient is ever copied.
2. During backward, a post-accumulate hook on each parameter calls `ready`; when every parameter
   of a bucket is ready, that bucket's reduction is launched asynchronously. Buckets are launched
   strictly in order, so every rank issues the same collectives in the same order. How a bucket
   is averaged is the reducer's business (compression.py): the backend's all-reduce, our ring,
   16-bit casts or PowerSGD.
3. When the autograd engine is done, `finish` launches what is left and waits for everything:
   then every rank holds the same averaged gradients.

Between synchronised backwards (gradient accumulation) the hooks are not called and gradients
accumulate in the buckets; the next synchronised backward all-reduces the accumulated sum.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from shardwise.parallel.compression import BucketReducer, Layout, Waitable
from shardwise.parallel.flat import views


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


class UnusedParameters(RuntimeError):
    """Parameters that got no gradient in a synchronised backward, where none may."""


class ReplicatedGradients:
    """The gradients of `params` (the order gradients arrive in), in buckets of about
    `bucket_bytes` on `device`, each averaged by `make_reducer(layout)`'s reducer once complete.
    `find_unused`: a parameter that gets no gradient contributes zeros; otherwise `finish`
    raises `UnusedParameters` naming it (`names`: by id)."""

    def __init__(self, params: list[nn.Parameter], bucket_bytes: int, device: torch.device,
                 make_reducer: Callable[[Layout], BucketReducer], names: dict[int, str], find_unused: bool) -> None:
        self.buckets = [self._make_bucket(group, device) for group in plan_buckets(params, bucket_bytes)]
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket.params}
        layout: Layout = [(bucket.buffer, bucket.views) for bucket in self.buckets]
        self.reducer: BucketReducer = make_reducer(layout)
        self.names, self.find_unused = names, find_unused
        self._next_launch = 0

    @staticmethod
    def _make_bucket(params: list[nn.Parameter], device: torch.device) -> Bucket:
        buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=device)
        return Bucket(buffer, params, views(buffer, [p.shape for p in params]))

    def attach(self) -> None:
        """Point every `.grad` back at its bucket view, before a backward; a step that starts with
        gradients set to None (zero_grad's default) starts from zeroed buckets."""
        for bucket in self.buckets:
            if any(p.grad is None for p in bucket.params):
                bucket.buffer.zero_()
                for param, view in zip(bucket.params, bucket.views, strict=True):
                    param.grad = view

    def ready(self, param: nn.Parameter) -> None:
        """`param`'s gradient is final for this backward: launch every bucket now complete, in order."""
        self.buckets[self._bucket_of[id(param)]].ready.add(id(param))
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if len(bucket.ready) < len(bucket.params):
                return
            bucket.work = self.reducer.launch(self._next_launch)
            self._next_launch += 1

    def finish(self) -> None:
        """At the end of a synchronised backward: launch what is left, wait for every bucket."""
        unused = [p for b in self.buckets for p in b.params if id(p) not in b.ready]
        if unused and not self.find_unused:
            self.reset()
            raise UnusedParameters(", ".join(self.names[id(p)] for p in unused))
        for param in unused:  # their bucket slice stays zero: this rank contributes nothing to them
            self.buckets[self._bucket_of[id(param)]].ready.add(id(param))
        self._launch_ready()
        for bucket in self.buckets:
            bucket.work.wait()
        self.reset()

    def reset(self) -> None:
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.work = None
        self._next_launch = 0
