"""Float8 training of a model's block linear layers on `torch._scaled_mm` (`parallel.float8`).

Each of a linear layer's three matmuls (the output, the input's gradient, the weight's gradient)
multiplies two float8 tensors, each cast with a scale that maps its largest magnitude to the
float8 format's largest finite value (dynamic scaling: computed from the tensor each time), and
accumulates in higher precision; the result comes out in the input's dtype. Two recipes, as
torchao names them:

- `tensorwise`: one scale a tensor; inputs and weights in e4m3 (more mantissa), gradients of the
  output in e5m2 (more range). The cheapest; under fsdp its weights could be gathered as float8.
- `rowwise`: a scale a row of each operand along the dimension the matmul sums over, every cast in
  e4m3, each scale rounded down to a power of 2 (so that scaling loses no mantissa bits): an
  outlier costs only its own row's precision.

The weight's parameter stays in its stored dtype (the master weights, fp32 under bf16-mixed), the
cast made from it each step, and the layer keeps its name, parameters and state-dict keys: a
checkpoint of a float8 run loads anywhere. Only the blocks' linear layers compute in float8: the
embeddings, the head and the norms stay as they are, and so does a Mixture-of-Experts router
(`gate` or `router`: its scores choose experts, and float8 would flip close choices). A layer whose
sizes are not multiples of 16 (the GPU kernel's tile) is left out and listed.

Autocast (bf16-mixed): the input and the weight are cast to autocast's dtype as F.linear's would
be, and the float8 casts made from those, so that a strategy holding the weight in bf16 (zero1 and
zero2 keep it so, fsdp gathers it so) casts the same float8 weight as single's fp32 master gives;
the matmuls themselves run outside autocast, each in the precision its recipe says.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
RECIPES = ("tensorwise", "rowwise")
KERNEL_MULTIPLE = 16  # torch._scaled_mm on a GPU takes sizes that are multiples of this
ROUTER_NAMES = ("gate", "router")  # a MoE layer's router: the scores that choose experts
EPS = 1e-12  # the least amax a scale is computed from (an all-zero tensor gets a finite scale)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How each operand is cast: per tensor or per row, and its gradients' format."""

    rowwise: bool
    grad_dtype: torch.dtype  # the output's gradient
    power_of_2: bool  # scales rounded down to a power of 2


def recipe(name: str) -> Recipe:
    if name == "tensorwise":
        return Recipe(rowwise=False, grad_dtype=E5M2, power_of_2=False)
    if name == "rowwise":
        return Recipe(rowwise=True, grad_dtype=E4M3, power_of_2=True)
    raise ValueError(f"float8 recipe {name!r}: expected one of {', '.join(RECIPES)}")


@dataclasses.dataclass
class Scaled:
    """A float8 tensor and its scale (float8 = value x scale): one scale, or one a row or column."""

    data: torch.Tensor
    scale: torch.Tensor

    def t(self) -> Scaled:
        return Scaled(self.data.t(), self.scale.t())


@torch.no_grad()
def scale_of(amax: torch.Tensor, dtype: torch.dtype, power_of_2: bool) -> torch.Tensor:
    """The float32 scale that maps `amax` to `dtype`'s largest finite value (computed in float64,
    so that it is the same however it is compiled)."""
    scale = (torch.finfo(dtype).max / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)
    return torch.exp2(torch.floor(torch.log2(scale))) if power_of_2 else scale


def to_float8(x: torch.Tensor, dtype: torch.dtype, rule: Recipe, dim: int | None,
              group: dist.ProcessGroup | None = None) -> Scaled:
    """`x` cast to `dtype` with a dynamic scale: over the whole tensor, or (rowwise) one for each
    slice along `dim`, the dimension the matmul sums over. Values beyond the format's range
    saturate to its largest. `group`: the tensor parallel ranks `x` is split over where the scale
    must span the split (its amax their largest), so that each casts as the whole tensor would."""
    with torch.no_grad():
        magnitude = x.abs()
        amax = magnitude.amax(dim=dim, keepdim=True) if rule.rowwise else magnitude.max()
        if group is not None:
            amax = amax.float()
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        scale = scale_of(amax, dtype, rule.power_of_2)
        return Scaled(cast(x, scale, dtype), scale)


def cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` times `scale` in `dtype`, in float32 until the cast, values beyond its range saturated."""
    limit = torch.finfo(dtype).max
    return (x.to(torch.float32) * scale).clamp(-limit, limit).to(dtype)


def scaled_mm(a: Scaled, b: Scaled, out_dtype: torch.dtype, fast: bool) -> torch.Tensor:
    """a @ b from float8 operands, in `out_dtype`: a laid out by rows and b by columns (the
    kernel's layout), each scale undone. With per-row scales and precise accumulation (`fast`
    false: the gradients' matmuls) the scales are undone after the product, in `out_dtype`."""
    a_data = a.data if a.data.stride(-1) == 1 else a.data.contiguous()
    b_data = b.data if b.data.stride(0) == 1 else b.data.t().contiguous().t()
    a_scale, b_scale = a.scale, b.scale
    if a_scale.dim() == 0 and b_scale.dim() != 0:  # a tensorwise operand beside a rowwise one
        a_scale = a_scale.repeat(a_data.shape[0]).reshape(-1, 1)
    elif a_scale.dim() != 0 and b_scale.dim() == 0:
        b_scale = b_scale.repeat(b_data.shape[1]).reshape(1, -1)
    undo_a, undo_b = a_scale.reciprocal(), b_scale.reciprocal()
    rowwise = undo_a.shape == (a_data.shape[0], 1) and undo_b.shape == (1, b_data.shape[1])
    after = None
    if rowwise and not fast:
        after, undo_a, undo_b = undo_a * undo_b, undo_a.new_ones(()), undo_a.new_ones(())
    kernel_dtype = torch.bfloat16 if rowwise and out_dtype in (torch.float16, torch.float32) else out_dtype
    out = torch._scaled_mm(a_data, b_data, scale_a=undo_a, scale_b=undo_b, out_dtype=kernel_dtype,
                           use_fast_accum=fast)
    if after is not None:
        out *= after
    return out.to(out_dtype)


class _Float8Matmul(torch.autograd.Function):
    """input @ weight.T with the three matmuls in float8 (the output's with fast accumulation, the
    gradients' precisely), every operand cast as `layer.rule` says along the dimension its matmul
    sums (M the tokens, K the input features, N the output features), its scale spanning a tensor
    parallel split where `layer.group_for` names one; the weight's float8 cast is `layer.gathered`
    where fsdp gathered it so (its bf16 `weight` then holds no data, and backward uses what was
    gathered again before it)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, weight: torch.Tensor,
                layer: Float8Linear | Float8Split) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.layer, rule = layer, layer.rule
        rows = x.reshape(-1, x.shape[-1])
        weight8 = layer.gathered.t() if layer.gathered is not None else \
            to_float8(weight.t(), E4M3, rule, 0, layer.group_for("weight", "K"))
        out = scaled_mm(to_float8(rows, E4M3, rule, -1, layer.group_for("input", "K")), weight8, x.dtype, fast=True)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        layer = ctx.layer
        rule = layer.rule
        grad_rows = grad.reshape(-1, grad.shape[-1])
        # the input's gradient: grad (M x N) @ weight (N x K), each cast along N
        weight8 = layer.gathered if layer.gathered is not None else \
            to_float8(weight.t(), E4M3, rule, -1, layer.group_for("weight", "N")).t()
        grad8 = to_float8(grad_rows, rule.grad_dtype, rule, -1, layer.group_for("grad", "N"))
        grad_input = scaled_mm(grad8, weight8, grad.dtype, fast=False)
        grad_input = grad_input.reshape(*grad.shape[:-1], grad_input.shape[-1])
        if not ctx.needs_input_grad[1]:  # a frozen weight (LoRA's base model)
            return grad_input, None, None
        # the weight's: grad.T (N x M) @ input (M x K), each cast along M
        rows = x.reshape(-1, x.shape[-1])
        grad_weight = scaled_mm(to_float8(grad_rows, rule.grad_dtype, rule, 0, layer.group_for("grad", "M")).t(),
                                to_float8(rows, E4M3, rule, 0, layer.group_for("input", "M")), grad.dtype, fast=False)
        return grad_input, grad_weight.to(weight.dtype), None


def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  layer: Float8Linear | Float8Split) -> torch.Tensor:
    """x @ weight.T + bias in float8 as `layer` says. Under autocast the input and the weight are cast
    as F.linear's would be (a gathered weight holds no data: its float8 cast is what counts)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x = x.to(dtype)
        weight = weight if layer.gathered is not None else weight.to(dtype)
    with torch.autocast(device, enabled=False):
        out = _Float8Matmul.apply(x, weight, layer)
        return out if bias is None else out + bias.to(out.dtype)


@dataclasses.dataclass
class Float8Split:
    """A tensor-parallel layer's float8 (parallel/tensor.py's split layers carry one): its recipe,
    the tp group, and which of its operands are split over it: a column-parallel layer's weight and
    output gradient along N (its output features), a row-parallel one's weight and input along K."""

    rule: Recipe
    group: dist.ProcessGroup
    column: bool  # column-parallel (else row-parallel)
    gathered: Scaled | None = None  # (fsdp gathers a split layer's weight in bf16)

    def group_for(self, operand: str, along: str) -> dist.ProcessGroup | None:
        """The group `operand`'s scale must span when cast along `along` (M, K or N): where the
        operand is split, the whole of it for tensorwise, the split dimension for rowwise."""
        split = {"weight": "N", "grad": "N"} if self.column else {"weight": "K", "input": "K"}
        if operand not in split or (self.rule.rowwise and along != split[operand]):
            return None
        return self.group


class Float8Linear(nn.Linear):
    """nn.Linear computing in float8 as `rule` says; its parameters, names and state are nn.Linear's.
    `gathered`: its weight cast to float8 (tensorwise) as fsdp's float8 all-gather delivers it,
    while the unit is gathered (parallel/float8_gather.py)."""

    rule: Recipe
    gathered: Scaled | None = None

    def group_for(self, operand: str, along: str) -> None:
        """A whole layer's operands are whole on this rank: no scale spans ranks."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return float8_linear(x, self.weight, self.bias, self)

    def extra_repr(self) -> str:
        kind = "rowwise" if self.rule.rowwise else "tensorwise"
        return f"{super().extra_repr()}, float8={kind}"


def float8_split(layer: nn.Module, group: dist.ProcessGroup, column: bool) -> Float8Split | None:
    """What a tensor-parallel split of `layer` computes in float8 with, if `layer` was a float8 one."""
    return Float8Split(layer.rule, group, column) if isinstance(layer, Float8Linear) else None


def float8_layers(model: nn.Module, block: str) -> tuple[list[nn.Linear], list[str]]:
    """The linear layers of `model`'s blocks (modules of class `block`) that compute in float8, and
    the names of those left out for their sizes (routers are left out silently: they are no matmul
    float8 is for)."""
    chosen, left_out, seen = [], [], set()
    for name, module in model.named_modules():
        if type(module).__name__ != block:
            continue
        for inner, layer in module.named_modules():
            if type(layer) is not nn.Linear or inner.rsplit(".", 1)[-1] in ROUTER_NAMES or id(layer) in seen:
                continue
            seen.add(id(layer))
            if layer.in_features % KERNEL_MULTIPLE or layer.out_features % KERNEL_MULTIPLE:
                left_out.append(".".join(filter(None, (name, inner))))
            else:
                chosen.append(layer)
    return chosen, left_out


def convert_to_float8(model: nn.Module, block: str, name: str) -> dict[str, object]:
    """Make the linear layers of `model`'s blocks (class `block`) compute in float8 by recipe `name`,
    in place: each stays the same module over the same parameters (whatever holds them, optimizer
    or sharding, still does), its forward float8's. Returns the recipe, how many layers compute in
    float8 and the names of those left out for their sizes."""
    rule = recipe(name)
    chosen, left_out = float8_layers(model, block)
    for layer in chosen:
        layer.__class__ = Float8Linear
        layer.rule = rule
    return {"recipe": name, "layers": len(chosen), "left_out": left_out}
