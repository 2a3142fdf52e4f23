"""4-bit NormalFloat storage of frozen linear weights (NF4, QLoRA: Dettmers et al. 2023), for
LoRA over a quantized base.

Each row of a weight is cut into blocks of 64 values. A block is stored as its absolute maximum
(its *scale*) and, for each value, the index (4 bits) of the nearest of 16 levels: the NF4
levels, quantiles of a normal distribution spread over [-1, 1], which is how pretrained weights
are distributed. The scales themselves are quantized again ("double quantization"): a row's
scales less their mean, to int8, in chunks of 256 with one fp32 factor per chunk. So a row of `n`
weights takes n/2 bytes of indices, n/64 bytes of scales and 4 bytes for the mean and each
factor: 4.127 bits a weight for n = 8192, where bf16 takes 16.

Everything a row needs is packed into that row's bytes, so the quantized weight is one uint8
tensor [out_features, row_bytes]: a data-parallel sharding that splits parameters by rows
(parallel/shard.py) holds 1/N of the 4-bit base on each rank and gathers bytes, and a rank's rows
of the packed weight are the packed weight of its rows of the float one (what loading pretrained
weights by rows relies on, weights.py).

`quantize_layers` turns linear layers into `NF4Linear`s in place: the layer keeps its name, its
children (a LoRA adapter) and its hooks, and its `weight` becomes the packed bytes, frozen;
its forward dequantizes the whole weight to the compute dtype and frees it after, and its
backward dequantizes it again (per layer: the transient costs one layer's weight in that dtype,
and nothing of it is kept between forward and backward).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# The 16 NF4 levels (the QLoRA paper's, as bitsandbytes and torchao store them): 8 quantiles of
# N(0, 1) on each side, normalised to [-1, 1], with an exact zero.
LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
          -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
          0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
          0.7229568362236023, 1.0)
BLOCK = 64  # weights per scale
SCALE_CHUNK = 256  # scales per fp32 factor of the double quantization


class QuantizeError(ValueError):
    """A layer that cannot be stored in NF4 as asked; the message names it."""


def row_bytes(in_features: int) -> int:
    """Bytes of one packed row of `in_features` weights: the mean and chunk factors (fp32), the
    indices (two to a byte), the scales (int8), padded to a multiple of 4."""
    blocks = in_features // BLOCK
    return 4 * (1 + math.ceil(blocks / SCALE_CHUNK)) + in_features // 2 + blocks + (-blocks % 4)


def check_shape(name: str, in_features: int) -> None:
    if in_features % BLOCK:
        raise QuantizeError(f"lora.quantize = 'nf4': {name} has {in_features} input features, not a multiple of "
                            f"the {BLOCK}-weight block its rows are quantized in")


def quantize(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] (in a multiple of 64) packed into NF4 rows: uint8 [out, row_bytes(in)]."""
    out, n = weight.shape
    blocks, chunks = n // BLOCK, math.ceil(n // BLOCK / SCALE_CHUNK)
    values = weight.detach().float().view(out, blocks, BLOCK)
    scales = values.abs().amax(dim=2)  # [out, blocks]
    levels = torch.tensor(LEVELS, device=weight.device)
    normalised = values / scales.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(2)
    # The nearest level: the number of midpoints between levels below the value.
    indices = torch.bucketize(normalised, (levels[1:] + levels[:-1]) / 2).to(torch.uint8).view(out, n)
    mean = scales.mean(dim=1, keepdim=True)
    centred = F.pad(scales - mean, (0, chunks * SCALE_CHUNK - blocks)).view(out, chunks, SCALE_CHUNK)
    factors = centred.abs().amax(dim=2) / 127
    scale_codes = (centred / factors.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(2)).round()
    packed = torch.zeros(out, row_bytes(n), dtype=torch.uint8, device=weight.device)
    head = 4 * (1 + chunks)
    packed[:, :head] = torch.cat([mean, factors], dim=1).contiguous().view(torch.uint8)
    packed[:, head : head + n // 2] = indices[:, 0::2] << 4 | indices[:, 1::2]
    packed[:, head + n // 2 : head + n // 2 + blocks] = scale_codes.view(out, -1)[:, :blocks].to(torch.int8).view(
        torch.uint8)
    return packed


def dequantize(packed: torch.Tensor, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight [out, in_features] in `dtype` that `packed` (uint8 [out, row_bytes]) stores."""
    out, n = packed.shape[0], in_features
    blocks, chunks = n // BLOCK, math.ceil(n // BLOCK / SCALE_CHUNK)
    head = 4 * (1 + chunks)
    floats = packed[:, :head].contiguous().view(torch.float32)
    mean, factors = floats[:, :1], floats[:, 1:]
    scale_codes = packed[:, head + n // 2 : head + n // 2 + blocks].contiguous().view(torch.int8).float()
    scales = F.pad(scale_codes, (0, chunks * SCALE_CHUNK - blocks)).view(out, chunks, SCALE_CHUNK)
    scales = (scales * factors.unsqueeze(2)).view(out, -1)[:, :blocks] + mean
    codes = packed[:, head : head + n // 2]
    indices = torch.stack([codes >> 4, codes & 15], dim=2).view(out, n).long()
    levels = torch.tensor(LEVELS, device=packed.device)
    return (levels[indices].view(out, blocks, BLOCK) * scales.unsqueeze(2)).view(out, n).to(dtype)


class _FrozenLinear(torch.autograd.Function):
    """x W^T for an NF4 weight W that gets no gradient. Backward dequantizes W again rather than
    keep it: F.linear would save the dequantized weight for the input's gradient, every layer's
    until backward, which is the whole base in the compute dtype, what NF4 is there to avoid."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, packed: torch.Tensor, in_features: int, dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(packed)
        ctx.in_features, ctx.dtype, ctx.x_dtype = in_features, dtype, x.dtype
        return F.linear(x, dequantize(packed, in_features, dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (packed,) = ctx.saved_tensors
        weight = dequantize(packed, ctx.in_features, ctx.dtype)
        return (grad.to(weight.dtype) @ weight).to(ctx.x_dtype), None, None, None


class NF4Linear(nn.Linear):
    """A linear layer whose frozen weight is stored packed in NF4 (`quantize_layers` makes one of
    an `nn.Linear` in place); `compute_dtype`: what the weight is dequantized to."""

    compute_dtype: torch.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _FrozenLinear.apply(x, self.weight, self.in_features, self.compute_dtype)
        return out if self.bias is None else out + self.bias


def quantize_layers(model: nn.Module, names: list[str], compute_dtype: torch.dtype) -> None:
    """Store the weights of `model`'s linear layers `names` in NF4, each from its value now, to be
    dequantized to `compute_dtype` (what the layer's input is in: mixed precision's, else the
    parameters'). Layers still on the meta device (materialised later, block by block) and those
    already stored in NF4 are left for a later call."""
    for name in names:
        layer = model.get_submodule(name)
        if isinstance(layer, NF4Linear) or layer.weight.is_meta:
            continue
        check_shape(name, layer.in_features)
        packed = quantize(layer.weight)
        # The class changes in place, not the module: the model's structure, the layer's name, its
        # adapter and its forward hooks stay as they are.
        layer.__class__ = NF4Linear
        layer.compute_dtype = compute_dtype
        layer.weight = nn.Parameter(packed, requires_grad=False)


def quantized(model: nn.Module) -> dict[str, NF4Linear]:
    """Each NF4 layer of `model`, by its weight's name."""
    return {f"{name}.weight": module for name, module in model.named_modules() if isinstance(module, NF4Linear)}
