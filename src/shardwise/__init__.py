"""shardwise: distributed training for PyTorch. `shardwise train` for configs; for your own loop,
the Python API (api.py): `run = shardwise.setup(strategy=...)`."""

from shardwise.api import Run, setup

__all__ = ["Run", "setup"]
