"""`shardwise bench checkpoint`: what our checkpoints cost, on gpt small under `fsdp` on 2 ranks,
against what the disk allows, in one run.

After a few real steps (so the optimizer state exists), each round measures:
- three writes of the same state, taking turns at going first (so none always follows the
  others' writes to the disk):
  - `save`: our `save_checkpoint` (temporary directory, DCP write, checksums, fsync, rename,
    `latest`): time, bytes on disk, effective write rate, and how much of it rank 0 spent in
    `dcp.save` and in our checksum pass;
  - `plain write`: every rank writes its share of the same bytes (what it wrote of the
    checkpoint) to a file of its own on the same disk, in large sequential blocks, flushed and
    fsynced, all at once: the limit;
  - `dcp save`: a bare blocking `dcp.save` (our save's DCP part, and the baseline for async);
- `load`: our `load_checkpoint` (checksums verified on rank 0, then `dcp.load`) with its files in
  the page cache, as they are right after a save; then again after `posix_fadvise(DONTNEED)` on
  every file, to approximate a cold read;
- `async save`: a training step alone, then the trainer's asynchronous save
  (`train.checkpoint_async`, checkpoint_async.py): how long training is stalled (until it
  returns, the buffers and the run's small state copied to host memory, then, in the next
  training step, the wait before its optimizer step for the rest of the copy, made meanwhile), that
  step, taken while it writes, and when it was sealed and every rank knew.
A first round is not kept (DCP's first calls, thread pools); medians over the rest. The
checkpoints go to a temporary directory under `runs/`, on the repo's disk, removed after.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from bench.common import BenchArgs, bench_config, bench_main, timed_steps
from shardwise import checkpoint
from shardwise.checkpoint import TrainingRun, load_checkpoint, save_checkpoint, training_state
from shardwise.checkpoint_async import AsyncCheckpointer
from shardwise.dist import DistContext
from shardwise.trainer import Trainer

T = TypeVar("T")
WARMUP_STEPS = 2
BLOCK = 8 << 20  # the plain write's unit: large enough that Python's per-call cost vanishes


def files_bytes(path: Path) -> int:
    """Bytes of every file under `path`."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def rank_share(path: Path, rank: int, world_size: int) -> int:
    """Bytes of the checkpoint at `path` that `rank` wrote: DCP names each rank's data files
    `__RANK_N.distcp`; rank 0 also writes DCP's metadata and our manifest."""
    own = sum(f.stat().st_size for f in Path(path).glob(f"__{rank}_*.distcp"))
    if rank != 0:
        return own
    others = sum(f.stat().st_size for r in range(1, world_size) for f in Path(path).glob(f"__{r}_*.distcp"))
    return files_bytes(path) - others


def timed_together(ctx: DistContext, fn: Callable[[], T]) -> tuple[float, T]:
    """Seconds from a common start on every rank until the last rank has finished `fn`, and what
    `fn` returned."""
    ctx.barrier()
    started = time.perf_counter()
    value = fn()
    ctx.barrier()
    return time.perf_counter() - started, value


@contextlib.contextmanager
def phases_timed(into: dict[str, float], **calls: tuple[Any, str]) -> Iterator[None]:
    """Add to `into[name]` the seconds this rank spends in each `getattr(owner, attr)` named in
    `calls`, while inside: how long our save and load spend in DCP and in checksums, measured in
    the real call rather than by subtracting separately timed runs (checkpoint.py stays as is)."""
    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                into[name] = into.get(name, 0.0) + time.perf_counter() - started
        return wrapper

    with contextlib.ExitStack() as patches:
        for name, (owner, attr) in calls.items():
            patches.enter_context(mock.patch.object(owner, attr, timed(name, getattr(owner, attr))))
        yield


def plain_write(path: Path, nbytes: int) -> None:
    """Write `nbytes` to a new file at `path` in large sequential blocks, flushed and fsynced:
    the least a checkpoint of that size can cost on this disk."""
    block = memoryview(os.urandom(max(1, min(BLOCK, nbytes))))  # random, should the filesystem compress
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left:
            left -= f.write(block[:min(left, len(block))])
        f.flush()
        os.fsync(f.fileno())


def drop_from_page_cache(path: Path) -> bool:
    """Ask the kernel to evict the files under `path` from the page cache (fsynced, so clean and
    evictable); False where posix_fadvise does not exist."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for file in Path(path).rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return True


def async_save_timings(ctx: DistContext, run: TrainingRun, checkpointer: AsyncCheckpointer, saved_step: int,
                       step: Callable[[], object]) -> dict[str, float]:
    """The trainer's asynchronous save (checkpoint_async.py) of `run`'s state as after
    `saved_step` steps, then `step` while it writes, then the wait for it. Returns, each the
    slowest rank's: the seconds until the save returned (the state the next forward may change
    copied), those `step` waited before its optimizer step for the rest of the copy, the stall
    (both), until it was sealed and every rank knew (from the call), and of `step` (its wait in it)."""
    ctx.barrier()
    started = time.perf_counter()
    checkpointer.save(run, saved_step)
    returned = time.perf_counter() - started
    waited_before = checkpointer.staging_wait_s
    step_started = time.perf_counter()
    step()
    step_s = time.perf_counter() - step_started
    waited = checkpointer.staging_wait_s - waited_before
    checkpointer.wait()
    done = time.perf_counter() - started
    names = ("returned_s", "staging_wait_s", "stall_s", "done_s", "step_during_write_s")
    slowest = [max(v) for v in zip(*ctx.all_gather_object((returned, waited, returned + waited, done, step_s)),
                                   strict=True)]
    return dict(zip(names, slowest, strict=True))


def filesystem_of(path: Path) -> str:
    """The filesystem and device `path` lies on, from /proc/mounts (the longest mount point that
    contains it); "unknown" where that cannot be read."""
    try:
        mounts = [line.split()[:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return "unknown"
    resolved = str(Path(path).resolve())
    containing = [m for m in mounts
                  if len(m) == 3 and (resolved == m[1] or resolved.startswith(m[1].rstrip("/") + "/"))]
    device, mount, kind = max(containing, key=lambda m: len(m[1]), default=("?", "?", "unknown"))
    return f"{kind} on {device} (mounted at {mount})"


@contextlib.contextmanager
def shared_scratch(ctx: DistContext) -> Iterator[Path]:
    """A new directory under `runs/` (the repo's disk; /tmp may be another, or memory), made by
    rank 0 and named to every rank; rank 0 removes it after, whatever happened inside."""
    made = None
    if ctx.is_main:
        Path("runs").mkdir(exist_ok=True)
        made = tempfile.mkdtemp(prefix="bench-checkpoint-", dir=Path("runs").resolve())
    scratch = Path(ctx.all_gather_object(made)[0])
    try:
        yield scratch
    finally:
        if ctx.is_main:
            shutil.rmtree(scratch, ignore_errors=True)


def run(ctx: DistContext, args: BenchArgs) -> dict[str, Any] | None:
    """`steps` rounds of every measurement (`rounds` is unused: each measurement is a block)."""
    steps, micro_batch = args.steps, args.micro_batch
    load_before = os.getloadavg()  # the machine is shared: say how busy it was
    with shared_scratch(ctx) as scratch:
        trainer = Trainer(bench_config("fsdp", ctx.world_size, micro_batch, WARMUP_STEPS + 2 * (steps + 1),
                                       f"run.out={scratch / 'run'}", preset=args.preset), ctx)
        timed_steps(trainer.run_step, 0, WARMUP_STEPS)  # the optimizer makes its state in its first step
        bench = Measurements(ctx, trainer, scratch)
        times, async_runs = bench.rounds(steps)
        nbytes = files_bytes(bench.saved)
        shares = [int(s) for s in ctx.all_gather_object(rank_share(bench.saved, ctx.rank, ctx.world_size))]
        files = sum(1 for f in bench.saved.rglob("*") if f.is_file())
        bench.close()
    if not ctx.is_main:
        return None
    result = summarize(trainer, ctx, times, async_runs, nbytes, shares, files, scratch)
    return result | {"load_average_1min": {"before": load_before[0], "after": os.getloadavg()[0]}}


class Measurements:
    """Each measurement on one trainer whose run directory is in `scratch`; each adds its seconds
    (and its phases: this rank's) to the record it is given."""

    def __init__(self, ctx: DistContext, trainer: Trainer, scratch: Path) -> None:
        self.ctx, self.trainer, self.scratch = ctx, trainer, scratch
        self.step = trainer.run_step
        self.saved = Path()  # the newest checkpoint of ours
        # The asynchronous saves go to a run directory of their own: our synchronous saves keep one.
        self.async_run = copy.copy(trainer)
        self.async_run.out = scratch / "async"
        self.checkpointer = AsyncCheckpointer(keep=1, is_main=ctx.is_main)
        trainer.checkpointer = self.checkpointer  # its optimizer steps wait for these saves' copies

    def rounds(self, count: int) -> tuple[dict[str, list[float]], list[dict[str, float]]]:
        """`count` rounds of every measurement, after one round not kept (DCP's first calls,
        thread pools). The three writes take turns at going first, so that none always follows
        the others' writes to the disk. Returns each one's times, and the async saves' timings."""
        times: dict[str, list[float]] = {}
        async_runs = []
        writes = [self.save, self.plain_write, self.dcp_save]
        for round_ in range(count + 1):
            record: dict[str, float] = {}
            for write in writes[round_ % 3:] + writes[:round_ % 3]:
                write(record, round_)
            self.load(record, "load")
            if self.ctx.all_gather_object(drop_from_page_cache(self.saved) if self.ctx.is_main else None)[0]:
                self.load(record, "load_cold")
            timings = self.async_save(record, WARMUP_STEPS + 2 * round_)
            if round_ == 0:
                continue
            async_runs.append(timings)
            for name, seconds in record.items():
                times.setdefault(name, []).append(seconds)
        return times, async_runs

    def save(self, record: dict[str, float], round_: int) -> None:
        phases: dict[str, float] = {}
        with phases_timed(phases, save_dcp=(dcp, "save"), save_checksums=(checkpoint, "_checksums")):
            record["save"], self.saved = timed_together(
                self.ctx, lambda: save_checkpoint(self.trainer, round_ + 1, keep=1))
        record |= phases

    def plain_write(self, record: dict[str, float], round_: int) -> None:
        """Every rank writes what it wrote of the checkpoint (the previous round's, if this one's
        is not saved yet: the same size) to a file of its own, all at once."""
        target = self.scratch / f"plain-{self.ctx.rank}.bin"
        nbytes = rank_share(self.saved, self.ctx.rank, self.ctx.world_size)
        record["plain_write"], _ = timed_together(self.ctx, lambda: plain_write(target, nbytes))
        target.unlink()

    def dcp_save(self, record: dict[str, float], round_: int) -> None:
        bare = self.scratch / "dcp"
        record["dcp_save"], _ = timed_together(self.ctx, lambda: dcp.save(
            training_state(self.trainer, self.ctx.world_size), checkpoint_id=bare))
        self.ctx.barrier()
        if self.ctx.is_main:
            shutil.rmtree(bare)

    def load(self, record: dict[str, float], name: str) -> None:
        phases: dict[str, float] = {}
        with contextlib.redirect_stderr(io.StringIO()), \
                phases_timed(phases, dcp=(dcp, "load"), checksums=(checkpoint, "_checksums")):
            record[name], _ = timed_together(self.ctx, lambda: load_checkpoint(self.trainer))  # "resumed from ..."
        record |= {f"{name}_{phase}": seconds for phase, seconds in phases.items()}

    def async_save(self, record: dict[str, float], k: int) -> dict[str, float]:
        """Training step k alone, then an async save and step k + 1 while it writes."""
        record["step_alone"] = timed_steps(self.step, k, 1)[0]
        return async_save_timings(self.ctx, self.async_run, self.checkpointer, k, lambda: self.step(k + 1))

    def close(self) -> None:
        self.ctx.barrier()
        dist.destroy_process_group(self.checkpointer.group)


def summarize(trainer: Trainer, ctx: DistContext, times: dict[str, list[float]],
              async_runs: list[dict[str, float]], nbytes: int, shares: list[int], files: int,
              scratch: Path) -> dict[str, Any]:
    med = {name: statistics.median(t) for name, t in times.items()}
    async_med = {key: statistics.median(r[key] for r in async_runs) for key in async_runs[0]}

    def timing(name: str) -> dict[str, Any]:
        return {"time_s": med[name], "times_s": times[name], "mb_per_s": nbytes / med[name] / 1e6}

    def load_entry(name: str, note: str) -> dict[str, Any]:
        return timing(name) | {"checksums_s": med[f"{name}_checksums"], "dcp_load_s": med[f"{name}_dcp"],
                               "note": note}

    cfg = trainer.cfg
    n_params = sum(p.numel() for p in trainer.strategy.module.parameters())
    return {
        "bench": "checkpoint",
        "model": f"gpt {cfg.model.preset}: {cfg.model.n_layer} layers, width {cfg.model.d_model}, "
                 f"seq {cfg.model.seq_len}, {n_params:,} parameters",
        "strategy": cfg.parallel.strategy,
        "world_size": ctx.world_size,
        "threads_per_rank": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {ctx.backend}, torch {torch.__version__}",
        "disk": filesystem_of(scratch),
        "rounds": len(times["save"]),
        "bytes": nbytes,
        "bytes_per_rank": shares,
        "files": files,
        "save": timing("save") | {
            "dcp_save_s": med["save_dcp"], "checksums_s": med["save_checksums"],
            "rest_s": med["save"] - med["save_dcp"] - med["save_checksums"],
            "note": "dcp_save_s and checksums_s: rank 0's time inside our save in dcp.save and in the checksum "
                    "pass (rank 0 hashes every rank's files); rest: the save less both (fsync, manifest, "
                    "rename, latest, removing the previous checkpoint, barriers)"},
        "plain_write": timing("plain_write"),
        "ratio_save_vs_plain_write": med["save"] / med["plain_write"],
        "load": load_entry("load", "files in the page cache, as right after a save; checksums_s: rank 0 "
                                   "verifying them before dcp.load"),
        "load_cold": load_entry("load_cold", "after posix_fadvise(DONTNEED) on every file: out of this "
                                             "machine's page cache (a virtual disk's host may still cache "
                                             "them); rank 0's checksum pass reads every file first, so it "
                                             "pays the cold read and dcp.load finds them cached"
                                ) if "load_cold" in times else "no posix_fadvise here",
        "dcp_save": timing("dcp_save"),
        "async_save": {
            "stall_s": async_med["stall_s"],
            "done_s": async_med["done_s"],
            "blocking_dcp_save_s": med["dcp_save"],
            "ratio_stall_vs_blocking": async_med["stall_s"] / med["dcp_save"],
            "ratio_stall_vs_our_save": async_med["stall_s"] / med["save"],
            "step_during_write_s": async_med["step_during_write_s"],
            "step_alone_s": med["step_alone"],
            "returned_s": async_med["returned_s"],
            "staging_wait_s": async_med["staging_wait_s"],
            "training_lost_s": statistics.median(r["returned_s"] + r["step_during_write_s"] - alone
                                                 for r, alone in zip(async_runs, times["step_alone"], strict=True)),
            "runs": async_runs,
            "note": "the trainer's asynchronous save (train.checkpoint_async); returned: until it returned (the "
                    "buffers and small state copied to host memory by HostStager); staging_wait: how long the "
                    "next step waited before its optimizer step for the parameters' and optimizer state's copy, "
                    "made during its forward and backward; stall: both; done: until it was sealed and every rank knew, "
                    "a training step running meanwhile; blocking: a bare dcp.save of the same state; our save: "
                    "the synchronous one; slowest rank of each; "
                    "training_lost: until it returned plus how much longer that step took than the one before it "
                    "(median over rounds)",
        },
    }


def format_result(result: dict[str, Any]) -> str:
    save, plain, a = result["save"], result["plain_write"], result["async_save"]

    def load_row(label: str, entry: dict[str, Any] | str) -> str:
        if isinstance(entry, str):
            return f"  {label:<19}{entry}"
        return (f"  {label:<19}{entry['time_s']:6.3f} s  {entry['mb_per_s']:7.1f} MB/s   checksums "
                f"{entry['checksums_s']:.3f} s, dcp.load {entry['dcp_load_s']:.3f} s")

    return "\n".join([
        f"checkpoint bench: {result['model']}, {result['strategy']} on {result['world_size']} ranks, "
        f"{result['rounds']} rounds, medians; disk: {result['disk']}; load average "
        f"{result['load_average_1min']['before']:.1f} before, {result['load_average_1min']['after']:.1f} after",
        f"  checkpoint         {result['bytes'] / 1e6:.1f} MB in {result['files']} files (per rank "
        f"{', '.join(f'{s / 1e6:.1f}' for s in result['bytes_per_rank'])} MB)",
        f"  save (ours)        {save['time_s']:6.3f} s  {save['mb_per_s']:7.1f} MB/s   dcp.save "
        f"{save['dcp_save_s']:.3f} s, checksums {save['checksums_s']:.3f} s, rest {save['rest_s']:.3f} s",
        f"  plain write        {plain['time_s']:6.3f} s  {plain['mb_per_s']:7.1f} MB/s   same bytes, each rank "
        "its share, fsynced: the limit",
        f"  ours / plain write {result['ratio_save_vs_plain_write']:.2f}x the time",
        load_row("load, page cache", result["load"]),
        load_row("load, cold", result["load_cold"]),
        f"  async_save         stall {a['stall_s']:.3f} s: {a['ratio_stall_vs_our_save']:.3f} of our save, "
        f"{a['ratio_stall_vs_blocking']:.2f} of a blocking dcp.save ({a['blocking_dcp_save_s']:.3f} s); "
        f"returned after {a['returned_s']:.3f} s, the next step waited {a['staging_wait_s']:.3f} s for the copy; "
        f"sealed after {a['done_s']:.3f} s",
        f"                     a step meanwhile {a['step_during_write_s']:.3f} s vs {a['step_alone_s']:.3f} s "
        f"alone: training loses {a['training_lost_s']:.3f} s in all",
    ])


if __name__ == "__main__":
    bench_main("checkpoint", run, format_result)
