"""A broken device for the replica-group health test (test_replicas.py), in the job's own processes:
with this folder on PYTHONPATH and SHARDWISE_TEST_NAN = "GROUP:RANK:STEP:ATTEMPTS,...", the worker
of rank RANK in replica group GROUP makes its loss and gradients NaN at (1-based) step STEP, for
the first ATTEMPTS attempts at it (1: a transient fault the re-run clears; more: a deterministic
one). Python imports this module at start in every process of the job; only the workers, which
import shardwise.trainer, are changed, as that import finishes."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys


def faults() -> dict[int, int]:
    """This process's faults: step -> attempts."""
    group, rank = os.environ.get("SHARDWISE_REPLICA_GROUP"), os.environ.get("RANK")
    found = {}
    for item in os.environ.get("SHARDWISE_TEST_NAN", "").split(","):
        if item:
            g, r, step, attempts = item.split(":")
            if (g, r) == (group, rank):
                found[int(step)] = int(attempts)
    return found


def break_trainer(trainer_class: type, steps: dict[int, int]) -> None:
    original, tried = trainer_class.forward_backward, {}

    def forward_backward(self, step: int):
        loss = original(self, step)
        tried[step] = tried.get(step, 0) + 1
        if tried[step] <= steps.get(step + 1, 0):
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
            loss = loss * float("nan")
        return loss

    trainer_class.forward_backward = forward_backward


class BreakTrainerOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, steps: dict[int, int]) -> None:
        self.steps = steps

    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201 (importlib's signature)
        if name != "shardwise.trainer":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module) -> None:  # noqa: ANN001
            run_module(module)
            break_trainer(module.Trainer, self.steps)

        spec.loader.exec_module = exec_module
        return spec


_FAULTS = faults()
if _FAULTS:
    sys.meta_path.insert(0, BreakTrainerOnImport(_FAULTS))
