"""The plain model's weights as one safetensors file, written one tensor at a time.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's dtype,
shape and byte range; `__metadata__`) and the tensors' bytes back to back. Everything in the
header is known before any tensor is: the names, shapes and dtypes are the plain model's, built
on the meta device. So the file is written as its tensors arrive, each gathered (or read from a
checkpoint), written at its place and dropped: the writer holds one tensor, never the model.
That is how a run's final weights are saved (`save_weights`, every rank of a strategy taking
part) and how `shardwise consolidate` turns a checkpoint into one file.

Two layouts, each byte for byte the file a library writes for the same model:
- `WeightsLayout.of`: what `safetensors.torch.save_model` writes: the state dict's keys, a tied
  weight under its alphabetically first name (the others in the metadata, which `load_model`
  reads to tie them again);
- `WeightsLayout.transformers`: what transformers' `save_pretrained` writes for a transformers
  model (shardwise's hf-* models hold one under `lm.`): transformers' own names, a tied weight
  under its first name (the embedding: the head is tied to it as the model loads), an MoE layer's
  stacked experts as the Hub's one matrix per expert (hub_layout.py), metadata `format: pt`.

Both order the tensors by element size, largest first, then by name (so each starts aligned to
its size) and pad the header with spaces to a multiple of 8 bytes. The file is written to a
temporary file beside the target and renamed into place once complete, so a failed write leaves
what was there before.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from shardwise.hub_layout import HubLayout, Piece
from shardwise.lora import merged
from shardwise.memory import return_free_memory

if TYPE_CHECKING:
    from shardwise.strategies.base import Strategy

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}


class WeightsFileError(RuntimeError):
    """The weights file could not be written (the disk's own words)."""


@dataclass(frozen=True)
class Entry:
    """One tensor of the file."""

    key: str  # its name in the file
    name: str  # the model tensor it holds (or holds part of), by the name strategies and checkpoints give it
    shape: tuple[int, ...]  # in the file
    dtype: torch.dtype
    piece: Piece | None = None  # the part of the model tensor it holds; None: all of it

    @property
    def nbytes(self) -> int:
        """The file tensor's bytes (a fused tensor's: all its entries')."""
        return self.dtype.itemsize * int(torch.Size(self.shape).numel())

    @property
    def within(self) -> int:
        """Where its bytes start in the file tensor's: a fused tensor's part's at its first row."""
        if self.piece is None or self.piece.rows is None:
            return 0
        return self.piece.rows[0] * self.nbytes // self.shape[0]

    @property
    def part_shape(self) -> tuple[int, ...]:
        """What it is given of the model tensor: a fused tensor's part is a whole model tensor."""
        return self.piece.sizes if self.piece is not None and self.piece.rows is not None else self.shape

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """What this entry holds of the model's `tensor`."""
        return tensor if self.piece is None else self.piece.of(tensor)


@dataclass(frozen=True)
class WeightsLayout:
    """What the file of a model holds, in the order it holds it."""

    entries: list[Entry]
    metadata: dict[str, str]  # the header's __metadata__ (none when empty)

    @classmethod
    def of(cls, model: nn.Module, tied_copies: bool = False) -> WeightsLayout:
        """The layout `save_model` writes for `model`'s state dict (a meta-built model will do:
        only shapes are read). `tied_copies`: a tied weight stored under each of its names, so
        that the file's keys are the state dict's (what `model.load_state_dict(load_file(...))`
        takes), rather than once."""
        entries, tied = [], {}
        for each, tensor in _named_once(model.state_dict(keep_vars=True)):
            kept = each if tied_copies else [min(each)]
            tied.update({other: kept[0] for other in each if other not in kept})
            entries += [Entry(key, each[0], tuple(tensor.shape), tensor.dtype) for key in kept]
        return cls(_in_file_order(entries), dict(sorted(tied.items())))

    @classmethod
    def transformers(cls, model: nn.Module, hub: HubLayout) -> WeightsLayout:
        """The layout `save_pretrained` writes for a transformers `model`, or for the one
        shardwise's hf-* wrapper holds as `lm` (whose names the entries' `name` keep); `hub`: its
        family's (`HubLayout.of(model)`)."""
        inner, prefix = (model.lm, "lm.") if isinstance(getattr(model, "lm", None), nn.Module) else (model, "")
        entries = []
        for each, tensor in _named_once(inner.state_dict(keep_vars=True)):
            held = hub.pieces(each[0], tuple(tensor.shape))
            name = prefix + each[0]
            entries += [Entry(p.key, name, p.shape, tensor.dtype, p) for p in held] if held else \
                [Entry(each[0], name, tuple(tensor.shape), tensor.dtype)]
        return cls(_in_file_order(entries), {"format": "pt"})

    def names(self) -> list[str]:
        """The model tensors the file holds, each once, in the file's order."""
        return list(dict.fromkeys(entry.name for entry in self.entries))

    def tensors(self) -> list[Entry]:
        """The file's tensors, each by its first entry (a fused tensor has one per model tensor)."""
        return list({entry.key: entry for entry in reversed(self.entries)}.values())[::-1]

    def header(self) -> bytes:
        """The header length and the header, padded to 8 bytes, as safetensors writes them."""
        header: dict[str, object] = {"__metadata__": self.metadata} if self.metadata else {}
        start = 0
        for entry in self.tensors():
            header[entry.key] = {"dtype": DTYPES[entry.dtype], "shape": list(entry.shape),
                                 "data_offsets": [start, start + entry.nbytes]}
            start += entry.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        return struct.pack("<Q", len(text)) + text


def _named_once(state: dict[str, torch.Tensor]) -> list[tuple[list[str], torch.Tensor]]:
    """Each tensor of a state dict once, with all its names (several for a tied weight), in order."""
    names: dict[int, list[str]] = {}
    for name, tensor in state.items():
        if tensor.dtype not in DTYPES:
            raise WeightsFileError(f"{name}: dtype {tensor.dtype} has no safetensors name")
        names.setdefault(id(tensor), []).append(name)
    return [(each, state[each[0]]) for each in names.values()]


def _in_file_order(entries: list[Entry]) -> list[Entry]:
    return sorted(entries, key=lambda e: (-e.dtype.itemsize, e.key))


class WeightsWriter:
    """Writes `layout`'s file at `path`, a model tensor at a time in any order (`write`); `finish`
    puts the complete file in place. Used as a context manager, an exception discards the file."""

    def __init__(self, path: Path, layout: WeightsLayout) -> None:
        self.path = Path(path)
        self.layout = layout
        self.tmp = self.path.with_name(f".{self.path.name}.tmp")
        self.written: set[tuple[str, str]] = set()  # (key, model tensor) of each entry written
        header = layout.header()
        self.places: dict[str, list[tuple[Entry, int]]] = {}
        starts, start = {}, len(header)
        for entry in layout.tensors():
            starts[entry.key] = start
            start += entry.nbytes
        for entry in layout.entries:
            self.places.setdefault(entry.name, []).append((entry, starts[entry.key] + entry.within))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.tmp, "wb")
        self.file.write(header)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The model tensor `name` (any dtype and device: cast to the file's, on the host): each
        entry that holds it, or part of it, at its place in the file."""
        for entry, start in self.places[name]:
            part = entry.of(tensor)
            if tuple(part.shape) != entry.part_shape:
                raise WeightsFileError(f"{entry.key}: got a tensor of shape {list(part.shape)}, the model's is "
                                       f"{list(entry.part_shape)}")
            host = part.detach().to("cpu", entry.dtype).contiguous()
            self.file.seek(start)
            self.file.write(host.reshape(-1).view(torch.uint8).numpy().data)
            self.written.add((entry.key, entry.name))

    def finish(self) -> None:
        if len(self.written) != len(self.layout.entries):
            raise WeightsFileError(f"{self.path}: {len(self.written)} of {len(self.layout.entries)} tensors written")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> WeightsWriter:
        return self

    def __exit__(self, kind: object, error: object, trace: object) -> None:
        if kind is None:
            self.finish()
        else:
            self.discard()


def final_layout(model: nn.Module, hub: HubLayout | None) -> WeightsLayout:
    """The layout of a model's final weights: `save_pretrained`'s for a transformers model (`hub`, its
    family's Hub layout, what `ModelNames.of` found; what `from_pretrained` loads beside its
    config.json), else (`hub` None) `save_model`'s."""
    return WeightsLayout.transformers(model, hub) if hub is not None else WeightsLayout.of(model)


def save_weights(strategy: Strategy, layout: WeightsLayout, path: Path) -> None:
    """Write the plain model's weights, as `strategy`'s ranks hold them, to `path` (rank 0 writes):
    each tensor gathered whole on rank 0 alone (`Strategy.view.full_tensors`, state_view.py), written
    and dropped; under LoRA, each adapted weight with its adapter's update merged in. `layout`: the
    plain model's (`final_layout` of the model before the strategy wrapped it, or of one built on the
    meta device). Every rank calls it. A write that fails (a full disk) raises WeightsFileError on
    every rank, leaving whatever `path` held before."""
    names = layout.names()
    view, lora = strategy.view, strategy.lora
    whole = view.full_tensors(names) if lora is None else merged(view.full_tensors, names, set(view.names()),
                                                                   lora.alpha / lora.rank)
    tensors = _trimmed(whole)
    problem = None
    if strategy.ctx.is_main:
        problem = _write_all(path, layout, names, tensors)
    else:
        for _ in tensors:  # take part in every gather
            pass
    problem = strategy.ctx.all_gather_object(problem)[0]
    if problem is not None:
        raise WeightsFileError(f"could not write {path}: {problem}")


def _trimmed(tensors: Iterator[torch.Tensor | None]) -> Iterator[torch.Tensor | None]:
    """`tensors`, the allocator's free memory handed back before each is gathered: the pieces of
    a tensor smaller than glibc maps on its own (shards, tensor-parallel parts), freed, would
    otherwise stay in its heaps and add up from one tensor to the next."""
    while True:
        return_free_memory()
        try:
            yield next(tensors)
        except StopIteration:
            return


def _write_all(path: Path, layout: WeightsLayout, names: list[str], tensors: Iterator[torch.Tensor]) -> str | None:
    """Write every tensor (`names`' in turn); on an OSError go on taking them (the other ranks are
    still gathering) and return the error. Each is dropped before the next is gathered (a zip of
    names and tensors would hold the last one while it takes the next)."""
    try:
        writer = WeightsWriter(path, layout)
    except OSError as error:
        writer, problem = None, str(error)
    else:
        problem = None
    for name in names:
        tensor = next(tensors)
        if writer is not None:
            try:
                writer.write(name, tensor)
            except OSError as error:
                writer.discard()
                writer, problem = None, str(error)
        del tensor  # before the next is gathered
    if writer is not None:
        try:
            writer.finish()
        except OSError as error:
            writer.discard()
            problem = str(error)
    return problem
