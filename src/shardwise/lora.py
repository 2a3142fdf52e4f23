"""Low-rank adapters (LoRA, Hu et al. 2021): fine-tune a model by training, beside each target
linear layer W, two small matrices A [r, in] and B [out, r] whose product adds to its output,

    y = W x + (alpha / r) B A dropout(x),

while every weight of the model stays frozen: no gradients, no optimizer state, nothing for the
data-parallel strategies to average or shard but the adapters.

`apply_lora` adds an `Adapter` as the child `lora` of each target layer and a forward hook on the
layer that adds its update, so the layer keeps its class, its parameter names and its place in the
model: pretrained weights load as they would without adapters, and a strategy cuts, shards and
recomputes the model as it always does (the adapters of a block are in its unit). Adapters are
initialised as peft initialises them, A Kaiming-uniform and B zero, so the model starts as the
pretrained one; each adapter's values come from the seed and its name alone (as materialise.py
makes every tensor), whatever the strategy, and a meta-built model's adapters are made with it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.materialise import seed_for, seeded
from shardwise.models.hf import decoder_layer_class
from shardwise.models.plans import PlanError, matches, plan_for
from shardwise.nf4 import dequantize


class LoraError(ValueError):
    """Adapters that cannot be made as asked; the message names the target and what is wrong."""


class Adapter(nn.Module):
    """One linear layer's low-rank update: `A` [rank, in], `B` [out, rank], scaled by alpha / rank."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, dropout: float,
                 device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.A = nn.Parameter(torch.empty(rank, in_features, device=device, dtype=dtype))
        self.B = nn.Parameter(torch.empty(out_features, rank, device=device, dtype=dtype))
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def init_module(self, module: nn.Module, name: str) -> None:
        """peft's initialisation: A as nn.Linear initialises its weight, B zero (the update starts at
        zero). materialise.py calls it for a meta-built model, under the adapter's own generator."""
        if module is self:
            nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))
            nn.init.zeros_(self.B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(self.dropout(x), self.A), self.B) * self.scale


def _add_update(layer: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output + layer.lora(args[0])


def default_targets(model: nn.Module) -> tuple[str, ...]:
    """The attention and MLP projections of the model's family, relative to a block: every column-
    and row-parallel layer of its parallel plan's regions (models/plans.py), or for a transformers
    family without one of ours the linear layers of its blocks that its own tensor-parallel plan
    (`base_model_tp_plan`) splits, else every linear layer of its blocks."""
    try:
        plan = plan_for(model)
    except PlanError:
        plan = None
    if plan is None or plan.where_present:  # no plan, or transformers' own
        found = transformers_split_layers(model) or block_linear_layers(model)
        if found:
            return found
        raise LoraError(f"lora.targets: {type(model).__name__} has no parallel plan to take the attention and MLP "
                        "projections from; name the layers that get adapters") from None
    return tuple(f"{region.module}.{name}" for region in plan.regions
                 for name in (*(column.name for column in region.columns), region.row))


def block_linear_layers(model: nn.Module) -> tuple[str, ...]:
    """Every nn.Linear layer of a transformers model's repeated layer (its `_no_split_modules`),
    relative to it: peft's `all-linear` within the blocks. () where it declares none."""
    block = decoder_layer_class(model)
    first = next((module for module in model.modules() if type(module).__name__ == block), None)
    if first is None:
        return ()
    return tuple(name for name, module in first.named_modules() if type(module) is nn.Linear)


def transformers_split_layers(model: nn.Module) -> tuple[str, ...]:
    """The nn.Linear layers of a transformers model's blocks that its family's `base_model_tp_plan`
    splits (`layers.*.self_attn.q_proj`: colwise), relative to a block; () without a plan."""
    config = getattr(getattr(model, "lm", model), "config", None)
    plan = getattr(config, "base_model_tp_plan", None) or {}
    linear = [name for name, module in model.named_modules() if type(module) is nn.Linear]
    found = []
    for pattern in plan:
        block, _, inside = pattern.partition(".*.")
        if inside and any(matches(name, f"{block.rpartition('.')[2]}.*.{inside}") for name in linear):
            found.append(inside)
    return tuple(dict.fromkeys(found))


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float, targets: list[str] | None,
               seed: int, train: list[str] | None = None) -> list[str]:
    """Freeze `model` and give each linear layer that `targets` name (default: `default_targets`) an
    adapter of `rank`; return the adapted layers' names. The modules `train` names (a new head, peft's
    `modules_to_save`) train whole beside the adapters. Adapters of a real model are initialised
    here, from `seed` and their names; those of a meta-built one stay on meta for the materialiser."""
    patterns = list(targets) if targets is not None else list(default_targets(model))
    named = [(name, module) for name, module in model.named_modules() if name]
    chosen = [(name, module) for name, module in named if any(matches(name, p) for p in patterns)]
    for pattern in patterns:
        if not any(matches(name, pattern) for name, _ in chosen):
            linear = sorted({name.rpartition(".")[2] for name, m in named if isinstance(m, nn.Linear)})
            raise LoraError(f"lora.targets: {pattern!r} matches no module of {type(model).__name__}; its linear "
                            f"layers are named {', '.join(linear)}")
    whole = [(name, module) for name, module in named if any(matches(name, p) for p in train or ())]
    for pattern in train or ():
        if not any(matches(name, pattern) for name, _ in whole):
            raise LoraError(f"lora.train: {pattern!r} matches no module of {type(model).__name__}")
    for name, module in chosen:
        if type(module) is not nn.Linear:
            raise LoraError(f"lora.targets: {name} is a {type(module).__name__}; adapters go beside nn.Linear layers")
        if not 0 < rank <= min(module.in_features, module.out_features):
            raise LoraError(f"lora.rank = {rank}: must be at least 1 and at most {name}'s smaller dimension "
                            f"({module.in_features} in, {module.out_features} out)")
    for param in model.parameters():
        param.requires_grad_(False)
    for _, module in whole:
        module.requires_grad_(True)
    for name, module in chosen:
        weight = module.weight
        module.lora = Adapter(module.in_features, module.out_features, rank, alpha, dropout, weight.device,
                              weight.dtype)
        if not weight.is_meta:
            with seeded(seed_for(seed, f"{name}.lora"), weight.device), torch.no_grad():
                module.lora.init_module(module.lora, f"{name}.lora")
        module.register_forward_hook(_add_update)
    return [name for name, _ in chosen]


def is_adapter(name: str) -> bool:
    """Whether state entry `name` is an adapter's (pretrained weights have none: they keep their init)."""
    return name.endswith((".lora.A", ".lora.B"))


def merged(full_tensors: Callable[[list[str]], Iterator[torch.Tensor | None]], names: list[str],
           held: set[str], scale: float) -> Iterator[torch.Tensor | None]:
    """The tensors `names`, as `full_tensors` brings them whole to rank 0 one at a time (None on the
    other ranks), with each adapted layer's update merged into its weight, W + scale B A (computed
    in fp32, stored in W's dtype; an NF4 weight dequantized to the adapters'): the final weights of
    a LoRA run are the plain model's. `held`: every state entry the model has (the adapters' among
    them)."""
    for name in names:
        layer = name.removesuffix(".weight")
        adapter = (f"{layer}.lora.A", f"{layer}.lora.B")
        if name.endswith(".weight") and adapter[0] in held:
            weight, a, b = full_tensors([name, *adapter])
            if weight is not None and weight.dtype == torch.uint8:  # an NF4 base (QLoRA)
                weight = dequantize(weight, a.shape[1], a.dtype)
            yield None if weight is None else (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)
        else:
            yield from full_tensors([name])
