"""The bytes a model saves for backward, and the operators its forward dispatches, without
allocating it: one forward on fake tensors through the real model code (planner/model.py builds
it), counted by the trainer's own ActivationCounter.

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
`tests/test_planner.py` holds the composition to a full-depth trace and to real runs. A
tensor-parallel rank's block is traced split (sequence parallel's split residual stream and
re-gathered column inputs included). The same fake forward also counts the operators it
dispatches, for the time model's per-operator overhead. A transformers family whose forward fake
tensors cannot follow is a PlanError naming why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Generic, TypeVar

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from shardwise.lora import Adapter
from shardwise.memory import ActivationCounter
from shardwise.models import loss_fn
from shardwise.nf4 import quantize_layers
from shardwise.planner.fake_forward import balanced_routing, fits_real_trace, one_loss_chunk, one_sequence_per_row
from shardwise.planner.model import NOTHING, Affine, ModelShape, PlanError, model_blocks, parallelize_for_planning
from shardwise.recompute import apply_recompute, parse_policy


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


@contextlib.contextmanager
def _refused_if_untraceable(shape: ModelShape) -> Iterator[None]:
    """Any family (`hf`): one whose construction or forward fake tensors cannot follow (a
    data-dependent shape, a module that swaps its own tensors) is a PlanError naming why, not a
    traceback. Shardwise's own families raise as they are."""
    try:
        yield
    except PlanError:
        raise
    except Exception as error:
        if shape.name != "hf":
            raise
        raise PlanError(f"model.hf_config = {shape.hf_config!r}: the planner cannot trace the family's model on fake "
                        f"tensors ({type(error).__name__}: {str(error).splitlines()[0][:200]})") from None


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
    fake = contextlib.nullcontext() if real else FakeTensorMode(allow_non_fake_inputs=True)
    with _refused_if_untraceable(shape), fake, torch.random.fork_rng(devices=[]), one_sequence_per_row(shape.name), \
            one_loss_chunk():
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
