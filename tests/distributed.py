"""Run a function on N real ranks (spawned processes, Gloo over loopback) and collect results."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, fn: Callable, args: tuple, result: Path,
               init: dict[str, Any]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    from shardwise.dist import init_distributed, shutdown_distributed

    try:
        ctx = init_distributed("gloo", threads_per_rank=1, **{"timeout_s": 60, **init})
        value = fn(ctx, *args)
        torch.save({"ok": value}, result)
        shutdown_distributed()
    except BaseException:
        torch.save({"error": traceback.format_exc()}, result)
        os._exit(1)  # skip teardown: a peer may be gone, and Gloo would hang in it


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 240, **init: Any) -> list[Any]:
    """fn(ctx, *args) on every rank; returns each rank's return value, or raises with a rank's
    traceback. `fn` must be importable (defined at module level). `init` goes to init_distributed
    (timeout_s, the collective timeout, is 60 unless given)."""
    spawn = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        results = [Path(tmp) / f"rank{r}.pt" for r in range(world_size)]
        procs = [spawn.Process(target=_rank_main, args=(r, world_size, port, fn, args, results[r], init))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
        outcomes = [torch.load(path, weights_only=False) if path.exists() else {"error": "no result (killed?)"}
                    for path in results]
    errors = [f"rank {r}:\n{o['error']}" for r, o in enumerate(outcomes) if "error" in o]
    if errors:
        raise AssertionError("\n".join(errors))
    return [o["ok"] for o in outcomes]
