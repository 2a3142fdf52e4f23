"""What the planner knows about a model without allocating it: parameter shapes per unit (from a
model built on the `meta` device) and the bytes each part saves for backward (from one forward
on fake tensors through the real model code, counted by the trainer's own ActivationCounter).

Nothing here is a formula for a transformer, nor a list of one model's module names: the model a
config names is built (shardwise's GPT, or a transformers Llama, Qwen2 or GPT-2), its repeated
block found by class (models/hf.py finds a transformers model's), and the rest read from it:
- parameters: a block's (every block has the same), the embeddings outside the blocks (what a
  first pipeline stage holds) and every other parameter outside them (final norm and head: the
  last stage's; a tied head is the embedding's weight, on both);
- saved bytes along depth: a trace at 2 blocks, marked before the first block and after each,
  gives the embeddings' part (before the blocks), one block's (the second's), what a stage saves
  once whatever its blocks (a Llama's rotary cos/sin, shared by every block of a stage: the
  first block's bytes less the second's) and the head's part (after the blocks: final norm,
  head, loss); one of 2 blocks under `every:2` (block 0 checkpointed, block 1 not) gives a
  checkpointed block's bytes, one of 1 block a `selective` one's;
- along the batch: every saved tensor is either per sample or fixed (the weight copies autocast
  makes, the position ids), so traces at two batch sizes give both parts.
The counter's peak is the end of the forward: backward only releases what the forward saved
(recomputation keeps its tensors out of the counter's sight, as it does in a real run).
`tests/test_planner.py` holds the composition to a full-depth trace and to real runs.

A tensor-parallel rank's block is the block split by the strategy's own code
(parallel/tensor.py, as the family's parallel plan in models/plans.py lays it out), on one rank
whose collectives answer with the shapes they would (`ShapesOnly`): so what a rank saves is
traced, sequence parallel's split residual stream and re-gathered column inputs included.

The same fake forward also counts the operators it dispatches, for the time model's per-operator
overhead.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Generic, TypeVar

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from shardwise.config.schema import DEFAULT_BLOCK, LANGUAGE_MODELS, MOE_MODELS, LoraConfig, ModelConfig
from shardwise.lora import Adapter, apply_lora
from shardwise.memory import ActivationCounter
from shardwise.models import build_model, loss_fn
from shardwise.models.hf import decoder_layer_class
from shardwise.models.moe import moe_layers, their_experts
from shardwise.models.plans import locate
from shardwise.nf4 import quantize_layers
from shardwise.parallel.pipeline.stages import balanced_split
from shardwise.parallel.shard import sharded_shape
from shardwise.parallel.tensor import ShapesOnly, parallelize_blocks
from shardwise.planner.fake_forward import balanced_routing, fits_real_trace, one_loss_chunk, one_sequence_per_row
from shardwise.recompute import apply_recompute, parse_policy


class PlanError(ValueError):
    """The plan cannot be made as asked; the message says what was wrong and what would work."""


@dataclass(frozen=True)
class Affine:
    """Bytes as a function of the micro-batch: `fixed + per_sample * batch`."""

    fixed: int
    per_sample: int

    def at(self, batch: float) -> int:
        return int(self.fixed + self.per_sample * batch)

    def __add__(self, other: Affine) -> Affine:
        return Affine(self.fixed + other.fixed, self.per_sample + other.per_sample)

    def __sub__(self, other: Affine) -> Affine:
        return Affine(self.fixed - other.fixed, self.per_sample - other.per_sample)

    def __mul__(self, times: int) -> Affine:
        return Affine(self.fixed * times, self.per_sample * times)


NOTHING = Affine(0, 0)


@dataclass(frozen=True)
class ModelShape:
    """The model a ModelConfig (presets resolved) names: hashable, for caching."""

    name: str
    n_layer: int
    n_head: int
    n_kv_head: int
    d_model: int
    d_ff: int
    seq_len: int
    vocab_size: int
    bias: bool = False
    hf_config: str | None = None  # a transformers config.json whose architecture an hf-* model follows
    head_dim: int | None = None  # hf-qwen3-moe's heads' own width
    # The Mixture-of-Experts models' experts and routing (models/moe.py); None for a dense model.
    n_experts: int | None = None
    top_k: int | None = None
    d_expert: int | None = None
    router_score: str = "softmax"
    balance: str = "aux-loss"
    shared_expert: bool = False
    # LoRA's adapters on the frozen model (lora.py): their rank (0: none) and targets (None: the family's)
    lora_rank: int = 0
    lora_targets: tuple[str, ...] | None = None
    lora_train: tuple[str, ...] | None = None
    lora_quantize: str = "none"  # `nf4`: the adapted layers' weights stored in 4 bits (nf4.py)

    def config(self, n_layer: int | None = None) -> ModelConfig:
        sizes = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("lora_")}
        return ModelConfig(**{**sizes, "n_layer": n_layer or self.n_layer})

    def build(self, n_layer: int | None = None) -> nn.Module:
        """The model, with `n_layer` blocks if given, on the current default device (or fake mode),
        with its adapters where it has them (their values do not matter here: alpha and seed 1)."""
        model = build_model(self.config(n_layer))
        if self.lora_rank:
            targets = list(self.lora_targets) if self.lora_targets is not None else None
            apply_lora(model, self.lora_rank, 1.0, 0.0, targets, seed=1, train=list(self.lora_train or ()))
        return model


def model_shape(cfg: ModelConfig, lora: LoraConfig | None = None) -> ModelShape:
    """The planner's key for the model `cfg` names (with `lora`'s adapters where its rank is above
    0); PlanError for a model it cannot plan."""
    if cfg.name not in LANGUAGE_MODELS:
        raise PlanError(f"model.name = {cfg.name!r}: the planner plans language models ({', '.join(LANGUAGE_MODELS)})")
    if cfg.name == "hf-deepseek-v3":
        raise PlanError("model.name = 'hf-deepseek-v3': the planner takes every block to be alike, and "
                        "DeepSeek-V3's first blocks are dense, the rest MoE; plan hf-qwen3-moe or gpt-moe of its "
                        "sizes")
    experts = {key: getattr(cfg, key) for key in ("n_experts", "top_k", "d_expert", "router_score", "balance",
                                                   "shared_expert")} if cfg.name in MOE_MODELS else {}
    if cfg.name == "hf":  # any family: the expert counts its config file names (the rest is the model's own)
        experts = {key: getattr(cfg, key) for key in ("n_experts", "top_k") if getattr(cfg, key) is not None}
    adapters = {"lora_rank": lora.rank, "lora_targets": None if lora.targets is None else tuple(lora.targets),
                "lora_train": tuple(lora.train or ()), "lora_quantize": lora.quantize} \
        if lora is not None and lora.rank > 0 else {}
    return ModelShape(cfg.name, cfg.n_layer, cfg.n_head, cfg.n_kv_head, cfg.d_model, cfg.d_ff, cfg.seq_len,
                      cfg.vocab_size, cfg.bias, cfg.hf_config, cfg.head_dim, **experts, **adapters)


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks, in order: the GPT's `Block`s, a transformers model's declared layers."""
    block = decoder_layer_class(model) or DEFAULT_BLOCK
    return [m for m in model.modules() if type(m).__name__ == block]


@dataclass(frozen=True)
class Tensors:
    """Shapes and count of some parameters: enough for every sharding layout."""

    shapes: tuple[tuple[int, ...], ...]

    @functools.cached_property
    def numel(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)

    @property
    def count(self) -> int:
        return len(self.shapes)

    def sharded_numel(self, world: int, fold: bool = False) -> int:
        """Elements of one rank's dim-0 shards, each padded to ceil(rows / world) rows as our
        sharded strategies (and torch.chunk) lay them out; with `fold` (experts), of each split as
        parallel/shard.py's sharded_shape splits it."""
        shapes = [sharded_shape(s, world, fold) for s in self.shapes]
        return sum(math.ceil(s[0] / world) * math.prod(s[1:]) for s in shapes)


def _tensors(params: list[nn.Parameter]) -> Tensors:
    return Tensors(tuple(tuple(p.shape) for p in params))


def _distinct(params: list[nn.Parameter]) -> list[nn.Parameter]:
    return list({id(p): p for p in params}.values())


@dataclass(frozen=True)
class ModelFacts:
    """A model's parameters per unit (its blocks, then the root: everything else), counted on the
    meta device, each distinct parameter once; and the root split as pipeline stages hold it."""

    shape: ModelShape
    block: Tensors  # one block's; every block has the same
    root: Tensors  # outside the blocks, each parameter once
    embeddings: Tensors  # a first stage's part of the root
    head: Tensors  # a last stage's: final norm, head (a tied head is the embedding's weight, here too)
    tied: int  # elements of the parameters both ends hold (a tied head's)
    experts: Tensors = Tensors(())  # one block's routed experts as a rank holds them (part of `block`)
    ep: int = 1  # the data-parallel ranks each layer's experts are split over

    @functools.cached_property
    def dense(self) -> Tensors:
        """One block's parameters but its routed experts: what every data-parallel rank holds."""
        rest = list(self.block.shapes)
        for shape in self.experts.shapes:
            rest.remove(shape)
        return Tensors(tuple(rest))

    @functools.cached_property
    def block_active(self) -> int:
        """One block's parameters a token computes with: in an MoE layer, its `top_k` experts of
        `n_experts` (of the whole layer, wherever its experts are)."""
        n, k = self.shape.n_experts, self.shape.top_k
        if not self.experts.count or n is None or k is None:  # dense, or a family whose routing we do not know
            return self.block.numel
        return self.dense.numel + self.experts.numel * self.ep * k // n

    @property
    def active_total(self) -> int:
        """The parameters a token computes with (the model's, not one rank's)."""
        return self.params_total - self.n_layer * (self.block.numel - self.block_active)

    @property
    def n_layer(self) -> int:
        return self.shape.n_layer

    @property
    def units(self) -> list[Tensors]:
        return [self.block] * self.n_layer + [self.root]

    @functools.cached_property
    def params_total(self) -> int:
        return self.block.numel * self.n_layer + self.root.numel

    @property
    def tensor_count(self) -> int:
        return self.block.count * self.n_layer + self.root.count

    def stage(self, first: bool, last: bool, blocks: int) -> tuple[int, int]:
        """(elements, tensors) a pipeline stage of `blocks` blocks holds: the embeddings on the
        first stage, the final norm and head on the last, a tied weight on both."""
        return _stage(self, first, last, blocks)

    def stage_facts(self, first: bool, last: bool, blocks: int) -> ModelFacts:
        """What a pipeline rank holds, as a model of its own: `blocks` blocks, and as its root the
        first stage's embeddings and the last stage's final norm and head where it holds those
        stages (what the sharded strategies over pipeline stages make units of)."""
        ends = self.root if first and last else Tensors(
            (self.embeddings.shapes if first else ()) + (self.head.shapes if last else ()))
        return ModelFacts(dataclasses.replace(self.shape, n_layer=blocks), self.block, ends,
                          self.embeddings if first else Tensors(()), self.head if last else Tensors(()),
                          self.tied if first and last else 0, self.experts, self.ep)

    def unit_shards(self, world: int) -> tuple[int, ...]:
        """Elements of one rank's padded shards of each unit over `world` ranks (Tensors.sharded_numel);
        a block's experts over the world / ep ranks that hold the same ones."""
        return tuple(shard for shard, _ in _unit_layout(self, world))

    def unit_padded(self, world: int) -> tuple[int, ...]:
        """Elements of each unit as its collectives over `world` ranks move it: every rank's padded
        shards (a block's experts: those of the world / ep ranks holding the same ones)."""
        return tuple(whole for _, whole in _unit_layout(self, world))

    def padded_numel(self, world: int) -> int:
        """Elements of every unit as its collectives move it (`unit_padded`), together: what a
        rank of zero1 and zero2 holds whole."""
        return sum(self.unit_padded(world))

    def shard_numel(self, world: int) -> int:
        """Elements of one rank's padded shards of the whole model over `world` ranks."""
        return sum(self.unit_shards(world))


@functools.cache  # the search asks for the same world's shards thousands of times
def _unit_layout(facts: ModelFacts, world: int) -> tuple[tuple[int, int], ...]:
    """(one rank's padded shards, every rank's) of each unit over `world` ranks."""
    replicas = world // facts.ep  # the ranks holding the same experts
    block = facts.dense.sharded_numel(world), facts.experts.sharded_numel(replicas, fold=True)
    blocks = ((sum(block), world * block[0] + replicas * block[1]),) * facts.n_layer
    root = facts.root.sharded_numel(world)
    return (*blocks, (root, world * root))


@functools.cache
def _stage(facts: ModelFacts, first: bool, last: bool, blocks: int) -> tuple[int, int]:
    if first and last:
        ends = facts.root
    else:
        ends = Tensors((facts.embeddings.shapes if first else ()) + (facts.head.shapes if last else ()))
    return ends.numel + blocks * facts.block.numel, ends.count + blocks * facts.block.count


@functools.cache
def meta_model(shape: ModelShape, n_layer: int | None = None) -> nn.Module:
    """The model of `shape` (with `n_layer` blocks if given) on the meta device: shapes, no memory."""
    with torch.device("meta"):
        return shape.build(n_layer)


def _split_facts(shape: ModelShape, model: nn.Module, part: str = "all") -> ModelFacts:
    """The facts of `model`'s parameters, or of those that train or are frozen (`part`:
    "trainable", "frozen"; LoRA's adapters train, the rest of its model is frozen)."""
    if part != "all":
        model = _only(model, trains=part == "trainable")
    blocks = model_blocks(model)
    in_blocks = {id(p) for p in blocks[0].parameters()}
    embeddings: list[nn.Parameter] = []
    head: list[nn.Parameter] = []
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in in_blocks]
        (embeddings if isinstance(module, nn.Embedding) else head).extend(own)
    in_blocks |= {id(p) for block in blocks[1:] for p in block.parameters()}
    root = [p for p in model.parameters() if id(p) not in in_blocks]
    embeddings, head = _distinct(embeddings), _distinct(head)
    tied = sum(p.numel() for p in embeddings if any(p is q for q in head))
    experts = [p for layer in moe_layers(blocks[0]) for p in layer.experts.parameters()]
    experts += [p for module in their_experts(blocks[0]) for p in module.parameters()]
    return ModelFacts(shape, _tensors(list(blocks[0].parameters())), _tensors(root), _tensors(embeddings),
                      _tensors(head), tied, _tensors(experts))


def _only(model: nn.Module, trains: bool) -> nn.Module:
    """A shallow view of `model` whose parameters are those that train (or are frozen): each module
    copied with the others left out, so the facts count only the kept ones."""
    clone = copy.copy(model)
    clone._parameters = {k: p for k, p in model._parameters.items() if p is not None and p.requires_grad == trains}
    clone._modules = {k: _only(m, trains) for k, m in model._modules.items() if m is not None}
    return clone


@functools.cache
def model_facts(shape: ModelShape, part: str = "all") -> ModelFacts:
    """Parameter shapes per unit, read from a one-block meta copy of the model; `part`: of the
    parameters that train, or are frozen (LoRA), or all."""
    if part == "trainable" and not shape.lora_rank:  # every parameter trains: the same facts, cached once
        return model_facts(shape)
    return _split_facts(shape, meta_model(shape, 1), part)


def parallelize_for_planning(model: nn.Module, tp: int, sequence_parallel: bool = False) -> None:
    """Every block of `model` as rank 0 of `tp` tensor-parallel ranks holds and runs it: split by the
    own code of tensor parallel (parallel/tensor.py) as the model family's parallel plan lays it out, its
    collectives answering with the shapes they would (`ShapesOnly`)."""
    located = locate(model)
    parallelize_blocks(located.blocks, located.plan, ShapesOnly(tp), sequence_parallel)


@functools.cache
def rank_facts(shape: ModelShape, tp: int, ep: int = 1, part: str = "all") -> ModelFacts:
    """The parameters one tensor-parallel rank holds: blocks split `tp` ways, the rest whole; with
    expert parallel, each layer's experts split `ep` ways (the MoE layers are whole on every tp
    rank: models/plans.py). `part`: of the parameters that train, or are frozen (LoRA), or all."""
    if part == "trainable" and not shape.lora_rank:
        return rank_facts(shape, tp, ep)
    if ep > 1:
        whole = rank_facts(shape, tp, part=part)
        share = Tensors(tuple((rows // ep, *rest) for rows, *rest in whole.experts.shapes))
        return dataclasses.replace(whole, block=Tensors(whole.dense.shapes + share.shapes), experts=share, ep=ep)
    if tp == 1:
        return model_facts(shape, part)
    with torch.device("meta"):
        model = shape.build(1)
        parallelize_for_planning(model, tp)
    return _split_facts(shape, model, part)


@functools.cache
def stage_bounds(shape: ModelShape, pp: int) -> tuple[tuple[int, int], ...]:
    """[start, stop) of each pipeline stage's blocks, balanced by parameter count as the pipeline
    strategy cuts them (its function, on the counts: the first block counting the embeddings, the
    last the final norm and head)."""
    facts = model_facts(shape)
    sizes = [facts.block.numel] * shape.n_layer
    sizes[0] += facts.embeddings.numel
    sizes[-1] += facts.head.numel
    starts = [0, *balanced_split(sizes, pp)]
    return tuple(zip(starts, [*starts[1:], shape.n_layer], strict=True))


@dataclass(frozen=True)
class TraceKey:
    """What decides the bytes a forward saves: the model, the dtype parameters have while computing,
    autocast's dtype (None: off), the tensor split, whether sequence parallel splits the rest, and
    the context-parallel ranks a sequence is split over (a rank's forward is over seq_len / cp
    tokens), and the dtype LoRA's frozen parameters have if not `param_dtype` (zero1 and zero2 keep
    them whole in the stored dtype, where autocast casts them at each use)."""

    shape: ModelShape
    param_dtype: torch.dtype
    autocast: torch.dtype | None = None
    tp: int = 1
    sequence_parallel: bool = False
    cp: int = 1
    frozen_dtype: torch.dtype | None = None

    @property
    def local_shape(self) -> ModelShape:
        """The model as one rank runs it: over its seq_len / cp tokens."""
        return dataclasses.replace(self.shape, seq_len=self.shape.seq_len // self.cp) if self.cp > 1 else self.shape


class OpCounter(TorchDispatchMode):
    """Counts the operators a forward dispatches: each one is a kernel launch (or, on a CPU, a
    trip through the dispatcher) whatever its size."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: object, types: object, args: tuple = (), kwargs: dict | None = None) -> object:
        self.ops += 1
        return func(*args, **(kwargs or {}))


Size = TypeVar("Size", int, Affine)


@dataclass(frozen=True)
class Marks(Generic[Size]):
    """What one forward and loss saved for backward (bytes) or dispatched (operators), counted
    before the first block, after each block, and in all."""

    before: Size
    ends: tuple[Size, ...]
    total: Size


def _trace(key: TraceKey, n_layer: int, policy: str, batches: tuple[int, ...],
           ops: bool = False) -> list[Marks[int]]:
    """The bytes saved for backward (with `ops`, the operators dispatched) by one forward and loss
    at each of `batches` of the model with `n_layer` blocks on fake tensors, as an
    ActivationCounter sees them (MoE layers routing evenly: `_balanced_routing`)."""
    shape = key.local_shape
    # Real tensors for a small model (its initialisation on a fork of the caller's RNG), but not for
    # NF4 layers, whose packed weights only fake matmuls take, nor to count operators.
    hidden = max(shape.d_ff, (shape.d_expert or 0) * (shape.n_experts or 1))
    real = not ops and shape.lora_quantize == "none" and \
        fits_real_trace(shape.vocab_size, shape.d_model, hidden, max(batches) * shape.seq_len)
    try:
        return _traced(key, n_layer, policy, batches, ops, real)
    except PlanError:
        raise
    except Exception as error:
        if shape.name != "hf":
            raise
        # any family: one whose construction or forward fake tensors cannot follow (a data-dependent
        # shape, a module that swaps its own tensors) is refused by name, not a traceback
        raise PlanError(f"model.hf_config = {shape.hf_config!r}: the planner cannot trace the family's model on fake "
                        f"tensors ({type(error).__name__}: {str(error).splitlines()[0][:200]})") from None


def _traced(key: TraceKey, n_layer: int, policy: str, batches: tuple[int, ...], ops: bool,
            real: bool) -> list[Marks[int]]:
    shape = key.local_shape
    with contextlib.nullcontext() if real else FakeTensorMode(allow_non_fake_inputs=True), \
            torch.random.fork_rng(devices=[]), one_sequence_per_row(shape.name), one_loss_chunk():
        model = shape.build(n_layer)
        for param in model.parameters():  # as the strategies do (Module.to cannot swap fake tensors)
            frozen = not param.requires_grad and key.frozen_dtype is not None
            param.data = param.data.to(key.frozen_dtype if frozen else key.param_dtype)
        if shape.lora_quantize == "nf4":  # its NF4 layers keep no weight for backward, cast or not
            adapted = [name for name, m in model.named_modules() if isinstance(getattr(m, "lora", None), Adapter)]
            quantize_layers(model, adapted, key.autocast or key.param_dtype)
        if key.tp > 1:
            parallelize_for_planning(model, key.tp, key.sequence_parallel)
        blocks = model_blocks(model)
        apply_recompute(model, policy, type(blocks[0]).__name__)
        with balanced_routing(model):
            return [_marks(model, blocks, key, batch, ops) for batch in batches]


def _marks(model: nn.Module, blocks: list[nn.Module], key: TraceKey, batch: int, ops: bool) -> Marks[int]:
    # As the data loader gives them: inputs and targets are two views of one window of tokens.
    window = torch.zeros(batch, key.local_shape.seq_len + 1, dtype=torch.long)
    tokens, targets = window[:, :-1], window[:, 1:]
    autocast = torch.autocast("cpu", dtype=key.autocast, enabled=key.autocast is not None)
    counter, dispatched = ActivationCounter(model), OpCounter()
    marks: list[int] = []

    def mark(*_: object) -> None:
        marks.append(dispatched.ops if ops else counter.live_bytes)

    hooks = [blocks[0].register_forward_pre_hook(mark), *(block.register_forward_hook(mark) for block in blocks)]
    # One listener at a time: the counter's own work on what autograd saves (it keeps each tensor
    # detached) would count among the model's operators.
    with dispatched if ops else counter, autocast:
        loss_fn(model(tokens), targets)
    for hook in hooks:
        hook.remove()
    return Marks(marks[0], tuple(marks[1:]), dispatched.ops if ops else counter.bytes)


def _line(two: int, three: int) -> Affine:
    return Affine(3 * two - 2 * three, three - two)


@functools.cache
def _affine(key: TraceKey, n_layer: int, policy: str) -> Marks[Affine]:
    """Marks as functions of the batch: traced; or, split over 8, 12, 16... context-parallel ranks,
    read off the line through the marks over the whole sequence and half of it, where the marks
    over a quarter of it lie on that line too."""
    if key.cp > 4 and key.cp % 4 == 0:
        whole, half, quarter = (_affine(dataclasses.replace(key, cp=cp), n_layer, policy) for cp in (1, 2, 4))
        derived = _along_length(whole, half, key.cp)
        if derived is not None and _along_length(whole, half, 4) == quarter:
            return derived
    # Batches 2 and 3, not 1: at batch 1 the targets' flattened view needs no copy, so it shares the
    # inputs' storage, and a line through batch 1 would miss a per-sample copy larger batches make.
    two, three = _trace(key, n_layer, policy, (2, 3))
    return Marks(_line(two.before, three.before), tuple(map(_line, two.ends, three.ends)),
                 _line(two.total, three.total))


def _along_length(whole: Marks[Affine], half: Marks[Affine], cp: int) -> Marks[Affine] | None:
    """The marks over 1/cp of the sequence on the line through `whole` and `half` (over all of it
    and half of it); None where that is not a whole number of bytes. A forward saves tensors of
    one row per token or of a fixed size (flash attention keeps no sequence x sequence scores; a
    causal mask is the kernel's, not a tensor), so the bytes are linear in the length: `_affine`
    checks it at a quarter of the length before relying on it."""
    def at(all_tokens: int, half_tokens: int) -> Fraction:
        return half_tokens + Fraction(half_tokens - all_tokens) * (cp - 2) / cp

    pairs = zip((whole.before, *whole.ends, whole.total), (half.before, *half.ends, half.total), strict=True)
    parts = [(at(w.fixed, h.fixed), at(w.per_sample, h.per_sample)) for w, h in pairs]
    if any(v.denominator != 1 for part in parts for v in part):
        return None
    before, *ends, total = (Affine(int(fixed), int(per_sample)) for fixed, per_sample in parts)
    return Marks(before, tuple(ends), total)


class SavedBytes:
    """What one part of the model saves for backward per micro-batch, by part and policy; each
    part traced the first time it is asked for (`saved_bytes` keeps one of these per key)."""

    def __init__(self, key: TraceKey) -> None:
        self.key = key

    @functools.cached_property
    def _none(self) -> Marks[Affine]:
        return _affine(self.key, 2, "none")

    @functools.cached_property
    def block(self) -> Affine:
        """One block, not recomputed: the second's (the first also saves what blocks share)."""
        return self._none.ends[1] - self._none.ends[0]

    @property
    def embeddings(self) -> Affine:
        """Before the blocks, on a first stage: the token (and position) ids."""
        return self._none.before

    @functools.cached_property
    def per_stage(self) -> Affine:
        """Saved once by a stage's blocks whatever their number, if any of them keeps what it saves
        (a Llama's rotary cos/sin, which recomputed blocks compute again)."""
        return self._none.ends[0] - self._none.before - self.block

    @functools.cached_property
    def head(self) -> Affine:
        """After the blocks, on a last stage: final norm, head and loss."""
        return self._none.total - self._none.ends[-1]

    @property
    def outside(self) -> Affine:
        """Outside the blocks on one stage holding them all, not recomputed."""
        return self.embeddings + self.per_stage + self.head

    @functools.cached_property
    def checkpointed(self) -> Affine:
        """One block under `blocks` / `every:K`: its input."""
        return _affine(self.key, 2, "every:2").total - self.outside - self.block

    @functools.cached_property
    def selective(self) -> Affine:
        """One block under `selective`."""
        return _affine(self.key, 1, "selective").total - self.embeddings - self.head

    def stage_affine(self, start: int, stop: int, first: bool, last: bool, policy: str) -> Affine:
        """Bytes saved by the stage holding blocks [start, stop), as a function of the micro-batch."""
        kind, every = parse_policy(policy)
        blocks = stop - start
        ends = (self.embeddings if first else NOTHING) + (self.head if last else NOTHING)
        if kind == "selective":
            return ends + self.selective * blocks
        # blocks 0, K, 2K, ... are checkpointed (`every:1` is `blocks`)
        checkpointed = 0 if kind == "none" else len(range(-(-start // every) * every, stop, every))
        kept = blocks - checkpointed
        return ends + (self.per_stage if kept else NOTHING) + self.checkpointed * checkpointed + self.block * kept

    def stage(self, start: int, stop: int, first: bool, last: bool, policy: str, batch: float) -> int:
        """Bytes saved by the stage holding blocks [start, stop) for one micro-batch of `batch`."""
        return self.stage_affine(start, stop, first, last, policy).at(batch)


@functools.cache
def saved_bytes(key: TraceKey) -> SavedBytes:
    """The saved-bytes parts of `key`'s model, traced on two-block models (one, selective) as needed."""
    return SavedBytes(key)


@dataclass(frozen=True)
class ForwardOps:
    """Operators one forward dispatches: per block, and outside the blocks (embeddings, head, loss)."""

    block: int
    outside: int


@functools.cache
def forward_ops(shape: ModelShape) -> ForwardOps:
    """Traced on fake tensors at two blocks; the count depends on neither batch nor width."""
    (marks,) = _trace(TraceKey(shape, torch.float32), 2, "none", (2,), ops=True)
    if len(marks.ends) != 2:  # a family whose forward runs its layers otherwise than once each, in order
        raise PlanError(f"model.hf_config = {shape.hf_config!r}: the traced forward of 2 blocks ran a block "
                        f"{len(marks.ends)} times (the planner counts a block's work as one pass through each)")
    block = marks.ends[1] - marks.ends[0]
    return ForwardOps(block, marks.total - 2 * block)
