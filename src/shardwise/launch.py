"""Start workers through PyTorch's own launcher (torch.distributed.run), never a transport of our own.

Each rank is forked from a server that imported the entry module (and so torch and shardwise) once:
torchrun's --run-path with the forkserver start method (launch_workers), and the same server under
our own launcher (launch_local); the server is forked from this process (fork_server.py). A
`python -m` per rank spent 1.8 core-s on the same imports in every rank, before the first step.

One node: a rendezvous on a free loopback port. Several nodes: c10d rendezvous at
launch.rdzv_endpoint, with --nnodes and --node-rank passed through; with launch.node_addr, what a
node's launcher and Gloo need to know about that address is derived from it (node_addr_settings).
"""

from __future__ import annotations

import fcntl
import ipaddress
import multiprocessing
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import closing, contextmanager
from typing import TypeVar

import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from shardwise.config.schema import ConfigError, LaunchConfig
from shardwise.dist import worker_name
from shardwise.elastic import LAST_CALL_S, NODE_ADDR
from shardwise.fork_server import start_fork_server

K = TypeVar("K")  # what a caller of `exits` knows its processes by


class WorkerFailed(RuntimeError):
    """A worker exited with an error; the message names the rank and carries its error."""


class Stopped(RuntimeError):
    """The launcher was told to stop (SIGTERM, SIGINT); it passed the signal on to the workers."""


def torchrun_args(launch: LaunchConfig) -> list[str]:
    """torch.distributed.run's options for launch (the entry point and its arguments follow them)."""
    args = [f"--nproc-per-node={launch.nproc}", f"--max-restarts={launch.max_restarts}", "--rdzv-backend=c10d"]
    # torchrun takes --shutdown-timeout from torch 2.12; under the GPU machines' torch 2.11 the workers get
    # its fixed grace instead (and _hold_failure_shutdown_to's)
    if torch.__version__ >= "2.12":
        args.append(f"--shutdown-timeout={launch.shutdown_timeout_s}")
    if launch.nnodes == 1:
        args += ["--nnodes=1", "--rdzv-endpoint=127.0.0.1:0", "--local-addr=127.0.0.1", f"--rdzv-id={uuid.uuid4()}"]
    else:
        nodes = f"{launch.min_nnodes}:{launch.nnodes}" if launch.min_nnodes is not None else str(launch.nnodes)
        args += [
            f"--nnodes={nodes}",
            f"--node-rank={launch.node_rank}",
            f"--rdzv-endpoint={launch.rdzv_endpoint}",
            "--rdzv-id=shardwise",
        ]
        conf = [f"last_call_timeout={LAST_CALL_S}"] if launch.min_nnodes is not None else []
        if launch.node_addr:
            # The launcher publishes --local-addr to the others (else its hostname, which need not
            # resolve to this node); c10d guesses whether it hosts the rendezvous store by comparing
            # hostnames, which nodes sharing one (containers, namespaces) all match: say it.
            conf.append(f"is_host={'true' if launch.node_rank == 0 else 'false'}")
            args.append(f"--local-addr={launch.node_addr}")
        if conf:
            args.append(f"--rdzv-conf={','.join(conf)}")
    return args


SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def _ipv4_of(interface: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            answer = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", interface.encode()[:15]))
        except OSError:  # no IPv4 address on it
            return None
    return socket.inet_ntoa(answer[20:24])


def _ipv6_addresses() -> dict[str, str]:
    """address -> interface, from the kernel's own table (hex address, index, prefix, scope, flags, name)."""
    table = {}
    try:
        lines = open("/proc/net/if_inet6").read().splitlines()
    except OSError:
        return table
    for line in lines:
        fields = line.split()
        table[str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))] = fields[-1]
    return table


def interface_of(address: str) -> str:
    """The name of this machine's network interface that holds `address` (Gloo binds by interface name)."""
    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        raise ConfigError(f"launch.node_addr = {address!r}: not an IP address; give this node's address on the "
                         "network the nodes share, e.g. --node-addr 10.0.0.2") from None
    held = {_ipv4_of(name): name for _, name in socket.if_nameindex()} | _ipv6_addresses()
    held.pop(None, None)
    if str(wanted) not in held:
        listed = ", ".join(f"{addr} ({name})" for addr, name in held.items())
        raise ConfigError(f"launch.node_addr = {address!r}: no interface of this machine holds it; this machine "
                         f"has {listed}")
    return held[str(wanted)]


def node_addr_settings(launch: LaunchConfig) -> dict[str, str]:
    """Environment for the workers of a node at launch.node_addr: Gloo binds to the interface that
    holds it (left to itself it binds to whatever the hostname resolves to, often 127.0.0.1, which
    other nodes cannot reach); elastic.NODE_ADDR names the node to its workers, whose config file
    (the run directory's, which every node's launcher writes) may be another node's."""
    if not launch.node_addr:
        return {}
    return {"GLOO_SOCKET_IFNAME": interface_of(launch.node_addr), NODE_ADDR: launch.node_addr}


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
    grace before SIGKILL, twice over: PContext.close's default timeout (--shutdown-timeout reaches
    only the path where the launcher itself is signalled: pytorch#119856), and before it the
    forked workers' own ProcessContext.join. A stalled rank, deaf to SIGTERM, lives through that
    grace: hold both to launch.shutdown_timeout_s."""
    from torch.distributed.elastic.multiprocessing.api import PContext
    from torch.multiprocessing.spawn import ProcessContext

    close, join_all = PContext.close, ProcessContext._join_procs_with_timeout

    def close_within(self: PContext, death_sig: signal.Signals | None = None, timeout: int = seconds) -> None:
        close(self, death_sig, timeout)

    def join_all_within(self: ProcessContext, timeout: float) -> None:
        join_all(self, min(timeout, seconds))

    PContext.close = close_within
    ProcessContext._join_procs_with_timeout = join_all_within


def _hold_exit_barrier_to(seconds: float) -> None:
    """At the end, torch 2.13's agents wait (300 s) for every agent of their last rendezvous: an elastic
    job whose survivors re-formed without a lost node (elastic.py) would wait for its agent, which
    never comes. Hold that wait to `seconds`."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    init = LocalElasticAgent.__init__

    def init_within(self: LocalElasticAgent, *args: object, **kwargs: object) -> None:
        init(self, *args, **{**kwargs, "exit_barrier_timeout": seconds})

    LocalElasticAgent.__init__ = init_within


def launch_workers(launch: LaunchConfig, entry: list[str]) -> None:
    """Run module entry[0] as a script with arguments entry[1:] (e.g. shardwise.worker CONFIG) on
    launch.nproc local ranks, each forked from a server that imported it; raise WorkerFailed with
    the first failing rank's error if any rank fails."""
    from torch.distributed.run import parse_args, run

    # torchrun would set this itself, with a warning; the config says how many threads a rank gets.
    os.environ["OMP_NUM_THREADS"] = str(launch.threads_per_rank)
    os.environ.update(node_addr_settings(launch))
    if launch.max_restarts:
        # torch 2.13 reuses the rendezvous store across restarts, and restarted Gloo groups then
        # sometimes reach a dead peer's address or hang (pytorch#135712, #167288): one store each.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    _hold_failure_shutdown_to(launch.shutdown_timeout_s)
    if launch.min_nnodes is not None:
        _hold_exit_barrier_to(launch.timeout_s)
    script = start_fork_server(entry[0])
    try:
        run(parse_args([*torchrun_args(launch), "--start-method=forkserver", "--run-path", script, *entry[1:]]))
    except ChildFailedError as error:
        raise WorkerFailed(_failure_message(error)) from None
    except SignalException as signal:
        raise Stopped(f"stopped by signal {signal.sigval.name}; workers were sent it too") from None
    finally:
        sys.stdout.flush()


def process_stat(pid: int | str) -> tuple[str, str, int] | None:
    """(name, state, parent pid) of process `pid` from /proc/PID/stat ("pid (name) state ppid ..."; the
    name may hold spaces and parentheses), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read()
    except OSError:
        return None
    state, parent = fields[fields.rindex(")") + 2:].split()[:2]
    return fields[fields.index("(") + 1:fields.rindex(")")], state, int(parent)


def worker_pids(launcher: int, group: int | None = None) -> dict[int, int]:
    """rank -> pid of the workers running under the launcher process `launcher` (its descendants that
    named themselves dist.worker_name(rank, group): of replica group `group`, or of a job without
    them), for whoever must signal one rank. Forked workers share their server's command line, so
    that does not tell them apart."""
    prefix = worker_name(0, group)[:-1]
    parents, ranks = {}, {}
    for entry in os.scandir("/proc"):
        stat = process_stat(entry.name) if entry.name.isdigit() else None
        if stat is None:  # not a process, or ended meanwhile
            continue
        name, _, parent = stat
        pid = int(entry.name)
        parents[pid] = parent
        if name.startswith(prefix) and name.removeprefix(prefix).isdigit():
            ranks[pid] = int(name.removeprefix(prefix))
    found = {}
    for pid, rank in ranks.items():
        ancestor = parents.get(pid, 0)
        while ancestor not in (0, 1, launcher):
            ancestor = parents.get(ancestor, 0)
        if ancestor == launcher:
            found[rank] = pid
    return dict(sorted(found.items()))


def launch_local(launch: LaunchConfig, entry: list[str], expendable: frozenset[int] = frozenset()) -> list[int]:
    """Run module entry[0] as a script with arguments entry[1:] on launch.nproc ranks of this
    machine, each forked from a server that imported it, without torchrun, and return the ranks
    lost on the way: a job that outlives some of its ranks (an asynchronous parameter server loses
    a worker and goes on) cannot run under torchrun, whose agent stops the whole group at the first
    failure.

    The launcher hosts the rendezvous store, so the store outlives every rank, and it writes
    `exited/RANK` there when a rank ends, which is how the ranks left learn that one is gone. A
    failing rank not in `expendable` stops the others (SIGTERM, then SIGKILL after
    launch.shutdown_timeout_s) and raises WorkerFailed; SIGTERM or SIGINT to the launcher is
    passed on the same way and raises Stopped. A rank's own error goes to stderr as it happens."""
    from torch.distributed import TCPStore

    script = start_fork_server(entry[0])  # first: a launcher with the store's thread cannot fork it
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(launch.nproc),
               LOCAL_WORLD_SIZE=str(launch.nproc), OMP_NUM_THREADS=str(launch.threads_per_rank),
               TORCHELASTIC_USE_AGENT_STORE="True")  # every rank is a client of the store above
    ranks = {rank: ForkedRank(script, entry[1:], dict(env, RANK=str(rank), LOCAL_RANK=str(rank)))
             for rank in range(launch.nproc)}
    lost: list[int] = []
    try:
        with closing(exits(ranks, launch.shutdown_timeout_s, "workers were sent SIGTERM")) as ended:
            for rank, code in ended:
                store.set(f"exited/{rank}", str(code))
                if code == 0:
                    continue
                if rank not in expendable:
                    raise WorkerFailed(f"worker rank {rank} failed (exit code {code}); its error is above")
                print(f"rank {rank} exited with code {code}; the job goes on without it", file=sys.stderr,
                      flush=True)
                lost.append(rank)
    finally:
        sys.stdout.flush()
    return lost


class ForkedRank:
    """A rank forked from the fork server, running `script` as __main__ with `argv` and `environ`;
    it answers subprocess.Popen's poll, terminate, kill and wait (exits, stop_processes)."""

    def __init__(self, script: str, argv: list[str], environ: dict[str, str]) -> None:
        self.process = multiprocessing.get_context("forkserver").Process(target=_run_script,
                                                                         args=(script, argv, environ))
        self.process.start()

    def poll(self) -> int | None:
        return self.process.exitcode

    def terminate(self) -> None:
        self.process.terminate()

    def kill(self) -> None:
        self.process.kill()

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(f"rank process {self.process.pid}", timeout)
        return self.process.exitcode


def _run_script(script: str, argv: list[str], environ: dict[str, str]) -> None:
    from torch.distributed.run import run_script_path  # what torchrun's --run-path runs

    os.environ.clear()
    os.environ.update(environ)
    run_script_path(script, *argv)


def exits(processes: dict[K, subprocess.Popen | ForkedRank], grace_s: float, on_signal: str) -> Iterator[tuple[K, int]]:
    """Each of `processes` (by key) with its exit code as it ends, until all have. SIGTERM or SIGINT
    meanwhile is noted, not acted on, and raises Stopped (`on_signal` says what became of the
    processes). Closed early (the caller raised, or the signal), it stops those still running:
    SIGTERM, then SIGKILL after `grace_s`. Iterate it under contextlib.closing, so that this happens
    as the caller's loop ends, not when the generator is collected."""
    running = dict(processes)
    with signals_noted() as signalled:
        try:
            while running and not signalled:
                for key, process in list(running.items()):
                    code = process.poll()
                    if code is not None:
                        del running[key]
                        yield key, code
                time.sleep(0.1)
            if signalled:
                raise Stopped(f"stopped by signal {signalled[0].name}; {on_signal}")
        finally:
            stop_processes(list(running.values()), grace_s)


@contextmanager
def signals_noted() -> Iterator[list[signal.Signals]]:
    """While inside, SIGTERM and SIGINT are noted in the list yielded, not acted on: a launcher
    passes them on to what it started and stops in order. The handlers before are put back after."""
    signalled: list[signal.Signals] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: signalled.append(signal.Signals(signum)))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield signalled
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_processes(processes: list[subprocess.Popen | ForkedRank], grace_s: float) -> None:
    """SIGTERM every process still running; SIGKILL those still there after `grace_s`."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # deaf to SIGTERM (stopped, or stuck in a collective)
            process.kill()
            process.wait()
