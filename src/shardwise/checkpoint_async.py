"""Checkpoints written while training goes on (`train.checkpoint_async`).

A save blocks the step only while the state is copied: `save` stages every tensor a rank holds
into host memory (DCP's stager: a copy, so the next steps may change the originals) and hands the
copies to a background thread that writes them (`dcp.async_save`). The thread's collectives run
over a process group of their own, so they never interleave with training's. On rank 0, once
every rank's files are written, the same thread seals the checkpoint as a synchronous save does
(checkpoint.py): checksums, fsync, rename into place, then `latest`, then pruning to
`keep_checkpoints`. So `latest` never names a checkpoint before it is whole, and pruning, which
runs after `latest` moved, never deletes the newest complete one.

At most one save is in flight. The next waits for it (`save` calls `wait` first), and so do a
SIGTERM's synchronous save and the end of the run. Each step, `poll` asks rank 0 (one small
broadcast, only while a save is in flight) whether it is done. When it is, every rank learns so in
the same step. A save that failed in the background raises CheckpointError on every rank at that
step, with its cause and the step it was saving; the checkpoint before it is intact.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from shardwise.checkpoint import (
    TrainingRun,
    _from_rank0,
    checkpoint_manifest,
    checkpoint_paths,
    first_failure,
    save_failed,
    seal,
    training_state,
)
from shardwise.memory import local_tensor


@dataclass
class InFlight:
    """One save being written: where it goes, and (rank 0) how it ended, once it has."""

    step: int
    final: Path
    tmp: Path
    written: Future
    staged_bytes: int
    done: threading.Event = field(default_factory=threading.Event)
    problem: str | None = None


class AsyncCheckpointer:
    """Background saves of one run's checkpoints, at most one in flight. Made on every rank, in
    the same order (it makes a process group)."""

    def __init__(self, keep: int, is_main: bool) -> None:
        self.keep, self.is_main = keep, is_main
        # Gloo: the background thread's collectives take host tensors, whatever device trains.
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.in_flight: InFlight | None = None

    @property
    def staged_bytes(self) -> int:
        """Host bytes the save in flight holds: its copy of this rank's state (0 when none)."""
        return self.in_flight.staged_bytes if self.in_flight is not None else 0

    def save(self, trainer: TrainingRun, step: int) -> Path:
        """Start saving the state after `step` completed steps; return once it is staged. Collective."""
        self.wait()
        final, tmp = checkpoint_paths(trainer, step)
        state = training_state(trainer, trainer.ctx.world_size)
        state["trainer"]["step"].fill_(step)
        manifest = checkpoint_manifest(trainer, state, step)
        staged = sum(local_tensor(t).nbytes for t in _leaves(state))
        written = dcp.async_save(state, checkpoint_id=tmp, process_group=self.group)
        flight = InFlight(step, final, tmp, written, staged)
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

    def poll(self) -> None:
        """Between steps: settle the save in flight if rank 0 has finished it. Collective while one
        is in flight; raises CheckpointError if it failed."""
        if self.in_flight is not None and _from_rank0(self.in_flight.done.is_set() if self.is_main else None):
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

    def _settle(self) -> None:
        flight, self.in_flight = self.in_flight, None
        problem = _from_rank0(flight.problem if self.is_main else None)
        if not self.is_main:  # rank 0 is done, so this rank's part is written: its thread is returning
            try:
                flight.written.result()
            except CheckpointException:
                pass  # the same failure as rank 0's, which every rank reports
        if problem is not None:
            error = save_failed(self.is_main, flight.final, flight.tmp, problem)
            raise type(error)(f"in the background after step {flight.step}: {error}")


def _leaves(state: dict) -> list[torch.Tensor]:
    """The tensors of a state dict (nested dicts: an optimizer's state)."""
    out = []
    for value in state.values():
        if isinstance(value, dict):
            out += _leaves(value)
        elif isinstance(value, torch.Tensor):
            out.append(value)
    return out
