"""`dp`: one process drives several devices, as torch.nn.DataParallel does, written out.

Every forward scatters the batch into `parallel.replicas` chunks, one per device, and replicates
the module: replica i is a copy of the module's structure whose parameters are, for this forward,
`param.to(device_i)` of the primary's, a differentiable copy, so backward sends each replica's
gradients back through it and they add up in the primary's `.grad`. The replicas run in parallel
threads and their outputs are gathered (concatenated) on the primary device, where the loss and
backward run as for one device. The optimizer steps the primary's parameters only. Buffers are
copied from the primary before each forward; replica 0 is the primary module itself, so its
BatchNorm statistics are the ones kept (nn.DataParallel's behaviour).

Without several GPUs every replica runs on the CPU (`.to` is then the parameter itself), which
is how it is tested here. Why ddp beats it, as `shardwise bench ps` measures: all replicas share one
Python interpreter, the parameters are copied to every device every step, every output is
gathered to one device, and the primary device does the loss alone; on the CPU, autograd runs
the whole backward on one thread.
"""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import torch
from torch import nn

from shardwise.config.schema import MOE_MODELS, Config, ConfigError, ParallelConfig
from shardwise.dist import DistContext
from shardwise.memory import active_counters
from shardwise.precision import Precision
from shardwise.strategies.base import Strategy


class Replicated(nn.Module):
    """The module the trainer calls: scatter, replicate, parallel apply, gather."""

    def __init__(self, module: nn.Module, devices: list[torch.device], precision: Precision) -> None:
        super().__init__()
        self.module = module
        self.devices = devices
        self.precision = precision
        # Structure only: their parameters are replaced by copies of the primary's in every forward.
        self.copies = [copy.deepcopy(module).to(device) for device in devices[1:]]
        self.threads = ThreadPoolExecutor(len(devices), thread_name_prefix="dp-replica")

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        replicas = [self.module, *(self._refresh(replica, device) for replica, device in
                                   zip(self.copies, self.devices[1:], strict=True))]
        chunks = [chunk.to(device) for chunk, device in zip(inputs.tensor_split(len(replicas)), self.devices,
                                                            strict=True)]
        # Grad mode, autocast and the activation counter are per thread: carry them over.
        grad = torch.is_grad_enabled()
        autocast = torch.is_autocast_enabled(self.devices[0].type)
        counters = active_counters()

        def run(replica: nn.Module, chunk: torch.Tensor, device: torch.device) -> torch.Tensor:
            with ExitStack() as stack:
                stack.enter_context(torch.set_grad_enabled(grad))
                if autocast:
                    stack.enter_context(self.precision.autocast(device))
                for counter in counters:
                    stack.enter_context(counter.listening())
                return replica(chunk)

        outputs = list(self.threads.map(run, replicas, chunks, self.devices))
        return torch.cat([output.to(self.devices[0]) for output in outputs])

    def train(self, mode: bool = True) -> Replicated:
        super().train(mode)
        for replica in self.copies:  # not submodules (their parameters are not the model's): set them too
            replica.train(mode)
        return self

    def _refresh(self, replica: nn.Module, device: torch.device) -> nn.Module:
        for primary, twin in zip(self.module.modules(), replica.modules(), strict=True):
            for key, param in primary._parameters.items():
                if param is not None:
                    # Assigned into the dict: a non-leaf tensor cannot be set as a Parameter attribute.
                    twin._parameters[key] = param.to(device)
            for key, buffer in primary._buffers.items():
                if buffer is not None:
                    twin._buffers[key] = buffer.detach().to(device, copy=True)
        return replica


class DataParallel(Strategy):
    @classmethod
    def check_config(cls, cfg: Config, world: int) -> None:
        """One process running parallel.replicas replicas, one per device (or all on the CPU)."""
        p = cfg.parallel
        if world != 1:
            raise ConfigError(f"parallel.strategy = 'dp': one process drives parallel.replicas = {p.replicas} "
                              f"devices, but the world size is {world}; use --nproc 1, or ddp for one process per "
                              "device")
        gpus = torch.cuda.device_count()
        if gpus and p.replicas > gpus:
            raise ConfigError(f"parallel.replicas = {p.replicas}: dp puts each replica on its own GPU, and only "
                              f"{gpus} are visible")
        if p.replicas > cfg.train.micro_batch:
            raise ConfigError(f"parallel.replicas = {p.replicas}: more replicas than the train.micro_batch = "
                              f"{cfg.train.micro_batch} samples dp scatters among them")
        if cfg.model.name in MOE_MODELS:
            raise ConfigError(f"model.name = {cfg.model.name!r}: dp's replicas would each route their part of a "
                              "micro-batch, balancing on it alone and counting it apart from the model's own "
                              "router statistics; train Mixture-of-Experts models under ddp (one rank per device)")
        if p.sync_batchnorm:
            raise ConfigError("parallel.sync_batchnorm = true: dp keeps replica 0's batch statistics, as "
                              "torch.nn.DataParallel does; batch statistics over all replicas are ddp's")

    def __init__(self, ctx: DistContext, cfg: ParallelConfig) -> None:
        super().__init__(ctx, cfg)
        if ctx.device.type == "cuda":
            self.devices = [torch.device("cuda", i) for i in range(cfg.replicas)]
        else:
            self.devices = [ctx.device] * cfg.replicas

    def _distribute(self, part: nn.Module) -> nn.Module:
        self.module = part
        return Replicated(part, self.devices, self.precision)
