"""The Strategy interface: the only thing the trainer knows about how training is spread out."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.compile import BlockCompiler
from shardwise.config.registry import spec
from shardwise.config.schema import DEFAULT_BLOCK, Config, LoraConfig, ParallelConfig
from shardwise.dist import DistContext
from shardwise.gradients import clip_grad_norm_, local_grads
from shardwise.lora import apply_lora
from shardwise.materialise import Materialiser, check_one_device_kind
from shardwise.memory import MemoryBreakdown, count_memory
from shardwise.models import moe
from shardwise.models.hf import decoder_layer_class
from shardwise.models.plans import find_positions
from shardwise.nf4 import quantize_layers
from shardwise.parallel.context.split import ContextParallel
from shardwise.parallel.dims import Mesh, MeshShape, node_size
from shardwise.parallel.experts import ExpertParallel, balance_routers
from shardwise.parallel.float8 import convert_to_float8
from shardwise.precision import LossScaler, make_precision
from shardwise.recompute import checkpoint_blocks, recomputed_blocks
from shardwise.state_view import StateView

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (outputs, targets) -> mean loss
# A micro-batch: (inputs, targets), or (inputs, targets, documents) for packed documents (each input
# token's document, `DocumentWindows.documents`).
MicroBatch = tuple[torch.Tensor, ...]


def on_grad_accumulated(param: nn.Parameter, hook: Callable[[nn.Parameter], None]) -> None:
    """Call `hook`, a strategy's bound method, each time backward has accumulated `param`'s gradient.
    The parameter holds it through a weak reference: autograd keeps a parameter's hooks where the
    garbage collector cannot see them, so a strategy held there, whose model holds the parameter, was
    a cycle never collected, its model, buffers and process groups (3 threads each) kept alive after
    the run, in every process that trains more than once (the API's, the tests' ranks)."""
    method = weakref.WeakMethod(hook)

    def call(param: nn.Parameter) -> None:
        owner = method()
        if owner is None:
            raise RuntimeError("backward through a model whose strategy is gone: keep the trainer (or the API's "
                               "run) alive while training; it synchronises the gradients")
        owner(param)

    param.register_post_accumulate_grad_hook(call)


class Strategy:
    """Wraps a model (replicate, shard or split it), builds its optimizer, and owns backward,
    gradient synchronisation and clipping. Subclasses override what they do differently."""

    def __init__(self, ctx: DistContext, cfg: ParallelConfig, mesh: Mesh | None = None) -> None:
        self.ctx = ctx
        self.cfg = cfg
        self.precision = make_precision(cfg.precision, cfg.sharding.reduce_dtype)
        # fp16's dynamic loss scaler: forward_backward scales the loss, the trainer unscales and may skip
        self.scaler: LossScaler | None = None
        if cfg.precision == "fp16-mixed":
            self.scaler = LossScaler(cfg.loss_scale, cfg.loss_scale_growth_interval)
        self.module: nn.Module | None = None  # the model as the user built it
        self.optim: torch.optim.Optimizer | None = None
        self.seed = 0  # what a meta-built model's initial values derive from (make_strategy sets train.seed)
        # Compiles each block's forward under train.compile (make_strategy sets it); None: eager
        self.compiler: BlockCompiler | None = None
        self.lora: LoraConfig | None = None  # adapters on the frozen model (lora.rank > 0; make_strategy sets it)
        self.nf4_layers: list[str] = []  # the layers whose frozen weights are stored in NF4 (lora.quantize)
        # parallel.float8: {"recipe", "layers": how many compute in float8, "left_out": names} (parallel/float8.py)
        self.float8: dict[str, Any] | None = None
        self.materialiser: Materialiser | None = None  # a meta-built model's groups and initial values
        self.setup_peak_bytes: int | None = None  # counted bytes at wrap's peak, where the strategy counts them
        self.context: ContextParallel | None = None  # the sequence split over parallel.cp ranks, made by `prepare`
        # The run's device mesh and its process groups (parallel/dims.py): `mesh`, or made here; none in
        # one process without a group.
        self.mesh: Mesh | None = mesh
        self.experts: ExpertParallel | None = None  # which experts this rank holds, under parallel.ep > 1
        # The last step's routing by MoE layer (pairs per expert, max / mean): what metrics.jsonl records.
        self.router_stats: dict[str, list] | None = None
        # The model's state by the plain model's names, for checkpoints and final weights: whole
        # here; a strategy that splits or shards the model makes the view of its layout in `wrap`.
        self.view: StateView = StateView(self)
        if mesh is None and ctx.distributed and not spec(cfg.strategy).parameter_servers:
            self.mesh = Mesh.of(ctx, mesh_of(cfg, ctx.world_size, node_size(ctx.world_size)))
        # Which share of the global batch this rank reads (its place on the mesh's dp ranks), of how
        # many: ranks that split one model between them (pipeline stages, tensor shards) or its
        # sequences (context parallel) read the same share.
        self.data_rank = self.mesh.rank("dp") if self.mesh is not None else 0
        self.data_size = self.mesh.size("dp") if self.mesh is not None else 1

    @classmethod
    def check_config(cls, cfg: Config, world: int) -> None:
        """Raise ConfigError for what only this strategy refuses, before any worker starts
        (validate.py has checked everything else)."""

    # Whether `prepare` makes a meta-built model real whole (and splits its experts): a strategy that
    # keeps less makes real only what it keeps, block by block, in `_split`.
    materialises_whole = True

    # Whether a forward's saved tensors are unpacked by more than one backward call (a split
    # backward's B and W): recomputed blocks then recompute once for both (recompute.py).
    recompute_once = False

    def wrap(self, model: nn.Module) -> nn.Module:
        """Compose this strategy over `model`, in the one order every strategy is composed in, and
        return the module the trainer calls forward on (docs/architecture.md):

        1. settle (`prepare`): the block class, LoRA adapters, the context-parallel split of the
           sequence, which experts this rank keeps; the model on this rank's device, or left on meta;
           the blocks' linear layers computing in float8 (parallel.float8);
        2. cut (`_cut`): a pipeline's stages, this rank's kept and the rest dropped;
        3. split (`_split`): block by block, a meta-built block made real, its experts cut to this
           rank's, split over tp (and sp) by parallel/tensor.py's `parallelize_blocks`, and under
           the sharded strategies sharded as a unit: a rank holds one whole block at a time;
        4. compile the blocks this rank holds (train.compile), then recompute those
           parallel.recompute chooses of the whole model's (the checkpoint around the compiled block);
        5. replicate or shard (`_distribute`): what makes the ranks one model (rank 0's values,
           gradient buckets and their hooks, the units' gathers, a pipeline's schedule).

        Each strategy differs only in the steps it overrides."""
        model = self.prepare(model)
        recomputed = recomputed_blocks(model, self.cfg.recompute, self.cfg.block)  # every K-th of the whole model's
        part = self._cut(model)
        self._split(part)
        if self.compiler is not None:
            self.compiler.compile_blocks(part, self.cfg.block)
        held = {id(module) for module in part.modules()}
        checkpoint_blocks([block for block in recomputed if id(block) in held], self.cfg.recompute,
                          self.recompute_once)
        return self._distribute(part)

    def prepare(self, model: nn.Module) -> nn.Module:
        """`wrap`'s first step: settle the model's block class, add LoRA adapters, split sequences
        over the context-parallel group (the model's positions become global ones), note which
        experts this rank keeps under expert parallel (`parallel.ep`), and put the model on this
        rank's device in the parameters' storage dtype. A meta-built model (shardwise.init_context())
        is materialised there whole, every tensor initialised as `single` initialises it
        (materialise.py), and its experts cut to this rank's; a strategy that keeps less
        (`materialises_whole` false) materialises what it keeps from `self.materialiser` in `_split`
        (the model then stays on meta, in the storage dtype)."""
        self.cfg = dataclasses.replace(self.cfg, block=block_class(model, self.cfg.block))
        if self.lora is not None:
            adapted = apply_lora(model, self.lora.rank, self.lora.alpha, self.lora.dropout, self.lora.targets,
                                 self.seed, self.lora.train)
            self.nf4_layers = adapted if self.lora.quantize == "nf4" else []
        self.context = ContextParallel(self.cfg.cp_mode, self.mesh.group("cp") if self.cfg.cp > 1 else None)
        if self.cfg.cp > 1:
            self.context.feed_positions(*find_positions(model))
        if self.cfg.ep > 1:
            self.experts = ExpertParallel(self.mesh, model)
        if self.cfg.float8 != "none":  # on meta or real modules alike: each keeps its parameters
            self.float8 = convert_to_float8(model, self.cfg.block, self.cfg.float8)
        if not check_one_device_kind(model, f"parallel.strategy = {self.cfg.strategy!r}"):
            model.to(self.ctx.device, self.precision.param_dtype)
        else:
            self.materialiser = Materialiser(model, self.cfg.block, self.seed)
            if not self.materialises_whole:
                return model.to(dtype=self.precision.param_dtype)
            self.materialiser.materialise_all(self.ctx.device, self.precision.param_dtype)
        quantize_layers(model, self.nf4_layers, self.precision.compute_dtype)
        if self.experts is not None:
            self.experts.split(model)
        return model

    def _cut(self, model: nn.Module) -> nn.Module:
        """`wrap`'s second step: the part of `model` this rank keeps (a pipeline's stages; here all of it)."""
        return model

    def _split(self, part: nn.Module) -> None:
        """`wrap`'s third step: this rank's part split block by block (here the model is whole, made
        real by `prepare`)."""

    def _distribute(self, part: nn.Module) -> nn.Module:
        """`wrap`'s last step: `part` made one model with the other ranks' (here there are none); sets
        `self.module` and returns the module the trainer calls forward on."""
        self.module = part
        return part

    def optimizer(self, make: OptimizerFactory) -> torch.optim.Optimizer:
        """The optimizer over what this rank holds and trains (under LoRA, the adapters alone)."""
        self.optim = make([p for p in self.local_parameters() if p.requires_grad])
        return self.optim

    def local_parameters(self) -> list[nn.Parameter]:
        """The parameters (or shards) this rank holds and its optimizer steps on."""
        return list(self.module.parameters())
    def forward_backward(self, model: nn.Module, micro_batches: Iterable[MicroBatch], loss_fn: LossFn,
                         accum: int) -> torch.Tensor:
        """Forward and backward over this rank's `accum` micro-batches of one step, gradients
        synchronised after the last one; return the sum of their mean losses. A pipeline overrides
        this to run its schedule."""
        loss_sum = torch.zeros((), device=self.ctx.device)
        scale = (self.scaler.scale if self.scaler else 1.0) / accum
        for i, batch in enumerate(micro_batches):
            with nullcontext() if i == accum - 1 else self.no_sync(), self.context.split(batch) as (inputs, targets), \
                    moe.loss_scale(model, scale):
                with self.precision.autocast(self.ctx.device):
                    loss = loss_fn(model(inputs), targets)
                scaled = loss / accum
                self.backward(self.scaler.scale_loss(scaled) if self.scaler else scaled)
            loss_sum += loss.detach()
        return loss_sum

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def no_sync(self) -> AbstractContextManager:
        """Inside it, backward only accumulates local gradients (gradient accumulation)."""
        return nullcontext()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so their global L2 norm is at most max_norm; return the norm before.
        Here every rank holds every gradient whole (replicas agree after synchronising), but for
        experts split over ep."""
        grads = local_grads(self.local_parameters())
        if self.experts is not None:
            return self.experts.clip_grad_norm_(grads, max_norm, self.ctx.device)
        return clip_grad_norm_(grads, grads, max_norm, self.ctx.device)

    def update_routers(self) -> None:
        """After an optimizer step: each MoE layer's pairs per expert over the step, summed over the
        ranks that route different tokens (dp and cp; under sequence parallel tp too, each tp rank's
        MoE layers routing its part of the sequence), balance its router and become `router_stats`
        (parallel/experts.py). Collective where there is a mesh."""
        self.router_stats = balance_routers(self.module, routing_groups(self.mesh, self.cfg), self.experts,
                                            self.ctx.device)

    def stage_timeline(self) -> list[dict[str, Any]] | None:
        """A pipeline's last step, stage by stage, for metrics (a collective where there is one);
        None for strategies that do not pipeline."""
        return None

    def memory(self, activations: int) -> MemoryBreakdown:
        return count_memory(self.local_parameters(), self.optim, activations, self.ctx.device)


def mesh_of(p: ParallelConfig, world_size: int, node_size: int | None = None) -> MeshShape:
    """The run's device mesh (parallel/dims.py): `p.mesh_shape`'s dp split into the replicas that average
    their gradients and the ranks the sharded strategies split a replica's state over: all of
    dp under zero1, zero2, fsdp and fsdp-native; hsdp's dp ranks within a node of `node_size`
    ranks (default: the whole world); none under the strategies that replicate."""
    dp, pp, tp = p.mesh_shape(world_size)
    chosen = spec(p.strategy)
    shard = 1
    if chosen.zero_stage:
        shard = dp
        if chosen.across_nodes:
            shard = max(1, min(dp, (node_size or world_size) // (p.cp * pp * tp)))
    return MeshShape(dp // shard, shard, p.cp, pp, tp, ep=p.ep)


def block_class(model: nn.Module, block: str) -> str:
    """`block`, unless it is the default and the model has no module of that class but declares its
    layers (every transformers model does): then the declared layer class, found automatically."""
    if block != DEFAULT_BLOCK or any(type(m).__name__ == block for m in model.modules()):
        return block
    return decoder_layer_class(model) or block


class DeferrableSync(Strategy):
    """A strategy that synchronises gradients in backward unless inside `no_sync()`."""

    _sync = True  # False inside no_sync(): gradients only accumulate locally

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        self._sync = False
        try:
            yield
        finally:
            self._sync = True


class HookedStrategy(DeferrableSync):
    """A strategy that communicates from gradient hooks while backward runs, and finishes in
    one callback after the autograd engine is done (`_finish_backward`)."""

    def _init_backward_state(self) -> None:
        self._in_backward = False

    def _queue_finish_once(self) -> None:
        """Call from every gradient hook: the first call of each backward queues the callback."""
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._run_finish)

    def _run_finish(self) -> None:
        try:
            self._finish_backward()
        finally:
            self._in_backward = False

    def _finish_backward(self) -> None:
        raise NotImplementedError


def routing_groups(mesh: Mesh | None, cfg: ParallelConfig) -> tuple[dist.ProcessGroup, ...]:
    """The groups over which MoE routers' counts are summed, whose ranks route different tokens:
    dp and cp, and under sequence parallel tp (each tp rank's MoE layers route its part of the
    sequence; without it, every tp rank routes the same tokens)."""
    if mesh is None:
        return ()
    split = (mesh.group("tp"),) if cfg.sequence_parallel and mesh.size("tp") > 1 else ()
    return (mesh.group("dp_cp"), *split)
