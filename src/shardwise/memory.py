"""Bytes this rank holds, by category, counted from the tensors themselves.

Tensors are counted by their underlying storage, once each: a tied weight, gradient views into a
communication bucket, or q/k/v views of one matmul output are each one allocation.
"""

from __future__ import annotations

import resource
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor


@dataclass
class MemoryBreakdown:
    params: int
    grads: int
    optimizer: int
    activations: int
    peak: int
    # the most bytes of full (unsharded) parameters held at once during a step; None: unknown
    gathered_peak: int | None = 0

    def as_dict(self) -> dict[str, int | None]:
        return asdict(self)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a (possibly distributed) tensor that lives on this rank."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = local_tensor(tensor).untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def peak_bytes(device: torch.device) -> int:
    """CUDA: the allocator's peak allocated bytes. CPU: the process's peak resident set, which
    includes the Python and torch runtime (there is no CPU allocator counter to read)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


_active_counters: list[ActivationCounter] = []


def record_saved(tensor: torch.Tensor) -> None:
    """Count `tensor` as saved for backward, for code that keeps tensors for backward without
    autograd's saved-tensor hooks seeing them (selective checkpointing)."""
    for counter in _active_counters:
        counter.add(tensor)


class ActivationCounter:
    """Counts the bytes autograd saves for backward during a forward pass: the activation memory
    that lives from forward until backward, each storage once. Parameters saved by their ops are
    not counted."""

    def __init__(self, model: nn.Module) -> None:
        self._params = list(model.parameters())
        self._param_storages: set[int] = set()
        self._saved: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _is_parameter(self, pointer: int) -> bool:
        if pointer not in self._param_storages:
            # Sharded strategies refill parameter storage on each gather: look again.
            self._param_storages = {local_tensor(p).untyped_storage().data_ptr() for p in self._params}
        return pointer in self._param_storages

    def add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if not self._is_parameter(storage.data_ptr()):
            self._saved[storage.data_ptr()] = storage.nbytes()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.add(tensor)
        return tensor

    @property
    def bytes(self) -> int:
        return sum(self._saved.values())

    def __enter__(self) -> ActivationCounter:
        self._hooks.__enter__()
        _active_counters.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _active_counters.remove(self)
        self._hooks.__exit__(*exc)


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
