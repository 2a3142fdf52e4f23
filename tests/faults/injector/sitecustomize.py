"""Faults and timings for the replica-group tests (test_replicas.py), injected into the job's own
processes. With this folder on PYTHONPATH, Python imports this module at start in every process of
the job; only the server the workers are forked from, which imports shardwise.trainer, is changed,
as that import finishes, and only as these variables ask. The ranks forked from it inherit the
changes, which read each rank's group, rank and restart from its environment as it runs:

- SHARDWISE_TEST_NAN = "GROUP:RANK:STEP:ATTEMPTS,...": a broken device. The worker of rank RANK in
  replica group GROUP makes its loss and gradients NaN at (1-based) step STEP, for the first
  ATTEMPTS attempts at it (1: a transient fault the re-run clears; more: a deterministic one).
- SHARDWISE_TEST_PACE = "SECONDS": steps as long as a real model's. While some group is missing
  from the quorum, every step of the groups present takes SECONDS more, so that what is left of
  the run outlasts a killed group's restart, as it would outside a test (gpt-tiny's steps take
  milliseconds; a restart takes seconds, more on a loaded machine).
- SHARDWISE_TEST_HOLD_RESTART = "GROUP": a restart slower than the rest of the run. Group GROUP's
  restarted worker waits until the launcher has recorded every other group's end before it trains
  (their final weights written is not enough: a worker that has written them may not have exited).
- SHARDWISE_TEST_KILL = "GROUP:STEPS": a lost process at a known step. Group GROUP's worker, at its
  first start, SIGKILLs itself as it begins the step after STEPS committed ones (a test's own kill
  can come late on a loaded machine, after the group has ended).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import signal
import sys
import time

VARIABLES = (  # the docstring's
    "SHARDWISE_TEST_NAN", "SHARDWISE_TEST_PACE", "SHARDWISE_TEST_HOLD_RESTART", "SHARDWISE_TEST_KILL")


def nan_faults() -> dict[int, int]:
    """This process's NaN faults: step -> attempts."""
    group, rank = os.environ.get("SHARDWISE_REPLICA_GROUP"), os.environ.get("RANK")
    found = {}
    for item in os.environ.get("SHARDWISE_TEST_NAN", "").split(","):
        if item:
            g, r, step, attempts = item.split(":")
            if (g, r) == (group, rank):
                found[int(step)] = int(attempts)
    return found


def break_trainer(trainer_class: type) -> None:
    original, tried = trainer_class.forward_backward, {}

    def forward_backward(self, step: int):
        loss = original(self, step)
        tried[step] = tried.get(step, 0) + 1
        if tried[step] <= nan_faults().get(step + 1, 0):
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
            loss = loss * float("nan")
        return loss

    trainer_class.forward_backward = forward_backward


def pace(replicas_class: type) -> None:
    original = replicas_class.begin

    def begin(self) -> int:
        step = original(self)
        if self.participants < int(os.environ["SHARDWISE_REPLICA_GROUPS"]):
            time.sleep(float(os.environ["SHARDWISE_TEST_PACE"]))
        return step

    replicas_class.begin = begin


def hold_restart() -> None:
    from torch.distributed import TCPStore

    from shardwise.replicas import GROUP_ENV, START_ENV, others_ended_keys

    group = os.environ["SHARDWISE_TEST_HOLD_RESTART"]
    if group != os.environ.get(GROUP_ENV) or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        return
    host, port = os.environ[START_ENV].rsplit(":", 1)
    launcher = TCPStore(host, int(port), is_master=False)
    while not launcher.check(others_ended_keys(int(group))):  # what the restarted group checks (begin)
        time.sleep(0.05)


def kill_at(replicas_class: type) -> None:
    original = replicas_class.begin

    def begin(self) -> int:
        step = original(self)
        group, steps = os.environ["SHARDWISE_TEST_KILL"].split(":")
        first_start = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
        if first_start and group == os.environ.get("SHARDWISE_REPLICA_GROUP") and step >= int(steps):
            os.kill(os.getpid(), signal.SIGKILL)
        return step

    replicas_class.begin = begin


def hold_restarts(replicas_class: type) -> None:
    original = replicas_class.__init__

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        hold_restart()
        original(self, *args, **kwargs)

    replicas_class.__init__ = __init__


def change(module) -> None:  # noqa: ANN001
    if os.environ.get("SHARDWISE_TEST_NAN"):
        break_trainer(module.Trainer)
    if os.environ.get("SHARDWISE_TEST_PACE"):
        pace(module.ReplicaGroups)
    if os.environ.get("SHARDWISE_TEST_HOLD_RESTART"):
        hold_restarts(module.ReplicaGroups)
    if os.environ.get("SHARDWISE_TEST_KILL"):
        kill_at(module.ReplicaGroups)


class ChangeTrainerOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201 (importlib's signature)
        if name != "shardwise.trainer":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module) -> None:  # noqa: ANN001
            run_module(module)
            change(module)

        spec.loader.exec_module = exec_module
        return spec


if any(os.environ.get(v) for v in VARIABLES):
    sys.meta_path.insert(0, ChangeTrainerOnImport())
