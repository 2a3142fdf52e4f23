"""The Python API: shardwise's strategies in your own training loop.

    import shardwise as sw

    run = sw.setup(strategy="fsdp", precision="bf16-mixed", grad_accum=2, grad_clip=1.0)
    model, optimizer = run.prepare(build_model(), lambda params: torch.optim.AdamW(params, lr=3e-4))
    for inputs, targets in run.loader(dataset, batch_size=32):
        loss = loss_fn(model(inputs), targets)
        run.backward(loss)
        run.step(optimizer)
    run.save("runs/mine")

Under `torchrun --nproc-per-node N script.py`, `setup` joins the process group torchrun describes;
under plain `python` it is a world of one (strategy "single"). What happens inside is what
`shardwise train` does, made of the same pieces: the strategy (strategies/), the optimizer step
(`trainer.optimizer_step`: fp16 unscale-and-skip, clipping), the global-batch sampler
(data/sampler.py) and sharded checkpoints that reshard to any strategy and world size
(checkpoint.py).

Gradient accumulation: with `grad_accum = K` the loader yields K micro-batches per global batch and
`backward` and `step` are called after each. The first K - 1 backward passes only accumulate, with
no communication: the strategy's `no_sync` is entered before their forward (torch's DDP decides in
forward whether backward communicates), and left before the K-th, which synchronises; `step` steps
after it and returns False before.

Strategies that split the model (`pipeline`, `model-parallel`, `tensor`) work on a model whose family
has a parallel plan (models/plans.py: shardwise's GPT, transformers' Llama, Mistral, Qwen2 and GPT-2,
or the model's own `parallel_plan`): they cut its blocks and matrices as the plan says. `tensor`
trains through the same loop. A pipeline cannot run a
whole forward and then a backward (its stages interleave micro-batches), so under `pipeline` and
`model-parallel` each step is `run.forward_backward(micro_batches, loss_fn)` then `run.step`; that
works under every strategy.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.data import default_collate

from shardwise.checkpoint import load_checkpoint, save_checkpoint
from shardwise.config.load import apply_section
from shardwise.config.registry import spec
from shardwise.config.schema import Config, ConfigError, LoraConfig, ParallelConfig
from shardwise.data import Dataset, GlobalBatchSampler
from shardwise.dist import DistContext, init_distributed, seed_everything, shutdown_distributed
from shardwise.materialise import build_on_meta
from shardwise.models.plans import PlanError
from shardwise.strategies.base import LossFn, OptimizerFactory
from shardwise.strategies.classes import make_strategy
from shardwise.strategies.mesh import check_mesh_fits
from shardwise.trainer import optimizer_step
from shardwise.validate import validate_parallel
from shardwise.weights import ModelNames, load_weights
from shardwise.weights_file import final_layout, save_weights

# What `run.loader` reads: shardwise's own datasets (`batch(indices)`) or any map-style dataset
# (`dataset[i]`, collated as torch's DataLoader does).
Samples = Dataset | torch.utils.data.Dataset


def setup(strategy: str, precision: str = "fp32", recompute: str = "none", *, grad_accum: int = 1,
          grad_clip: float = 0.0, seed: int = 0, backend: str = "auto", timeout_s: float = 300.0,
          threads_per_rank: int | None = None, **parallel: Any) -> Run:
    """Join the process group torchrun describes in the environment (a world of one under plain
    python), seed every rank alike (so a model built after this is the same on every rank), and
    make the strategy.

    strategy, precision, recompute: as `--strategy`, `--precision`, `--recompute` of `shardwise train`.
    grad_accum: micro-batches per global batch on each replica. grad_clip: global gradient-norm
    clip (0: none). seed: model init (through the torch seed) and data order. backend, timeout_s:
    as launch.backend and launch.timeout_s. threads_per_rank: torch CPU threads (unset: as they are).
    parallel: any other key of [parallel] or of its tables, by its own name (block, dp, pp, tp;
    bucket_mb, prefetch, micro_batches, schedule, ... wherever their table is), or a table whole
    (`pipeline={"schedule": "gpipe"}`).
    """
    cfg = Config()
    keys = {_parallel_key(key): value for key, value in parallel.items()}
    apply_section(cfg, "parallel", {"strategy": strategy, "precision": precision, "recompute": recompute, **keys},
                  "shardwise.setup")
    validate_parallel(cfg.parallel)
    if not spec(strategy).api:
        raise ConfigError(f"shardwise.setup: strategy = {strategy!r} runs only under `shardwise train`, whose own "
                          "launcher starts its processes and outlives a lost one")
    if cfg.parallel.cp > 1:
        raise ConfigError(f"shardwise.setup: cp = {cfg.parallel.cp}: context parallel runs under `shardwise train`, "
                          "whose trainer splits each micro-batch's sequence and runs the model's attention over the "
                          "group; here your loop calls the model")
    for key, value, zero_ok in (("grad_accum", grad_accum, False), ("grad_clip", grad_clip, True)):
        if value < 0 or (value == 0 and not zero_ok):
            raise ConfigError(f"shardwise.setup: {key} = {value!r}: must be {'>= 0' if zero_ok else '>= 1'}")
    cfg.train.grad_clip, cfg.train.seed = grad_clip, seed
    cfg.launch.backend, cfg.launch.timeout_s = backend, timeout_s
    ctx = init_distributed(backend, timeout_s, threads_per_rank or torch.get_num_threads())
    one_process = spec(strategy).one_process
    if one_process and ctx.world_size > 1:
        raise ConfigError(f"shardwise.setup: strategy = {strategy!r} runs on one process, but torchrun started "
                          f"{ctx.world_size}; use a multi-rank strategy such as 'ddp'")
    if not one_process and not ctx.distributed:
        raise ConfigError(f"shardwise.setup: strategy = {strategy!r} needs the process group torchrun sets up; "
                          "start the script with torchrun --nproc-per-node N (or use strategy = 'single')")
    if ctx.distributed and not one_process and not spec(strategy).parameter_servers:
        check_mesh_fits(cfg.parallel, ctx.world_size, api=True)  # as `shardwise train` checks it before launch
    seed_everything(seed)
    return Run(cfg, ctx, grad_accum)


def _parallel_key(key: str) -> str:
    """A [parallel] key, or a key of one of its tables by its own name (`prefetch`:
    `sharding.prefetch`): a keyword argument cannot be dotted."""
    defaults = ParallelConfig()
    for table in dataclasses.fields(defaults):
        held = getattr(defaults, table.name)
        if dataclasses.is_dataclass(held) and key in {f.name for f in dataclasses.fields(held)}:
            return f"{table.name}.{key}"
    return key


class Run:
    """One model trained with one strategy on this rank; made by `setup`."""

    def __init__(self, cfg: Config, ctx: DistContext, grad_accum: int) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.grad_accum = grad_accum
        self.strategy = make_strategy(cfg.parallel, ctx, cfg.train.seed)
        self.scaler = self.strategy.scaler
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.global_step = 0  # global batches done, stepped or skipped (fp16 overflow)
        self.skipped_steps = 0
        self.out = Path(".")  # the directory save/load last used (checkpoint.TrainingRun)
        self._backwards = 0  # backward passes since the last step
        self._deferred = ExitStack()  # holds the strategy's no_sync between accumulating micro-batches

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def is_main(self) -> bool:
        return self.ctx.is_main

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    def prepare(self, model: nn.Module | Callable[[], nn.Module], make_optimizer: OptimizerFactory,
                weights: str | Path | None = None,
                lora: LoraConfig | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Wrap `model` with the strategy (replicate, shard or split it; recompute blocks; move it to
        this rank's device and the precision's storage dtype) and build its optimizer over the
        parameters this rank holds: `make_optimizer(params)`. Returns (model to call, optimizer).
        Under mixed precision the returned model's forward runs under autocast; compute the loss
        in fp32 (`logits.float()`).

        `model` is a model, or a function of no arguments that builds one. A model built under
        `shardwise.init_context()` (and every model a function builds, which runs under it) is on
        the meta device: the strategy materialises only what this rank keeps, each tensor with the
        values `single` gives it, from `setup`'s seed (materialise.py).

        `weights`: pretrained weights to start from, a `.safetensors` file or a directory of them
        (what `from_pretrained` reads), each rank reading only the part it holds (weights.py).

        `lora`: fine-tune with low-rank adapters (lora.py) of `lora.rank` > 0: the model's weights
        frozen, adapters beside the layers `lora.targets` names (default: its family's attention and
        MLP projections); the optimizer then holds the adapters alone."""
        if self.model is not None:
            raise RuntimeError("run.prepare: this run has a model already; call shardwise.setup again for another")
        if not isinstance(model, nn.Module):
            model = build_on_meta(model, "run.prepare")
        names = ModelNames.of(model)
        self._weights_layout = final_layout(model, names.layout)
        if lora is not None and lora.rank > 0:
            self.strategy.lora = lora
        try:
            wrapped = self.strategy.wrap(model)
        except PlanError as error:  # the model does not split as the mesh asks: what `shardwise train` refuses first
            raise ConfigError(f"run.prepare: {error}") from None
        self.optimizer = self.strategy.optimizer(make_optimizer)
        if weights is not None:
            load_weights(self.strategy, weights, names)
        if self.strategy.precision.mixed:
            wrapped.forward = self._in_autocast(wrapped.forward)
        self.model = wrapped
        self._defer_sync()
        return wrapped, self.optimizer

    def _in_autocast(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(forward)
        def run(*args: Any, **kwargs: Any) -> Any:
            with self.strategy.precision.autocast(self.ctx.device):
                return forward(*args, **kwargs)

        return run

    def loader(self, dataset: Samples, batch_size: int, steps: int | None = None,
               start: int | None = None) -> Iterator[Any]:
        """This rank's micro-batches of `steps` global batches of `batch_size` samples each (over all
        ranks), from global batch `start` on: grad_accum micro-batches per global batch, on this
        rank's device. Global batch k holds the same samples for every strategy and world size (a
        seeded permutation per epoch, cut into global batches; each replica reads its contiguous
        slice). `steps` defaults to one epoch's whole batches; `start` to `global_step`, so after
        `load` the loader goes on where the checkpointed run was."""
        shares = self.strategy.data_size * self.grad_accum
        if batch_size < 1 or batch_size % shares:
            raise ValueError(f"run.loader: batch_size = {batch_size}: must be a positive multiple of {shares} "
                             f"({self.strategy.data_size} replica(s) x grad_accum {self.grad_accum})")
        count = len(dataset) // batch_size if steps is None else steps
        if count < 1:
            raise ValueError(f"run.loader: {count} steps: the dataset has {len(dataset)} samples, "
                             f"fewer than one batch of {batch_size}; give steps or a smaller batch_size")
        first = self.global_step if start is None else start
        sampler = GlobalBatchSampler(len(dataset), batch_size, self.cfg.train.seed)
        return self._micro_batches(dataset, sampler, range(first, first + count), batch_size // shares)

    def _micro_batches(self, dataset: Samples, sampler: GlobalBatchSampler, steps: range,
                       micro_batch: int) -> Iterator[Any]:
        for step in steps:
            for indices in sampler.micro_batches(step, self.strategy.data_rank, self.strategy.data_size, micro_batch):
                if hasattr(dataset, "batch"):
                    batch = dataset.batch(indices)
                else:
                    batch = default_collate([dataset[i] for i in indices.tolist()])
                yield pytree.tree_map(lambda x: x.to(self.ctx.device) if isinstance(x, torch.Tensor) else x, batch)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's mean loss, counted as 1/grad_accum of the global batch's
        (and scaled under fp16); the global batch's last micro-batch synchronises the gradients."""
        self._require_model("backward")
        if self.grad_accum > 1 and self._backwards == self.grad_accum:
            raise RuntimeError(f"run.backward: already {self.grad_accum} backward passes (grad_accum) since the "
                               "last step; call run.step(optimizer) after every backward")
        scaled = loss / self.grad_accum
        self.strategy.backward(self.scaler.scale_loss(scaled) if self.scaler else scaled)
        self._backwards += 1
        if self._backwards == self.grad_accum - 1:
            self._deferred.close()  # the next micro-batch is the last: its forward and backward synchronise

    def forward_backward(self, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                         loss_fn: LossFn) -> torch.Tensor:
        """Forward and backward over this rank's grad_accum micro-batches of one global batch, as
        (inputs, targets) pairs with loss_fn(outputs, targets) -> mean loss, the strategy's own way
        (a pipeline's schedule). Returns the global batch's mean loss, the same on every rank; call
        `step` next. The way to train under `pipeline` and `model-parallel`."""
        self._require_model("forward_backward")
        batches = list(micro_batches)
        if len(batches) != self.grad_accum or self._backwards:
            raise RuntimeError(f"run.forward_backward: takes one global batch's {self.grad_accum} micro-batches "
                               f"(grad_accum) right after a step; got {len(batches)} after "
                               f"{self._backwards} backward pass(es)")
        self._deferred.close()  # the strategy defers synchronisation itself
        loss_sum = self.strategy.forward_backward(self.model, batches, loss_fn, self.grad_accum)
        self._backwards = self.grad_accum
        return self.ctx.all_reduce_mean(loss_sum / self.grad_accum)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """After the global batch's last backward: unscale and check (fp16; every rank skips the step
        if any found an inf), clip to grad_clip, step, zero the gradients. Before it (accumulating),
        nothing. Returns whether the optimizer stepped."""
        self._require_model("step")
        if optimizer is not self.optimizer:
            raise ValueError("run.step: not the optimizer run.prepare returned; step that one (it holds the "
                             "parameters, or shards, this rank updates)")
        if self._backwards < self.grad_accum:
            return False
        stepped = optimizer_step(self.strategy, optimizer, self.cfg.train.grad_clip)
        optimizer.zero_grad(set_to_none=True)
        self.skipped_steps += not stepped
        self.global_step += 1
        self._backwards = 0
        self._defer_sync()
        return stepped

    def _defer_sync(self) -> None:
        """At a global batch's start: unless it is also its last micro-batch, forward and backward
        accumulate locally until `backward` leaves the strategy's no_sync."""
        if self.grad_accum > 1:
            self._deferred.enter_context(self.strategy.no_sync())

    def no_sync(self) -> AbstractContextManager:
        """Inside it, forward and backward only accumulate gradients locally: for a loop that
        accumulates itself, with grad_accum = 1 (it scales its losses, and calls `step` after the
        backward that is outside)."""
        if self.grad_accum > 1:
            raise RuntimeError(f"run.no_sync: grad_accum = {self.grad_accum} already defers synchronisation to "
                               "the last micro-batch; use one or the other")
        return self.strategy.no_sync()

    def reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of `value` (a loss, a count) over all ranks."""
        return self.ctx.all_reduce_mean(value)

    def save(self, path: str | Path, keep: int = 3) -> Path:
        """Checkpoint the model, optimizer, fp16 loss scaler, step and RNG state after `global_step`
        steps, as path/checkpoints/step-N (what `shardwise train` writes): every rank writes its own
        shards, in global shapes, so any strategy and world size can load it; atomic and checksummed.
        Keeps the newest `keep`. Call between steps, on every rank. Returns the checkpoint's directory."""
        self._require_model("save")
        self.out = Path(path)
        return save_checkpoint(self, self.global_step, keep)

    def load(self, path: str | Path) -> int:
        """Load the newest good checkpoint under `path` (saved by any strategy and world size) into
        this run, in place, and return its step, which `global_step` (and so the loader) goes on
        from. With no checkpoint there yet it says so on stderr and returns 0, so one script can
        start or resume. Call between steps, on every rank."""
        self._require_model("load")
        if self._backwards:
            raise RuntimeError("run.load: called in the middle of a global batch; load between steps")
        self.out = Path(path)
        self.global_step = load_checkpoint(self)
        return self.global_step

    def save_weights(self, path: str | Path) -> Path:
        """The plain model's weights (parameters and buffers) as one safetensors file at `path`,
        the one safetensors' `save_model` writes for the model, for `load_model` without shardwise
        (for a transformers model the one `save_pretrained` writes, for `from_pretrained`):
        gathered a tensor at a time to rank 0, which writes it, so no rank holds the whole model
        (weights_file.py). Atomic: a failed write leaves what `path` held. Call on every rank."""
        self._require_model("save_weights")
        save_weights(self.strategy, self._weights_layout, Path(path))
        return Path(path)

    def close(self) -> None:
        """Leave the process group (explicitly: Gloo can hang or abort if it is left to interpreter exit)."""
        self._deferred.close()
        shutdown_distributed()

    def _require_model(self, method: str) -> None:
        if self.model is None:
            raise RuntimeError(f"run.{method}: no model yet; call run.prepare(model, make_optimizer) first")
