"""Sharded checkpoints that resume exactly, reshard across strategies and world sizes, and never
leave a half-written one in the way.

Layout under the run directory:

    checkpoints/step-00000040/   torch.distributed.checkpoint files (each rank writes its own
                                 shards), manifest.json (step, world size, shapes, checksums)
    checkpoints/latest           the name of the newest complete checkpoint

What is saved: every strategy's `state_dict()` (model and optimizer by parameter name, tensors
in their global shapes, DTensors where sharded), the step, the loss scaler, and each rank's RNG
state. The LR schedule and the data order are functions of the step, so the step restores them.

A save goes to a hidden temporary directory, is checksummed and fsynced, and is renamed into
place; `latest` is replaced last. A crash at any point leaves the previous checkpoint whole.
Loading verifies the checksums and falls back to the newest good checkpoint, with a warning.
Nothing in a checkpoint is unpickled except through an allow-list (DCP's metadata) or
`torch.load(weights_only=True)` (DCP's non-tensor entries).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pickle
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, StorageReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.utils import _create_file_view
from torch.futures import Future

if TYPE_CHECKING:
    from shardwise.config.schema import Config, LoraConfig
    from shardwise.dist import DistContext
    from shardwise.precision import LossScaler
    from shardwise.strategies.base import Strategy

MANIFEST = "manifest.json"
LATEST = "latest"
REMOVING = ".removing-"  # a checkpoint being deleted is renamed to this prefix first: out of the step-* names


class TrainingRun(Protocol):
    """What a checkpoint is saved from and loaded into: the CLI's Trainer or the Python API's Run."""

    cfg: Config
    ctx: DistContext
    out: Path  # the run directory; checkpoints go to out/checkpoints
    strategy: Strategy
    optimizer: torch.optim.Optimizer
    scaler: LossScaler | None


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that does not fit this model."""


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _name(step: int) -> str:
    return f"step-{step:08d}"


def _checksums(path: Path) -> dict[str, str]:
    sums = {}
    for file in sorted(p for p in path.rglob("*") if p.is_file() and p.name != MANIFEST):
        digest = hashlib.sha256()
        with open(file, "rb") as f:
            for block in iter(lambda f=f: f.read(1 << 20), b""):
                digest.update(block)
        sums[str(file.relative_to(path))] = digest.hexdigest()
    return sums


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(path.parent)


def from_rank0(value: Any) -> Any:
    """Rank 0's `value` on every rank (plain data: names, messages)."""
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def training_state(trainer: TrainingRun, world_size: int, with_rng: bool = True) -> dict[str, Any]:
    """What a checkpoint holds, as live tensors a load overwrites in place. Under LoRA the model's
    frozen weights are left out: they are the pretrained weights (`model.weights`) or the seed's,
    made again on resume, so a checkpoint holds what trains (adapters, buffers, optimizer state)."""
    view = trainer.strategy.view
    state: dict[str, Any] = view.state_dict()
    if trainer.strategy.lora is not None:
        frozen = {name for name, param in view.named_parameters() if not param.requires_grad}
        state["model"] = {name: t for name, t in state["model"].items() if name not in frozen}
    state["trainer"] = {"step": torch.zeros((), dtype=torch.int64)}
    if trainer.scaler:
        state["trainer"]["loss_scale"] = torch.tensor(trainer.scaler.scale, dtype=torch.float64)
        state["trainer"]["clean_steps"] = torch.tensor(trainer.scaler.clean_steps)
    if with_rng:  # one per rank: only a load at the same world size can use them
        state["rng"] = {f"rank{trainer.ctx.rank}": torch.get_rng_state()}
        own = trainer.strategy.view.rank_state()
        if own:
            state["rank_state"] = {f"rank{trainer.ctx.rank}.{key}": value for key, value in own.items()}
    return state


def _model_shapes(state: dict[str, Any]) -> dict[str, list[int]]:
    """The global shape of every model entry any rank holds (a pipeline stage holds only its own)."""
    shapes = {name: list(t.shape) for name, t in state["model"].items()}
    if dist.is_initialized():
        every: list[dict[str, list[int]]] = [{}] * dist.get_world_size()
        dist.all_gather_object(every, shapes)
        shapes = {name: shape for part in every for name, shape in part.items()}
    return shapes


def save_checkpoint(trainer: TrainingRun, step: int, keep: int) -> Path:
    """Save the state after `step` completed steps; keep the newest `keep` checkpoints. A save
    that fails (a full or read-only disk) raises the same CheckpointError on every rank, leaving
    the previous checkpoints and `latest` as they were."""
    final, tmp = checkpoint_paths(trainer, step)
    state = training_state(trainer, trainer.ctx.world_size)
    state["trainer"]["step"].fill_(step)
    try:
        dcp.save(state, checkpoint_id=tmp)  # returns on every rank once every rank's files are written
    except CheckpointException as error:
        problem = first_failure(error)
    else:
        manifest = checkpoint_manifest(trainer, state, step)
        problem = _agreed_from_rank0(trainer.ctx.is_main, lambda: seal(tmp, final, manifest, keep))
    if problem is not None:
        raise save_failed(trainer.ctx.is_main, final, tmp, problem)
    return final


def checkpoint_paths(trainer: TrainingRun, step: int) -> tuple[Path, Path]:
    """Where the checkpoint after `step` goes, and the empty temporary directory it is written to
    first (rank 0 makes it; every rank returns once it is made, or raises CheckpointError)."""
    root = checkpoint_dir(trainer.out)
    final, tmp = root / _name(step), root / f".tmp-{_name(step)}"
    problem = _agreed_from_rank0(trainer.ctx.is_main, lambda: _empty_dir(tmp))
    if problem is not None:
        raise save_failed(trainer.ctx.is_main, final, tmp, problem)
    return final, tmp


def checkpoint_manifest(trainer: TrainingRun, state: dict[str, Any], step: int,
                        shapes: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """What the manifest records of a checkpoint of `state`: `shapes`, the model's entries' shapes,
    are gathered from every rank (collective) unless given (an earlier save's: they never change)."""
    return {
        "step": step,
        "world_size": trainer.ctx.world_size,
        "strategy": trainer.cfg.parallel.strategy,
        "precision": trainer.cfg.parallel.precision,
        "shapes": shapes if shapes is not None else _model_shapes(state),
        "rank_state": sorted(trainer.strategy.view.rank_state()),
        "lora": lora_manifest(trainer.strategy.lora),
    }


def save_failed(is_main: bool, final: Path, tmp: Path, problem: str) -> CheckpointError:
    """The error every rank raises for a save of `final` that failed with `problem`; rank 0 removes
    what was written of it (a full disk gets its space back)."""
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    latest = final.parent / LATEST
    kept = f"the newest complete one, {latest.read_text().strip()}, is intact" if latest.is_file() else \
        "there is no earlier one"
    return CheckpointError(f"could not save checkpoint {final.name} in {final.parent}: {problem}; {kept}")


def _empty_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)  # left by a save that crashed
    path.mkdir(parents=True)


def seal(tmp: Path, final: Path, manifest: dict[str, Any], keep: int) -> None:
    """Checksum and flush the files in `tmp`, move it to `final`, point `latest` at it, prune.

    No moment of it leaves a complete checkpoint removed or half-removed under its own name: a
    complete one already at `final` (renamed into place by a run killed before `latest` moved, and
    saved again by its resumed run) is kept and `tmp` dropped; an incomplete one, and every one
    pruned, is renamed out of the `step-*` names first (one atomic rename) and deleted after."""
    manifest["files"] = _checksums(tmp)
    for file in tmp.rglob("*"):
        if file.is_file():
            _fsync(file)
    _write_atomically(tmp / MANIFEST, json.dumps(manifest, indent=1))
    root = final.parent
    if final.exists() and problem_with(final) is None:
        shutil.rmtree(tmp)
    else:
        if final.exists():
            os.replace(final, root / f"{REMOVING}{final.name}")
        os.replace(tmp, final)
    _fsync(root)
    _write_atomically(root / LATEST, final.name)
    for old in sorted(root.glob("step-*"))[:-keep]:
        os.replace(old, root / f"{REMOVING}{old.name}")
    _fsync(root)
    for removing in root.glob(f"{REMOVING}*"):  # this save's, and any a kill left mid-removal
        shutil.rmtree(removing, ignore_errors=True)


def _agreed_from_rank0(is_main: bool, action: Callable[[], None]) -> str | None:
    """Run `action` on rank 0 alone; every rank returns why it failed (None if it did not).
    Doubles as a barrier: no rank goes on before rank 0 is done."""
    problem = None
    if is_main:
        try:
            action()
        except OSError as error:
            problem = str(error)
    return from_rank0(problem)


def first_failure(error: CheckpointException) -> str:
    """The clearest of the ranks' errors in a failed DCP save: an OSError (the disk's own words)
    if any rank had one."""
    failures = sorted(error.failures.items())
    rank, (cause, _) = next(((r, f) for r, f in failures if isinstance(f[0], OSError)), failures[0])
    return f"rank {rank}: {cause}"


def problem_with(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be trusted, or None if its files match its manifest."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return "no manifest (an unfinished save?)"
    try:
        expected = json.loads(manifest_path.read_text())["files"]
    except (ValueError, KeyError):
        return "manifest unreadable"
    actual = _checksums(path)
    if actual.keys() != expected.keys():
        return f"files differ from the manifest: missing {sorted(set(expected) - set(actual))}, " \
               f"unexpected {sorted(set(actual) - set(expected))}"
    altered = [name for name in expected if actual[name] != expected[name]]
    return f"checksum mismatch in {', '.join(altered)}" if altered else None


def newest_good_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint `latest` names if it verifies, else the newest one that does (with a
    warning for each skipped); None if the run has none. Raises if there are some but none is good."""
    root = checkpoint_dir(run_dir)
    candidates = sorted(root.glob("step-*"), reverse=True)
    latest = root / LATEST
    if latest.is_file() and (root / latest.read_text().strip()).is_dir():
        named = root / latest.read_text().strip()
        candidates = [named] + [c for c in candidates if c != named]
    problems = []
    for candidate in candidates:
        problem = problem_with(candidate)
        if problem is None:
            for skipped, why in problems:
                print(f"warning: checkpoint {skipped} is unusable ({why}); using {candidate.name}", file=sys.stderr)
            return candidate
        problems.append((candidate.name, problem))
    if problems:
        details = "; ".join(f"{name}: {why}" for name, why in problems)
        raise CheckpointError(f"no usable checkpoint in {root}: {details}")
    return None


class SafeReader(FileSystemReader):
    """DCP's file reader, unpickling its metadata through an allow-list instead of plain pickle,
    so a crafted `.metadata` cannot run code; and reading tensors memory-mapped, so a rank reads
    only the part of a stored tensor it asks for (its shard of a tensor a replicating strategy
    saved whole), never the whole of it."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        mapped = [item for item in plan.items if item.type == LoadItemType.TENSOR
                  and not self.storage_data[item.storage_index].transform_descriptors]
        rest = [item for item in plan.items if item not in mapped]
        if rest:
            super().read_data(dataclasses.replace(plan, items=rest), planner).wait()
        per_file: dict[str, list[ReadItem]] = {}
        for item in mapped:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in per_file.items():
            with self.open_file(relative_path) as stream:
                for item in items:
                    storage = self.file_storage(relative_path)
                    stored = self._mapped_tensor(stream, storage, self.storage_data[item.storage_index])
                    for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                        stored = stored.narrow(dim, start, length)
                    target = planner.resolve_tensor(item).detach()
                    target.copy_(stored)  # reads the pages of these rows only
                    planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def open_file(self, relative_path: str) -> IO[bytes]:
        return open(Path(self.path) / relative_path, "rb")

    def file_storage(self, relative_path: str) -> torch.UntypedStorage:
        """The file's bytes as a storage, mapped (afresh for each tensor read, so that only its pages
        are resident at once)."""
        path = Path(self.path) / relative_path
        return torch.UntypedStorage.from_file(str(path), False, path.stat().st_size)  # private

    @staticmethod
    def _mapped_tensor(stream: Any, storage: torch.UntypedStorage, stored: Any) -> torch.Tensor:
        """The tensor DCP saved at `stored`'s place in the file (one torch.save archive), as a view
        of the file's mapping: its layout read from the archive without its data (a meta load,
        which notes where the data lies), the data left in the file until touched."""
        layout = torch.load(_create_file_view(stream, stored.offset, stored.length), map_location="meta",
                            weights_only=True)
        start = stored.offset + layout.untyped_storage()._checkpoint_offset
        data = storage[start : start + layout.untyped_storage().nbytes()]
        return torch.empty(0, dtype=layout.dtype).set_(data, layout.storage_offset(), layout.shape, layout.stride())

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, unpickled once per reader (a load reads it again, and
        `consolidate` loads tensor by tensor through one reader)."""
        metadata = self.__dict__.get("_metadata")
        if metadata is None:
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as file:
                metadata = self._metadata = _AllowListUnpickler(file).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def safe_reader(path: Path) -> SafeReader:
    """A reader for the checkpoint at `path` whose metadata has been read once already, alone,
    so that a refused pickle is reported as such rather than buried in DCP's own error."""
    reader = SafeReader(path)
    try:
        reader.read_metadata()
    except pickle.UnpicklingError as error:
        raise CheckpointError(f"checkpoint {path}: {error}; refusing to load it") from None
    return reader


class _AllowListUnpickler(pickle.Unpickler):
    MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")

    def find_class(self, module: str, name: str) -> Any:
        if module in self.MODULES or (module, name) in {("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
                                                        ("torch.serialization", "_get_layout"),
                                                        ("collections", "OrderedDict")}:
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


def lora_manifest(lora: LoraConfig | None) -> dict[str, Any] | None:
    """What a manifest records of a run's adapters (None: every parameter trains)."""
    return None if lora is None else {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
                                      "targets": lora.targets, "train": lora.train, "quantize": lora.quantize}


def check_lora(path: Path, lora: LoraConfig | None) -> None:
    """Raise where the checkpoint at `path` and the run disagree on adapters: a LoRA checkpoint holds
    adapters and no frozen weights, a full fine-tune's no adapters."""
    saved = json.loads((path / MANIFEST).read_text()).get("lora")
    ours = lora_manifest(lora)
    if (saved is None) != (ours is None):
        kind = f"LoRA adapters (rank {saved['rank']})" if saved else "every parameter of a full fine-tune"
        run = f"trains adapters (lora.rank = {ours['rank']})" if ours else "trains every parameter (lora.rank = 0)"
        raise CheckpointError(f"checkpoint {path} holds {kind}; this run {run}: resume it as it was saved")
    if saved is not None and (saved["rank"], saved["targets"], saved.get("train")) != \
            (ours["rank"], ours["targets"], ours["train"]):
        default = "the family's default targets"
        raise CheckpointError(f"checkpoint {path} holds adapters of rank {saved['rank']} on "
                              f"{saved['targets'] or default} (training {saved.get('train') or 'no module'} whole); "
                              f"this run asks for rank {ours['rank']} on {ours['targets'] or default} (training "
                              f"{ours['train'] or 'no module'} whole)")


def check_fits(path: Path, state: dict[str, Any]) -> None:
    """Raise naming every parameter whose name or shape differs between checkpoint and model."""
    saved = json.loads((path / MANIFEST).read_text())["shapes"]
    ours = _model_shapes(state)
    missing = sorted(set(ours) - set(saved))
    extra = sorted(set(saved) - set(ours))
    shapes = [f"{n} {saved[n]} in the checkpoint vs {ours[n]} here" for n in sorted(set(ours) & set(saved))
              if saved[n] != ours[n]]
    if missing or extra or shapes:
        parts = ([f"missing from the checkpoint: {', '.join(missing)}"] if missing else []) + \
                ([f"not in this model: {', '.join(extra)}"] if extra else []) + \
                ([f"shapes differ: {'; '.join(shapes)}"] if shapes else [])
        raise CheckpointError(f"checkpoint {path} is of another model: {' | '.join(parts)}")


def load_checkpoint(trainer: TrainingRun) -> int:
    """Load the newest good checkpoint of the trainer's run into it; return the steps it had
    completed (0 when the run has no checkpoint yet)."""
    if trainer.ctx.is_main:
        try:
            found = newest_good_checkpoint(trainer.out)
            chosen = (str(found) if found else None, None)
        except CheckpointError as error:
            chosen = (None, str(error))
    else:
        chosen = None
    path, error = from_rank0(chosen)
    if error:
        raise CheckpointError(error)
    if path is None:
        if trainer.ctx.is_main:
            print(f"no checkpoint in {checkpoint_dir(trainer.out)}: starting from step 0", file=sys.stderr)
        return 0
    path, started = Path(path), time.perf_counter()
    manifest = json.loads((path / MANIFEST).read_text())
    check_lora(path, trainer.strategy.lora)
    step = load_state(trainer, safe_reader(path), manifest["world_size"] == trainer.ctx.world_size,
                      manifest.get("rank_state"), str(path), fits=lambda state: check_fits(path, state))
    if trainer.ctx.is_main:
        print(f"resumed from {path} (step {manifest['step']}, saved by {manifest['strategy']} on "
              f"{manifest['world_size']} rank(s); read in {time.perf_counter() - started:.2f} s)", file=sys.stderr)
    return step


def load_state(trainer: TrainingRun, reader: StorageReader, same_world: bool, saved_rank_state: list[str] | None,
               source: str, fits: Callable[[dict[str, Any]], None] | None = None) -> int:
    """Load a checkpoint's state through `reader` into the trainer (collective); return its step.
    Its RNG states where it was saved at this world size; its per-rank state where it holds this
    run's kind (`saved_rank_state`, the names the manifest lists); `fits` checks the state first."""
    ensure_optimizer_state(trainer.optimizer)
    state = training_state(trainer, trainer.ctx.world_size, with_rng=same_world)
    if fits is not None:
        fits(state)
    if trainer.scaler is None:
        state["trainer"] = {"step": state["trainer"]["step"]}
    if "rank_state" in state and saved_rank_state != sorted(trainer.strategy.view.rank_state()):
        del state["rank_state"]  # saved without it (another strategy or option): it starts afresh
        if trainer.ctx.is_main:
            print(f"{source} holds none of this run's per-rank state (PowerSGD's factors and error feedback): "
                  "it starts afresh", file=sys.stderr)
    dcp.load(state, storage_reader=reader)
    trainer.strategy.view.after_load()
    if trainer.scaler:
        trainer.scaler.scale = state["trainer"]["loss_scale"].item()
        trainer.scaler.clean_steps = int(state["trainer"]["clean_steps"])
    if same_world:
        torch.set_rng_state(state["rng"][f"rank{trainer.ctx.rank}"])
    return int(state["trainer"]["step"])


def ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Make the optimizer create its state (it does so lazily, on the first step) so a load has
    tensors to fill: one step on zero gradients at learning rate 0, which changes no parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if all(p in optimizer.state for p in params):
        return
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate


def read_tensor(reader: SafeReader, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Model entry `name` of a checkpoint, whole, read in this one process (whatever ranks saved it)."""
    tensor = torch.empty(shape, dtype=dtype)
    dcp.load({"model": {name: tensor}}, storage_reader=reader, no_dist=True)
    return tensor


def consolidate(run_dir: Path, out: Path, progress: bool = False) -> Path:
    """Write the model of the run's newest good checkpoint, read from however many ranks' shards
    in this one process, a tensor at a time, each written and dropped (weights_file.py), so the
    process holds one tensor, never the model. `out` is either
    - a `.safetensors` file: every key of the model's state dict (tied weights as copies), for
      `safetensors.torch.load_file` and `model.load_state_dict` without shardwise; or
    - for an hf-* run, a directory `from_pretrained` loads: model.safetensors as `save_pretrained`
      writes it, config.json and the tokenizer's files (hf_files.py).
    `progress`: a bar on stderr. Returns the checkpoint used."""
    from shardwise.config.load import load_config
    from shardwise.materialise import init_context, state_buffers
    from shardwise.models import build_model

    cfg = load_config(Path(run_dir) / "config.toml")
    path = checkpoint_to_write(run_dir, cfg, Path(out), "consolidate")
    if json.loads((path / MANIFEST).read_text()).get("lora"):
        raise CheckpointError(f"{path} holds LoRA adapters, not the model: `shardwise export RUN OUT --merged` "
                              "merges them into the weights the run started from")
    with init_context():
        model = build_model(cfg.model)
    check_fits(path, {"model": dict(model.named_parameters()) | dict(state_buffers(model))})
    state = model.state_dict(keep_vars=True)
    reader = safe_reader(path)
    write_model(cfg, model, Path(out), lambda name: read_tensor(reader, name, state[name].shape, state[name].dtype),
                "consolidate", progress, tied_copies=True)
    return path


def checkpoint_to_write(run_dir: Path, cfg: Config, out: Path, verb: str) -> Path:
    """The newest good checkpoint of `run_dir`, whose model is to be written to `out`; CheckpointError
    where there is none, or `out` is a directory for a model transformers does not load."""
    from shardwise.config.schema import HF_MODELS

    if out.suffix != ".safetensors" and cfg.model.name not in HF_MODELS:
        raise CheckpointError(f"{out}: a {cfg.model.name} run {verb}s to a .safetensors file; a directory is "
                              f"written for the transformers families ({', '.join(HF_MODELS)})")
    path = newest_good_checkpoint(run_dir)
    if path is None:
        raise CheckpointError(f"{checkpoint_dir(run_dir)}: no checkpoint to {verb}")
    return path


def write_model(cfg: Config, model: torch.nn.Module, out: Path, tensor: Callable[[str], torch.Tensor], what: str,
                progress: bool = False, tied_copies: bool = False) -> None:
    """Write the plain `model` (built on the meta device), each tensor as `tensor(name)` gives it,
    a tensor at a time: to `out`, a .safetensors file as save_model writes it (with `tied_copies`,
    a tied weight under each of its names: every key of the state dict), or for an hf-* model the
    directory from_pretrained loads (model.safetensors as save_pretrained writes it, config.json,
    the tokenizer's files). `what`: the progress bar's label."""
    from tqdm import tqdm

    from shardwise.hf_files import config_json, write_model_files
    from shardwise.hub_layout import HubLayout
    from shardwise.weights_file import WeightsLayout, WeightsWriter

    directory = out.suffix != ".safetensors"
    state = model.state_dict(keep_vars=True)
    layout = WeightsLayout.transformers(model, HubLayout.of(model)) if directory else \
        WeightsLayout.of(model, tied_copies=tied_copies)
    total = sum(state[name].nbytes for name in layout.names())
    with WeightsWriter(out / "model.safetensors" if directory else out, layout) as writer, \
            tqdm(total=total, unit="B", unit_scale=True, disable=not progress, desc=what) as bar:
        for name in layout.names():
            value = tensor(name)
            writer.write(name, value)
            bar.update(value.nbytes)
    if directory:
        write_model_files(out, config_json(model, cfg.model.hf_config), cfg.data.tokenizer)
