"""One device, one process: the oracle every other strategy must match."""

from __future__ import annotations

from torch import nn

from shardwise.strategies.base import Strategy


class Single(Strategy):
    def wrap(self, model: nn.Module) -> nn.Module:
        self.module = self.prepare(model)
        return self.module
