"""What the planner knows about a model without allocating it: parameter shapes per unit (from a
model built on the `meta` device) and the bytes each part saves for backward (from one forward
on fake tensors through the real model code, counted by the trainer's own ActivationCounter).

Nothing here is a formula for a transformer: change the model and the numbers follow.

Saved bytes are traced on shallow copies of the model and composed, because a forward through a
70B model's 80 blocks takes seconds even on fake tensors, and the planner needs dozens of them:
- along depth: every block of a GPT saves the same, so a stage of n blocks saves its outside part
  (embeddings' inputs on the first stage; the final norm, head and loss on the last) plus n
  blocks' worth; the traces at 1 and 2 blocks give both, and one of 2 blocks under `every:2`
  (block 0 checkpointed, block 1 not) gives a checkpointed block's bytes;
- along the batch: every saved tensor is either per sample or fixed (the weight copies autocast
  makes, the position ids), so traces at two batch sizes give both parts.
The counter's peak is the end of the forward: backward only releases what the forward saved
(recomputation keeps its tensors out of the counter's sight, as it does in a real run).
`tests/test_planner.py` holds the composition to a full-depth trace and to real runs.

The same fake forward also counts the operators it dispatches, for the time model's per-operator
overhead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from shardwise.config import ModelConfig
from shardwise.memory import ActivationCounter
from shardwise.models import GPT, GPTConfig, loss_fn
from shardwise.recompute import apply_recompute, parse_policy
from shardwise.strategies.pipeline import GPTStage, balanced_split, parameter_counts
from shardwise.strategies.tensor import LocalHeadsAttention

BLOCK = "Block"


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


class SavedBytes:
    """What one part of the model saves for backward per micro-batch, by part and policy; each
    part traced the first time it is asked for (`saved_bytes` keeps one of these per key)."""

    def __init__(self, key: TraceKey) -> None:
        self.key = key

    @functools.cached_property
    def _whole_one(self) -> Affine:
        return _affine(self.key, 1, "none", True, True)

    @functools.cached_property
    def block(self) -> Affine:
        """One block, not recomputed."""
        return _affine(self.key, 2, "none", True, True) - self._whole_one

    @functools.cached_property
    def outside(self) -> Affine:
        """Outside the blocks: token and position ids, final norm, head and loss."""
        return self._whole_one - self.block

    @functools.cached_property
    def first(self) -> Affine:
        """Outside the blocks on a first stage: the token and position ids."""
        return _affine(self.key, 1, "none", True, False) - self.block

    @functools.cached_property
    def checkpointed(self) -> Affine:
        """One block under `blocks` / `every:K`: its input."""
        return _affine(self.key, 2, "every:2", True, True) - self.outside - self.block

    @functools.cached_property
    def selective(self) -> Affine:
        """One block under `selective`."""
        return _affine(self.key, 1, "selective", True, True) - self.outside

    def stage(self, start: int, stop: int, first: bool, last: bool, policy: str, batch: float) -> int:
        """Bytes saved by the stage holding blocks [start, stop) for one micro-batch of `batch`."""
        kind, every = parse_policy(policy)
        if first and last:
            total = self.outside
        else:
            total = (self.first if first else Affine(0, 0)) + (self.outside - self.first if last else Affine(0, 0))
        for index in range(start, stop):
            if kind == "none":
                total += self.block
            elif kind == "selective":
                total += self.selective
            else:  # blocks 0, K, 2K, ... are checkpointed (`every:1` is `blocks`)
                total += self.checkpointed if index % every == 0 else self.block
        return total.at(batch)


@dataclass(frozen=True)
class Tensors:
    """Shapes and count of some parameters: enough for every sharding layout."""

    shapes: tuple[tuple[int, ...], ...]

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)

    @property
    def count(self) -> int:
        return len(self.shapes)

    def sharded_numel(self, world: int) -> int:
        """Elements of one rank's dim-0 shards, each padded to ceil(rows / world) rows as our
        sharded strategies (and torch.chunk) lay them out."""
        return sum(math.ceil(s[0] / world) * math.prod(s[1:]) for s in self.shapes)


def _tensors(params: list[nn.Parameter]) -> Tensors:
    return Tensors(tuple(tuple(p.shape) for p in params))


def gpt_shape(cfg: ModelConfig) -> GPTConfig:
    """The sizes of the GPT a ModelConfig (presets resolved) names: hashable, for caching."""
    if cfg.name != "gpt":
        raise PlanError(f"model.name = {cfg.name!r}: the planner plans the GPT (model.name = 'gpt') only")
    return GPTConfig(cfg.n_layer, cfg.n_head, cfg.d_model, cfg.seq_len, cfg.vocab_size, cfg.bias, cfg.d_ff)


def _gpt(shape: GPTConfig, n_layer: int | None) -> GPT:
    """The GPT of `shape`, with `n_layer` blocks if given, on the current default device."""
    return GPT(dataclasses.replace(shape, n_layer=n_layer or shape.n_layer))


@dataclass(frozen=True)
class ModelFacts:
    """A GPT's parameters per unit (its blocks, then the root: embeddings, final norm, tied head),
    counted on the meta device, each distinct parameter once."""

    shape: GPTConfig
    block: Tensors  # one block's; every block has the same
    root: Tensors

    @property
    def n_layer(self) -> int:
        return self.shape.n_layer

    @property
    def units(self) -> list[Tensors]:
        return [self.block] * self.n_layer + [self.root]

    @property
    def params_total(self) -> int:
        return self.block.numel * self.n_layer + self.root.numel

    @property
    def tensor_count(self) -> int:
        return self.block.count * self.n_layer + self.root.count

    def flops_per_sample(self) -> int:
        """Training FLOPs per sequence: the GPT's own estimate (6 per parameter per token plus
        attention), computed on a meta model of this size."""
        return meta_gpt(self.shape).flops_per_token() * self.shape.seq_len


def meta_gpt(shape: GPTConfig, n_layer: int | None = None) -> GPT:
    """The GPT of `shape` (with `n_layer` blocks if given) on the meta device: shapes, no memory."""
    with torch.device("meta"):
        return _gpt(shape, n_layer)


def _split_facts(shape: GPTConfig, model: GPT) -> ModelFacts:
    block = model.blocks[0]
    in_block = {id(p) for p in block.parameters()}
    root = [p for p in model.parameters() if id(p) not in in_block]
    return ModelFacts(shape, _tensors(list(block.parameters())), _tensors(root))


@functools.cache
def model_facts(shape: GPTConfig) -> ModelFacts:
    """Parameter shapes per unit, read from a one-block meta copy of the model."""
    return _split_facts(shape, meta_gpt(shape, n_layer=1))


def tensor_parallel_block(block: nn.Module, tp: int) -> None:
    """Give `block` the shapes one of `tp` tensor-parallel ranks holds (strategies/tensor.py):
    qkv and up column-parallel (qkv by heads), proj and down row-parallel with the bias whole.
    Plain linears of those shapes: the communication saves nothing for backward."""
    attn, mlp = block.attn, block.mlp
    width, bias = attn.qkv.in_features, attn.qkv.bias is not None
    block.attn = LocalHeadsAttention(nn.Linear(width, 3 * width // tp, bias=bias),
                                     nn.Linear(width // tp, width, bias=bias), attn.n_head // tp)
    mlp.up = nn.Linear(width, mlp.up.out_features // tp, bias=bias)
    mlp.down = nn.Linear(mlp.down.in_features // tp, width, bias=bias)


@functools.cache
def rank_facts(shape: GPTConfig, tp: int) -> ModelFacts:
    """The parameters one tensor-parallel rank holds: blocks split `tp` ways, the rest whole."""
    if tp == 1:
        return model_facts(shape)
    model = meta_gpt(shape, n_layer=1)
    with torch.device("meta"):
        tensor_parallel_block(model.blocks[0], tp)
    return _split_facts(shape, model)


@functools.cache
def stage_bounds(shape: GPTConfig, pp: int) -> tuple[tuple[int, int], ...]:
    """[start, stop) of each pipeline stage's blocks, balanced by parameter count as the pipeline
    strategy cuts them (the same function, on a meta model)."""
    model = meta_gpt(shape)
    starts = [0, *balanced_split(parameter_counts(model, list(model.blocks)), pp)]
    return tuple(zip(starts, [*starts[1:], shape.n_layer], strict=True))


def stage_tensors(facts: ModelFacts, first: bool, last: bool, blocks: int) -> Tensors:
    """Parameters of a pipeline stage: its blocks, the embeddings on the first stage, the final
    norm and the (tied) head on the last; the tied weight is on both."""
    return Tensors(_stage_outside(facts.shape, first, last).shapes + facts.block.shapes * blocks)


@functools.cache
def _stage_outside(shape: GPTConfig, first: bool, last: bool) -> Tensors:
    model = meta_gpt(shape, n_layer=1)
    root_parts = ([model.tok_emb, model.pos_emb] if first else []) + ([model.ln_f, model.head] if last else [])
    seen: dict[int, nn.Parameter] = {}
    for module in root_parts:
        for param in module.parameters():
            seen.setdefault(id(param), param)
    return _tensors(list(seen.values()))


@dataclass(frozen=True)
class TraceKey:
    """What decides the bytes a forward saves: the model, the dtype parameters have while computing,
    autocast's dtype (None: off), and the tensor split."""

    shape: GPTConfig
    param_dtype: torch.dtype
    autocast: torch.dtype | None = None
    tp: int = 1


class OpCounter(TorchDispatchMode):
    """Counts the operators a forward dispatches: each one is a kernel launch (or, on a CPU, a
    trip through the dispatcher) whatever its size."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: object, types: object, args: tuple = (), kwargs: dict | None = None) -> object:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _trace(key: TraceKey, n_layer: int, policy: str, first: bool, last: bool, batch: int,
           ops: OpCounter | None = None) -> int:
    """Bytes saved for backward by one forward (and loss, on a last stage) of a stage of the model
    with `n_layer` blocks, on fake tensors: the peak an ActivationCounter sees. `ops`, if given,
    counts the operators of the forward."""
    shape = key.shape
    with FakeTensorMode():
        model = _gpt(shape, n_layer)
        for param in model.parameters():  # as the strategies do (Module.to cannot swap fake tensors)
            param.data = param.data.to(key.param_dtype)
        if key.tp > 1:
            for block in model.blocks:
                tensor_parallel_block(block, key.tp)
        apply_recompute(model, policy, BLOCK)
        stage = GPTStage(model, list(model.blocks), first=first, last=last)
        # As the data loader gives them: inputs and targets are two views of one window of tokens.
        window = torch.zeros(batch, shape.seq_len + 1, dtype=torch.long)
        tokens, targets = window[:, :-1], window[:, 1:]
        # What a later stage receives: the activations, as a leaf that needs its gradient.
        inputs = tokens if first else torch.zeros(batch, shape.seq_len, shape.d_model, dtype=key.param_dtype,
                                                  requires_grad=True)
        autocast = torch.autocast("cpu", dtype=key.autocast, enabled=key.autocast is not None)
        with ActivationCounter(stage) as counter, autocast, ops or contextlib.nullcontext():
            out = stage(inputs)
            if last:
                loss_fn(out, targets)
    return counter.bytes


def _affine(key: TraceKey, n_layer: int, policy: str, first: bool, last: bool) -> Affine:
    # Batches 2 and 3, not 1: at batch 1 the targets' flattened view needs no copy, so it shares the
    # inputs' storage, and a line through batch 1 would miss a per-sample copy larger batches make.
    two, three = (_trace(key, n_layer, policy, first, last, batch) for batch in (2, 3))
    return Affine(3 * two - 2 * three, three - two)


@functools.cache
def saved_bytes(key: TraceKey) -> SavedBytes:
    """The saved-bytes parts of `key`'s model, traced on one- and two-block stages as needed."""
    return SavedBytes(key)


@dataclass(frozen=True)
class ForwardOps:
    """Operators one forward dispatches: per block, and outside the blocks (embeddings, head, loss)."""

    block: int
    outside: int


@functools.cache
def forward_ops(shape: GPTConfig) -> ForwardOps:
    """Traced on fake tensors at one and two blocks; the count depends on neither batch nor width."""
    key = TraceKey(shape, torch.float32)
    one, two = OpCounter(), OpCounter()
    _trace(key, 1, "none", True, True, 2, one)
    _trace(key, 2, "none", True, True, 2, two)
    return ForwardOps(two.ops - one.ops, 2 * one.ops - two.ops)
