"""Numeric precision of training: what dtype computes, what dtype is stored, and (fp16) the loss
scaler that keeps small gradients from flushing to zero.

- `fp32`: everything in float32.
- `bf16-mixed`: matmuls under autocast in bfloat16; parameters (master weights) and optimizer
  state stay float32. The sharded strategies keep (zero1, zero2) or gather (fsdp) the whole
  parameters in bfloat16 beside float32 master shards, and reduce gradients in
  `parallel.sharding.reduce_dtype` (float32 by default).
- `fp16-mixed`: the same in float16, plus a dynamic loss scaler (`LossScaler`).
- `bf16-true`: parameters, gradients and optimizer state in bfloat16 too. Half the memory of
  master weights, but an update smaller than a weight's bf16 spacing (about 1/256 of it) is
  lost, so small learning rates stall late in training.

LayerNorm, softmax and the loss run in float32 whatever the setting (the model's LayerNorm and
the trainer's loss see to it).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    name: str
    compute_dtype: torch.dtype  # what matmuls run in
    param_dtype: torch.dtype  # what parameters and optimizer state are stored in
    reduce_dtype: torch.dtype  # what sharded strategies reduce gradients in

    @property
    def mixed(self) -> bool:
        """Autocast computes in a lower precision than the parameters are stored in."""
        return self.compute_dtype != self.param_dtype

    def autocast(self, device: torch.device) -> AbstractContextManager:
        if not self.mixed:
            return nullcontext()
        return torch.autocast(device.type, dtype=self.compute_dtype)


def make_precision(name: str, reduce_dtype: str = "fp32") -> Precision:
    compute = {"fp32": torch.float32, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16,
               "bf16-true": torch.bfloat16}[name]
    param = torch.bfloat16 if name == "bf16-true" else torch.float32
    return Precision(name, compute, param, DTYPES[reduce_dtype])


class LossScaler:
    """Dynamic loss scaling for fp16 that every rank agrees on.

    The loss is multiplied by `scale` before backward so small gradients survive fp16; gradients
    are divided by it before clipping and the step. If any gradient on any rank (or shard) is
    inf or NaN, every rank skips the step and the scale halves; after `growth_interval` clean
    steps in a row it doubles.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.scale = init_scale
        self.growth_interval = growth_interval
        self.clean_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_(self, grads: list[torch.Tensor], device: torch.device | None = None) -> bool:
        """Divide `grads` (this rank's, local tensors) by the scale in place; return whether any
        gradient on any rank is not finite. The ranks compare on `device` (the process group's;
        default the gradients', which differs where they are offloaded to the host)."""
        where = grads[0].device if grads else torch.device("cpu")
        found_inf = torch.zeros(1, device=where)
        inv_scale = torch.full((1,), 1.0 / self.scale, device=where)
        for dtype in {g.dtype for g in grads}:
            same = [g for g in grads if g.dtype == dtype]
            torch._amp_foreach_non_finite_check_and_unscale_(same, found_inf, inv_scale)
        if dist.is_initialized():  # the whole world: pipeline stages and tensor shards hold different gradients
            found_inf = found_inf.to(device or where)
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        return bool(found_inf.item())

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale /= 2
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= 2
            self.clean_steps = 0

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "growth_interval": self.growth_interval, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.growth_interval = int(state["growth_interval"])
        self.clean_steps = int(state["clean_steps"])
