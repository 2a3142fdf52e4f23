"""PyTorch's own implementations behind the Strategy interface: the anchors ours are held to."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from shardwise.config.schema import Config, ConfigError
from shardwise.memory import MemoryBreakdown
from shardwise.strategies.base import Strategy


class NativeStrategy(Strategy):
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """PyTorch's own clipping, as its users clip (FSDP2's gradients are DTensors, whose global
        norm torch computes itself)."""
        return torch.nn.utils.clip_grad_norm_(self.local_parameters(), max_norm)


class NativeDDP(NativeStrategy):
    """torch.nn.parallel.DistributedDataParallel with its defaults (gradients copied into its
    buckets), bucket size and unused-parameter handling taken from the config."""

    @classmethod
    def check_config(cls, cfg: Config, world: int) -> None:
        if cfg.parallel.sync_batchnorm and not torch.cuda.is_available():
            raise ConfigError(
                "parallel.sync_batchnorm = true: torch.nn.SyncBatchNorm (used by ddp-native) runs only on GPUs; "
                "use --strategy ddp, whose SyncBatchNorm runs on CPU too"
            )
        if cfg.launch.debug_collectives:
            raise ConfigError(
                "launch.debug_collectives = true: torch 2.13's DistributedDataParallel crashes (SIGSEGV) in its "
                "constructor under TORCH_DISTRIBUTED_DEBUG=DETAIL; debug with --strategy ddp, the same algorithm"
            )

    def prepare(self, model: nn.Module) -> nn.Module:
        return super().prepare(nn.SyncBatchNorm.convert_sync_batchnorm(model) if self.cfg.sync_batchnorm else model)

    def _distribute(self, part: nn.Module) -> nn.Module:
        self.module = part
        self.ddp = DistributedDataParallel(
            part,
            device_ids=[self.ctx.device.index] if self.ctx.device.type == "cuda" else None,
            bucket_cap_mb=self.cfg.ddp.bucket_mb,
            find_unused_parameters=self.cfg.ddp.find_unused_parameters,
            process_group=self.mesh.group("dp_cp"),
        )
        return self.ddp

    def no_sync(self) -> AbstractContextManager:
        return self.ddp.no_sync()


class NativeFSDP(NativeStrategy):
    """PyTorch FSDP2: `fully_shard` on every `parallel.block` module, then on the root. A meta-built
    model takes FSDP2's own path: sharded on the meta device, `to_empty` allocates this rank's
    shards, then each unit's initial values are made whole once and each rank copies its shard."""

    materialises_whole = False  # fully_shard on meta, then each rank's shards allocated and initialised

    def _distribute(self, model: nn.Module) -> nn.Module:
        # Mixed precision gathers parameters in the compute dtype (bf16-true stores them so already).
        policy = MixedPrecisionPolicy(param_dtype=self.precision.compute_dtype if self.precision.mixed else None,
                                      reduce_dtype=self.precision.reduce_dtype)
        mesh = self.mesh["dp_shard_cp"]
        for module in model.modules():
            if type(module).__name__ == self.cfg.block:
                fully_shard(module, mesh=mesh, reshard_after_forward=self.cfg.sharding.reshard_after_forward,
                            mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        if self.materialiser is not None:
            model.to_empty(device=self.ctx.device)
            for group in self.materialiser.groups:
                self.materialiser.distribute(group, self.ctx.device)
        self.module = model
        return model

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        modules = [m for m in self.module.modules() if isinstance(m, FSDPModule)]
        for module in modules:
            module.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for module in modules:
                module.set_requires_gradient_sync(True, recurse=False)

    def memory(self, activations: int) -> MemoryBreakdown:
        breakdown = super().memory(activations)
        breakdown.gathered_peak = None  # FSDP2 does not expose how much it holds unsharded at once
        return breakdown
