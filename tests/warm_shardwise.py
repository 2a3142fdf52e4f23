"""`shardwise` command lines run as the installed script runs them, each in a process of its own,
without each paying for Python's and torch's start: here about 1.5 CPU-seconds of the launcher's,
and another second in the server its ranks are forked from, where a short line's own work is half
a second.

A server process starts as the console script does (the script's directory first on sys.path, the
caller's environment and working directory), imports what every command imports first (torch, the
CLI) and what the ranks' fork server would (the worker, torch._dynamo), and then, for each line,
forks a child that runs the script's two lines (`sys.argv` set, `sys.exit(main())`) and exits as an
interpreter does: its exit status, atexit's handlers run. A bug of the script's path (a module the
script's sys.path cannot find) fails here as it fails a user; the first line of each command is run
as a fresh process all the same (tests/test_commands.py).

    python tests/warm_shardwise.py SCRIPT    # the server: one JSON request a line on stdin
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

PRELOADED = ("torch", "torch._dynamo", "shardwise.cli", "shardwise.worker")


class WarmShardwise:
    """The server, started in `cwd` with `env`; `run` is subprocess.run's for one line."""

    def __init__(self, script: Path, cwd: Path, env: dict[str, str], streams: Path) -> None:
        self.streams = streams  # where a line's stdout and stderr are written
        self.server = subprocess.Popen([sys.executable, __file__, str(script)], cwd=cwd, env=env,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.server.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the warm shardwise server did not start (exit {self.server.wait()})")

    def run(self, words: tuple[str, ...], timeout: float) -> subprocess.CompletedProcess:
        """Run `words` (the script's path, then its arguments) to completion in a forked child."""
        out, err = self.streams / "stdout", self.streams / "stderr"
        self.server.stdin.write(json.dumps({"argv": list(words[1:]), "stdout": str(out), "stderr": str(err)}) + "\n")
        self.server.stdin.flush()
        child, killed = self._answer(), []

        def kill() -> None:  # the child leads a session of its own: with it, its launcher's and ranks' processes
            killed.append(child)
            os.killpg(child, signal.SIGKILL)

        timer = threading.Timer(timeout, kill)
        timer.start()
        status = self._answer()
        timer.cancel()
        if killed:
            raise subprocess.TimeoutExpired(list(words), timeout)
        return subprocess.CompletedProcess(list(words), status, out.read_text(), err.read_text())

    def _answer(self) -> int:
        answer = self.server.stdout.readline()
        if not answer:
            raise RuntimeError(f"the warm shardwise server exited ({self.server.wait()}); its errors are above")
        return int(answer)

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=60)


def serve(script: str) -> None:
    """Each request: fork; the child runs the line, the server answers its pid and then its status."""
    import importlib

    for module in PRELOADED:
        importlib.import_module(module)
    print("ready", flush=True)
    for request in map(json.loads, sys.stdin):
        pid = os.fork()
        if pid == 0:
            run_in_child(script, request)  # never returns
        print(pid, flush=True)
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)


def run_in_child(script: str, request: dict) -> None:
    """In the forked child: the console script's body, with the standard streams of a new process."""
    os.setsid()
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT)):
        opened = os.open(path, flags | (os.O_TRUNC if fd else 0), 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin, sys.stdout, sys.stderr = (open(fd, mode, closefd=False) for fd, mode in ((0, "r"), (1, "w"), (2, "w")))
    sys.argv = [script, *request["argv"]]
    from shardwise.cli import main

    sys.exit(main())  # unwinds the server's loop: the interpreter exits as the script's would


if __name__ == "__main__":
    sys.path[0] = str(Path(sys.argv[1]).parent)  # the script's directory, where python puts this file's
    serve(sys.argv[1])
