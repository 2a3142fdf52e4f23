"""The plain model's weights as one safetensors file, written one tensor at a time.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's dtype,
shape and byte range; `__metadata__`, here naming each tied weight's other names) and the tensors'
bytes back to back. Everything in the header is known before any tensor is: the names, shapes and
dtypes are the plain model's, built on the meta device. So the file is written as its tensors
arrive, each gathered (or read from a checkpoint), written and dropped: the writer holds one
tensor, never the model. That is how a run's final weights are saved (`save_weights`, every rank
of a strategy taking part) and how `shardwise consolidate` turns a checkpoint into one file.

The file is the one `safetensors.torch.save_model` writes for the same model, byte for byte: a
tied weight under its alphabetically first name (the others in the metadata, which `load_model`
reads to tie them again), tensors ordered by element size, largest first, then by name (so each
starts aligned to its size), the header padded with spaces to a multiple of 8 bytes. It is
written to a temporary file beside the target and renamed into place once complete, so a failed
write leaves what was there before.
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
    name: str  # its name in the model as strategies and checkpoints hold it: a tied weight's first
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * int(torch.Size(self.shape).numel())


@dataclass(frozen=True)
class WeightsLayout:
    """What the file of a model holds, in the order it holds it."""

    entries: list[Entry]
    tied: dict[str, str]  # a tied weight's other names -> its key in the file

    @classmethod
    def of(cls, model: nn.Module, tied_copies: bool = False) -> WeightsLayout:
        """The layout of `model`'s state dict (a meta-built model will do: only shapes are read).
        `tied_copies`: a tied weight stored under each of its names, so that the file's keys are the
        state dict's (what `model.load_state_dict(load_file(...))` takes), rather than once."""
        names: dict[int, list[str]] = {}
        tensors = model.state_dict(keep_vars=True)
        for name, tensor in tensors.items():
            if tensor.dtype not in DTYPES:
                raise WeightsFileError(f"{name}: dtype {tensor.dtype} has no safetensors name")
            names.setdefault(id(tensor), []).append(name)
        entries, tied = [], {}
        for each in names.values():
            first = tensors[each[0]]
            kept = each if tied_copies else [min(each)]
            tied.update({other: kept[0] for other in each if other not in kept})
            entries += [Entry(key, each[0], tuple(first.shape), first.dtype) for key in kept]
        entries.sort(key=lambda e: (-e.dtype.itemsize, e.key))
        return cls(entries, tied)

    def header(self) -> bytes:
        """The header length and the header, padded to 8 bytes, as `save_model` writes them."""
        header: dict[str, object] = {"__metadata__": dict(sorted(self.tied.items()))} if self.tied else {}
        start = 0
        for entry in self.entries:
            header[entry.key] = {"dtype": DTYPES[entry.dtype], "shape": list(entry.shape),
                                 "data_offsets": [start, start + entry.nbytes]}
            start += entry.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        return struct.pack("<Q", len(text)) + text


class WeightsWriter:
    """Writes `layout`'s file at `path`, tensor by tensor in the layout's order (`write`); `finish`
    puts the complete file in place. Used as a context manager, an exception discards the file."""

    def __init__(self, path: Path, layout: WeightsLayout) -> None:
        self.path = Path(path)
        self.layout = layout
        self.tmp = self.path.with_name(f".{self.path.name}.tmp")
        self.written = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(self.tmp, "wb")
        self.file.write(layout.header())

    def write(self, tensor: torch.Tensor) -> None:
        """The next entry's tensor (any dtype and device: it is cast to the entry's, on the host)."""
        entry = self.layout.entries[self.written]
        if tuple(tensor.shape) != entry.shape:
            raise WeightsFileError(f"{entry.key}: got a tensor of shape {list(tensor.shape)}, the model's is "
                                   f"{list(entry.shape)}")
        host = tensor.detach().to("cpu", entry.dtype).contiguous()
        self.file.write(host.reshape(-1).view(torch.uint8).numpy().data)
        self.written += 1

    def finish(self) -> None:
        if self.written != len(self.layout.entries):
            raise WeightsFileError(f"{self.path}: {self.written} of {len(self.layout.entries)} tensors written")
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


def save_weights(strategy: Strategy, layout: WeightsLayout, path: Path) -> None:
    """Write the plain model's weights, as `strategy`'s ranks hold them, to `path` (rank 0 writes):
    each tensor gathered whole on rank 0 alone (`Strategy.full_tensors`), written and dropped.
    `layout`: the plain model's (`WeightsLayout.of` the model before the strategy wrapped it, or
    one built on the meta device). Every rank calls it. A write that fails (a full disk) raises
    WeightsFileError on every rank, leaving whatever `path` held before."""
    tensors = _trimmed(strategy.full_tensors([entry.name for entry in layout.entries]))
    problem = None
    if strategy.ctx.is_main:
        problem = _write_all(path, layout, tensors)
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


def _write_all(path: Path, layout: WeightsLayout, tensors: Iterator[torch.Tensor | None]) -> str | None:
    """Write every tensor; on an OSError go on taking them (the other ranks are still gathering) and
    return the error."""
    try:
        writer = WeightsWriter(path, layout)
    except OSError as error:
        writer, problem = None, str(error)
    else:
        problem = None
    for tensor in tensors:
        if writer is not None:
            try:
                writer.write(tensor)
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
