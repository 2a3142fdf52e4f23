"""What the planner knows about a model's parameters without allocating it: their shapes per unit,
read from the model built on the `meta` device (what it saves for backward is planner/traces.py's).

Nothing here is a formula for a transformer, nor a list of one model's module names: the model a
config names is built (shardwise's GPT, or any transformers family), its repeated block found by
class (models/hf.py finds a transformers model's), and the rest read from it: a block's parameters
(every block has the same), the embeddings outside the blocks (what a first pipeline stage holds)
and every other parameter outside them (final norm and head: the last stage's; a tied head is the
embedding's weight, on both).

A tensor-parallel rank's block is the block split by the strategy's own code
(parallel/tensor.py, as the family's parallel plan in models/plans.py lays it out), on one rank
whose collectives answer with the shapes they would (`ShapesOnly`).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
from torch import nn

from shardwise.config.schema import DEFAULT_BLOCK, LANGUAGE_MODELS, MOE_MODELS, LoraConfig, ModelConfig
from shardwise.lora import apply_lora
from shardwise.models import build_model, plans
from shardwise.models.hf import decoder_layer_class
from shardwise.models.moe import moe_layers, their_experts
from shardwise.models.plans import locate
from shardwise.parallel.float8 import float8_layers
from shardwise.parallel.pipeline.stages import balanced_split
from shardwise.parallel.shard import sharded_shape
from shardwise.parallel.tensor import parallelize_blocks
from shardwise.parallel.tensor_group import ShapesOnly


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
    float8: Tensors = Tensors(())  # one block's weights parallel.float8 computes with (part of `block`)

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

    def muon_matrices(self, world: int) -> tuple[int, int]:
        """(elements, tensors) of what Muon steps by default (train.muon.params unset: the blocks'
        parameters of 2 dims and more) in one rank's padded shards over `world` ranks (1: whole),
        a block's experts over the world / ep ranks holding the same ones, as `unit_shards`."""
        return _muon_matrices(self, world)


def in_units(facts: ModelFacts, blocks: int) -> ModelFacts:
    """`facts` as the sharded strategies' units hold them with `blocks` consecutive blocks a unit
    (parallel.sharding.blocks_per_unit, which divides the blocks): each unit's parameters as one
    block's, n_layer / blocks of them. Totals, shards and what the optimizer steps are `facts`'."""
    if blocks == 1:
        return facts
    return dataclasses.replace(facts, shape=dataclasses.replace(facts.shape, n_layer=facts.n_layer // blocks),
                               block=Tensors(facts.block.shapes * blocks),
                               experts=Tensors(facts.experts.shapes * blocks),
                               float8=Tensors(facts.float8.shapes * blocks))


def fsdp_gathered_numel(facts: ModelFacts, world: int, prefetch: int, reshard_after_forward: bool) -> int:
    """fsdp's most gathered elements at once (what it reports as `gathered_peak`): the root, whole
    for the step, the unit computing, and the all-gather buffers of the `prefetch` units issued
    ahead, each every rank's padded shards. Without resharding, every unit stays whole after its
    forward until its backward. (With none issued ahead, no prefetch or a single unit, the reported
    peak is one buffer more: a unit's own, as it is copied out; no step's peak is there.)"""
    blocks = facts.n_layer
    if not blocks:
        return facts.root.numel
    computing = blocks * facts.block.numel if not reshard_after_forward else facts.block.numel
    return facts.root.numel + computing + min(prefetch, blocks - 1) * facts.unit_padded(world)[0]


def fsdp_gathered_bytes(facts: ModelFacts, world: int, prefetch: int, reshard_after_forward: bool, element: int,
                        float8: bool) -> int:
    """fsdp's most gathered bytes at once: `fsdp_gathered_numel`'s elements, `element` bytes each,
    but with `float8` (parallel.float8 = "tensorwise": parallel/float8_gather.py) the blocks' float8
    weights one byte each, gathered and whole."""
    whole = fsdp_gathered_numel(facts, world, prefetch, reshard_after_forward) * element
    if not float8 or not facts.n_layer:
        return whole
    computing = facts.n_layer if not reshard_after_forward else 1
    in_float8 = computing * facts.float8.numel + min(prefetch, facts.n_layer - 1) * world * \
        facts.float8.sharded_numel(world)
    return whole - in_float8 * (element - 1)


@functools.cache  # the search asks for every candidate's
def _muon_matrices(facts: ModelFacts, world: int) -> tuple[int, int]:
    dense = Tensors(tuple(s for s in facts.dense.shapes if len(s) >= 2))
    experts = Tensors(tuple(s for s in facts.experts.shapes if len(s) >= 2))
    numel = dense.sharded_numel(world) + experts.sharded_numel(max(1, world // facts.ep), fold=True)
    return facts.n_layer * numel, facts.n_layer * (dense.count + experts.count)


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
    # the weights parallel.float8 would compute with (those of the part counted: a filtered view holds no other)
    layers = float8_layers(blocks[0], type(blocks[0]).__name__)[0]
    float8 = [w for w in (layer._parameters.get("weight") for layer in layers) if w is not None]
    return ModelFacts(shape, _tensors(list(blocks[0].parameters())), _tensors(root), _tensors(embeddings),
                      _tensors(head), tied, _tensors(experts), float8=_tensors(float8))


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


@functools.cache
def split_refusal(shape: ModelShape) -> str | None:
    """Why the model-splitting strategies (tensor, pipeline, the sharded ones over tp or stages)
    cannot split a model of `shape` as its family's plan lays it out (a transformers family whose
    model holds more than its plan names: a vision tower beside its layers), or None."""
    try:
        locate(meta_model(shape, 2))
    except plans.PlanError as error:
        return str(error)
    return None


def parallelize_for_planning(model: nn.Module, tp: int, sequence_parallel: bool = False) -> None:
    """Every block of `model` as rank 0 of `tp` tensor-parallel ranks holds and runs it: split by the
    own code of tensor parallel (parallel/tensor.py) as the model family's parallel plan lays it out, its
    collectives answering with the shapes they would (`ShapesOnly`)."""
    located = locate(model)
    parallelize_blocks(located.blocks, located.plan, ShapesOnly(tp), sequence_parallel, model=model)


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
