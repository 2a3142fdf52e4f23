"""Run a function on N real ranks (processes forked from a fork server, Gloo over loopback) and
collect results.

Spawning a rank costs about 4 s on 2 cores (an interpreter, torch, transformers, the process
group), more than most tests spend training. So ranks are forked from a server that imported all
that once (_fork_server: a fraction of a second a rank), and they are kept: `run_ranks` hands each
call to a pool of live ranks of that world size, which run it and wait for the next call. A call
leaves nothing the next one could see: after it every rank restores what a fresh process starts
with (torch's random state, thread count, default dtype and grad mode, the environment, signal
handlers, working directory), and a pool whose call failed, timed out or took the process group
down is discarded, its ranks killed, so the next call starts fresh ones. Calls with their own
`init` arguments (a short collective timeout, debug collectives) get ranks of their own, discarded
after the call: they usually break the group on purpose.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing as mp
import os
import pickle
import signal
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardwise.dist import DistContext

DEFAULT_TIMEOUT_S = 60  # the collective timeout of pooled ranks
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FreshProcessState:
    """What a rank had before its first call, put back after every call."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.seed = torch.initial_seed()
        self.threads = torch.get_num_threads()
        self.dtype = torch.get_default_dtype()
        self.handlers = {sig: signal.getsignal(sig) for sig in HANDLED_SIGNALS}

    def restore(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        torch.manual_seed(self.seed)
        torch.set_num_threads(self.threads)
        torch.set_default_dtype(self.dtype)
        torch.set_grad_enabled(True)
        for sig, handler in self.handlers.items():
            signal.signal(sig, handler)


GLOO_LOOP_NICE = 19  # the nice value of a rank's Gloo transport threads (_lower_gloo_loops)


def _lower_gloo_loops() -> None:
    """Forever: every Gloo transport thread (gloo_tcp_loop) of this rank at nice 19, soon after it
    starts. Gloo's loop thread, finding a connection's lock held by another thread, skips it and
    polls again at once (gloo's tcp Pair::handleEvents tries the lock; epoll is level-triggered):
    with more ranks than cores it spun through the time slice the lock's holder needed, 820,000
    epoll_waits for 2,000 all-reduces of 2 ranks. At nice 19 it yields to them: test_fsdp.py run
    beside test_context.py, 5 pairs A B, took 2 to 7% less CPU (median 3%) and 1 to 4% less time.
    Each thread is looked at until it has a name of its own, then never again: reading every
    thread's name each time cost the rank about what the nice saved."""
    unnamed = Path("/proc/self/comm").read_text()  # a new thread's name until it sets its own
    named: set[str] = set()
    while True:
        for task in os.listdir("/proc/self/task"):
            if task in named:
                continue
            try:
                name = Path(f"/proc/self/task/{task}/comm").read_text()
                if name == "gloo_tcp_loop\n":
                    os.setpriority(os.PRIO_PROCESS, int(task), GLOO_LOOP_NICE)
            except OSError:  # the thread ended meanwhile
                continue
            if name != unnamed:
                named.add(task)
        time.sleep(0.2)


def _rank_main(rank: int, world_size: int, port: int, conn: Connection, init: dict[str, Any],
               environ: dict[str, str]) -> None:
    """A rank: join the group, then run each call `conn` brings until told to stop. A call's result
    (or traceback) goes to the file the call names; `conn` only says when it is there. The rank
    starts with the test process's environment as it is now, as a spawned process would (a forked
    one has the fork server's)."""
    os.environ.clear()
    os.environ.update(environ)
    torch.manual_seed(torch.initial_seed())  # the generator's state in a fresh process
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    from shardwise.dist import init_distributed, shutdown_distributed

    threading.Thread(target=_lower_gloo_loops, name="lower-gloo-loops", daemon=True).start()
    ctx = init_distributed("gloo", threads_per_rank=1, **{"timeout_s": DEFAULT_TIMEOUT_S, **init})
    fresh = FreshProcessState()
    # What the rank holds now (PRELOAD's modules: ~380k objects) lives as long as it does: frozen, the
    # collector never walks it again, where each gc.collect() (drop_groups') took 0.2 s of CPU.
    gc.freeze()
    while True:
        try:
            task = conn.recv_bytes()
        except EOFError:  # the test process is gone
            os._exit(0)
        if task == b"stop":
            shutdown_distributed()
            conn.send_bytes(b"stopped")
            return
        fn, args, result = pickle.loads(task)
        try:
            value = fn(ctx, *args)
            torch.save({"ok": value}, result)
        except BaseException:
            torch.save({"error": traceback.format_exc()}, result)
            conn.send_bytes(b"failed")
            os._exit(1)  # skip teardown: a peer may be waiting in a collective, and Gloo would hang in it
        fresh.restore()
        alive = dist.is_initialized()
        if alive:
            drop_groups(ctx)
        conn.send_bytes(b"done" if alive else b"left")
        if not alive:
            os._exit(0)


def drop_groups(ctx: DistContext) -> None:
    """Destroy every process group but the world's, once every rank is done with them (a barrier:
    a peer may still be in the call's last collective). Each Gloo group keeps 3 threads whose
    event loop wakes every 10 ms: left alive, the groups of a hundred calls kept an idle rank
    busy on a quarter of a core, and slowed everything else the machine ran."""
    from torch.distributed import distributed_c10d as c10d  # no public list of a process's groups

    dist.barrier()
    ctx.meshes.clear()
    gc.collect()  # the call's objects holding groups (strategies, meshes) are often in cycles
    for group in list(c10d._world.pg_map):
        if group is not c10d.GroupMember.WORLD:
            dist.destroy_process_group(group)


# What the fork server imports once for every rank: torch, the trainer, and transformers' models
# (another 2 s a process), imported offline as the test modules that use them ask; and scikit-learn's
# datasets, which the digits the CNN tests train on come from (1 s a process).
PRELOAD = ["torch", "torch.distributed", "shardwise.trainer", "sklearn.datasets", "transformers",
           *(f"transformers.models.{m}.modeling_{m}" for m in ("llama", "qwen2", "gpt2", "mixtral", "qwen3_moe",
                                                                "deepseek_v3"))]


def _fork_server() -> mp.context.BaseContext:
    """Where ranks come from: forked from a server process that imported PRELOAD once, not spawned,
    which would import it all again in every rank (3-4 s of CPU each, 10 s for 8 ranks on 2 cores).
    The server has never run an operator, so a fork carries no threads; a rank then takes the test
    process's current environment (_rank_main), as a spawned one would."""
    from multiprocessing import forkserver

    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    saved = dict(os.environ)
    try:
        os.environ["HF_HUB_OFFLINE"] = "1"  # the server's own environment, as it imports transformers
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return context


class RankPool:
    """`world_size` live ranks, each running one call at a time."""

    def __init__(self, world_size: int, init: dict[str, Any]) -> None:
        context = _fork_server()
        port = _free_port()
        self.world_size = world_size
        self.conns: list[Connection] = []
        self.procs = []
        for rank in range(world_size):
            ours, theirs = context.Pipe()
            proc = context.Process(target=_rank_main, args=(rank, world_size, port, theirs, init, dict(os.environ)))
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)

    def run(self, fn: Callable, args: tuple, timeout: float) -> tuple[list[dict], bool]:
        """Every rank's outcome ({"ok": value} or {"error": text}), and whether the pool can take
        another call."""
        with tempfile.TemporaryDirectory() as tmp:
            results = [Path(tmp) / f"rank{r}.pt" for r in range(self.world_size)]
            for conn, result in zip(self.conns, results, strict=True):
                conn.send_bytes(pickle.dumps((fn, args, result)))
            replies = self._replies(time.monotonic() + timeout)
            outcomes = []
            for rank, (reply, result) in enumerate(zip(replies, results, strict=True)):
                if result.exists() and reply in (b"done", b"left", b"failed"):
                    outcomes.append(torch.load(result, weights_only=False))
                else:
                    why = f"no result within {timeout:.0f} s" if reply is None else "the rank died"
                    outcomes.append({"error": f"{why} (rank {rank}, running {fn.__name__})"})
        return outcomes, all(reply == b"done" for reply in replies)

    def _replies(self, deadline: float) -> list[bytes | None]:
        """Each rank's reply, None for a rank that died or did not answer by `deadline`. Once one
        rank has failed, the others get a few seconds more, not the whole timeout: they may be
        waiting in a collective for it."""
        replies: list[bytes | None] = [None] * self.world_size
        pending = set(range(self.world_size))
        while pending and time.monotonic() < deadline:
            for rank in list(pending):
                conn = self.conns[rank]
                try:
                    ready = conn.poll(0.05)
                    reply = conn.recv_bytes() if ready else None
                except (EOFError, OSError):
                    pending.discard(rank)
                    continue
                if reply is not None:
                    replies[rank] = reply
                    pending.discard(rank)
                    if reply == b"failed":
                        deadline = min(deadline, time.monotonic() + 5)
        return replies

    def stop(self) -> None:
        """Shut the group down and let the ranks exit; kill any that do not within a few seconds."""
        for conn in self.conns:
            try:
                conn.send_bytes(b"stop")
            except OSError:
                pass
        for proc in self.procs:
            proc.join(10)
        self.kill()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()


_pools: dict[int, RankPool] = {}


def _pool(world_size: int) -> RankPool:
    """The live pool of this world size; at most two are kept (2 and 4 ranks alternate in some files)."""
    if world_size not in _pools:
        while len(_pools) >= 2:
            _pools.pop(next(iter(_pools))).stop()
        _pools[world_size] = RankPool(world_size, {})
    _pools[world_size] = _pools.pop(world_size)  # most recently used last
    return _pools[world_size]


@atexit.register
def _stop_pools() -> None:
    while _pools:
        _pools.popitem()[1].stop()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 240, **init: Any) -> list[Any]:
    """fn(ctx, *args) on every rank; returns each rank's return value, or raises with a rank's
    traceback. `fn` must be importable (defined at module level). `init` goes to init_distributed
    (timeout_s, the collective timeout, is 60 unless given); with it, the ranks are not pooled."""
    if init:
        pool = RankPool(world_size, init)
        try:
            outcomes, _ = pool.run(fn, args, timeout)
        finally:
            pool.kill()
    else:
        pool = _pool(world_size)
        outcomes, reusable = pool.run(fn, args, timeout)
        if not reusable:
            _pools.pop(world_size).kill()
    errors = [f"rank {r}:\n{o['error']}" for r, o in enumerate(outcomes) if "error" in o]
    if errors:
        raise AssertionError("\n".join(errors))
    return [o["ok"] for o in outcomes]
