"""Bytes this rank holds, by category, counted from the tensors themselves.

Tensors are counted by their underlying storage, once each: a tied weight, gradient views into a
communication bucket, or q/k/v views of one matmul output are each one allocation. A storage is
known by its identity, not its address, so the same counting works on meta and fake tensors
(which have no addresses), and that is how the planner traces a model it never allocates.
"""

from __future__ import annotations

import ctypes
import functools
import resource
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn


@dataclass
class MemoryBreakdown:
    params: int
    grads: int
    optimizer: int
    activations: int
    peak: int
    # the most bytes of full (unsharded) parameters held at once during a step; None: unknown
    gathered_peak: int | None = 0
    # bytes in host memory, apart from the device's categories (parallel.sharding.offload: master shards, their
    # gradients, optimizer state); None: nothing offloaded
    host: int | None = None
    # host bytes of the asynchronous checkpoints' copy of this rank's state, held from the first save on; None: none
    staging: int | None = None

    def as_dict(self) -> dict[str, int | None]:
        return asdict(self)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a (possibly distributed) tensor that lives on this rank."""
    # A DTensor exists only once its module is loaded; not importing it here keeps 0.6 s of imports
    # off what does not train (the planner, the CLI's help).
    dtensor = sys.modules.get("torch.distributed.tensor")
    return tensor.to_local() if dtensor is not None and isinstance(tensor, dtensor.DTensor) else tensor


def storage_key(storage: torch.UntypedStorage) -> int:
    """Which storage this is: the same for every view of it, and defined on meta and fake tensors,
    whose data pointers are all 0. (A storage freed and refilled in place, as fsdp does, keeps it.)"""
    return storage._cdata


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = local_tensor(tensor).untyped_storage()
        seen[storage_key(storage)] = storage.nbytes()
    return sum(seen.values())


def exact_storage(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, a contiguous view into a larger storage (a shard in a packed buffer), as a tensor
    over the same memory whose storage is exactly its own bytes. DCP's writer copies a tensor whose
    storage is larger than itself and keeps every copy until the rank's file is written: a rank's
    whole sharded state, twice over, at every checkpoint. A non-contiguous view is returned as it is."""
    storage = tensor.untyped_storage()
    if not tensor.is_contiguous() or storage.nbytes() == tensor.nbytes:
        return tensor
    start = tensor.storage_offset() * tensor.element_size()
    own = storage[start : start + tensor.nbytes]  # shares the memory
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(own, 0, tensor.shape, tensor.stride())


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def peak_bytes(device: torch.device) -> int:
    """CUDA: the allocator's peak allocated bytes. CPU: the process's peak resident set, which
    includes the Python and torch runtime (there is no CPU allocator counter to read)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def resident_bytes() -> tuple[int, int]:
    """This process's resident set now and its peak since it started or `reset_peak_resident`
    (Linux: VmRSS and VmHWM); (0, 0) where /proc does not say."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    except OSError:
        return 0, 0
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def reset_peak_resident() -> None:
    """Count the peak resident set afresh from now (Linux clear_refs 5), so a peak read later
    belongs to what ran in between; without it, the peak stays the process's."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


class PhasePeaks:
    """Each phase of a run's peak resident set, in bytes (Linux VmHWM, counted afresh as each
    phase starts), and its rise: the peak less the resident set as the phase started, what the
    phase itself added. `with peaks("eval"): ...`; a phase that runs again keeps its highest of
    each. On CUDA, each phase's peak allocated bytes as well."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.rss: dict[str, int] = {}
        self.rise: dict[str, int] = {}
        self.allocated: dict[str, int] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        reset_peak_resident()
        start = resident_bytes()[0]
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        finally:
            peak = resident_bytes()[1]
            self.rss[phase] = max(self.rss.get(phase, 0), peak)
            self.rise[phase] = max(self.rise.get(phase, 0), peak - start)
            if self.device.type == "cuda":
                self.allocated[phase] = max(self.allocated.get(phase, 0), torch.cuda.max_memory_allocated(self.device))

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {"rss": self.rss, "rise": self.rise, **({"allocated": self.allocated} if self.allocated else {})}


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
OWN_MAPPING_BYTES = 4 << 20  # blocks this large and larger get their own mapping (see map_large_blocks)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)


def _malloc_trim() -> Callable[[int], int] | None:
    return getattr(_libc(), "malloc_trim", None)


def map_large_blocks(min_bytes: int = OWN_MAPPING_BYTES) -> None:
    """Have glibc give every block of `min_bytes` or more its own memory mapping, which freeing it
    returns to the OS at once (elsewhere: nothing). By default glibc raises that threshold to the
    size of each large block it frees, up to 32 MiB, and serves blocks below it from heaps that
    keep freed memory resident: a rank that gathers and frees units, or sends buffers through
    Gloo's threads, would hold the memory of many freed ones. Smaller blocks (most activations)
    keep the heap's fast reuse."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, min_bytes)


def return_free_memory() -> None:
    """Hand the memory the C allocator holds free back to the OS (glibc's malloc_trim; elsewhere
    nothing). Once glibc has freed a block of some megabytes it serves blocks up to that size from
    its heap, where freed ones stay resident: a loop that makes and frees a whole unit at a time
    would otherwise grow the resident set by a unit each turn."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


# The counters open in this thread (a context variable, so each of dp's replica threads has its own,
# set by `listening`), innermost last; and the lists `saved_until_gradient` records into, innermost last.
_open_counters: ContextVar[tuple[ActivationCounter, ...]] = ContextVar("open_activation_counters", default=())
_recording: ContextVar[tuple[list, ...]] = ContextVar("recorded_until_gradient", default=())


def active_counters() -> list[ActivationCounter]:
    """The counters open now in this thread."""
    return list(_open_counters.get())


def record_saved(tensor: torch.Tensor) -> None:
    """Count `tensor` as saved for backward, for code that keeps tensors for backward without
    autograd's saved-tensor hooks seeing them (selective checkpointing). It counts as held until
    the gradient named by the innermost `saved_until_gradient` around the call is computed, or,
    without one, until the counter closes."""
    recording = _recording.get()
    for counter in _open_counters.get():
        key = counter.hold(tensor)
        if key is not None and recording:
            recording[-1].append((counter, key))


def hold_while_alive(owner: object, tensor: torch.Tensor) -> None:
    """Count `tensor` as saved for backward, in every open counter, until `owner` is freed: for
    code that keeps tensors for backward in an object of its own (recompute.RecomputedOnce)."""
    for counter in _open_counters.get():
        key = counter.hold(tensor)
        if key is not None:
            weakref.finalize(owner, counter._release, key)


@contextmanager
def saved_until_gradient(tensor: torch.Tensor) -> Iterator[None]:
    """What `record_saved` counts inside is released when `tensor`'s gradient is computed: for a
    block's input, once the block's backward is done with everything it kept (so the next
    micro-batch's forward does not find it still counted)."""
    recorded: list[tuple[ActivationCounter, int]] = []
    token = _recording.set((*_recording.get(), recorded))
    try:
        yield
    finally:
        _recording.reset(token)
    if recorded and tensor.requires_grad:
        tensor.register_hook(functools.partial(_release_all, recorded))


def _release_all(recorded: list[tuple[ActivationCounter, int]], grad: torch.Tensor) -> None:
    for counter, key in recorded:
        counter._release(key)


class _Saved:
    """What autograd keeps for a saved tensor while the counter listens: the tensor, detached (a
    tensor an op saves of its own outputs would otherwise hold its node, which holds this: a cycle
    that keeps a graph whose saved tensors are never released, as a split backward's, alive for
    ever), and a note to the counter when autograd lets go of it (after the backward that used it)."""

    __slots__ = ("tensor", "counter", "storage")

    def __init__(self, tensor: torch.Tensor, counter: ActivationCounter, storage: int) -> None:
        self.tensor = tensor
        self.counter = counter
        self.storage = storage

    def __del__(self) -> None:
        self.counter._release(self.storage)


class ActivationCounter:
    """Counts the bytes autograd holds saved for backward: the activation memory that lives from a
    forward until its backward. `bytes` is the most held at once while the counter was open: one
    micro-batch's forward for a loop that runs backward after each, several for a pipeline schedule
    that runs several forwards first. Parameters saved by their ops are not counted; a storage is
    counted once however many saved tensors view it."""

    def __init__(self, model: nn.Module) -> None:
        self._params = list(model.parameters())
        self._param_storages: set[int] = set()
        self._live: dict[int, tuple[int, int]] = {}  # storage key -> (saved tensors viewing it, bytes)
        self.live_bytes = 0
        self.bytes = 0
        self._lock = threading.Lock()  # dp's replica threads save tensors concurrently

    def _is_parameter(self, key: int) -> bool:
        if key not in self._param_storages:
            # A strategy may give a parameter new storage after the counter starts (a dtype change): look again.
            self._param_storages = {storage_key(local_tensor(p).untyped_storage()) for p in self._params}
        return key in self._param_storages

    def hold(self, tensor: torch.Tensor) -> int | None:
        """Count `tensor`'s storage as held; return its key for `_release`, or None for a parameter."""
        storage = tensor.untyped_storage()
        key = storage_key(storage)
        with self._lock:
            if self._is_parameter(key):
                return None
            count, nbytes = self._live.get(key, (0, storage.nbytes()))
            if count == 0:
                self.live_bytes += nbytes
                self.bytes = max(self.bytes, self.live_bytes)
            self._live[key] = (count + 1, nbytes)
        return key

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _Saved:
        key = self.hold(tensor)
        return tensor if key is None else _Saved(tensor.detach(), self, key)

    @staticmethod
    def _unpack(saved: torch.Tensor | _Saved) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        with self._lock:
            count, nbytes = self._live[key]
            if count == 1:
                del self._live[key]
                self.live_bytes -= nbytes
            else:
                self._live[key] = (count - 1, nbytes)

    @contextmanager
    def listening(self) -> Iterator[None]:
        """The counter, open in this thread: its saved-tensor hooks and `active_counters`. A thread
        of its own opens it again (dp's replicas): autograd's hooks and the open counters belong
        to the thread that opens them."""
        token = _open_counters.set((*_open_counters.get(), self))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            _open_counters.reset(token)

    def __enter__(self) -> ActivationCounter:
        self._opened = self.listening()
        self._opened.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._opened.__exit__(*exc)


def count_memory(
    params: Iterable[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    activations: int,
    device: torch.device,
) -> MemoryBreakdown:
    """The breakdown for the parameters this rank holds (shards, where a strategy shards them)."""
    params = list(params)
    held = storage_bytes(params)
    return MemoryBreakdown(
        params=held,
        grads=storage_bytes(p.grad for p in params if p.grad is not None),
        optimizer=storage_bytes(optimizer_state_tensors(optimizer)),
        activations=activations,
        peak=peak_bytes(device),
        gathered_peak=held,  # unsharded strategies hold every parameter whole all the time
    )
