"""Muon for a model's hidden weight matrices, AdamW for the rest of it, as one optimizer
(`train.optimizer = "muon"`, its keys in `[train.muon]`).

Muon (Keller Jordan, 2024) keeps a momentum per matrix and steps along its orthogonalization: the
momentum's nearest semi-orthogonal matrix, approximated by Newton-Schulz iterations of a quintic
(`orthogonalized`, torch.optim.Muon's iteration, coefficients and norm, in bf16 as torch computes it
or in fp32). Moonlight's split (Liu et al., 2025) decides what takes it: the matrices of the
model's blocks; the embeddings, the head, norms and biases take AdamW. A matrix is orthogonalized
as the model computes with it:
- a fused projection (the GPT's qkv, GPT-2's c_attn: the plan's column of several parts) part by
  part along its output features, as modded-nanogpt does (`train.muon.whole_fused` takes it whole);
- a stack of experts' matrices ([experts, d, f]) expert by expert, each its own matrix (and a
  stacked gate_up part by part, as its plan packs it).
The learning rate of a matrix of `rows` output features and `cols` input features is adjusted as
torch's `adjust_lr_fn` says: `original` multiplies it by sqrt(max(1, rows / cols)), Keller Jordan's;
`match_rms_adamw` by 0.2 sqrt(max(rows, cols)), Moonlight's, so that one lr serves both halves.
A layer that stores its weight [in, out] (transformers' Conv1D) has its shape read the other way.

The AdamW half is torch's own (its functional `adam` with decoupled weight decay, the state
torch.optim.AdamW keeps), so that both halves' state checkpoints under torch's names: `exp_avg`,
`exp_avg_sq` and `step` for AdamW's parameters, `momentum_buffer` for Muon's, half of AdamW's state.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.adam import adam

from shardwise.parallel.whole_matrices import WholeMatrices

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's quintic (Keller Jordan's)
NS_EPS = 1e-7  # torch.optim.Muon's floor of the norm it divides by
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def orthogonalized(update: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """`update` (a matrix) made nearly semi-orthogonal by `steps` Newton-Schulz iterations in
    `dtype`, as torch.optim.Muon computes it (there always in bf16); returned in `update`'s dtype."""
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=NS_EPS)  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.T if tall else x).to(update.dtype)


def lr_scale(rows: int, cols: int, adjust: str) -> float:
    """torch.optim.Muon's learning-rate adjustment for a matrix of `rows` output features."""
    return math.sqrt(max(1.0, rows / cols)) if adjust == "original" else 0.2 * math.sqrt(max(rows, cols))


@dataclass(frozen=True)
class MatrixLayout:
    """How a parameter Muon steps holds its matrices: `experts` (a leading dimension of experts,
    each its own matrix), `parts` equal parts along the matrix's dimension `part_dim` (a fused
    projection), `in_out` (stored [in, out]: its rows are its input features)."""

    experts: bool = False
    parts: int = 1
    part_dim: int = 0
    in_out: bool = False

    def matrix_shape(self, shape: torch.Size) -> tuple[int, int]:
        """(output features, input features) of each matrix a parameter of `shape` holds."""
        matrix = list(shape[1:] if self.experts else shape)
        matrix[self.part_dim] //= self.parts
        rows, cols = matrix
        return (cols, rows) if self.in_out else (rows, cols)


class Muon(torch.optim.Optimizer):
    """Muon's groups (`muon: True`, each with its `layout`) and AdamW's, stepped as one optimizer.
    `matrices` says how the tensors it steps on are parts of whole matrices (parallel/whole_matrices.py:
    whole on this rank, or ZeRO's shards, orthogonalized by an owner rank); Newton-Schulz's steps
    and dtype are the optimizer's, not a group's: the whole step orthogonalizes in one exchange."""

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float], momentum: float, ns_steps: int,
                 ns_dtype: str, adjust_lr: str, matrices: WholeMatrices) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": 1e-8, "weight_decay": 0.0, "momentum": momentum,
                    "adjust_lr": adjust_lr, "muon": False, "layout": MatrixLayout()}
        super().__init__(groups, defaults)
        self.ns_steps, self.ns_dtype, self.matrices = ns_steps, NS_DTYPES[ns_dtype], matrices

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        self._muon_step([group for group in self.param_groups if group["muon"]])
        for group in self.param_groups:
            if not group["muon"]:
                self._adamw_step(group)

    def _muon_step(self, groups: list[dict]) -> None:
        """Momentum, Nesterov's update and weight decay on what this rank holds; the update's
        orthogonalization on the whole matrices (`matrices`), this rank's part of it added."""
        stepped = [(param, group) for group in groups for param in group["params"] if param.grad is not None]

        def update(index: int) -> torch.Tensor:
            param, group = stepped[index]
            state = self.state[param]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            buffer = state["momentum_buffer"]
            buffer.lerp_(param.grad, 1 - group["momentum"])
            return param.grad.lerp(buffer, group["momentum"])  # Nesterov's, as torch's

        def orthogonal(index: int, whole: torch.Tensor) -> torch.Tensor:
            layout, result = stepped[index][1]["layout"], torch.empty_like(whole)
            for out, matrix in zip(_matrices(result, layout), _matrices(whole, layout), strict=True):
                out.copy_(orthogonalized(matrix, self.ns_steps, self.ns_dtype))
            return result

        def step(index: int, orthogonalized_update: torch.Tensor) -> None:
            param, group = stepped[index]
            rows, cols = group["layout"].matrix_shape(self.matrices.shape_of(param))
            param.mul_(1 - group["lr"] * group["weight_decay"])
            param.add_(orthogonalized_update, alpha=-group["lr"] * lr_scale(rows, cols, group["adjust_lr"]))

        self.matrices.apply([param for param, _ in stepped], update, orthogonal, self.ns_dtype, step)

    def _adamw_step(self, group: dict) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if not state:  # as torch.optim.AdamW starts it
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            params.append(param)
            grads.append(param.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, beta1=beta1, beta2=beta2,
             lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
             decoupled_weight_decay=True)


def _matrices(tensor: torch.Tensor, layout: MatrixLayout) -> list[torch.Tensor]:
    """The matrices `tensor` holds (views: what is added to them lands in it)."""
    stack = list(tensor) if layout.experts else [tensor]
    return [part for matrix in stack for part in matrix.chunk(layout.parts, layout.part_dim)]


def muon_groups(params: Iterable[nn.Parameter], takes_muon: set[int], layouts: dict[int, MatrixLayout],
                weight_decay: float, matrices: WholeMatrices) -> list[dict]:
    """Muon's groups of `params` (those of the whole parameters whose ids are in `takes_muon`): one
    per layout, weight decay on. The other parameters go in AdamW's groups, the caller's."""
    muon: dict[MatrixLayout, list[nn.Parameter]] = {}
    for param in params:
        whole = id(matrices.whole_of(param))
        if whole in takes_muon:
            muon.setdefault(layouts.get(whole, MatrixLayout()), []).append(param)
    return [{"params": params, "muon": True, "layout": layout, "weight_decay": weight_decay}
            for layout, params in muon.items()]


def selected(named: Iterable[tuple[str, nn.Parameter]], block_params: set[int], patterns: list[str] | None) -> set[int]:
    """Ids of the parameters Muon steps: those whose names match one of `patterns`, or (None) the
    matrices (2-D and up) of the model's blocks."""
    if patterns is None:
        return {id(p) for _, p in named if p.dim() >= 2 and id(p) in block_params}
    return {id(p) for name, p in named if p.dim() >= 2 and any(fnmatch.fnmatchcase(name, x) for x in patterns)}


def split_for_muon(model: nn.Module, named: list[tuple[str, nn.Parameter]], block: str, params: list[str] | None,
                   whole_fused: bool) -> tuple[set[int], dict[int, MatrixLayout]]:
    """Which of `model`'s parameters (`named`, by the plain model's names) Muon steps, and how each
    holds its matrices: a stack of experts (3-D), a fused column of several parts (its family's
    plan's `Column(parts=...)`, its stacked experts' packed parts), stored [in, out] (Conv1D).
    ValueError where none takes Muon."""
    from shardwise.models.plans import PlanError, plan_for

    block_params = {id(p) for m in model.modules() if type(m).__name__ == block for p in m.parameters()}
    takes = selected(named, block_params, params)
    if not takes:
        raise ValueError(f"train.optimizer = 'muon': no parameter takes Muon (train.muon.params = {params!r}, blocks "
                         f"of class {block!r})")
    in_out = {id(m.weight) for m in model.modules() if type(m).__name__ == "Conv1D"}
    parts: dict[str, tuple[int, int]] = {}  # a parameter's name suffix -> (parts, matrix dimension)
    try:
        plan = plan_for(model)
    except PlanError:  # a family of no plan (data parallel needs none): every matrix whole
        plan = None
    if plan is not None and not whole_fused:
        for region in plan.regions:
            for column in region.columns:
                if column.parts > 1:
                    parts[f"{region.module}.{column.name}.weight"] = (column.parts, 1 if plan.weights_in_out else 0)
        for stacked in plan.experts:
            for name, dim, count in stacked.params:
                if count > 1:
                    parts[f"{stacked.module}.{name}"] = (count, dim - 1)
    layouts = {}
    for name, param in named:
        if id(param) not in takes:
            continue
        count, dim = next((value for suffix, value in parts.items() if name.endswith(f".{suffix}")), (1, 0))
        layouts[id(param)] = MatrixLayout(experts=param.dim() == 3, parts=count, part_dim=dim,
                                          in_out=id(param) in in_out)
    return takes, layouts
