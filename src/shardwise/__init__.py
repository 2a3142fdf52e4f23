"""shardwise: distributed training for PyTorch. `shardwise train` for configs; for your own loop,
the Python API (api.py): `run = shardwise.setup(strategy=...)`."""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for type checkers and editors; at run time imported on first use, below
    from shardwise.api import Run, setup
    from shardwise.materialise import init_context

__all__ = ["Run", "init_context", "setup"]
_HOMES = {"Run": "shardwise.api", "setup": "shardwise.api", "init_context": "shardwise.materialise"}


def __getattr__(name: str) -> object:
    # Imported on first use: the CLI's `plan` and `--help` need none of the training stack.
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'shardwise' has no attribute {name!r}")
