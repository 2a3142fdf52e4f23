"""A strategy's class, imported by name when a run asks for it (the registry, registry.py, holds
facts only and imports nothing): config validation asks a class for its own checks, a worker
builds its strategy here."""

from __future__ import annotations

import functools
import importlib

from shardwise.compile import BlockCompiler
from shardwise.config.registry import spec
from shardwise.config.schema import LoraConfig, ParallelConfig
from shardwise.dist import DistContext
from shardwise.strategies.base import Strategy


@functools.cache  # validation asks once per planner candidate: import_module's lookup is 20 us
def strategy_class(name: str, pp: int = 1) -> type[Strategy]:
    """The Strategy subclass of the strategy called `name`, imported now. Ours that shard, over
    pipeline stages (`pp` > 1): the pipeline, which composes their sharding after its cut."""
    chosen = spec(name)
    if pp > 1 and chosen.shards_split_model:
        return importlib.import_module("shardwise.strategies.pipeline").Pipeline
    return getattr(importlib.import_module(f"shardwise.strategies.{chosen.module}"), chosen.cls)


def make_strategy(cfg: ParallelConfig, ctx: DistContext, seed: int = 0, compile_blocks: bool = False,
                  lora: LoraConfig | None = None) -> Strategy:
    """The configured strategy; a meta-built model it wraps is initialised from `seed`, its blocks
    compiled with `compile_blocks` (train.compile), and given adapters where `lora.rank` > 0."""
    strategy = strategy_class(cfg.strategy, cfg.mesh_shape(ctx.world_size)[1])(ctx, cfg)
    strategy.seed = seed
    strategy.compiler = BlockCompiler() if compile_blocks else None
    strategy.lora = lora if lora is not None and lora.rank > 0 else None
    return strategy
