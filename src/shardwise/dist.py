"""The process group, this rank's device, CPU threads and seeding, held in one explicit context."""

from __future__ import annotations

import multiprocessing
import os
import random
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from shardwise.memory import map_large_blocks
from shardwise.parallel.comm import all_gather_single

FLIGHT_RECORDER_ENTRIES = 64  # collectives the flight recorder keeps per process


@dataclass
class DistContext:
    """Where this process stands: its rank, the world, its device. Passed explicitly, never global."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    # The device meshes made over this process group, by shape (parallel/dims.py `Mesh.of`): made once,
    # then the same one for every run this process trains (a notebook, a pool of test ranks), since Gloo
    # keeps threads and connections for every group.
    meshes: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def all_reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        """Mean over ranks of a small tensor (losses, norms); a no-op on one process."""
        if not self.distributed or self.world_size == 1:
            return value
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value / self.world_size

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        """Every rank's 1-D `row` (a few numbers a step: what each rank found, how much it holds),
        stacked in rank order on every rank: one collective, where a pickled object takes two."""
        if not self.distributed or self.world_size == 1:
            return row[None]
        rows = torch.empty(self.world_size * row.numel(), dtype=row.dtype, device=row.device)
        all_gather_single(rows, row)
        return rows.view(self.world_size, -1)

    def all_gather_object(self, value: object) -> list[object]:
        """Every rank's `value` (small, picklable: log records), in rank order, on every rank."""
        if not self.distributed or self.world_size == 1:
            return [value]
        values: list[object] = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values


def restart_count() -> int:
    """How often torchrun has restarted this worker's group after a failure (0: its first start)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def choose_backend(requested: str) -> str:
    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(backend: str = "auto", timeout_s: float = 300.0, threads_per_rank: int = 1,
                     debug_collectives: bool = False) -> DistContext:
    """Join the process group torchrun describes in the environment (RANK, WORLD_SIZE, ...).

    Without those variables (a plain `python` run) this is a world of one and no group is made.
    Every group records its collectives (stalls.py names the one a timeout happened in); with
    `debug_collectives` every collective is first checked to be the same call on every rank.
    """
    configure_process(threads_per_rank, debug_collectives)
    backend = choose_backend(backend)
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = rank_device(backend, local_rank)
    if "MASTER_ADDR" in os.environ and not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            device_id=device if backend == "nccl" else None,
        )
    return DistContext(rank, world_size, local_rank, device, backend)


def configure_process(threads_per_rank: int, debug_collectives: bool) -> None:
    """What every rank sets before it makes a process group (see init_distributed)."""
    # Every group records its collectives from here on (the flight recorder, read when a process
    # group is made), so stalls.py can name the one a timeout happened in; only the newest is read.
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(FLIGHT_RECORDER_ENTRIES))
    if debug_collectives:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        dist.set_debug_level_from_env()
    # Ranks sharing a CPU must not each start one thread per core, or they fight for cores.
    torch.set_num_threads(threads_per_rank)
    map_large_blocks()  # freed parameters, units and buffers go back to the OS: the resident set is what a rank holds


def rank_device(backend: str, local_rank: int) -> torch.device:
    """The device a rank computes on: its own GPU under NCCL, else the CPU."""
    if backend != "nccl":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("launch.backend = 'nccl' needs CUDA, and none is available; use 'gloo' or 'auto'")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def job_store(timeout_s: float) -> dist.TCPStore:
    """A client of the store the launcher (torchrun's agent, or launch_local) hosts for the job."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def shutdown_distributed() -> None:
    """Tear the group down explicitly: Gloo can abort or hang if it is left to interpreter exit."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def world_timeout() -> timedelta | None:
    """The default group's collective timeout (launch.timeout_s), for every group a run makes
    besides: new_group's own default is 30 minutes, and a stall in one would go unexplained, and
    hold its rank, that long (a device mesh's dimensions: parallel/dims.py). None in a fake
    world (bench/fake_world.py), whose groups never wait: new_group's default then."""
    backend = dist.get_backend()
    if backend not in ("gloo", "nccl"):
        return None
    return dist.group.WORLD._get_backend(torch.device("cuda" if backend == "nccl" else "cpu")).options._timeout


def new_group_of_all() -> dist.ProcessGroup:
    """A second process group of every rank (for collectives issued from another thread), with
    the world's timeout."""
    return dist.new_group(timeout=world_timeout())


def worker_name(rank: int, group: int | None = None) -> str:
    """A worker's process name: `shardwise rRANK`, or `shardwise gGROUPrRANK` in replica group GROUP."""
    return f"shardwise r{rank}" if group is None else f"shardwise g{group}r{rank}"


def name_worker(rank: int, group: int | None = None) -> None:
    """Call this process worker_name(rank, group) where ps, top and pgrep look (Linux keeps 15
    characters of it): workers forked from one server (launch.py) otherwise all show the server's
    command line."""
    try:
        Path("/proc/self/comm").write_text(worker_name(rank, group)[:15])
    except OSError:  # not Linux
        pass


def leave_process() -> None:
    """End a worker process that has written everything and destroyed its group, without the
    interpreter's teardown: there torch 2.13 on Gloo sometimes aborts ("terminate called without an
    active exception") as it frees its threads, which makes a finished run look failed. A process
    forked by the launcher (multiprocessing's) ends that way by itself once it has handed the
    launcher its result, and must return to do so: the launcher waits for that result."""
    sys.stdout.flush()
    sys.stderr.flush()
    if multiprocessing.parent_process() is None:
        os._exit(0)


def broadcast_from_rank0(tensors: list[torch.Tensor]) -> None:
    """Overwrite `tensors` on every rank with rank 0's values, in place."""
    with torch.no_grad():
        for tensor in tensors:
            dist.broadcast(tensor, src=0)


def seed_everything(seed: int) -> None:
    """Same seed on every rank, so every rank builds the same initial model."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
