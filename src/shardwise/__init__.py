"""shardwise: distributed training for PyTorch. `shardwise train` for configs; for your own loop,
the Python API (api.py): `run = shardwise.setup(strategy=...)`."""

from shardwise.api import Run, setup
from shardwise.materialise import init_context

__all__ = ["Run", "init_context", "setup"]
