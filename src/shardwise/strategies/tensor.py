"""Tensor parallel, ours (`tensor`): every weight matrix of the GPT's blocks is split across the
tp ranks of one model replica (Megatron-LM's scheme), so each rank holds and computes 1/tp of
every block.

- Column-parallel linear: the weight's output rows are split; each rank computes its slice of the
  output from the whole input. The input enters through `copy_to_tp` (identity forward,
  all-reduce backward): every rank's slice used the whole input, so the input's gradient is the
  sum of theirs.
- Row-parallel linear: the weight's input columns are split; each rank multiplies its slice of
  the input, and `reduce_from_tp` (all-reduce forward, identity backward) sums the partial
  outputs. A bias is added once, after the sum.
- Attention: qkv is column-parallel *by heads* (rank r holds the q, k and v rows of heads
  r*H/tp .. (r+1)*H/tp - 1), so attention runs on the local heads without talking; proj is
  row-parallel. MLP: up column-parallel, GELU on the local slice, down row-parallel.

So a block's forward has two all-reduces (after attention, after the MLP), and so does its
backward (at the two `copy_to_tp`), each of one activation's size.

Embeddings, layer norms, the head and the loss are *replicated*, not vocabulary-parallel: every
tp rank computes them on the same activations (the all-reduces leave the residual stream equal
on every rank), so their gradients come out equal on every rank without communication. With the
byte-level vocabulary of 256, splitting them would save little and add two collectives.

Applied from outside: `parallelize_blocks` swaps the blocks' linear layers and attention for
these, keeping parameter names, so the state dict reads like the plain model's (shards instead
of whole tensors; `full_state_dict` joins them). In checkpoints each shard is a DTensor of the
whole parameter, `Shard(dim)` over the tp ranks (`TensorShard.as_dtensor`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardwise.config import Config, ConfigError
from shardwise.strategies.mesh import MeshStrategy, TensorShard, find_blocks

Group = dist.ProcessGroup


class CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()  # autograd may hand the same gradient to other consumers
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, group: Group) -> torch.Tensor:
        x = x.clone()  # an input must not be changed in place
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return CopyToTensorParallel.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return ReduceFromTensorParallel.apply(x, group)


class ColumnParallelLinear(nn.Module):
    """`linear` with its output features split over `group`: this rank's slice of the output."""

    def __init__(self, linear: nn.Linear, group: Group, parts: int = 1) -> None:
        super().__init__()
        self.group = group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.shards = {"weight": TensorShard(0, parts), "bias": TensorShard(0, parts)}
        self.weight = nn.Parameter(self.shards["weight"].take(linear.weight.detach(), rank, size))
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(self.shards["bias"].take(bias.detach(), rank, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tp(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """`linear` with its input features split over `group`: takes this rank's slice of the input,
    returns the whole output (summed over ranks)."""

    def __init__(self, linear: nn.Linear, group: Group) -> None:
        super().__init__()
        self.group = group
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        self.shards = {"weight": TensorShard(1)}  # the bias is added after the sum: replicated
        self.weight = nn.Parameter(self.shards["weight"].take(linear.weight.detach(), rank, size))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class LocalHeadsAttention(nn.Module):
    """Causal self-attention over `heads` heads, whose q, k and v are the three thirds of `qkv`'s
    output: this rank's heads, when qkv is column-parallel by heads. The GPT's attention, with the
    head count a rank computes instead of the model's."""

    def __init__(self, qkv: nn.Module, proj: nn.Module, heads: int) -> None:
        super().__init__()
        self.qkv = qkv
        self.proj = proj
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, -1))


def parallelize_blocks(blocks: list[nn.Module], group: Group) -> dict[int, TensorShard]:
    """Split each GPT block's attention (by heads) and MLP over `group`, in place; return how each
    new parameter is split, by id."""
    size = dist.get_world_size(group)
    shards = {}
    for block in blocks:
        attn, mlp = block.attn, block.mlp
        block.attn = LocalHeadsAttention(ColumnParallelLinear(attn.qkv, group, parts=3),
                                         RowParallelLinear(attn.proj, group), attn.n_head // size)
        mlp.up = ColumnParallelLinear(mlp.up, group)
        mlp.down = RowParallelLinear(mlp.down, group)
        for linear in (block.attn.qkv, block.attn.proj, mlp.up, mlp.down):
            shards |= {id(getattr(linear, name)): shard for name, shard in linear.shards.items()
                       if getattr(linear, name) is not None}
    return shards


class TensorParallel(MeshStrategy):
    """`tensor`: each replica's blocks split over its tp group; replicas average gradients over dp."""

    @classmethod
    def check_split(cls, cfg: Config, dp: int, pp: int, tp: int) -> None:
        if pp != 1:
            raise ConfigError(f"parallel.pp = {pp}: tensor does not pipeline; use --strategy pipeline "
                              "with --tp, which splits each stage's blocks tensor-parallel")
        if tp < 2:
            raise ConfigError(f"parallel.tp = {tp}: tensor parallel needs at least 2 ranks per model")

    def wrap(self, model: nn.Module) -> nn.Module:
        model = self.prepare(model)
        self.record_layout(model, [model])
        self.tensor_shards = parallelize_blocks(find_blocks(model, self.cfg.block), self.tp_group)
        self.record_local_state(model, model)
        self.module = model
        return model
