"""Communication primitives the parallelisms share: collective algorithms written from
point-to-point messages, and the bytes they put on the wire (the ring all-reduce below, a gather
into the caller's buffers, `gather_in_place`), and an all-reduce of many tensors packed into one
(`all_reduce_packed`).

Ring all-reduce (Patarasuk & Yuan 2009; what Gloo and NCCL run for large messages). The N ranks
of a group form a ring: each sends only to its right neighbour (r + 1) and receives only from its
left (r - 1). The flat tensor is cut into N chunks (`tensor_split`: sizes differ by at most one
element, so any size works, 0 and 1 included).

- Reduce-scatter, N - 1 steps. In step s, rank r sends chunk (r - s) mod N and receives chunk
  (r - s - 1) mod N, which it adds to its own copy. The chunk a rank sends in step s is the one
  it received and added to in step s - 1, so every chunk travels once round the ring gathering
  one more rank's values per hop; afterwards rank r holds chunk (r + 1) mod N summed over all.
- All-gather, N - 1 steps. In step s, rank r sends chunk (r + 1 - s) mod N, which is complete,
  and receives chunk (r - s) mod N, overwriting its own. Afterwards every rank holds every sum.

Each rank sends 2 (N - 1) / N of the tensor in all, whatever N: no rank's link carries more
than that, which is why the ring is bandwidth-optimal (and why nccl-tests report "bus
bandwidth" = 2 (N - 1) / N x bytes / time, comparable across N). The price is 2 (N - 1)
latencies, so small messages fare better with trees.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from shardwise.parallel.flat import pack, unpack

# A reduce-scatter step receives its chunk in segments of at most this many bytes, into two
# alternating buffers: adding one segment overlaps the arrival of the next (as Gloo's own ring
# does), and a step never allocates a chunk-sized buffer, whose page faults alone cost as much
# as a large message's transfer on CPU.
SEGMENT_BYTES = 4 * 2**20


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None,
                      async_op: bool = False) -> dist.Work | None:
    """Every rank's `input` laid end to end in `output`: torch 2.13's all_gather_single (its older
    name warns there), or all_gather_into_tensor on the GPU machines' torch 2.11, which has only
    that. Looked up at each call, so that what wraps torch.distributed (bench/multinode.py's
    timing) sees it."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM,
                          group: dist.ProcessGroup | None = None, async_op: bool = False) -> dist.Work | None:
    """`input` reduced over the ranks, this rank's 1/N of it in `output`: torch 2.13's
    reduce_scatter_single, or reduce_scatter_tensor on torch 2.11 (as `all_gather_single`)."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, op=op, group=group, async_op=async_op)


def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, average: bool = False) -> int:
    """Sum `tensor` over the ranks of `group` (default: the world) in place, by the ring above;
    with `average`, divide by the group's size. Returns the bytes this rank sent."""
    if not tensor.is_contiguous():
        raise ValueError(f"ring_all_reduce: needs a contiguous tensor (it works on a flat view); got strides "
                         f"{tensor.stride()} for shape {tuple(tensor.shape)}")
    if average and not tensor.is_floating_point():
        raise TypeError(f"ring_all_reduce(average=True): {tensor.dtype} cannot hold a mean; sum it instead")
    group = group or dist.group.WORLD
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    chunks = tensor.view(-1).tensor_split(world)
    right, left = (rank + 1) % world, (rank - 1) % world
    sent = 0
    for step in range(world - 1):
        sent += _send_and_add(chunks[(rank - step) % world], right, chunks[(rank - step - 1) % world], left, group)
    if average:
        # Only the chunk this rank completed: the all-gather then hands out means, not sums.
        chunks[(rank + 1) % world].div_(world)
    for step in range(world - 1):
        sent += _send_and_receive(chunks[(rank + 1 - step) % world], right, chunks[(rank - step) % world], left,
                                  group)
    return sent


def _send_and_add(send: torch.Tensor, to: int, mine: torch.Tensor, source: int, group: dist.ProcessGroup) -> int:
    """Send `send` to group rank `to` while receiving group rank `source`'s partial sum of the
    chunk `mine` and adding it in, segment by segment. Returns the bytes sent."""
    length = max(1, SEGMENT_BYTES // mine.element_size())
    sends = [dist.isend(part, group=group, group_dst=to) for part in _segments(send, length)]
    parts = _segments(mine, length)
    buffers = [torch.empty(min(length, mine.numel()), dtype=mine.dtype, device=mine.device) for _ in range(2)]

    def receive(i: int) -> dist.Work:
        return dist.irecv(buffers[i % 2][: parts[i].numel()], group=group, group_src=source)

    receives = [receive(i) for i in range(min(2, len(parts)))]
    for i, part in enumerate(parts):
        receives[i].wait()
        part += buffers[i % 2][: part.numel()]
        if i + 2 < len(parts):
            receives.append(receive(i + 2))
    for work in sends:
        work.wait()
    return send.numel() * send.element_size()


def _send_and_receive(send: torch.Tensor, to: int, recv: torch.Tensor, source: int, group: dist.ProcessGroup) -> int:
    """Send `send` to group rank `to` while receiving `recv` in place from group rank `source`;
    return the bytes sent. An empty chunk is skipped by both its sender and its receiver, who
    know its size."""
    works = []
    if send.numel():
        works.append(dist.isend(send, group=group, group_dst=to))
    if recv.numel():
        works.append(dist.irecv(recv, group=group, group_src=source))
    for work in works:
        work.wait()
    return send.numel() * send.element_size()


def _segments(chunk: torch.Tensor, length: int) -> tuple[torch.Tensor, ...]:
    """`chunk` in consecutive views of at most `length` elements; none for an empty chunk (its
    sender and receiver both skip it)."""
    return chunk.split(length) if chunk.numel() else ()


def gather_in_place(tensor: torch.Tensor, parts: list[torch.Tensor] | None, group: dist.ProcessGroup | None,
                    dst: int = 0) -> None:
    """Every rank's `tensor` into `parts` (rank r's into parts[r]) on rank `dst` of `group` (None
    elsewhere), received straight into them, one message per rank: Gloo's gather receives the
    whole result into a buffer of its own first, twice the memory on the rank that gathers."""
    if dist.get_rank(group) != dst:
        dist.send(tensor.contiguous(), group=group, group_dst=dst)
        return
    works = [dist.irecv(part, group=group, group_src=r) for r, part in enumerate(parts) if r != dst]
    parts[dst].copy_(tensor)
    for work in works:
        work.wait()


def ring_bytes_sent(numel: int, element_size: int, world_size: int, rank: int) -> int:
    """The bytes rank `rank` sends in a ring all-reduce of `numel` elements over `world_size`
    ranks: the chunks `ring_all_reduce` sends, step by step. About 2 (N - 1) / N of the tensor;
    exactly the whole tensor for N = 2."""

    def chunk(index: int) -> int:
        return numel // world_size + (index % world_size < numel % world_size)

    steps = range(world_size - 1)
    return element_size * sum(chunk(rank - s) + chunk(rank + 1 - s) for s in steps)


def bus_bandwidth(nbytes: int, seconds: float, world_size: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce, bytes/s: what each rank's link carried per
    second, comparable across world sizes (the algorithm bandwidth, bytes / time, is not)."""
    return 2 * (world_size - 1) / world_size * nbytes / seconds


def all_reduce_packed(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup, average: bool = True) -> int:
    """Average (or, without `average`, sum) `tensors` in place over `group` in one all-reduce of them
    all, packed into one buffer (one collective's latency instead of one per tensor); returns the
    bytes it sent and received."""
    packed = pack(tensors)
    dist.all_reduce(packed, op=dist.ReduceOp.AVG if average else dist.ReduceOp.SUM, group=group)
    unpack(packed, tensors)
    return 2 * packed.numel() * packed.element_size()
