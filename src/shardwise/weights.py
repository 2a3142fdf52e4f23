"""Pretrained weights from safetensors files, read straight into what each rank holds.

`load_weights(strategy, path)` takes a `.safetensors` file or a directory of them (what
`from_pretrained` reads: `model.safetensors`, or the shards an index names) and fills every tensor
the strategy holds, by the plain model's names (`Strategy.view.state_dict()`, state_view.py: whole
tensors, DTensors where it shards or splits them). The reading is DCP's, through its reader of Hugging Face
safetensors: each file is memory-mapped, and each rank reads only the part of each tensor it
holds (`get_slice`), one tensor at a time: `fsdp` on N ranks reads 1/N of each, and no rank ever
holds a whole copy of the model.

Names: the file's keys are the model's names less a common prefix, found as the one that matches
the most (`lm.` for shardwise's hf-* models, whose transformers model sits under `lm`;
`lm.transformer.` for GPT-2 files that name `h.0...` as the Hub's do). Every parameter must be in
the file, in its shape; a buffer the file lacks (rotary frequencies, which transformers never
saves) keeps its initial value; the file's tensors the model lacks are ignored (and counted).
A transformers MoE model's experts, which the Hub keeps one matrix per expert, are read into the
model's stacked tensors from those matrices (hub_layout.py), each rank reading its experts' rows.

`check_weights` holds the files' headers to a model built on the meta device: what `shardwise
train` does before any worker starts.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint._hf_utils import _HFStorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

from shardwise.hub_layout import HubLayout, Piece
from shardwise.lora import is_adapter
from shardwise.nf4 import quantize, quantized

if TYPE_CHECKING:
    from shardwise.strategies.base import Strategy


class WeightsError(ValueError):
    """Weights that cannot be loaded into this model: missing, or of another shape."""


def weight_files(path: Path) -> list[Path]:
    """The safetensors files `path` names: itself, or every `*.safetensors` in the directory."""
    if path.is_file():
        if path.suffix != ".safetensors":
            raise WeightsError(f"weights {path}: not a .safetensors file")
        return [path]
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise WeightsError(f"weights {path}: no .safetensors file in the directory")
        return files
    raise WeightsError(f"weights {path}: no such file or directory")


def stored_shapes(files: list[Path]) -> dict[str, tuple[list[int], Path]]:
    """Every tensor's shape in `files` (read from their headers), and the file holding it."""
    from safetensors import safe_open

    shapes: dict[str, tuple[list[int], Path]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                if key in shapes:
                    raise WeightsError(f"weights: {key} is in both {shapes[key][1]} and {file}")
                shapes[key] = (list(handle.get_slice(key).get_shape()), file)
    return shapes


def common_prefix(names: list[str], keys: set[str]) -> str:
    """The prefix that, taken off the model's `names`, leaves the most of them among the file's
    `keys` (the shortest of equally good ones)."""
    candidates = {""} | {name[: i + 1] for name in names for i, c in enumerate(name) if c == "."}
    return max(sorted(candidates, key=lambda p: (len(p), p)),
               key=lambda p: sum(n.startswith(p) and n[len(p):] in keys for n in names))


def tied_names(model: nn.Module) -> dict[str, list[str]]:
    """Every name of each tensor the model holds under several (a tied weight), by its first name:
    a file may keep it under any of them (safetensors' save_model keeps the last)."""
    names: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), []).append(name)
    return {each[0]: each for each in names.values() if len(each) > 1}


@dataclass(frozen=True)
class ModelNames:
    """What a weights file may call the plain model's tensors: a tied weight by any of its names,
    and a transformers model's as the Hub keeps them (`layout`: its family's, hub_layout.py)."""

    ties: dict[str, list[str]] = field(default_factory=dict)
    layout: HubLayout | None = None

    @classmethod
    def of(cls, model: nn.Module) -> ModelNames:
        return cls(tied_names(model), HubLayout.of(model))


@dataclass
class Matched:
    """This rank's tensors by their keys in the files; those the files hold in pieces (the Hub's
    experts), with each piece's file; and what is wrong: parameters the files lack, tensors whose
    shapes differ (each named)."""

    found: dict[str, torch.Tensor] = field(default_factory=dict)
    pieced: dict[str, list[tuple[Piece, Path]]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def match(state: dict[str, torch.Tensor], parameters: set[str], stored: dict[str, tuple[list[int], Path]],
          names: ModelNames) -> Matched:
    """Find each of `state`'s tensors (the model's, by its names) among the files' `stored` tensors."""
    prefix = common_prefix(list(state), set(stored))
    matched = Matched()
    for name, tensor in state.items():
        keys = [alias[len(prefix):] for alias in names.ties.get(name, [name]) if alias.startswith(prefix)]
        key = next((key for key in keys if key in stored), None)
        if key is None:
            held = names.layout.pieces(keys[0], tuple(tensor.shape)) if keys and names.layout else []
            if held and all(piece.key in stored for piece in held):
                _match_pieces(matched, name, keys[0], tensor, held, stored)
            elif name in parameters:
                looked = ", ".join([*keys, *(p.key for p in held[:2])]) or name
                matched.problems.append(f"{name}: not in the file (looked for {looked})")
            continue
        shape, file = stored[key]
        if list(tensor.shape) != shape:
            matched.problems.append(f"{name}: {list(tensor.shape)} in the model, {shape} in {file.name} (as {key})")
            continue
        matched.found[key] = tensor
    return matched


def _match_pieces(matched: Matched, name: str, key: str, tensor: torch.Tensor, held: list[Piece],
                  stored: dict[str, tuple[list[int], Path]]) -> None:
    wrong = [piece for piece in held if stored[piece.key][0] != list(piece.shape)]
    if wrong:
        shape, file = stored[wrong[0].key]
        matched.problems.append(f"{name}: {list(wrong[0].shape)} for {wrong[0].key} in the model's "
                                f"{list(tensor.shape)}, {shape} in {file.name}")
        return
    matched.found[key] = tensor
    matched.pieced[key] = [(piece, stored[piece.key][1]) for piece in held]


def check_weights(model: nn.Module, path: str | Path) -> None:
    """Before anything runs: every parameter of `model` (built on the meta device will do) is in
    the safetensors files at `path`, in its shape, read from their headers alone. Raises
    WeightsError naming the first problems."""
    stored = stored_shapes(weight_files(Path(path)))
    parameters = {name for name, _ in model.named_parameters()}
    problems = match(model.state_dict(), parameters, stored, ModelNames.of(model)).problems
    if problems:
        raise WeightsError(f"model.weights = {str(path)!r} does not fit the model ({len(problems)} problem(s)): "
                           + "; ".join(problems[:3]))


def load_weights(strategy: Strategy, path: str | Path, names: ModelNames) -> None:
    """Fill the model `strategy` holds from the safetensors weights at `path`, in place, each rank
    reading only its part; `names`: the plain model's (`ModelNames.of`). Raises WeightsError on
    every rank, naming the tensors, if any rank's tensors are missing from the files or of another
    shape."""
    files = weight_files(Path(path))
    stored = stored_shapes(files)
    state = {name: t for name, t in strategy.view.state_dict()["model"].items() if not is_adapter(name)}
    nf4 = {name: (state[name], _float_stand_in(state[name], layer.in_features))
           for name, layer in quantized(strategy.module).items()}
    state.update({name: stand_in for name, (_, stand_in) in nf4.items()})
    parameters = {name for name, _ in strategy.view.named_parameters()}
    matched = match(state, parameters, stored, names)
    # Ranks hold different tensors (a pipeline's stages): they agree on the problems and the use.
    used = sorted({*matched.found, *(piece.key for held in matched.pieced.values() for piece, _ in held)})
    ranks = strategy.ctx.all_gather_object((matched.problems, used))
    everyone = sorted({problem for rank_problems, _ in ranks for problem in rank_problems})
    if everyone:
        raise WeightsError(f"weights {path} do not fit this model ({len(everyone)} problem(s)): "
                           + "; ".join(everyone[:5]))
    unused = set(stored) - {key for _, keys in ranks for key in keys}
    if unused and strategy.ctx.is_main:
        print(f"weights {path}: {len(unused)} of its tensors are not in this model, ignored (e.g. {min(unused)})",
              file=sys.stderr)
    stand_ins = {id(stand_in): packed for packed, stand_in in nf4.values()}
    dcp.load({key: t for key, t in matched.found.items() if id(t) not in stand_ins},
             storage_reader=SafetensorsReader(files, matched.pieced))
    # An NF4 weight (QLoRA), one at a time: this rank's rows of it read in floating point, then
    # quantized into its rows of the packed weight (a packed row is its float row's alone).
    for key, stand_in in matched.found.items():
        if id(stand_in) in stand_ins:
            dcp.load({key: stand_in}, storage_reader=SafetensorsReader(files))
            _local(stand_ins[id(stand_in)]).copy_(quantize(_local(stand_in)))
    strategy.view.after_load()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `tensor` (a DTensor's local part)."""
    from torch.distributed.tensor import DTensor  # not at the top: see ShardedView.as_global

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _float_stand_in(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """A float32 tensor laid out as the NF4 weight `packed` is (a DTensor's rows over the same
    ranks), with the float weight's shape: what the file's weight is read into."""
    local = _local(packed)
    rows = torch.empty(local.shape[0], in_features, device=local.device)
    if local is packed:
        return rows
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(rows, packed.device_mesh, packed.placements, run_check=False,
                              shape=(packed.shape[0], in_features), stride=(in_features, 1))


class _Listing:
    """A DCP file system that lists only the given files (the reader reads every file `ls` lists)."""

    def __init__(self, fs: Any, files: list[Path]) -> None:
        self._fs = fs
        self._files = [str(file) for file in files]

    def ls(self, path: object) -> list[str]:
        return self._files

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)


class SafetensorsReader(HuggingFaceStorageReader):
    """DCP's reader of Hugging Face safetensors (memory-mapped, slices read as asked), over the
    given files alone, which may sit beside other safetensors files. `pieced`: tensors the files
    hold in pieces (hub_layout.py), by key, their pieces covering the whole; DCP sees each piece as
    a chunk of the whole, so a rank reads only the pieces, and the rows of each, that it holds."""

    def __init__(self, files: list[Path], pieced: dict[str, list[tuple[Piece, Path]]] | None = None) -> None:
        super().__init__(str(files[0].parent))
        self.fs = _Listing(self.fs, files)
        self.pieced = pieced or {}
        self.pieces: dict[MetadataIndex, Piece] = {}

    def read_metadata(self) -> Metadata:
        metadata = super().read_metadata()
        for key, held in self.pieced.items():
            dtype = metadata.state_dict_metadata[held[0][0].key].properties.dtype
            chunks = [ChunkStorageMetadata(torch.Size(piece.offsets), torch.Size(piece.sizes)) for piece, _ in held]
            # The whole tensor: along each dimension, as far as its pieces reach.
            whole = torch.Size(max(c.offsets[d] + c.sizes[d] for c in chunks) for d in range(len(chunks[0].sizes)))
            metadata.state_dict_metadata[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), whole, chunks)
            for piece, file in held:
                index = MetadataIndex(key, piece.offsets)
                metadata.storage_data[index] = _HFStorageInfo(str(file), torch.Size(piece.sizes), dtype)
                self.pieces[index] = piece
        return metadata

    def _process_read_request(self, f: Any, req: ReadItem, planner: LoadPlanner) -> None:
        piece = self.pieces.get(MetadataIndex(req.storage_index.fqn, req.storage_index.offset))
        if piece is None:
            super()._process_read_request(f, req, planner)
            return
        slices = tuple(slice(o, o + n) for o, n in zip(req.storage_offsets, req.lengths, strict=True))
        if piece.rows is not None:  # the model tensor's rows among its neighbours'
            slices = (slice(slices[0].start + piece.rows[0], slices[0].stop + piece.rows[0]), *slices[1:])
        part = f.get_slice(piece.key)[slices[1:] if piece.expert else slices]
        target = planner.resolve_tensor(req).detach()
        target.copy_(part.reshape(target.shape))
        planner.commit_tensor(req, target)
