"""Checkpoints held in the peers' memory (`train.memory_checkpoint_every`), for an elastic job
whose survivors re-form the world in their own processes (elastic.py): they go on from the state
of a few steps ago without reading a disk.

Every K steps each rank saves its state as a disk checkpoint would (DCP, the same state dict,
resharding on load), into files in its own memory (`MemoryFiles`), and sends its file to a rank on
the next node (rank + nproc), which keeps it: the copy travels on a process group of its own while
training goes on, and each step asks whether it arrived. Rank 0's `.metadata`, which says what
every file holds, goes to every rank. Each rank keeps two generations, its own file and its
peer's, so a node lost in the middle of a copy leaves the generation before it whole.

After a loss, the survivors, in the world they re-formed, tell each other what they hold; the
newest generation of which every file of the world that saved it is held by some survivor (its
own, or the copy of a lost rank's) is restored: each rank is sent, by a rank that holds it, each
file its part of the load reads, and DCP loads them into the smaller world, resharded, with no file
opened. Where no
generation is whole among them (two neighbouring nodes lost), or a disk checkpoint is newer, they
load the disk's, as any resume does.

What it costs: a copy of the rank's state (serialised, in the training thread: a host copy) every
K steps, and in host memory its own file and its peer's, twice: 4x the state a rank checkpoints;
the planner counts it with an asynchronous save's staging (memory_model.checkpoint_copy), and
metrics.jsonl records what is held as `memory.staging`.
"""

from __future__ import annotations

import io
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from shardwise.checkpoint import SafeReader, TrainingRun, checkpoint_dir, load_state, training_state

METADATA = ".metadata"  # DCP's name for the file that says what the others hold
FileBytes = bytes | memoryview  # a file in memory: as written here, or as received from a peer


class MemoryFiles(FileSystemBase):
    """A checkpoint's files as bytes in this process, by name, through which DCP writes and reads."""

    def __init__(self, files: dict[str, FileBytes] | None = None) -> None:
        self.files = files if files is not None else {}

    @contextmanager
    def create_stream(self, path: str | Path, mode: str) -> Iterator[io.BytesIO]:
        name = Path(path).name
        if "r" in mode:
            yield io.BytesIO(self.files[name])
            return
        stream = _Written(self.files, name)
        yield stream
        stream.close()

    def concat_path(self, path: str | Path, suffix: str) -> str:
        return f"{path}/{suffix}"

    def rename(self, path: str | Path, new_path: str | Path) -> None:
        self.files[Path(new_path).name] = self.files.pop(Path(path).name)

    def init_path(self, path: str | Path) -> str:
        return str(path)

    def mkdir(self, path: str | Path) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | Path) -> bool:
        return True

    def exists(self, path: str | Path) -> bool:
        return Path(path).name in self.files

    def rm_file(self, path: str | Path) -> None:
        self.files.pop(Path(path).name, None)


class _Written(io.BytesIO):
    """A file being written: its bytes kept under its name once it is closed (DCP closes some itself)."""

    def __init__(self, files: dict[str, FileBytes], name: str) -> None:
        super().__init__()
        self.kept, self.name = files, name

    def close(self) -> None:
        if not self.closed:
            self.kept[self.name] = self.getvalue()
        super().close()


class MemoryReader(SafeReader):
    """DCP's reader over files in memory, as SafeReader reads files on disk: the metadata through its
    allow-list, each tensor a view of the file's bytes, copied once, into the state. `fetch`, where
    given, is called on every rank (DCP reads on every rank, once) with the names of the files this
    rank's part of the load reads, and adds those it lacks to `files`."""

    def __init__(self, files: dict[str, FileBytes], fetch: Callable[[set[str]], None] | None = None) -> None:
        super().__init__("memory")
        self.fs = MemoryFiles(files)
        self.fetch = fetch

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        if self.fetch is not None:
            self.fetch({self.storage_data[item.storage_index].relative_path for item in plan.items})
        return super().read_data(plan, planner)

    def open_file(self, relative_path: str) -> IO[bytes]:
        return io.BytesIO(self.fs.files[relative_path])

    def file_storage(self, relative_path: str) -> torch.UntypedStorage:
        return as_tensor(self.fs.files[relative_path]).untyped_storage()


@dataclass
class Generation:
    """The files of one memory checkpoint this rank holds."""

    step: int
    world: int  # the world that saved it: its files are __R_0.distcp for each rank R of it
    strategy: str
    files: dict[str, FileBytes] = field(default_factory=dict)  # its own, the metadata, its peer's once arrived

    @property
    def nbytes(self) -> int:
        return sum(len(data) for data in self.files.values())


@dataclass
class Copy:
    """A generation's copy under way: this rank's file sent to its peer and the previous rank's
    received, on the copies' thread; `arrived`, the received file once both are done."""

    generation: Generation
    name: str  # the incoming file's
    nbytes: int  # the outgoing file's, held until sent
    arrived: Future[memoryview]


def file_name(rank: int) -> str:
    return f"__{rank}_0.distcp"  # DCP's, one file a rank


class PeerCheckpoints:
    """This process's memory checkpoints, kept across the worlds it re-forms (worker.py holds it)."""

    KEEP = 2

    def __init__(self, nproc: int) -> None:
        self.nproc = nproc
        self.generations: list[Generation] = []
        self.copy: Copy | None = None
        self.group: dist.ProcessGroup | None = None
        self.thread: ThreadPoolExecutor | None = None

    @property
    def held_bytes(self) -> int:
        return sum(generation.nbytes for generation in self.generations) + (self.copy.nbytes if self.copy else 0)

    def join(self) -> None:
        """The copies' own process group and thread in the world now formed (collective: every rank,
        at setup). A copy under way belonged to a world that is gone: its thread is left to end."""
        self.copy = None
        if self.thread is not None:
            self.thread.shutdown(wait=False)
        self.group = dist.new_group(backend="gloo")
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardwise-peer-copy")

    def save(self, trainer: TrainingRun, step: int) -> None:
        """The state after `step` into this rank's memory, and its copy to its peer started."""
        self.finish_copy()  # the group is the main thread's again
        rank, world = trainer.ctx.rank, trainer.ctx.world_size
        state = training_state(trainer, world, with_rng=False)
        state["trainer"]["step"].fill_(step)
        writer = FileSystemWriter("memory", sync_files=False)
        writer.fs = MemoryFiles()
        dcp.save(state, storage_writer=writer)
        generation = Generation(step, world, trainer.cfg.parallel.strategy, writer.fs.files)
        metadata = [generation.files.get(METADATA)]
        dist.broadcast_object_list(metadata, src=0, group=self.group)
        generation.files[METADATA] = metadata[0]
        self.generations = [*self.generations, generation][-self.KEEP:]
        peer, source = (rank + self.nproc) % world, (rank - self.nproc) % world
        if peer != rank:  # else one node: nowhere else to keep it
            own = generation.files[file_name(rank)]
            arrived = self.thread.submit(self._exchange, own, peer, source, world)
            self.copy = Copy(generation, file_name(source), len(own), arrived)

    def _exchange(self, own: bytes, peer: int, source: int, world: int) -> memoryview:
        """On the copies' thread: `own` sent to rank `peer`, rank `source`'s file received."""
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([len(own)]), group=self.group)
        incoming = torch.empty(int(sizes[source]), dtype=torch.uint8)
        works = [dist.isend(as_tensor(own), peer, self.group), dist.irecv(incoming, source, self.group)]
        for work in works:
            work.wait()
        return memoryview(incoming.numpy())  # kept as received, not copied again

    def poll(self) -> None:
        """Keep the peer's file once it has arrived (each step; nothing waits)."""
        if self.copy is not None and self.copy.arrived.done():
            self.finish_copy()

    def finish_copy(self) -> None:
        """Wait for the copy under way and keep what it brought."""
        if self.copy is not None:
            self.copy.generation.files[self.copy.name] = self.copy.arrived.result()
            self.copy = None

    def settle(self) -> None:
        """Before this world's groups end (a peer is lost): keep the peer's file if it had arrived,
        else drop the copy (its generation keeps this rank's own file)."""
        copy, self.copy = self.copy, None
        if copy is not None and copy.arrived.done() and copy.arrived.exception() is None:
            copy.generation.files[copy.name] = copy.arrived.result()

    def restore(self, trainer: TrainingRun) -> int | None:
        """In a re-formed world: the newest generation whole among the survivors loaded into
        `trainer` (collective); its step, or None where none is whole or a disk checkpoint is newer."""
        started = time.perf_counter()
        held = {(g.step, g.world, g.strategy): {name: len(data) for name, data in g.files.items()}
                for g in self.generations}
        disk = newest_disk_step(trainer.out) if trainer.ctx.is_main else None
        every: list[Any] = [None] * trainer.ctx.world_size
        dist.all_gather_object(every, (held, disk))
        disk = every[0][1]
        chosen = newest_whole([rank_held for rank_held, _ in every])
        if chosen is None or (disk is not None and disk > chosen[0][0]):
            return None
        key, holders = chosen
        step, world, strategy = key
        own = next(g.files for g in self.generations if (g.step, g.world, g.strategy) == key) \
            if key in held else {}
        files = dict(own)  # every survivor holds the metadata: each saved the generation
        sizes = {name: every[holder][0][key][name] for name, holder in holders.items()}
        fetched: list[int] = []

        def fetch(needed: set[str]) -> None:
            """The files each rank's part of the load reads and it lacks, sent by the ranks that hold them."""
            wanted: list[Any] = [None] * trainer.ctx.world_size
            dist.all_gather_object(wanted, sorted(needed - files.keys()))
            sends = [(name, holders[name], rank) for rank, names in enumerate(wanted) for name in names]
            received = send_files(files, sizes, sends, trainer.ctx.rank)
            files.update(received)
            fetched.append(sum(map(len, received.values())))

        load_state(trainer, MemoryReader(files, fetch), same_world=False, saved_rank_state=None, source="memory")
        if trainer.ctx.is_main:
            print(f"restored step {step} from the survivors' memory (saved by {strategy} on {world} rank(s); "
                  f"{sum(fetched) / 2**20:.1f} MiB fetched from the others, in "
                  f"{time.perf_counter() - started:.2f} s)", file=sys.stderr, flush=True)
        return step


def send_files(files: dict[str, FileBytes], sizes: dict[str, int], sends: list[tuple[str, int, int]],
               rank: int) -> dict[str, FileBytes]:
    """Each (name, from, to) of `sends`: the file sent by rank `from`, which holds it in `files`, to rank
    `to`; what this rank received (every rank goes through the same list, in order)."""
    works, received = [], {}
    for name, holder, to in sends:
        if rank == holder:
            works.append(dist.isend(as_tensor(files[name]), to))
        elif rank == to:
            received[name] = torch.empty(sizes[name], dtype=torch.uint8)
            works.append(dist.irecv(received[name], holder))
    for work in works:
        work.wait()
    return {name: memoryview(data.numpy()) for name, data in received.items()}


def as_tensor(data: FileBytes) -> torch.Tensor:
    """A file's bytes as a tensor over the same memory, to send (a send only reads it)."""
    with warnings.catch_warnings():  # bytes are read-only
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)


def newest_whole(held: list[dict[tuple[int, int, str], dict[str, int]]]) -> tuple[Any, dict[str, int]] | None:
    """Of what each rank holds (`held[rank]`: its generations, (step, world, strategy), and their files'
    sizes by name), the newest generation of which some rank holds every file, and which rank holds
    each (the lowest); None where none is whole."""
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
