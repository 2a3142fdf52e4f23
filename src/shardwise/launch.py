"""Start workers through PyTorch's own launcher (torch.distributed.run), never a transport of our own.

One node: a rendezvous on a free loopback port. Several nodes: c10d rendezvous at
launch.rdzv_endpoint, with --nnodes and --node-rank passed through.
"""

from __future__ import annotations

import os
import signal
import sys
import uuid

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from shardwise.config import LaunchConfig


class WorkerFailed(RuntimeError):
    """A worker exited with an error; the message names the rank and carries its error."""


class Stopped(RuntimeError):
    """The launcher was told to stop (SIGTERM, SIGINT); it passed the signal on to the workers."""


def torchrun_args(launch: LaunchConfig, entry: list[str]) -> list[str]:
    """torch.distributed.run's arguments for `python -m <entry...>` on every rank."""
    args = [f"--nproc-per-node={launch.nproc}", f"--max-restarts={launch.max_restarts}",
            f"--shutdown-timeout={launch.shutdown_timeout_s}", "--rdzv-backend=c10d"]
    if launch.nnodes == 1:
        args += ["--nnodes=1", "--rdzv-endpoint=127.0.0.1:0", "--local-addr=127.0.0.1", f"--rdzv-id={uuid.uuid4()}"]
    else:
        args += [
            f"--nnodes={launch.nnodes}",
            f"--node-rank={launch.node_rank}",
            f"--rdzv-endpoint={launch.rdzv_endpoint}",
            "--rdzv-id=shardwise",
        ]
    return args + ["-m", *entry]


def _failure_message(error: ChildFailedError) -> str:
    rank, failure = error.get_first_failure()
    message = failure.message
    if isinstance(message, dict):  # written by @record: the exception and its traceback
        info = message.get("extraInfo", {})
        text = f"{message.get('message', '')}\n{info.get('py_callstack', '')}".strip()
    else:
        text = str(message) or f"exit code {failure.exitcode}"
    return f"worker rank {rank} failed (exit code {failure.exitcode}):\n{text}"


def _hold_failure_shutdown_to(seconds: int) -> None:
    """When a worker fails, torch 2.13's launcher stops the others with SIGTERM and a fixed 30 s
    grace before SIGKILL (PContext.close's default timeout; --shutdown-timeout reaches only the
    path where the launcher itself is signalled: pytorch#119856). A stalled rank, deaf to SIGTERM,
    lives through that grace: hold it to launch.shutdown_timeout_s as well."""
    from torch.distributed.elastic.multiprocessing.api import PContext

    close = PContext.close

    def close_within(self: PContext, death_sig: signal.Signals | None = None, timeout: int = seconds) -> None:
        close(self, death_sig, timeout)

    PContext.close = close_within


def launch_workers(launch: LaunchConfig, entry: list[str]) -> None:
    """Run `python -m <entry...>` (e.g. shardwise.worker CONFIG) on launch.nproc local ranks;
    raise WorkerFailed with the first failing rank's error if any rank fails."""
    from torch.distributed.run import parse_args, run

    # torchrun would set this itself, with a warning; the config says how many threads a rank gets.
    os.environ["OMP_NUM_THREADS"] = str(launch.threads_per_rank)
    if launch.max_restarts:
        # torch 2.13 reuses the rendezvous store across restarts, and restarted Gloo groups then
        # sometimes reach a dead peer's address or hang (pytorch#135712, #167288): one store each.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    _hold_failure_shutdown_to(launch.shutdown_timeout_s)
    try:
        run(parse_args(torchrun_args(launch, entry)))
    except ChildFailedError as error:
        raise WorkerFailed(_failure_message(error)) from None
    except SignalException as signal:
        raise Stopped(f"stopped by signal {signal.sigval.name}; workers were sent it too") from None
    finally:
        sys.stdout.flush()
