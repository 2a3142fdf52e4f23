"""SyncBatchNorm on torch.distributed collectives, for any device (PyTorch's own is GPU-only).

In training, batch statistics are taken over the global batch: each rank all-reduces its
per-channel sum, sum of squares and count. Backward all-reduces the two per-channel sums the
input gradient needs. The result, running statistics included, is what one BatchNorm on one
device would compute over the whole global batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardwise.parallel.comm import all_gather_single


class _GlobalBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float):
        dims = [0, *range(2, x.dim())]  # every dimension but channels
        channels = x.shape[1]
        # Each rank's count, mean and sum of squared deviations, combined exactly (Chan et al.):
        # better conditioned than E[x^2] - E[x]^2.
        count = x.numel() // channels
        local_mean = x.mean(dims)
        local_m2 = ((x - local_mean.view(1, channels, *[1] * (x.dim() - 2))) ** 2).sum(dims)
        local = torch.cat([torch.tensor([float(count)], dtype=x.dtype, device=x.device), local_mean, local_m2])
        gathered = torch.empty(dist.get_world_size() * local.numel(), dtype=x.dtype, device=x.device)
        all_gather_single(gathered, local)
        counts, means, m2s = gathered.view(dist.get_world_size(), -1).split([1, channels, channels], dim=1)
        total = counts.sum()
        mean = (counts * means).sum(0) / total
        var = (m2s + counts * (means - mean) ** 2).sum(0) / total
        invstd = torch.rsqrt(var + eps)
        shape = [1, channels] + [1] * (x.dim() - 2)
        xhat = (x - mean.view(shape)) * invstd.view(shape)
        ctx.save_for_backward(xhat, weight, invstd, total)
        ctx.dims, ctx.shape = dims, shape
        return xhat * weight.view(shape) + bias.view(shape), mean, var, total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, *unused: torch.Tensor):
        xhat, weight, invstd, total = ctx.saved_tensors
        dims, shape = ctx.dims, ctx.shape
        grad_bias = grad_out.sum(dims)
        grad_weight = (grad_out * xhat).sum(dims)
        sums = torch.cat([grad_bias, grad_weight])
        dist.all_reduce(sums)
        sum_dy, sum_dy_xhat = sums.view(2, -1)
        grad_x = (weight * invstd).view(shape) / total * (
            total * grad_out - sum_dy.view(shape) - xhat * sum_dy_xhat.view(shape)
        )
        # Weight and bias gradients stay local: data parallel averages them like any other.
        return grad_x, grad_weight, grad_bias, None


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm whose training statistics cover the batch of every rank."""

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects at least 2-D input (batch, channels, ...), got {x.dim()}-D")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        if not self.affine or not self.track_running_stats or self.momentum is None:
            raise ValueError("SyncBatchNorm supports affine BatchNorm with running statistics and a momentum")
        y, mean, var, total = _GlobalBatchNorm.apply(x, self.weight, self.bias, self.eps)
        with torch.no_grad():
            self.num_batches_tracked += 1
            unbiased = var * total / (total - 1)
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(unbiased, self.momentum)
        return y


def convert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every BatchNorm*d in `module` by a SyncBatchNorm with the same state."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, SyncBatchNorm):
        # Built where the module's tensors are: on the meta device for a meta-built model.
        device = next((t.device for t in (*module.parameters(), *module.buffers())), None)
        sync = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                             module.track_running_stats, device=device)
        sync.load_state_dict(module.state_dict())
        return sync
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child))
    return module
