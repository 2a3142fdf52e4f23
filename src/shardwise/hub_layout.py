"""How the Hugging Face Hub stores a transformers model's tensors, where that is not how the model
holds them.

transformers says so itself, family by family (its `conversion_mapping.py`): what `from_pretrained`
does to a checkpoint's keys as it loads it, and what `save_pretrained` undoes as it saves. Of two
kinds:
- a renaming: a tensor kept whole under another name (Mixtral's checkpoints call the model's `mlp`
  `block_sparse_moe`; EXAONE's keep GPT-2's names);
- a converter: one model tensor made of several of the Hub's. transformers 5 holds a
  Mixture-of-Experts layer's experts stacked, `mlp.experts.gate_up_proj` of [E, 2I, H] and
  `mlp.experts.down_proj` of [E, H, I], where the Hub keeps one matrix per expert and projection
  (`MergeModulelist` along the experts, then `Concatenate` of gate and up).

`HubLayout.of(model)` takes the family's conversion from transformers, as `save_pretrained` applies
it (its legacy renamings, which only read old checkpoints, left out), and `layout.pieces(name,
shape)` says which of the Hub's tensors hold a model tensor and where each sits in it. Weights are
read through it (weights.py: a pretrained Qwen3-MoE's experts land in the stacked tensors, each rank
reading its own) and written through it (weights_file.py: a run's final weights are what
`save_pretrained` writes). A converter whose parts are not boxes of the model tensor (a transpose, an
interleave) cannot be read or written a part at a time: `HubLayout.of` refuses such a family
(`UnsupportedLayout`), naming it, before anything runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


class UnsupportedLayout(ValueError):
    """A family whose Hub checkpoints shardwise cannot read or write a part at a time."""


@dataclass(frozen=True)
class Piece:
    """One of the Hub's tensors, and the part of a model tensor it holds: from `offsets`, of
    `sizes` (both in the model tensor's dimensions); `expert`: the part is one expert's, which the
    file holds without the experts' dimension. `rows`: the other way round, the Hub's tensor holds
    the whole model tensor and others (a fused projection): its first row there, and the Hub
    tensor's rows."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    expert: bool = False
    rows: tuple[int, int] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The Hub tensor's shape in the file."""
        if self.rows is not None:
            return (self.rows[1], *self.sizes[1:])
        return self.sizes[1:] if self.expert else self.sizes

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """Its part of the model's `tensor`, shaped as the file holds it."""
        part = tensor[tuple(slice(o, o + s) for o, s in zip(self.offsets, self.sizes, strict=True))]
        return part.squeeze(0) if self.expert else part


def model_type(model: nn.Module) -> str | None:
    """transformers' model_type of `model` (a transformers model, or shardwise's wrapper of one:
    models/hf.py), or None for any other model."""
    config = getattr(getattr(model, "lm", model), "config", None)
    return getattr(config, "model_type", None)


@dataclass(frozen=True)
class HubLayout:
    """A transformers family's conversion, reversed: the model's names to the Hub's."""

    model_type: str
    renamings: tuple[Any, ...]  # transformers' WeightRenaming, reversed, in the order save_pretrained applies them
    converters: tuple[tuple[Any, Any], ...]  # (a WeightConverter as from_pretrained applies it, its reverse)
    shapes: dict[str, tuple[int, ...]]  # the model's tensors' (a fused tensor's parts are its neighbours)

    @classmethod
    def of(cls, model: nn.Module) -> HubLayout | None:
        """The layout of `model`'s family (None for a model that is no transformers model), checked
        against every tensor of `model` (one built on the meta device will do)."""
        kind = model_type(model)
        if kind is None:
            return None
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightConverter

        inner = getattr(model, "lm", model)
        # What save_pretrained reverts, in its order: a model made here, not loaded, has no prefix to restore.
        forward = [t for t in get_model_conversion_mapping(inner, add_legacy=False) if not isinstance(t, PrefixChange)]
        pairs = [(t, t.reverse_transform()) for t in reversed(forward)]
        shapes = {name: tuple(tensor.shape) for name, tensor in inner.state_dict(keep_vars=True).items()}
        layout = cls(kind, tuple(back for t, back in pairs if not isinstance(t, WeightConverter)),
                     tuple((t, back) for t, back in pairs if isinstance(t, WeightConverter)), shapes)
        for name, shape in shapes.items():
            layout.pieces(name, shape)
        return layout

    def pieces(self, name: str, shape: tuple[int, ...]) -> list[Piece]:
        """The Hub's tensors that hold the model tensor `name` (transformers' own name) of `shape`;
        [] where the Hub keeps it whole under `name`."""
        for forward, back in self.converters:
            renamed, matched = back.rename_source_key(name)
            if matched is not None:
                return [dataclasses.replace(piece, key=self._renamed(piece.key))
                        for piece in self._parts(forward, back, name, renamed, matched, shape)]
        key = self._renamed(name)
        return [] if key == name else [Piece(key, (0,) * len(shape), shape)]

    def _renamed(self, key: str) -> str:
        for renaming in self.renamings:
            key, _ = renaming.rename_source_key(key)
        return key

    def _parts(self, forward: Any, back: Any, name: str, renamed: str, matched: str,
               shape: tuple[int, ...]) -> list[Piece]:
        """The parts a converter makes `name` of, named as the Hub does before the renamings: the
        experts' matrices of a stacked tensor (`*` in the Hub's names, the expert's index), and
        equal slices of a concatenation (one of the Hub's names each, in order); or the one Hub
        tensor that holds it with its neighbours (`_fused`)."""
        ops = list(forward.operations)
        if len(ops) == 1 and type(ops[0]).__name__ in ("Chunk", "Split") and ops[0].dim == 0 and \
                getattr(ops[0], "num_shards_attribute", None) is None:
            return [self._fused(back, name, renamed, matched, shape, equal=type(ops[0]).__name__ == "Chunk")]
        merged = bool(ops) and type(ops[0]).__name__ == "MergeModulelist" and ops[0].dim == 0
        rest = ops[1:] if merged else ops
        sources = back.target_patterns  # the Hub's names, `*` standing for an expert's index
        concatenated = len(rest) == 1 and type(rest[0]).__name__ == "Concatenate" and \
            getattr(rest[0], "num_shards_attribute", None) is None
        if not (rest == [] and merged or concatenated) or sources[0] not in renamed:
            raise UnsupportedLayout(
                f"model_type {self.model_type!r}: the Hub keeps {name} as transformers makes it with "
                f"{' then '.join(type(op).__name__ for op in ops)}, which shardwise cannot read or write a part at "
                "a time (it reads stacked experts, equal concatenated parts and projections fused along their rows)")
        names = [renamed.replace(sources[0], source, 1) for source in sources]
        dim = rest[0].dim if concatenated else None
        if dim is not None and shape[dim] % len(names):
            raise UnsupportedLayout(f"model_type {self.model_type!r}: {name} of {list(shape)} does not split into "
                                    f"{len(names)} equal parts along dimension {dim}")
        part = shape[dim] // len(names) if dim is not None else None
        pieces = []
        for e in range(shape[0]) if merged else [None]:
            for i, each in enumerate(names):
                offsets, sizes = [0] * len(shape), list(shape)
                if merged:
                    offsets[0], sizes[0] = e, 1
                if dim is not None:
                    offsets[dim], sizes[dim] = i * part, part
                key = each.replace("*", str(e)) if merged else each
                pieces.append(Piece(key, tuple(offsets), tuple(sizes), expert=merged))
        return pieces

    def _fused(self, back: Any, name: str, renamed: str, matched: str, shape: tuple[int, ...],
               equal: bool) -> Piece:
        """The Hub tensor `renamed` that holds model tensor `name` and its neighbours (the converter's
        other parts: Sarvam's q, k and v in one `query_key_value`) one after another along their
        rows, and where `name`'s rows sit in it."""
        neighbours = [name.replace(matched, part, 1) for part in back.source_patterns]
        shapes = [self.shapes.get(each) for each in neighbours]
        if any(s is None or s[1:] != shape[1:] for s in shapes) or equal and len({s[0] for s in shapes}) > 1:
            raise UnsupportedLayout(f"model_type {self.model_type!r}: the Hub keeps {name} in {renamed} with "
                                    f"{', '.join(neighbours)}, whose shapes ({shapes}) do not stack along their rows")
        first = sum(s[0] for s in shapes[:back.source_patterns.index(matched)])
        return Piece(renamed, (0,) * len(shape), shape, rows=(first, sum(s[0] for s in shapes)))
