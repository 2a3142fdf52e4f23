"""Checkpoints written while training goes on (`train.checkpoint_async`).

A save hands a copy of the state to a background thread that writes it (`dcp.async_save`), and
the copy itself is made while training goes on. `save` copies at once only what the next step's
forward may change (buffers: BatchNorm's statistics, a router's balancing bias) and the run's small
state (its step, RNG); the parameters and the optimizer state, which only an optimizer step (or a
replica group's heal) changes, are copied by a staging thread during the next step's forward and
backward, and the trainer waits for that copy (`staged`) before it changes them. The copies go into
host memory (`HostStager`: pinned where a GPU trains, copied on a stream of its own; the same
buffers every save, held from the first on). The writing thread's collectives run over a process
group of their own, so they never interleave with training's. On rank 0, once every rank's files
are written, the same thread seals the checkpoint as a synchronous save does (checkpoint.py):
checksums, fsync, rename into place, then `latest`, then pruning to `keep_checkpoints`. So
`latest` never names a checkpoint before it is whole, and pruning, which runs after `latest`
moved, never deletes the newest complete one.

At most one save is in flight. The next waits for it (`save` calls `wait` first), and so do a
SIGTERM's synchronous save and the end of the run. Each step, `poll` asks rank 0 (one small
broadcast, only while a save is in flight) whether it is done. When it is, every rank learns so in
the same step. A save that failed in the background (its copy or its write) raises CheckpointError
on every rank at that step, with its cause and the step it was saving; the checkpoint before it is
intact.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

from shardwise.checkpoint import (
    TrainingRun,
    checkpoint_manifest,
    checkpoint_paths,
    first_failure,
    from_rank0,
    save_failed,
    seal,
    training_state,
)
from shardwise.dist import world_timeout


class HostStager(AsyncStager):
    """Stages a state dict as a copy of every tensor in host memory (pinned where a GPU trains),
    each DTensor rewrapped around a copy of its local part, into the same buffers save after save:
    memory fresh from the allocator costs a page fault per page as the copy first touches it, about
    half of a fresh copy's time here (and pinning it, on CUDA, more). The buffers are reused only
    once the save that wrote from them is done (one save in flight).

    `stage` copies the model entries not named in `deferred` (set before each save) and everything
    outside the model and the optimizer at once, and returns a future of the copy that its thread
    completes with the rest; the writer waits for it.

    DCP's default stager fails on our sharded state ("Attempted to call copy_() on an invalid
    python storage"): our shards are views into one flat buffer, a DTensor around such a view
    carries the view's storage offset (pytorch#167597), so its `data_ptr()` is not 0, and that
    stager, which tells wrappers from plain tensors by `data_ptr() != 0`, copies the wrapper's
    empty storage."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}  # by the entry's path in the state dict
        self.deferred: set[str] = set()  # the model's entries only an optimizer step changes: its parameters
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardwise-staging")

    @property
    def nbytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.buffers.values())

    def stage(self, state_dict: dict[str, Any]) -> Future:
        later: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, source) for the staging thread
        staged = {}
        for part, entries in state_dict.items():
            if part == "model":
                staged[part] = {name: self._to_host(value, f"/model/{name}", later if name in self.deferred else None)
                                for name, value in entries.items()}
            else:
                staged[part] = self._to_host(entries, f"/{part}", later if part == "optimizer" else None)
        # The copy on a GPU starts after what the device was asked to do before the save (the step).
        device = next((source.device for _, source in later if source.is_cuda), None)
        ready = None
        if device is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        return self.thread.submit(self._copy, later, device, ready, staged)

    @staticmethod
    @torch.no_grad()
    def _copy(later: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device | None,
              ready: torch.cuda.Event | None, staged: dict[str, Any]) -> dict[str, Any]:
        """In the staging thread: `later`'s copies, on a stream of their own where a GPU trains
        (this thread's current device is not the rank's: the stream is made on the tensors' own)."""
        stream = torch.cuda.Stream(device) if device is not None else None
        with torch.cuda.stream(stream):  # no stream: the CPU's copies, in this thread
            if stream is not None:
                stream.wait_event(ready)
            for buffer, source in later:
                buffer.copy_(source, non_blocking=source.is_cuda)
        if stream is not None:
            stream.synchronize()
        return staged

    @torch.no_grad()
    def _to_host(self, value: Any, path: str, later: list[tuple[torch.Tensor, torch.Tensor]] | None) -> Any:
        """`value`'s copy, made now, or (`later` given) its buffer, copied from `value` by the thread."""
        if isinstance(value, dict):
            return {key: self._to_host(v, f"{path}/{key}", later) for key, v in value.items()}
        if isinstance(value, DTensor):
            return DTensor.from_local(self._to_host(value.to_local(), path, later), value.device_mesh,
                                      value.placements, run_check=False, shape=value.shape, stride=value.stride())
        if isinstance(value, LocalShardsWrapper):  # a tensor-parallel shard's pieces (state_view.py)
            pieces = [self._to_host(piece, f"{path}#{i}", later) for i, piece in enumerate(value.local_shards())]
            return LocalShardsWrapper(pieces, value.local_offsets())
        if not isinstance(value, torch.Tensor):
            return value
        buffer = self.buffers.get(path)
        if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
            buffer = self.buffers[path] = torch.empty_like(value, device="cpu", pin_memory=value.is_cuda)
        if later is None:
            return buffer.copy_(value)
        later.append((buffer, value))
        return buffer


@dataclass
class InFlight:
    """One save being written: where it goes, and (rank 0) how it ended, once it has."""

    step: int
    final: Path
    tmp: Path
    written: Future
    done: threading.Event = field(default_factory=threading.Event)
    problem: str | None = None


class AsyncCheckpointer:
    """Background saves of one run's checkpoints, at most one in flight. Made on every rank, in
    the same order (it makes a process group)."""

    def __init__(self, keep: int, is_main: bool) -> None:
        self.keep, self.is_main = keep, is_main
        # Gloo: the background thread's collectives take host tensors, whatever device trains. With
        # the world's timeout: a rank lost mid-save fails the save in launch.timeout_s, and the rank
        # that waits for it on its way out (close) ends, instead of holding for 30 minutes. Named, so
        # that a collective failing in it says where it was.
        self.group = dist.new_group(backend="gloo", timeout=world_timeout(), group_desc="async_checkpoints") \
            if dist.is_initialized() else None
        self.stager = HostStager()
        self.shapes: dict[str, list[int]] | None = None  # the manifest's model shapes: the same every save
        self.in_flight: InFlight | None = None
        self.staging: Future | None = None  # the copy of the save in flight, until the state may change
        self.staging_wait_s = 0.0  # how long `staged` has waited for copies, in all

    @property
    def staged_bytes(self) -> int:
        """Host bytes of the copy of this rank's state, held from the first save on (0 before)."""
        return self.stager.nbytes

    def save(self, trainer: TrainingRun, step: int) -> Path:
        """Start saving the state after `step` completed steps; return once it is staged. Collective."""
        self.wait()
        final, tmp = checkpoint_paths(trainer, step)
        state = training_state(trainer, trainer.ctx.world_size)
        state["trainer"]["step"].fill_(step)
        manifest = checkpoint_manifest(trainer, state, step, self.shapes)
        self.shapes = manifest["shapes"]
        self.stager.deferred = {name for name, _ in trainer.strategy.view.named_parameters()}
        response = dcp.async_save(state, checkpoint_id=tmp, process_group=self.group, async_stager=self.stager)
        self.staging, written = response.staging_completion, response.upload_completion
        flight = InFlight(step, final, tmp, written)
        if self.is_main:
            written.add_done_callback(lambda future: self._seal(flight, future, manifest))
        self.in_flight = flight
        return final

    def _seal(self, flight: InFlight, future: Future, manifest: dict) -> None:
        """Rank 0, in the writing thread, once every rank's files are written (or the save failed)."""
        try:
            future.result()
            seal(flight.tmp, flight.final, manifest, self.keep)
        except CheckpointException as error:
            flight.problem = first_failure(error)
        except OSError as error:
            flight.problem = str(error)
        except Exception as error:  # anything else the writer raised: reported, not lost in its thread
            flight.problem = f"{type(error).__name__}: {error}"
        flight.done.set()

    def staged(self) -> None:
        """Before the parameters or the optimizer state change (an optimizer step, a heal): wait
        until the save in flight has copied them. Not collective; a failed copy is reported as the
        save's failure (`poll`, `wait`), on every rank at once."""
        if self.staging is not None:
            started = time.perf_counter()
            futures.wait([self.staging])
            self.staging_wait_s += time.perf_counter() - started
            self.staging = None

    def poll(self) -> None:
        """Between steps: settle the save in flight if rank 0 has finished it. Collective while one
        is in flight; raises CheckpointError if it failed."""
        if self.in_flight is not None and from_rank0(self.in_flight.done.is_set() if self.is_main else None):
            self._settle()

    def wait(self) -> None:
        """Wait for the save in flight and settle it. Collective; raises CheckpointError if it failed."""
        if self.in_flight is not None:
            if self.is_main:
                self.in_flight.done.wait()
            self._settle()

    def close(self) -> None:
        """After a run stopped on an error: let the save in flight end on this rank (sealed if every
        rank's files arrived), with no collective, since other ranks may be gone; never raises."""
        if self.in_flight is not None:
            flight, self.in_flight = self.in_flight, None
            if self.is_main:
                flight.done.wait()
            else:
                flight.written.exception()
        self.staging = None
        self.stager.thread.shutdown()

    def _settle(self) -> None:
        flight, self.in_flight, self.staging = self.in_flight, None, None
        problem = from_rank0(flight.problem if self.is_main else None)
        if not self.is_main:  # rank 0 is done, so this rank's part is written: its thread is returning
            try:
                flight.written.result()
            except CheckpointException:
                pass  # the same failure as rank 0's, which every rank reports
        if problem is not None:
            error = save_failed(self.is_main, flight.final, flight.tmp, problem)
            raise type(error)(f"in the background after step {flight.step}: {error}")
