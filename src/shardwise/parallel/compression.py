"""How `ddp` averages its gradient buckets across ranks: as they are, cast to 16 bits, or
PowerSGD-compressed; over the backend's all-reduce or our ring (parallel/comm.py).

`ddp` calls `reducer.launch(i)` the moment bucket i's gradients are final, buckets in the same
order on every rank, and `.wait()`s on what it returns at the end of backward; by then every
rank's bucket holds the same averaged (or compressed-and-averaged) gradients.

The plain case, the backend's all-reduce on uncompressed buckets, is one asynchronous
collective per bucket. Everything else is a chain of steps (cast, reduce, cast back; or
PowerSGD's two dependent all-reduces with an orthogonalisation between them; or our ring's
2 (N - 1) point-to-point steps) that Gloo cannot run asynchronously. So those run on one
background thread, in launch order, on a process group of their own: every rank launches the
same buckets in the same order, so the thread issues the same collectives in the same order on
every rank, and the group keeps them apart from what the main thread communicates meanwhile
(buffer broadcasts, loss averaging). Backward goes on computing while the thread communicates.

Bytes on the wire are counted per rank (`bytes_sent`): what our ring sends, and for the
backend's all-reduce the same count, as Gloo's is a ring too (gloo/allreduce.cc).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from queue import SimpleQueue
from typing import Protocol

import torch
import torch.distributed as dist

from shardwise.dist import new_group_of_all
from shardwise.parallel.comm import ring_all_reduce, ring_bytes_sent
from shardwise.parallel.flat import pack, unpack, views

CAST_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# Per bucket: its flat gradient buffer, and each parameter's gradient as a view into it.
Layout = list[tuple[torch.Tensor, list[torch.Tensor]]]


class Waitable(Protocol):
    def wait(self) -> object: ...


class BucketReducer(Protocol):
    bytes_sent: int  # what this rank has sent, in all

    def launch(self, index: int) -> Waitable: ...

    def state(self) -> dict[str, torch.Tensor]:
        """What this rank carries from step to step (PowerSGD's), as live tensors a load overwrites."""
        ...


def make_reducer(layout: Layout, all_reduce: str = "backend", compression: str = "none", powersgd_rank: int = 4,
                 powersgd_start_step: int = 0) -> BucketReducer:
    """The reducer of `layout`'s buckets: by the backend's all-reduce or our `ring`, each bucket as
    it is, cast to 16 bits (`fp16`, `bf16`) or `powersgd`-compressed."""
    if all_reduce == "backend" and compression == "none":
        return AsyncBackendMean(layout)
    reduce = AllReduce(all_reduce, new_group_of_all())
    if compression == "powersgd":
        average = PowerSGD(layout, reduce, powersgd_rank, powersgd_start_step)
    elif compression in CAST_DTYPES:
        average = CastMean(layout, reduce, CAST_DTYPES[compression])
    else:
        average = Mean(layout, reduce)
    return InBackground(average, reduce)


class AsyncBackendMean:
    """The backend's asynchronous all-reduce (average) of each bucket as it is."""

    def __init__(self, layout: Layout) -> None:
        self.buffers = [buffer for buffer, _ in layout]
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.bytes_sent = 0

    def state(self) -> dict[str, torch.Tensor]:
        return {}

    def launch(self, index: int) -> Waitable:
        buffer = self.buffers[index]
        self.bytes_sent += ring_bytes_sent(buffer.numel(), buffer.element_size(), self.world, self.rank)
        return dist.all_reduce(buffer, op=dist.ReduceOp.AVG, async_op=True)


class AllReduce:
    """Sum (or average) a tensor over `group`, synchronously, by the backend's all-reduce or by
    our ring; count the bytes this rank sends."""

    def __init__(self, algorithm: str, group: dist.ProcessGroup) -> None:
        self.algorithm = algorithm
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.bytes_sent = 0

    def __call__(self, tensor: torch.Tensor, average: bool = False) -> None:
        if self.algorithm == "ring":
            self.bytes_sent += ring_all_reduce(tensor, self.group, average)
            return
        dist.all_reduce(tensor, op=dist.ReduceOp.AVG if average else dist.ReduceOp.SUM, group=self.group)
        self.bytes_sent += ring_bytes_sent(tensor.numel(), tensor.element_size(), self.world, self.rank)


class Mean:
    """Each bucket averaged as it is."""

    def __init__(self, layout: Layout, all_reduce: AllReduce) -> None:
        self.buffers = [buffer for buffer, _ in layout]
        self.all_reduce = all_reduce

    def __call__(self, index: int) -> None:
        self.all_reduce(self.buffers[index], average=True)


class CastMean:
    """Each bucket sent in a 16-bit dtype, half the bytes of fp32, and cast back. A gradient
    keeps about 3 significant digits in fp16 (which flushes ones below 6e-8 to zero and
    overflows above 65504) or about 2 in bf16 (with fp32's range)."""

    def __init__(self, layout: Layout, all_reduce: AllReduce, dtype: torch.dtype) -> None:
        self.buffers = [buffer for buffer, _ in layout]
        self.all_reduce = all_reduce
        self.dtype = dtype

    def __call__(self, index: int) -> None:
        buffer = self.buffers[index]
        # Divided before the cast: a sum of N fp16 values can overflow where their mean does not.
        compressed = buffer.div_(self.all_reduce.world).to(self.dtype)
        self.all_reduce(compressed)
        buffer.copy_(compressed)


@dataclass
class PowerSGDBucket:
    buffer: torch.Tensor
    whole: list[torch.Tensor]  # gradients averaged as they are
    matrices: list[torch.Tensor]  # gradients compressed, as (rows, columns) views into the bucket
    errors: list[torch.Tensor]  # what compression left out last step, per matrix (error feedback)
    p_flat: torch.Tensor  # every matrix's P (rows x rank), in one buffer: one all-reduce
    ps: list[torch.Tensor]
    q_flat: torch.Tensor  # every matrix's Q (columns x rank), kept from step to step (warm start)
    qs: list[torch.Tensor]
    # steps this bucket has been averaged in: a tensor, so that a checkpoint load can fill it
    reductions: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.int64))


class PowerSGD:
    """Rank-r PowerSGD (Vogels, Karimireddy & Jaggi, NeurIPS 2019) with error feedback.

    A gradient matrix M (a parameter's gradient as rows x everything else) goes as two thin
    factors: P = M Q, averaged over ranks and orthonormalised, then Q = M^T P, averaged. M is
    replaced by P Q^T, the average gradient projected onto the r directions P spans: r (rows +
    columns) numbers sent instead of rows x columns. What the projection leaves out of this
    rank's gradient is kept and added to its next gradient (error feedback), so it is delayed,
    not lost. Q is warm-started from the previous step, so each training step is one step of
    subspace iteration and P tracks the gradient's dominant directions; its first value is random,
    the same on every rank. Vectors (biases, norm scales) and matrices whose factors would take
    more than half their size are averaged whole: compressing them would save little and cost
    accuracy.

    The first `start_step` steps are plain averages (as torch's `start_powerSGD_iter`): early
    on, under the learning-rate warm-up, the gradient's directions change faster than one
    subspace iteration a step can follow, and the error fed back would be stale. On gpt-tiny
    (200 steps, rank 4, AdamW) starting after 10 plain steps took the validation loss from 5.3%
    above the uncompressed run's to 1.4%.
    """

    def __init__(self, layout: Layout, all_reduce: AllReduce, rank: int, start_step: int, seed: int = 0) -> None:
        self.all_reduce = all_reduce
        self.start_step = start_step
        generator = torch.Generator().manual_seed(seed)  # the same first Q on every rank
        self.buckets = [self._plan(buffer, grads, rank, generator) for buffer, grads in layout]

    @staticmethod
    def _plan(buffer: torch.Tensor, grads: list[torch.Tensor], rank: int, generator: torch.Generator) -> PowerSGDBucket:
        def worth_it(grad: torch.Tensor) -> bool:
            if grad.dim() < 2:
                return False
            rows, columns = grad.shape[0], grad[0].numel()
            return 2 * rank * (rows + columns) <= rows * columns

        matrices = [g.view(g.shape[0], -1) for g in grads if worth_it(g)]
        like = dict(dtype=grads[0].dtype, device=grads[0].device)
        p_flat = torch.empty(sum(m.shape[0] for m in matrices) * rank, **like)
        q_flat = torch.randn(sum(m.shape[1] for m in matrices) * rank, generator=generator).to(**like)
        return PowerSGDBucket(
            buffer=buffer,
            whole=[g for g in grads if not worth_it(g)],
            matrices=matrices,
            errors=[torch.zeros_like(m) for m in matrices],
            p_flat=p_flat, ps=views(p_flat, [(m.shape[0], rank) for m in matrices]),
            q_flat=q_flat, qs=views(q_flat, [(m.shape[1], rank) for m in matrices]),
        )

    def state(self) -> dict[str, torch.Tensor]:
        """Every bucket's Q, error feedback and step count: resuming exactly needs them."""
        state = {}
        for i, bucket in enumerate(self.buckets):
            state[f"bucket{i}.q"] = bucket.q_flat
            state[f"bucket{i}.reductions"] = bucket.reductions
            state.update({f"bucket{i}.error{j}": error for j, error in enumerate(bucket.errors)})
        return state

    def __call__(self, index: int) -> None:
        bucket = self.buckets[index]
        bucket.reductions += 1
        if bucket.reductions <= self.start_step:
            self.all_reduce(bucket.buffer, average=True)
            return
        if bucket.whole:
            flat = pack(bucket.whole)
            self.all_reduce(flat, average=True)
            unpack(flat, bucket.whole)
        if not bucket.matrices:
            return
        for grad, error, p, q in zip(bucket.matrices, bucket.errors, bucket.ps, bucket.qs, strict=True):
            grad += error
            torch.matmul(grad, q, out=p)
        self.all_reduce(bucket.p_flat, average=True)
        for p in bucket.ps:
            p.copy_(torch.linalg.qr(p).Q)
        for grad, p, q in zip(bucket.matrices, bucket.ps, bucket.qs, strict=True):
            torch.matmul(grad.T, p, out=q)
        self.all_reduce(bucket.q_flat, average=True)
        for grad, error, p, q in zip(bucket.matrices, bucket.errors, bucket.ps, bucket.qs, strict=True):
            approximation = p @ q.T
            torch.sub(grad, approximation, out=error)
            grad.copy_(approximation)


class InBackground:
    """Runs an averager on one background thread, bucket after bucket in launch order."""

    def __init__(self, average: Callable[[int], None], all_reduce: AllReduce) -> None:
        self.average = average
        self.all_reduce = all_reduce
        self.jobs: SimpleQueue[tuple[int, Future] | None] = SimpleQueue()
        # A daemon: a thread blocked in a collective whose peer died must not keep the process alive.
        # It holds the queue and a weak reference, not this object: once the strategy lets go of it,
        # the finalizer ends the thread, and the group and buffers go with it (a process that trains
        # again, the API's or the tests' ranks, kept every run's).
        threading.Thread(target=_run_jobs, args=(weakref.ref(self), self.jobs, torch.get_num_threads()),
                         name="shardwise-ddp-reduce", daemon=True).start()
        weakref.finalize(self, self.jobs.put, None)

    @property
    def bytes_sent(self) -> int:
        return self.all_reduce.bytes_sent

    def state(self) -> dict[str, torch.Tensor]:
        return self.average.state() if isinstance(self.average, PowerSGD) else {}

    def launch(self, index: int) -> Waitable:
        future: Future = Future()
        self.jobs.put((index, future))
        return Pending(future)


def _run_jobs(owner: weakref.ref[InBackground], jobs: SimpleQueue[tuple[int, Future] | None], threads: int) -> None:
    """InBackground's thread: each launched bucket averaged in turn, until the owner is gone (None)."""
    # A new thread starts with the machine's default intra-op thread count, not this rank's.
    torch.set_num_threads(threads)
    while (job := jobs.get()) is not None:
        index, future = job
        average = owner().average  # alive: it launched this job and waits for it
        try:
            average(index)
        except BaseException as error:  # handed to the waiting main thread, which raises it
            future.set_exception(error)
        else:
            future.set_result(None)
        del average  # holding it while waiting for the next job would keep the owner's state alive


@dataclass
class Pending:
    future: Future

    def wait(self) -> None:
        self.future.result()
