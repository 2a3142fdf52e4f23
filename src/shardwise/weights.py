"""Pretrained weights from safetensors files, read straight into what each rank holds.

`load_weights(strategy, path)` takes a `.safetensors` file or a directory of them (what
`from_pretrained` reads: `model.safetensors`, or the shards an index names) and fills every tensor
the strategy holds, by the plain model's names (`Strategy.state_dict()`: whole tensors, DTensors
where it shards or splits them). The reading is DCP's, through its reader of Hugging Face
safetensors: each file is memory-mapped, and each rank reads only the part of each tensor it
holds (`get_slice`), one tensor at a time: `fsdp` on N ranks reads 1/N of each, and no rank ever
holds a whole copy of the model.

Names: the file's keys are the model's names less a common prefix, found as the one that matches
the most (`lm.` for shardwise's hf-* models, whose transformers model sits under `lm`;
`lm.transformer.` for GPT-2 files that name `h.0...` as the Hub's do). Every parameter must be in
the file, in its shape; a buffer the file lacks (rotary frequencies, which transformers never
saves) keeps its initial value; the file's tensors the model lacks are ignored (and counted).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader

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


def match(state: dict[str, torch.Tensor], parameters: set[str], stored: dict[str, tuple[list[int], Path]],
          ties: dict[str, list[str]]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """This rank's tensors by their keys in the file, and what is wrong: parameters the file lacks,
    tensors whose shapes differ (each named)."""
    prefix = common_prefix(list(state), set(stored))
    found, problems = {}, []
    for name, tensor in state.items():
        keys = [alias[len(prefix):] for alias in ties.get(name, [name]) if alias.startswith(prefix)]
        key = next((key for key in keys if key in stored), None)
        if key is None:
            if name in parameters:
                problems.append(f"{name}: not in the file (looked for {', '.join(keys) or name})")
            continue
        shape, file = stored[key]
        if list(tensor.shape) != shape:
            problems.append(f"{name}: {list(tensor.shape)} in the model, {shape} in {file.name} (as {key})")
            continue
        found[key] = tensor
    return found, problems


def load_weights(strategy: Strategy, path: str | Path, ties: dict[str, list[str]]) -> None:
    """Fill the model `strategy` holds from the safetensors weights at `path`, in place, each rank
    reading only its part; `ties`: the plain model's `tied_names`. Raises WeightsError on every
    rank, naming the tensors, if any rank's tensors are missing from the files or of another shape."""
    files = weight_files(Path(path))
    stored = stored_shapes(files)
    state = strategy.state_dict()["model"]
    parameters = {name for name, _ in strategy.named_local_parameters()}
    found, problems = match(state, parameters, stored, ties)
    # Ranks hold different tensors (a pipeline's stages): they agree on the problems and the use.
    ranks = strategy.ctx.all_gather_object((problems, sorted(found)))
    everyone = sorted({problem for rank_problems, _ in ranks for problem in rank_problems})
    if everyone:
        raise WeightsError(f"weights {path} do not fit this model ({len(everyone)} problem(s)): "
                           + "; ".join(everyone[:5]))
    unused = set(stored) - {key for _, keys in ranks for key in keys}
    if unused and strategy.ctx.is_main:
        print(f"weights {path}: {len(unused)} of its tensors are not in this model, ignored (e.g. {min(unused)})",
              file=sys.stderr)
    dcp.load(found, storage_reader=SafetensorsReader(files))
    strategy.after_state_loaded()


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
    given files alone, which may sit beside other safetensors files."""

    def __init__(self, files: list[Path]) -> None:
        super().__init__(str(files[0].parent))
        self.fs = _Listing(self.fs, files)
