"""The server every rank of a job is forked from (multiprocessing's forkserver), started by forking
the launcher rather than as a new interpreter.

multiprocessing starts its fork server as `python -c 'from multiprocessing.forkserver import main;
main(...)'`, which imports torch again before it imports the entry module. Forked from the launcher,
the server starts with what the launcher imported and imports only the rest (the worker's modules
and torch._dynamo): for a 2-rank gpt-tiny job here, the server's 2.3 s of CPU became 1.0 s, and the
job's 4.0 s of wall 3.0 s. It runs the code multiprocessing would have run, with only the
descriptors multiprocessing passes it open and the signal dispositions of a new interpreter.

A fork copies only the thread that forks: a lock another thread held stays held in the copy. So
the server is forked only while the launcher runs no Python thread and has started none of its own
native ones (its stores, the Lighthouse and torchrun's agent come after); otherwise it starts as
multiprocessing starts it. The one native thread there already is numpy's OpenBLAS pool, which stops
its threads around a fork (its pthread_atfork handlers); Python 3.12 and later still count it and
warn of a multi-threaded fork (a DeprecationWarning, hidden unless asked for).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from importlib.util import find_spec
from multiprocessing import forkserver, resource_tracker, util
from unittest import mock


def start_fork_server(module: str) -> str:
    """Start the server the ranks are forked from, importing `module` (and what it imports) once;
    return the module's file, which each rank runs as a script."""
    # The optimizers import torch._dynamo at their first step: once here too, not once a rank.
    forkserver.set_forkserver_preload([module, "torch._dynamo"])
    if threading.active_count() == 1:
        resource_tracker.ensure_running()  # which ensure_running starts first: as a new interpreter still
        with mock.patch.object(util, "spawnv_passfds", _forked):
            forkserver.ensure_running()  # it imports while the caller goes on (torchrun's agent meets the others)
    else:
        forkserver.ensure_running()
    return find_spec(module).origin


def _forked(path: str, args: list[str], passfds: list[int]) -> int:
    """What multiprocessing.util.spawnv_passfds(path, args, passfds) starts, a process running
    `args` (`python [flags] -c CODE`) with only `passfds` and the standard streams open, forked from
    this one: the child runs CODE itself. Return its pid."""
    sys.stdout.flush()  # else the child, which shares this process's buffers, would write them again
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    try:
        keep = sorted(fd for fd in passfds if fd > 2)
        for low, high in zip([3] + [fd + 1 for fd in keep], [*keep, os.sysconf("SC_OPEN_MAX")], strict=True):
            os.closerange(low, high)
        for sig in signal.valid_signals():  # a new interpreter's: no Python handler but SIGINT's own
            if callable(signal.getsignal(sig)):
                signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        forkserver._forkserver._lock = threading.Lock()  # held by ensure_running, in the launcher, at the fork
        exec(args[args.index("-c") + 1], {"__name__": "__main__"})
    finally:
        os._exit(0)
