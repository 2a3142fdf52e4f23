"""Sharded data parallel, ours: ZeRO stage 1 (`zero1`), 2 (`zero2`) and 3 (`fsdp`), and `hsdp`,
sharded within a node and replicated across nodes: the model's units sharded over the data-parallel
ranks by parallel/sharded_model.py (a unit's sharding: parallel/shard.py).

Units are the modules whose class is `parallel.block` (the GPT's `Block`), plus the root:
every parameter not in a unit (embeddings, final norm). The root is gathered for the whole of
forward and backward. Under expert parallel (`parallel.ep`) a block's experts, which differ from
one ep rank to the next, are a unit of their own, sharded over the ranks that hold the same
experts instead. Over tensor parallel (`parallel.tp`) each block is split over the tp ranks as it
is made (parallel/tensor.py), then sharded as a unit.

A meta-built model is made real unit by unit (materialise.py) under fsdp and over tensor
parallel, each unit's shards kept and the rest freed before the next, so setup holds at most the
shards made so far and one whole unit (`setup_peak_bytes`, counted). `parallel.sharding.offload =
"optimizer"` keeps the master shards, their gradients and the optimizer state on the host
(ZeRO-Offload).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from shardwise.config.registry import spec
from shardwise.config.schema import LANGUAGE_MODELS, Config, ConfigError, ParallelConfig
from shardwise.dist import DistContext, broadcast_from_rank0
from shardwise.materialise import Group, Materialiser
from shardwise.memory import MemoryBreakdown
from shardwise.models.plans import locate
from shardwise.nf4 import quantize_layers
from shardwise.parallel.dims import Mesh, node_size
from shardwise.parallel.shard import GatherHooks, Sharding, Unit
from shardwise.parallel.sharded_model import ShardedModel
from shardwise.parallel.tensor import parallelize_blocks
from shardwise.parallel.tensor_group import TensorParallelGroup
from shardwise.state_view import ShardedView
from shardwise.strategies.base import HookedStrategy, OptimizerFactory, Strategy, on_grad_accumulated
from shardwise.strategies.mesh import check_model_split
from shardwise.strategies.sync_batchnorm import convert_sync_batchnorm


def sharded_model(strategy: Strategy, module: nn.Module) -> ShardedModel:
    """`module`'s units to be sharded as `strategy`'s config asks (the whole model's under fsdp, a
    pipeline rank's stages' under the sharded pipeline): its ZeRO stage, in its precision's dtypes,
    with parallel.sharding's offload, prefetch and resharding after forward; within a node where
    it replicates across nodes (hsdp); its experts as expert parallel cut them."""
    cfg, precision, device = strategy.cfg, strategy.precision, strategy.ctx.device
    sharding = Sharding(spec(cfg.strategy).zero_stage, device, precision.param_dtype,
                        precision.compute_dtype if precision.mixed else precision.param_dtype, precision.reduce_dtype,
                        cfg.sharding.offload == "optimizer", cfg.sharding.prefetch, cfg.sharding.reshard_after_forward)
    return ShardedModel(module, strategy.ctx, strategy.mesh, sharding, spec(cfg.strategy).across_nodes,
                        strategy.experts)


class ShardedDataParallel(HookedStrategy):
    """zero1, zero2, fsdp and hsdp: which of them is the registry's ZeRO stage for the configured
    name, and whether it replicates across nodes what it shards within one (`across_nodes`)."""

    @classmethod
    def check_config(cls, cfg: Config, world: int) -> None:
        """Over tensor parallel (parallel.tp > 1): the model splits as tensor's does. Units of several
        blocks: a language model's, as many in each."""
        p = cfg.parallel
        dp, pp, tp = p.mesh_shape(world)
        per_unit = p.sharding.blocks_per_unit
        if per_unit > 1 and (cfg.model.name not in LANGUAGE_MODELS or cfg.model.n_layer % per_unit):
            raise ConfigError(f"parallel.sharding.blocks_per_unit = {per_unit}: must divide the model's blocks "
                              + (f"(model.n_layer = {cfg.model.n_layer})" if cfg.model.name in LANGUAGE_MODELS
                                 else f"(model.name = {cfg.model.name!r} has none)"))
        if tp > 1 or p.sequence_parallel:
            check_model_split(cfg, world)
        if spec(p.strategy).across_nodes and cfg.launch.nproc % (p.cp * pp * tp):
            raise ConfigError(f"parallel.tp = {tp}: {p.strategy} keeps a replica's tensor-parallel ranks within a "
                              f"node; launch.nproc = {cfg.launch.nproc} must be a multiple of it")

    def __init__(self, ctx: DistContext, cfg: ParallelConfig, mesh: Mesh | None = None) -> None:
        if spec(cfg.strategy).across_nodes and ctx.world_size % node_size(ctx.world_size):
            raise ValueError(f"{cfg.strategy}: world size {ctx.world_size} is not a whole number of nodes of "
                             f"{node_size(ctx.world_size)} processes (LOCAL_WORLD_SIZE); every node must run "
                             "the same --nproc")
        super().__init__(ctx, cfg, mesh)
        self.stage = spec(cfg.strategy).zero_stage
        self.tp = self.mesh.size("tp") if self.mesh is not None else 1  # no mesh: one process without a group
        # zero1 and zero2 keep the full parameters: a meta-built model is materialised whole; fsdp
        # materialises it one unit at a time (_make_units), as all of them do over tensor parallel,
        # which splits each block as it is made.
        self.materialises_whole = self.stage < 3 and self.tp == 1
        self.sharded: ShardedModel | None = None  # the model's units, made by wrap

    def prepare(self, model: nn.Module) -> nn.Module:
        return super().prepare(convert_sync_batchnorm(model) if self.cfg.sync_batchnorm else model)

    def _split(self, model: nn.Module) -> None:
        """Each block made real, split over tp and sharded as a unit, in turn (`_make_units`)."""
        self.module = model
        scalars = [name for name, p in self.module.named_parameters() if p.dim() == 0]
        if scalars:
            raise ValueError(f"{self.cfg.strategy}: parameters {', '.join(scalars)} are 0-dim; sharding splits dim 0")
        self.sharded = sharded_model(self, self.module)
        if self.materialiser is None:  # an ordinary model: rank 0's values (meta-built ones agree by construction)
            broadcast_from_rank0([*(p for p in self.module.parameters() if not self.sharded.is_expert(p)),
                                  *self.module.buffers()])
            if self.experts is not None:
                self.experts.broadcast()
        # Over tp: the plain model's state (on meta), noted before the split, for the view
        full = {name: t.detach().to("meta") for name, t in self.module.state_dict(keep_vars=True).items()} \
            if self.tp > 1 else {}
        self.block_units = self._make_units(self.tp)  # for _distribute's gather hooks
        if self.float8 is not None and self.stage == 3:  # the tensorwise layers' weights gathered as float8
            self.float8["gathered_in_float8"] = self.sharded.float8_gathered
        self.setup_peak_bytes = self.sharded.setup_peak_bytes
        self.view = ShardedView(self.sharded, dict(self.module.named_parameters()), full)

    def _distribute(self, model: nn.Module) -> nn.Module:
        """The units' hooks: each gradient reduce-scattered as backward makes it; under fsdp each
        block's unit gathered before its forward and backward and freed after."""
        for unit in self.sharded.sharding.units:
            for param in unit.params if not unit.frozen else []:
                on_grad_accumulated(param, self._on_grad_ready)
        self._init_backward_state()
        if self.stage == 3:
            GatherHooks(self.sharded.sharding, self.module, self.block_units)
            self.sharded.sharding.peak_gathered_bytes = 0  # the peak counts from the first step
        return self.module

    def _make_units(self, tp: int) -> list[tuple[list[nn.Module], list[Unit]]]:
        """A unit per `parallel.sharding.blocks_per_unit` consecutive blocks (the parameters under
        modules of class `parallel.block` that no earlier block holds), then the root, as
        materialise.py groups them; each unit's blocks with its units, in order. Each block in the
        one order: made real (a meta-built model, under fsdp or over tp), its experts cut to this
        rank's, split over tp by tensor parallel's one function (`parallelize_blocks`, which calls
        `unit` around each block's split); then, once its unit's blocks are, sharded. So fsdp's
        setup holds at most the shards made so far and one whole unit."""
        grouping = self.materialiser or Materialiser(self.module, self.cfg.block, self.seed)
        make_real = self.materialiser is not None and (self.stage == 3 or tp > 1)
        *block_groups, root = grouping.groups
        blocks: list[tuple[list[nn.Module], list[Unit]]] = []
        pending: list[tuple[nn.Module, list[nn.Parameter]]] = []  # blocks made, their unit not yet

        @contextmanager
        def unit(group: Group) -> Iterator[None]:
            if make_real:
                self.materialiser.materialise(group, self.ctx.device, self.precision.param_dtype)
                quantize_layers(self.module, self.nf4_layers, self.precision.compute_dtype)  # this group's
                if self.experts is not None and group.block is not None:
                    self.experts.split(group.block)
            yield
            split = tp > 1 and group.block is not None  # its layers now hold this rank's tp shards
            if split and make_real:
                self.materialiser.release(group, self.module)
            params = list(group.block.parameters()) if split else grouping.parameters(group)
            if group.block is None:
                self.sharded.add([], params)
                return
            pending.append((group.block, params))
            if len(pending) == self.cfg.sharding.blocks_per_unit:
                run = [block for block, _ in pending]
                made = self.sharded.add(run, [p for _, held in pending for p in held])
                if made:
                    blocks.append((run, made))
                pending.clear()

        if tp > 1:
            by_block = {id(group.block): group for group in block_groups}
            self.sharded.tensor_shards, self.sharded.tp_partial = parallelize_blocks(
                [group.block for group in block_groups], locate(self.module).plan,
                TensorParallelGroup(self.mesh.group("tp")), self.cfg.sequence_parallel,
                lambda block: unit(by_block[id(block)]))
        else:
            for group in block_groups:
                with unit(group):
                    pass
        if pending:  # the API's config is not validated as a whole: a model it did not know
            raise ValueError(f"parallel.sharding.blocks_per_unit = {self.cfg.sharding.blocks_per_unit}: must divide "
                             f"the model's blocks ({len(block_groups)})")
        with unit(root):
            pass
        return blocks

    @property
    def sharding(self) -> Sharding:
        """The units and their collectives (what moved, what is gathered), for benches and tests."""
        return self.sharded.sharding

    # --- backward: reduce-scatter gradients ----------------------------------------------

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        self._queue_finish_once()
        self.sharded.sharding.grad_ready(param, self._sync)

    def backward(self, loss: torch.Tensor) -> None:
        self.sharded.sharding.attach_full_grads()
        loss.backward()

    def _finish_backward(self) -> None:
        self.sharded.finish_backward(self._sync)

    # --- optimizer, clipping, memory --------------------------------------------------------

    def local_parameters(self) -> list[nn.Parameter]:
        return self.sharded.shards()
    def optimizer(self, make: OptimizerFactory) -> torch.optim.Optimizer:
        self.optim = self.sharded.optimizer(make)
        return self.optim

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return self.sharded.clip_grad_norm_(max_norm)

    def memory(self, activations: int) -> MemoryBreakdown:
        return self.sharded.memory(activations)
