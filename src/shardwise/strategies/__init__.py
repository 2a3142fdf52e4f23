"""Strategies by name. Each lives in one module you can read top to bottom."""

from __future__ import annotations

from shardwise.config import ParallelConfig
from shardwise.dist import DistContext
from shardwise.strategies.base import OptimizerFactory, Strategy
from shardwise.strategies.ddp import DDP
from shardwise.strategies.dp import DataParallel
from shardwise.strategies.fsdp import FSDP, Zero1, Zero2
from shardwise.strategies.hsdp import HSDP
from shardwise.strategies.native import NativeDDP, NativeFSDP
from shardwise.strategies.param_server import ParamServer
from shardwise.strategies.pipeline import ModelParallel, Pipeline
from shardwise.strategies.single import Single
from shardwise.strategies.tensor import TensorParallel

__all__ = ["OptimizerFactory", "Strategy", "make_strategy"]


def make_strategy(cfg: ParallelConfig, ctx: DistContext) -> Strategy:
    strategies: dict[str, type[Strategy]] = {
        "single": Single, "dp": DataParallel, "ddp": DDP, "ddp-native": NativeDDP,
        "zero1": Zero1, "zero2": Zero2, "fsdp": FSDP, "fsdp-native": NativeFSDP, "hsdp": HSDP,
        "pipeline": Pipeline, "model-parallel": ModelParallel, "tensor": TensorParallel,
        "param-server": ParamServer,
    }
    return strategies[cfg.strategy](ctx, cfg)
