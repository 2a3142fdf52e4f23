"""One device, one process: the oracle every other strategy must match."""

from __future__ import annotations

from shardwise.strategies.base import Strategy


class Single(Strategy):
    """Every step of `Strategy.wrap` as the base class takes it: the whole model, on one device."""
