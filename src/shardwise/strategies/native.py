"""PyTorch's own implementations behind the Strategy interface: the anchors ours are held to."""

from __future__ import annotations

from contextlib import AbstractContextManager

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from shardwise.strategies.base import Strategy


class NativeDDP(Strategy):
    """torch.nn.parallel.DistributedDataParallel with its defaults (gradients copied into its
    buckets), bucket size and unused-parameter handling taken from the config."""

    name = "ddp-native"

    def wrap(self, model: nn.Module) -> nn.Module:
        model = model.to(self.ctx.device)
        if self.cfg.sync_batchnorm:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        self.module = model
        self.ddp = DistributedDataParallel(
            model,
            device_ids=[self.ctx.device.index] if self.ctx.device.type == "cuda" else None,
            bucket_cap_mb=self.cfg.bucket_mb,
            find_unused_parameters=self.cfg.find_unused_parameters,
        )
        return self.ddp

    def no_sync(self) -> AbstractContextManager:
        return self.ddp.no_sync()
