"""How the Hugging Face Hub stores a transformers model's tensors, where that is not how the model
holds them.

transformers 5 holds each Mixture-of-Experts layer's experts stacked, two tensors for all of them:
`mlp.experts.gate_up_proj` of [E, 2I, H] (each expert's gate rows, then its up rows) and
`mlp.experts.down_proj` of [E, H, I]. The checkpoints on the Hub, and what `save_pretrained`
writes, keep one matrix per expert and projection, as the families were published
(transformers' `conversion_mapping.py` stacks them as it loads and splits them as it saves).
Mixtral's checkpoints also name the layer `block_sparse_moe` and its projections w1 (gate),
w3 (up) and w2 (down).

`pieces(name, shape, model_type)` says which of the Hub's tensors hold a model tensor and where
each sits in it. Weights are read through it (weights.py: a pretrained Qwen3-MoE's experts land
in the stacked tensors) and written through it (weights_file.py: a run's final weights are
what `save_pretrained` writes). Every other tensor the Hub keeps under the model's own name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

# transformers' model_type -> the MoE layer's name on the Hub, and its gate, up and down projections'.
_EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "deepseek_v3": ("mlp", "gate_proj", "up_proj", "down_proj"),
}
_STACKED = re.compile(r"(?P<block>.*)\.mlp\.experts\.(?P<which>gate_up_proj|down_proj)")
_ROUTER = re.compile(r"(?P<block>.*)\.mlp\.gate\.weight")


@dataclass(frozen=True)
class Piece:
    """One of the Hub's tensors, and the part of a model tensor it holds: from `offsets`, of
    `sizes` (both in the model tensor's dimensions); `expert`: the part is one expert's, which the
    file holds without the experts' dimension."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    expert: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        """Its shape in the file."""
        return self.sizes[1:] if self.expert else self.sizes

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """Its part of the model's `tensor`, shaped as the file holds it."""
        part = tensor[tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes, strict=True))]
        return part.squeeze(0) if self.expert else part


def pieces(name: str, shape: tuple[int, ...], model_type: str | None) -> list[Piece]:
    """The Hub's tensors that hold the model tensor `name` (transformers' own name) of `shape`, for
    a model of transformers' `model_type`; [] where the Hub keeps it whole under `name`."""
    if model_type not in _EXPERT_NAMES:
        return []
    layer, gate, up, down = _EXPERT_NAMES[model_type]
    stacked = _STACKED.fullmatch(name)
    if stacked:
        experts, rows, columns = shape
        prefix = f"{stacked['block']}.{layer}.experts"
        if stacked["which"] == "down_proj":
            return [Piece(f"{prefix}.{e}.{down}.weight", (e, 0, 0), (1, rows, columns), expert=True)
                    for e in range(experts)]
        half = rows // 2
        return [Piece(f"{prefix}.{e}.{projection}.weight", (e, start, 0), (1, half, columns), expert=True)
                for e in range(experts) for projection, start in ((gate, 0), (up, half))]
    router = _ROUTER.fullmatch(name)
    if router and layer != "mlp":
        return [Piece(f"{router['block']}.{layer}.gate.weight", (0,) * len(shape), tuple(shape))]
    return []


def model_type(model: torch.nn.Module) -> str | None:
    """transformers' model_type of `model` (a transformers model, or shardwise's wrapper of one:
    models/hf.py), or None for any other model."""
    inner = getattr(model, "lm", model)
    config = getattr(inner, "config", None)
    return getattr(config, "model_type", None)
