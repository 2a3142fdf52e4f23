"""Checkpoints held in the nodes' memory (`train.memory_checkpoint_every`), for an elastic job
(elastic.py): after a lost node, and when it comes back, the job goes on from the state of a few
steps ago without reading a disk.

Every K steps each rank saves its state as a disk checkpoint would (DCP, the same state dict,
resharding on load), into its node's shared memory (/dev/shm: it outlives the processes, so a
re-forming in them, a restart of them by the agents and the world's growth all find it, but not the
node), and a thread sends its file to the same local rank of the next node (rank + nproc), which
keeps it there, on a process group of its own while training goes on. Rank 0's `.metadata`, which
says what every file holds, goes to every rank. A file has its name once it is whole. Each node
keeps two generations, so a node lost in the middle of a copy leaves the one before it whole. At
the agents' stop (SIGTERM: a node came back) the ranks save a generation before the disk's.

At every start, and in a re-formed world, the ranks tell each other what their nodes hold; the
newest generation of which every file of the world that saved it is held by some node (a rank's
own, or the copy of a lost rank's) is restored: each rank is sent, by a rank that holds it, each
file its part of the load reads that its node lacks (a returning node: its part of all), and DCP
loads them, resharded, from the node's memory, with no checkpoint file on disk opened. Where no
generation is whole (two neighbouring nodes lost) or a disk checkpoint is newer, the disk's is
loaded, as any resume does. The run's end removes the node's directory; a run directory that has
written no step starts with none.

What it costs: a copy of the rank's state every K steps, serialised in the training thread (into
shared memory: a host copy), and in host memory its own file and its peer's, twice: 4x the state a
rank checkpoints; the planner counts it with an asynchronous save's staging
(memory_model.checkpoint_copy), and metrics.jsonl records a rank's share of its node's as
`memory.staging`.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from shardwise.checkpoint import SafeReader, TrainingRun, checkpoint_dir, load_state, training_state

METADATA = ".metadata"  # DCP's name for the file that says what the others hold
SHARED_MEMORY = Path("/dev/shm")
GENERATION = re.compile(r"step-(\d+)-world-(\d+)-(.+)")
Holding = dict[tuple[int, int, str], dict[str, int]]  # a node's generations (step, world, strategy): file sizes


def node_directory(run_out: str | Path, node_addr: str | None) -> Path:
    """Where the node at `node_addr` (None: this one, by its name) keeps the memory checkpoints of the
    run in `run_out`: shared memory, one directory a run and node."""
    run = hashlib.sha1(str(Path(run_out).resolve()).encode()).hexdigest()[:12]
    return SHARED_MEMORY / f"shardwise-{run}-{node_addr or socket.gethostname()}"


def generation_name(step: int, world: int, strategy: str) -> str:
    """A generation's directory: what GENERATION reads back."""
    return f"step-{step:08d}-world-{world}-{strategy}"


def file_name(rank: int) -> str:
    return f"__{rank}_0.distcp"  # DCP's, one file a rank


def mapped(path: Path, size: int | None = None) -> torch.Tensor:
    """The file at `path` as bytes over its own memory (shared memory: no copy); with `size`, made
    that long, for a peer's file to be received into."""
    return torch.from_file(str(path), shared=size is not None, size=size if size is not None else path.stat().st_size,
                           dtype=torch.uint8)


class FetchingReader(SafeReader):
    """SafeReader over a generation's directory, which first asks `fetch` (on every rank: DCP reads on
    every rank, once) for the files this rank's part of the load reads that its node lacks."""

    def __init__(self, path: Path, fetch: Callable[[set[str]], None]) -> None:
        super().__init__(path)
        self.fetch = fetch

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        self.fetch({self.storage_data[item.storage_index].relative_path for item in plan.items})
        return super().read_data(plan, planner)


class PeerCheckpoints:
    """This node's memory checkpoints as one rank of it sees them (worker.py keeps it across the
    worlds the rank re-forms): generations in `directory`, each file whole once it has its name."""

    KEEP = 2

    def __init__(self, directory: Path, nproc: int, fresh: bool) -> None:
        self.directory, self.nproc = directory, nproc
        if fresh:  # a run that has written no step has nothing to restore: a failed run's leftovers go
            shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True, exist_ok=True)
        self.copy: Future[None] | None = None
        self.group: dist.ProcessGroup | None = None
        self.thread: ThreadPoolExecutor | None = None

    def generations(self) -> Holding:
        """The whole files of each generation this node holds, by name, and their sizes."""
        held: Holding = {}
        for path in sorted(self.directory.iterdir()):
            found = GENERATION.fullmatch(path.name)
            if found:
                held[int(found[1]), int(found[2]), found[3]] = {
                    file.name: file.stat().st_size for file in path.iterdir()
                    if file.name == METADATA or not file.name.startswith(".")}
        return held

    @property
    def held_bytes(self) -> int:
        """This rank's share of what its node holds."""
        return sum(sum(files.values()) for files in self.generations().values()) // self.nproc

    def join(self) -> None:
        """The copies' own process group and thread in the world now formed (collective: every rank,
        at setup). A copy under way belonged to a world that is gone: its thread is left to end (what
        had arrived has its name; what had not, a hidden one)."""
        self.copy = None
        if self.thread is not None:
            self.thread.shutdown(wait=False)
        self.group = dist.new_group(backend="gloo")
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardwise-peer-copy")

    def save(self, trainer: TrainingRun, step: int, wait: bool = False) -> None:
        """The state after `step` into this node's memory, and this rank's file's copy to its peer started
        (with `wait`, done)."""
        self.finish_copy()  # the group is the main thread's again
        rank, world = trainer.ctx.rank, trainer.ctx.world_size
        state = training_state(trainer, world, with_rng=False)
        state["trainer"]["step"].fill_(step)
        generation = self.directory / generation_name(step, world, trainer.cfg.parallel.strategy)
        writing = generation / f".writing-{rank}"
        dcp.save(state, storage_writer=FileSystemWriter(writing, sync_files=False))
        os.replace(writing / file_name(rank), generation / file_name(rank))
        metadata = [(writing / METADATA).read_bytes() if rank == 0 else None]
        dist.broadcast_object_list(metadata, src=0, group=self.group)
        shutil.rmtree(writing)
        kept = generation / f".{METADATA}-{rank}"
        kept.write_bytes(metadata[0])
        os.replace(kept, generation / METADATA)
        for old in sorted(self.directory.glob("step-*"))[:-self.KEEP]:
            shutil.rmtree(old, ignore_errors=True)
        peer, source = (rank + self.nproc) % world, (rank - self.nproc) % world
        if peer != rank:  # else one node: nowhere else to keep it
            self.copy = self.thread.submit(self._exchange, generation, rank, peer, source, world)
        if wait:
            self.finish_copy()

    def _exchange(self, generation: Path, rank: int, peer: int, source: int, world: int) -> None:
        """On the copies' thread: this rank's file sent to rank `peer`, rank `source`'s received."""
        own = mapped(generation / file_name(rank))
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([own.numel()]), group=self.group)
        receiving = generation / f".{file_name(source)}"
        incoming = mapped(receiving, int(sizes[source]))
        works = [dist.isend(own, peer, self.group), dist.irecv(incoming, source, self.group)]
        for work in works:
            work.wait()
        os.replace(receiving, generation / file_name(source))

    def poll(self) -> None:
        """Raise where the last copy failed (each step; nothing waits)."""
        if self.copy is not None and self.copy.done():
            self.finish_copy()

    def finish_copy(self) -> None:
        """Wait for the copy under way."""
        copy, self.copy = self.copy, None
        if copy is not None:
            copy.result()

    def restore(self, trainer: TrainingRun) -> int | None:
        """At a start, or in a re-formed world: the newest generation whole among the nodes' memory
        loaded into `trainer` (collective); its step, or None where none is whole or disk's is newer."""
        started = time.perf_counter()
        disk = newest_disk_step(trainer.out) if trainer.ctx.is_main else None
        every: list[Any] = [None] * trainer.ctx.world_size
        dist.all_gather_object(every, (self.generations(), disk))
        disk = every[0][1]
        chosen = newest_whole([held for held, _ in every])
        if chosen is None or (disk is not None and disk > chosen[0][0]):
            return None
        key, holders = chosen
        step, world, strategy = key
        generation = self.directory / generation_name(*key)
        generation.mkdir(exist_ok=True)
        sizes = {name: every[holder][0][key][name] for name, holder in holders.items()}
        fetched: list[int] = []

        def fetch(needed: set[str]) -> None:
            """The files each rank's part of the load reads and its node lacks, sent by ranks that hold them."""
            wanted: list[Any] = [None] * trainer.ctx.world_size
            here = {file.name for file in generation.iterdir()}
            dist.all_gather_object(wanted, sorted({*needed, METADATA} - here))
            sends = [(name, holders[name], rank) for rank, names in enumerate(wanted) for name in names]
            fetched.append(send_files(generation, sizes, sends, trainer.ctx.rank))

        fetch(set())  # the metadata, which DCP reads before it plans
        load_state(trainer, FetchingReader(generation, fetch), same_world=False, saved_rank_state=None,
                   source="memory")
        if trainer.ctx.is_main:
            print(f"restored step {step} from the nodes' memory (saved by {strategy} on {world} rank(s); "
                  f"{sum(fetched) / 2**20:.1f} MiB fetched from other nodes, in "
                  f"{time.perf_counter() - started:.2f} s)", file=sys.stderr, flush=True)
        return step

    def close(self) -> None:
        """At the run's end (collective): nothing will restore from memory again; the node's directory goes."""
        self.finish_copy()
        dist.barrier()
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            shutil.rmtree(self.directory, ignore_errors=True)


def send_files(generation: Path, sizes: dict[str, int], sends: list[tuple[str, int, int]], rank: int) -> int:
    """Each (name, from, to) of `sends`: the file rank `from` holds in `generation` (its node's) sent to
    rank `to`, which keeps it there (every rank goes through the same list, in order); the bytes this
    rank received."""
    works, receiving = [], []
    for name, holder, to in sends:
        if rank == holder:
            works.append(dist.isend(mapped(generation / name), to))
        elif rank == to:
            partial = generation / f".{name}-{rank}"
            works.append(dist.irecv(mapped(partial, sizes[name]), holder))
            receiving.append((partial, generation / name))
    for work in works:
        work.wait()
    for partial, whole in receiving:
        os.replace(partial, whole)
    return sum(sizes[whole.name] for _, whole in receiving)


def newest_whole(held: list[Holding]) -> tuple[Any, dict[str, int]] | None:
    """Of what each rank's node holds (`held[rank]`: its generations and their files' sizes), the newest
    generation of which some rank's node holds every file, and which rank holds each (the lowest);
    None where none is whole."""
    whole = []
    for key in {key for rank_held in held for key in rank_held}:
        names = [METADATA, *(file_name(r) for r in range(key[1]))]
        holders = {name: next((r for r, rank_held in enumerate(held) if name in rank_held.get(key, {})), None)
                   for name in names}
        if None not in holders.values():
            whole.append((key, holders))
    return max(whole, key=lambda generation: generation[0][0], default=None)


def newest_disk_step(run_dir: Path) -> int | None:
    """The step of the newest checkpoint on disk, by its directory's name (no file opened)."""
    names = sorted(checkpoint_dir(run_dir).glob("step-*"))
    return int(names[-1].name.removeprefix("step-")) if names else None
