"""Predicted bytes per rank, by the categories `memory` in metrics.jsonl counts, for what *our*
strategies hold; and, apart from it, the textbook ZeRO accounting.

Ours (what `shardwise train` counts at the end of a step):

| | params | grads | optimizer (AdamW) |
| --- | --- | --- | --- |
| single, ddp | Ψ·p | Ψ·p | 2Ψ·p + 4 per tensor |
| zero1 | N(Ψ/N)·w + (Ψ/N)·p* | max(N(Ψ/N)·w, (Ψ/N)·p) | 2(Ψ/N)·p + 4 per tensor |
| zero2 | N(Ψ/N)·w + (Ψ/N)·p* | (Ψ/N)·p | the same |
| fsdp | (Ψ/N)·p | (Ψ/N)·p | the same |

with p the bytes of the stored (master) dtype: 4 under fp32, bf16-mixed and fp16-mixed, 2 under
bf16-true; w those of the working dtype, which zero1 and zero2 keep the whole parameters (and
zero1 the whole gradients) in: 2 under mixed precision, else p; Ψ/N each rank's dim-0 shards
padded to equal rows, N(Ψ/N) the whole model so padded; "4 per tensor" AdamW's fp32 `step`.
(*) The master shards are a buffer of their own only where w differs from p (mixed precision):
otherwise they are views into the whole parameters. zero1's shard gradients live in its
gradient buffer, hence the max.

With `parallel.sharding.offload = "optimizer"` the master shards, their gradients ((Ψ/N)·p each) and the
optimizer state are in host memory: `host`, outside the device's total; the device keeps
zero1's and zero2's whole parameters and zero1's gradient buffer.

The textbook (Rajbhandari et al. 2020, "ZeRO", section 3) assumes mixed-precision Adam with fp16
parameters and gradients and an fp32 copy, momentum and variance: 2 + 2 + 12 bytes per parameter,
the 12 sharded from stage 1, the gradients' 2 from stage 2, the parameters' 2 from stage 3.
`zero_textbook_bytes` computes that, per rank, from the same per-unit shard sizes.

Context parallel (`cp` > 1) splits the tokens, not the model: a rank saves what a forward over
seq_len / cp tokens saves (ring attention keeps what `scaled_dot_product_attention` keeps for its
tokens: q, k, v, output, log-sum-exp; all-to-all attention one more copy of the output), so the
trace is of the model at that length (over 8 or more ranks read off a line: traces._affine); the
sharded strategies shard over all dp x cp ranks.

Beyond the counted categories the prediction adds `buffers` (communication buffers and
gradients that live only within a step: all-gather and reduce-scatter buffers in flight, fsdp's
gathered units, pipeline sends, gradients kept whole during accumulation, context parallel's keys
and values in flight) and `loss`, what the loss's backward makes over the logits: their
gradient and one float32 chunk (models/cross_entropy.py).

Each category is at its own largest at a different time, so the step's `peak` is not their sum
but the largest of three moments: where backward starts, every activation saved, the loss's
gradient made and only the gradients and buffers already there (`at_loss`); later in backward,
the head's saved tensors freed (`head`: the logits above all) and gradients and buffers at their
largest; and under fsdp, backward's end, every activation and gathered unit freed, where the
root's whole gradients and their packed copy are reduce-scattered (`at_end`: the peak where the
root outweighs the rest, as a large vocabulary's over many ranks does). Held to torch.profiler's
memory timeline (tests/test_bench_gpu.py). `margin` is a stated fraction of the peak for
allocator fragmentation and the optimizer step's temporaries.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, replace

import torch

from shardwise.config.registry import SPECS
from shardwise.config.schema import Config
from shardwise.lora import Adapter
from shardwise.models.cross_entropy import chunk_rows
from shardwise.nf4 import row_bytes
from shardwise.parallel.pipeline.schedules import Schedule, build, layout_of
from shardwise.parallel.pipeline.simulate import peak_held
from shardwise.planner.candidates import Candidate
from shardwise.planner.model import (
    ModelFacts,
    ModelShape,
    Tensors,
    fsdp_gathered_bytes,
    in_units,
    meta_model,
    model_blocks,
    model_facts,
    model_shape,
    rank_facts,
    stage_bounds,
)
from shardwise.planner.traces import TraceKey, saved_bytes
from shardwise.precision import Precision, make_precision
from shardwise.recompute import parse_policy

DEFAULT_MARGIN = 0.10  # allocator fragmentation and the optimizer step's temporaries
UNITS_IN_FLIGHT = 2  # unit-sized collective buffers at once: a unit's gradients and their packed copy, or 2 gathers


@dataclass
class RankMemory:
    """Bytes one rank holds, each category at its own largest; `peak`, the step's largest moment,
    and `total`, the peak and the margin (module docstring)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    buffers: int
    margin: int = 0
    host: int = 0  # parallel.sharding.offload: bytes in host memory, not in `total` (the device's)
    staging: int = 0  # host bytes of the state's copies: an async checkpoint's, the memory checkpoints'
    loss: int = 0  # the logits' gradient and one float32 chunk, made as backward starts (models/cross_entropy.py)
    head: int = 0  # of `activations`, what the head and the loss saved (the logits): freed by their backward
    at_loss: int = 0  # the gradients and buffers already live as backward starts
    at_end: int = 0  # fsdp's gradients and buffers as backward ends, every activation freed (the root's reduction)

    @property
    def peak(self) -> int:
        """The largest of the step's busiest moments: backward's start, every activation still
        saved; the rest of backward, with the head's freed and gradients and buffers at their
        largest; and, under fsdp, backward's end, where the root's gradients are reduced."""
        backward_starts = self.activations + self.at_loss + self.loss
        later = self.activations - self.head + self.grads + self.buffers
        return self.params + self.optimizer + max(backward_starts, later, self.at_end)

    @property
    def total(self) -> int:
        return self.peak + self.margin

    def with_margin(self, fraction: float) -> RankMemory:
        self.margin = int(fraction * self.peak)
        return self

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "peak": self.peak, "total": self.total}


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def optimizer_bytes(numel: int, tensors: int, stored: int, cfg: Config, muon: tuple[int, int]) -> int:
    """State of the trainer's optimizer over `tensors` tensors of `numel` elements stored in
    `stored` bytes each: AdamW's two moments and a float32 step per tensor, SGD's momentum; Muon's
    momentum for the (elements, tensors) of them it steps (`muon`), AdamW's state for the rest."""
    if cfg.train.optimizer == "muon":
        matrices, count = muon
        return matrices * stored + 2 * (numel - matrices) * stored + 4 * (tensors - count)
    if cfg.train.optimizer == "adamw":
        return 2 * numel * stored + 4 * tensors
    return numel * stored if cfg.train.momentum else 0


def trace_key(shape: ModelShape, candidate: Candidate, tp: int = 1, sequence_parallel: bool = False) -> TraceKey:
    """What the forward looks like under `candidate`: parameters as they are while computing
    (the sharded strategies keep or gather mixed precision's in the compute dtype, but zero1's and
    zero2's LoRA-frozen ones), autocast when mixed, the tensor split (sequence parallel only where
    there is one), and a rank's share of the sequence under context parallel."""
    precision = make_precision(candidate.precision)
    # zero1 and zero2 keep LoRA's frozen parameters out of their units: whole, in the stored dtype
    frozen = precision.param_dtype if shape.lora_rank and candidate.spec.zero_stage in (1, 2) else None
    return TraceKey(shape, computing_params_dtype(candidate), precision.compute_dtype if precision.mixed else None,
                    tp, sequence_parallel and tp > 1, candidate.cp, frozen)


def computing_params_dtype(c: Candidate) -> torch.dtype:
    """What the parameters are in while they compute: the sharded strategies keep or gather mixed
    precision's in the compute dtype, the others keep the stored one. An MoE layer's input, and so
    the rows its dispatch moves, is in it too (the norm before the layer returns it; measured:
    tests/test_planner.py)."""
    precision = make_precision(c.precision)
    return working_dtype(precision) if (c.spec.zero_stage or 0) >= 1 else precision.param_dtype


def predict_memory(candidate: Candidate, cfg: Config, margin: float = DEFAULT_MARGIN,
                   activations: bool = True) -> list[RankMemory]:
    """Each rank's bytes under `candidate` for the model and training setup of `cfg`: one entry
    for data-parallel and tensor-parallel ranks (all alike), one per stage for a pipeline.
    Without `activations`, a lower bound that traces nothing: every category but the
    activations, which count 0."""
    shape = model_shape(cfg.model, cfg.lora)
    if candidate.spec.mesh_dim == "pp" or candidate.pp > 1:
        ranks = _pipeline(candidate, cfg, shape, activations)
    elif candidate.spec.mesh_dim == "tp":
        ranks = [_tensor(candidate, cfg, shape, activations)]
    else:
        ranks = [_data_parallel(candidate, cfg, shape, activations)]
    return [rank.with_margin(margin) for rank in ranks]


def _data_parallel(c: Candidate, cfg: Config, shape: ModelShape, activations: bool) -> RankMemory:
    """A data-parallel rank: the model, or over tensor parallel its tp part (its blocks' matrices
    split, the rest whole), replicated or sharded over the data-parallel (and cp) ranks."""
    per_unit = blocks_per_unit(c, cfg)
    facts = in_units(rank_facts(shape, c.tp, c.ep, "trainable"), per_unit)  # under LoRA its adapters; else all
    world = c.shard or c.dp * c.cp  # the ranks each parameter is split over: hsdp's is one node
    precision = make_precision(c.precision, cfg.parallel.sharding.reduce_dtype)
    stored = dtype_bytes(precision.param_dtype)
    frozen = as_stored(rank_facts(shape, c.tp, c.ep, "frozen"), stored)
    shard = facts.shard_numel(world)
    # hsdp holds what fsdp over its node does
    state = model_state(c.spec.zero_stage, precision, facts, world, cfg, frozen)
    key = trace_key(shape, c, c.tp, cfg.parallel.sequence_parallel)
    saved, head = 0, 0
    if activations:
        traced = saved_bytes(key)
        whole = traced.stage(0, shape.n_layer, True, True, c.recompute, c.micro_batch)
        saved = whole + all_to_all_outputs(c, shape)
        # what the final norm, the head and the loss save, the logits above all: freed by their backward
        head = whole - traced.stage(0, shape.n_layer, True, False, c.recompute, c.micro_batch)
    units = in_units(as_stored(rank_facts(shape, c.tp, c.ep), dtype_bytes(working_dtype(precision))), per_unit)
    buffers = _sharded_buffers(c, cfg, facts, world, stored, units) \
        + context_buffers(c, shape) + expert_buffers(c, shape) + dequantized_weight(shape, precision)
    if c.tp > 1:  # an all-reduce's result is a copy of one activation (ReduceFromTensorParallel clones its input)
        buffers += c.micro_batch * shape.seq_len // c.cp * shape.d_model * 4
    if c.spec.across_nodes and c.dp > world:
        buffers += shard * stored  # the packed gradient shards all-reduced across nodes
    return RankMemory(state.params, state.grads, state.optimizer, saved, buffers, host=state.host,
                      staging=state.staging, loss=loss_gradients(c, shape), head=head,
                      at_loss=_data_parallel_at_loss(c, cfg, state, facts, units, world, stored),
                      at_end=_fsdp_at_end(c, cfg, state, facts, world, stored))


@functools.cache
def nf4_weights(shape: ModelShape) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
    """The weights QLoRA stores in NF4 (lora.quantize): the adapted layers', (out, in) each, one
    block's and the root's; none without it."""
    if shape.lora_quantize != "nf4":
        return (), ()
    model = meta_model(shape, 1)
    in_block = {id(m) for m in model_blocks(model)[0].modules()}
    adapted = [m for m in model.modules() if isinstance(getattr(m, "lora", None), Adapter)]
    return tuple((m.out_features, m.in_features) for m in adapted if id(m) in in_block), \
        tuple((m.out_features, m.in_features) for m in adapted if id(m) not in in_block)


def as_stored(facts: ModelFacts, element_bytes: int) -> ModelFacts:
    """`facts` with each NF4 weight counted as the elements of `element_bytes` bytes its packed rows
    take (rows x row bytes, a row rounded up to whole elements): so that a count of elements times
    `element_bytes` is the bytes held, gathered or moved, floating and packed alike."""
    block, root = nf4_weights(facts.shape)
    if not block and not root:
        return facts

    def packed(tensors: Tensors, weights: tuple[tuple[int, int], ...]) -> Tensors:
        shapes = list(tensors.shapes)
        for out, features in weights:
            if (out, features) in shapes:  # not in `facts` of the parameters that train
                shapes.remove((out, features))
                shapes.append((out, math.ceil(row_bytes(features) / element_bytes)))
        return Tensors(tuple(shapes))

    return replace(facts, block=packed(facts.block, block), root=packed(facts.root, root))


def dequantized_weight(shape: ModelShape, precision: Precision) -> int:
    """QLoRA: the one NF4 weight dequantized at a time, in the compute dtype, while its layer runs."""
    block, root = nf4_weights(shape)
    return max((out * features for out, features in block + root), default=0) * dtype_bytes(precision.compute_dtype)


@dataclass
class ModelState:
    params: int
    grads: int
    optimizer: int
    host: int = 0
    staging: int = 0


def checkpoint_copy(cfg: Config, numel: int, tensors: int, stored: int, muon: tuple[int, int]) -> int:
    """Host bytes the copies of a rank's state take: an asynchronous checkpoint's (train.checkpoint_async,
    in a run that saves) once, the memory checkpoints' (train.memory_checkpoint_every: its own and a
    peer's, two generations each) 4 times; the state, the `numel` elements in `tensors` tensors it
    checkpoints (its trained parameters or their shards) in the stored dtype, and their optimizer state."""
    copies = int(bool(cfg.train.checkpoint_async and cfg.train.checkpoint_every)) + \
        4 * bool(cfg.train.memory_checkpoint_every)
    return copies * (numel * stored + optimizer_bytes(numel, tensors, stored, cfg, muon)) if copies else 0


def model_state(stage: int, precision: Precision, facts: ModelFacts, world: int, cfg: Config,
                frozen: ModelFacts | None = None) -> ModelState:
    """Parameter, gradient and optimizer bytes of a data-parallel rank at ZeRO stage `stage` over
    `world` ranks, at the end of a step (the module's table), for the parameters that train
    (`facts`). A model LoRA freezes (`frozen`) adds its parameters alone, in the stored dtype:
    sharded by fsdp (its own units; in host memory where fsdp offloads its shards), whole on every
    rank otherwise."""
    state = _trained_state(stage, precision, facts, world, cfg)
    checkpointed = facts.shard_numel(world) if stage else facts.params_total
    state.staging = checkpoint_copy(cfg, checkpointed, facts.tensor_count, dtype_bytes(precision.param_dtype),
                                    facts.muon_matrices(world if stage else 1))
    if frozen is not None and frozen.params_total:
        stored = dtype_bytes(precision.param_dtype)
        if stage < 3:
            state.params += frozen.params_total * stored
        elif cfg.parallel.sharding.offload == "optimizer":
            state.host += frozen.shard_numel(world) * stored
        else:
            state.params += frozen.shard_numel(world) * stored
    return state


def _trained_state(stage: int, precision: Precision, facts: ModelFacts, world: int, cfg: Config) -> ModelState:
    stored = dtype_bytes(precision.param_dtype)
    full, count = facts.params_total, facts.tensor_count
    if stage == 0:
        return ModelState(full * stored, full * stored, optimizer_bytes(full, count, stored, cfg,
                                                                        facts.muon_matrices(1)))
    shard = facts.shard_numel(world)
    master = shard * stored  # the master shards; their gradients as many bytes
    optimizer = optimizer_bytes(shard, count, stored, cfg, facts.muon_matrices(world))
    whole = facts.padded_numel(world) * dtype_bytes(working_dtype(precision))  # zero1, zero2: the whole parameters
    params = {1: whole, 2: whole, 3: 0}[stage]
    grads = {1: max(whole, master), 2: 0, 3: 0}[stage]  # zero1's gradient buffer holds its shard gradients
    if cfg.parallel.sharding.offload == "optimizer":
        return ModelState(params, grads, 0, host=2 * master + optimizer)
    if stage == 3 or precision.mixed:
        params += master
    if stage >= 2:
        grads += master
    return ModelState(params, grads, optimizer)


def working_dtype(precision: Precision) -> torch.dtype:
    """What zero1 and zero2 keep the whole parameters in and fsdp gathers them in."""
    return precision.compute_dtype if precision.mixed else precision.param_dtype


def all_to_all_outputs(c: Candidate, shape: ModelShape) -> int:
    """What all-to-all attention saves beyond a forward over seq_len / cp tokens: each block whose
    activations are kept holds its attention output twice, split by heads (what
    `scaled_dot_product_attention` keeps) and back by tokens (what the output projection keeps),
    where one device holds one tensor both keep. Where a rank's key/value heads do not divide by
    cp, they are repeated for every query head before the exchange, so attention keeps its keys
    and values at n_head, not n_kv_head, heads."""
    if c.cp == 1 or c.cp_mode != "all-to-all":
        return 0
    kind, every = parse_policy(c.recompute)
    kept = {"none": shape.n_layer, "every": shape.n_layer - len(range(0, shape.n_layer, every))}.get(kind, 0)
    element = dtype_bytes(make_precision(c.precision).compute_dtype)
    tokens = c.micro_batch * shape.seq_len
    output = tokens // c.cp * shape.d_model // c.tp
    repeated = 0
    if shape.n_kv_head // c.tp % c.cp:
        repeated = 2 * tokens * (shape.n_head - shape.n_kv_head) // (c.tp * c.cp) * (shape.d_model // shape.n_head)
    return kept * (output + repeated) * element


def context_buffers(c: Candidate, shape: ModelShape) -> int:
    """Context parallel's messages alive at once, in one layer at a time: ring attention's keys and
    values (fp32) being computed on and arriving, and in backward their gradients too; all-to-all's
    q, k and v (key/value heads repeated where they do not divide) sent and received."""
    if c.cp == 1:
        return 0
    tokens = c.micro_batch * shape.seq_len // c.cp
    head_dim = shape.d_model // shape.n_head
    heads, kv_heads = shape.n_head // c.tp, shape.n_kv_head // c.tp  # this tp rank's
    if c.cp_mode == "ring":
        return 4 * 2 * tokens * kv_heads * head_dim * 4
    kv_heads = kv_heads if kv_heads % c.cp == 0 else heads
    computing = make_precision(c.precision).compute_dtype
    return 2 * tokens * (heads + 2 * kv_heads) * head_dim * dtype_bytes(computing)


def expert_buffers(c: Candidate, shape: ModelShape) -> int:
    """Expert parallel's rows in flight in one MoE layer at a time: the micro-batch's (token,
    expert) pairs received for this rank's experts and, regrouped by expert, their copy, in the
    dtype the parameters compute in (routing balanced: as many arrive as leave)."""
    if c.ep == 1:
        return 0
    return 2 * expert_rows(c, shape) * shape.d_model * dtype_bytes(computing_params_dtype(c))


def expert_rows(c: Candidate, shape: ModelShape) -> int:
    """The (token, expert) pairs of one micro-batch on a rank: top_k per token of its seq_len / cp."""
    return c.micro_batch * shape.seq_len // c.cp * shape.top_k


def _sharded_buffers(c: Candidate, cfg: Config, facts: ModelFacts, world: int, stored: int,
                     units: ModelFacts) -> int:
    """Bytes alive only within a step under the sharded strategies (ddp's gradients are its buckets):
    for the parameters that train (`facts`), and fsdp's gathers of every unit (`units`: with LoRA's
    frozen model, which fsdp alone shards)."""
    stage = c.spec.zero_stage
    if stage == 0:
        return 0
    precision = make_precision(c.precision, cfg.parallel.sharding.reduce_dtype)
    reduce = dtype_bytes(precision.reduce_dtype)
    # What one unit's all-gather and reduce-scatter move: every rank's padded shards.
    padded = (units if stage == 3 else facts).unit_padded(world)
    largest = sorted(padded, reverse=True)[:UNITS_IN_FLIGHT]
    working = dtype_bytes(working_dtype(precision))
    kept_whole = _kept_whole(c, cfg, facts, stored)
    # A unit's gradients are packed for its reduce-scatter once the previous unit's is done: one
    # packed unit in flight (zero1: at the end of backward, from its gradient buffer).
    if stage == 1:  # one unit's reduce-scatter at the end of backward; two gathers after the step
        return max(max(padded) * reduce, sum(largest) * working)
    if stage == 2:  # the unit's gradients and their packed copy; two gathers after the step
        return sum(largest) * max(reduce, working) + kept_whole
    gathered = dtype_bytes(precision.compute_dtype if precision.mixed else precision.param_dtype)
    # As a block's backward ends: the root and the blocks gathered, the block's whole gradients, the
    # previous block's packed in flight, the root's gradients the head's backward made. Only what
    # trains is reduced (not LoRA's frozen units). The root's reduce-scatter, at the end, is `at_end`.
    # Split over ep, experts' whole gradients wait for the end of backward: the most of them are
    # there as the first block's backward ends, with nothing left to prefetch, its dense part reduced.
    waiting = _experts_waiting(facts)
    gathered_bytes = fsdp_gathered_bytes(units, world, 0 if waiting else cfg.parallel.sharding.prefetch,
                                         cfg.parallel.sharding.reshard_after_forward, gathered,
                                         gathers_in_float8(c, cfg))
    reduced = facts.dense if waiting else facts.block
    block_packed = world * reduced.sharded_numel(world) if waiting else max(facts.unit_padded(world)[:-1], default=0)
    whole = reduced.numel + facts.head.numel + waiting
    return gathered_bytes + whole * working + block_packed * reduce + kept_whole


def _fsdp_at_end(c: Candidate, cfg: Config, state: ModelState, facts: ModelFacts, world: int, stored: int) -> int:
    """fsdp's gradients and buffers as its backward ends, every activation and gathered parameter
    freed: every unit's shard gradients, the root's and experts' whole gradients, and the root's
    packed for its reduce-scatter."""
    if c.spec.zero_stage != 3:
        return 0
    precision = make_precision(c.precision, cfg.parallel.sharding.reduce_dtype)
    working, reduce = dtype_bytes(working_dtype(precision)), dtype_bytes(precision.reduce_dtype)
    whole = (facts.root.numel + _experts_waiting(facts)) * working
    return state.grads + max(whole, _kept_whole(c, cfg, facts, stored)) + facts.unit_padded(world)[-1] * reduce


def _experts_waiting(facts: ModelFacts) -> int:
    """Elements of the experts' whole gradients fsdp keeps to the end of backward: split over ep,
    every layer's are units of their own, reduce-scattered in the same order on every rank once
    backward ends (parallel/shard.py's grad_ready); without ep they are part of their block's unit."""
    return facts.n_layer * facts.experts.numel if facts.ep > 1 else 0


def _kept_whole(c: Candidate, cfg: Config, facts: ModelFacts, stored: int) -> int:
    """zero2's and fsdp's whole gradients, kept between the micro-steps of an accumulating step."""
    if (c.spec.zero_stage or 0) < 2 or cfg.train.global_batch <= c.dp * c.micro_batch:
        return 0
    working = dtype_bytes(working_dtype(make_precision(c.precision)))
    return facts.params_total * (working if c.spec.zero_stage == 2 else stored)


def _data_parallel_at_loss(c: Candidate, cfg: Config, state: ModelState, facts: ModelFacts, units: ModelFacts,
                           world: int, stored: int) -> int:
    """Gradients and buffers a data-parallel rank holds as backward starts: those that outlive a step
    (ddp's buckets, zero1's gradient buffer) or an accumulating one's micro-steps, and fsdp's
    gathered root (with every block too where none reshards after its forward)."""
    stage = c.spec.zero_stage
    accumulating = cfg.train.global_batch > c.dp * c.micro_batch
    if stage == 0:
        return state.grads if c.strategy != "single" or accumulating else 0
    if stage == 1:
        return state.grads
    held = _kept_whole(c, cfg, facts, stored)
    if stage == 3:
        held += fsdp_gathered_bytes(units, world, 0, cfg.parallel.sharding.reshard_after_forward,
                                    dtype_bytes(working_dtype(make_precision(c.precision))), gathers_in_float8(c, cfg))
    return held


def loss_gradients(c: Candidate, shape: ModelShape) -> int:
    """What the loss's backward makes at once over a micro-batch's logits (this rank's tokens by
    the whole vocabulary): their gradient, in the dtype they are computed in, and one chunk of
    rows in float32 (models/cross_entropy.py)."""
    tokens = c.micro_batch * shape.seq_len // c.cp
    logits = dtype_bytes(working_dtype(make_precision(c.precision)))
    return tokens * shape.vocab_size * logits + min(tokens, chunk_rows(shape.vocab_size)) * shape.vocab_size * 4


def blocks_per_unit(c: Candidate, cfg: Config) -> int:
    """The blocks each of the sharded strategies' units holds (parallel.sharding.blocks_per_unit);
    1 for the others, which have none, and over pipeline stages, which gather a stage whole."""
    return cfg.parallel.sharding.blocks_per_unit if c.spec.zero_stage and c.pp == 1 else 1


def gathers_in_float8(c: Candidate, cfg: Config) -> bool:
    """Whether fsdp gathers the blocks' float8 weights as float8 (tensorwise scaling, stage 3)."""
    return cfg.parallel.float8 == "tensorwise" and c.spec.zero_stage == 3


@functools.cache
def pipeline_schedule(schedule: str | None, pp: int, micro_batches: int) -> Schedule:
    """The lists a pipeline candidate runs (parallel/pipeline/schedules.py): its schedule with its own
    stages per rank; `model-parallel`'s (no schedule) GPipe's of one micro-batch."""
    return build(schedule or "gpipe", pp, micro_batches)


def _pipeline(c: Candidate, cfg: Config, shape: ModelShape, activations: bool) -> list[RankMemory]:
    """Each rank's stages' tensors, and the activations its schedule holds at most: the stages'
    saved bytes per micro-batch, each from its forward until its weight gradients (the simulator's
    count, peak_held); under expert parallel each stage's experts split ep ways, and one MoE layer's
    rows in flight; under context parallel each stage's share of the sequence, and one layer's
    messages in flight."""
    facts = rank_facts(shape, c.tp, c.ep)
    trained = rank_facts(shape, c.tp, c.ep, "trainable")  # under LoRA its adapters; else all of it
    frozen = rank_facts(shape, c.tp, c.ep, "frozen")  # under LoRA the rest; else nothing
    runs = c.micro_batches  # 1 where the model is split without pipelining
    per_run = c.micro_batch / runs
    layout = layout_of(c.schedule or "gpipe", c.pp)
    bounds = stage_bounds(shape, layout.stages)
    last = layout.stages - 1
    peaks = [0.0] * c.pp
    per_micro_batch = replace(c, micro_batch=c.micro_batch // runs)  # what one forward routes and attends
    if activations:
        saved = saved_bytes(trace_key(shape, c, c.tp, cfg.parallel.sequence_parallel))
        a2a = all_to_all_outputs(per_micro_batch, shape)  # over every layer
        held = [saved.stage(start, stop, s == 0, s == last, c.recompute, per_run)
                + a2a * (stop - start) // shape.n_layer for s, (start, stop) in enumerate(bounds)]
        peaks = peak_held(pipeline_schedule(c.schedule, c.pp, runs), held)
    activation = int(per_run * shape.seq_len // c.cp * shape.d_model * 4)  # what crosses between stages
    ranks = []
    for rank in range(c.pp):
        stages = layout.stages_of(rank)
        blocks = sum(bounds[s][1] - bounds[s][0] for s in stages)
        numel, count = facts.stage(0 in stages, last in stages, blocks)
        # Each neighbour on another rank: its M messages sent are kept until the run ends (outputs
        # forward, input gradients back), and a receive is posted one message ahead.
        crossings = sum(0 <= t <= last and layout.rank_of(t) != rank for s in stages for t in (s - 1, s + 1))
        buffers = (runs + 2) * crossings * activation + expert_buffers(per_micro_batch, shape) \
            + context_buffers(per_micro_batch, shape)
        loss = loss_gradients(per_micro_batch, shape) if last in stages else 0
        if c.spec.zero_stage:
            where = (0 in stages, last in stages, blocks)
            ranks.append(_sharded_stages_rank(c, cfg, trained.stage_facts(*where), frozen.stage_facts(*where),
                                              int(peaks[rank]), buffers, loss))
        else:
            where = (0 in stages, last in stages, blocks)
            ranks.append(_mesh_rank(c, cfg, numel, trained.stage(*where), trained.stage_facts(*where).muon_matrices(1),
                                    int(peaks[rank]), buffers, loss))
    return ranks


def _sharded_stages_rank(c: Candidate, cfg: Config, trained: ModelFacts, frozen: ModelFacts, activations: int,
                         buffers: int, loss: int) -> RankMemory:
    """A rank of zero1, zero2, fsdp or hsdp over pipeline stages: its stages' units sharded over the
    dp ranks (hsdp's of a node; the model state as data parallel's over the `trained` parameters,
    beside a LoRA model's `frozen` ones), and within a step fsdp's stages gathered whole and the
    whole gradients zero2 and fsdp accumulate over the micro-batches (zero1's are its gradient
    buffer), with one unit packed for its reduce-scatter. A later micro-batch's backward starts with
    all of that live: `at_loss` counts it whole."""
    precision = make_precision(c.precision, cfg.parallel.sharding.reduce_dtype)
    world = c.shard or c.dp * c.cp  # the ranks a stage's parameters are split over: hsdp's of a node
    stored = dtype_bytes(precision.param_dtype)
    state = model_state(c.spec.zero_stage, precision, trained, world, cfg, as_stored(frozen, stored))
    working = dtype_bytes(working_dtype(precision))
    within_step = max(world * shard for shard in trained.unit_shards(world)) * dtype_bytes(precision.reduce_dtype)
    if c.spec.zero_stage >= 2:
        within_step += trained.params_total * working  # the whole gradients
    if c.spec.zero_stage == 3:
        within_step += (trained.params_total + frozen.params_total) * working  # the whole parameters
    return RankMemory(state.params, state.grads, state.optimizer, activations, buffers + within_step,
                      staging=state.staging, loss=loss, at_loss=state.grads + buffers + within_step)


def _tensor(c: Candidate, cfg: Config, shape: ModelShape, activations: bool) -> RankMemory:
    """A tensor-parallel rank: its blocks' shards and the rest whole (an MoE layer's experts split over
    ep), and the activations of the split forward."""
    facts, trained = rank_facts(shape, c.tp, c.ep), rank_facts(shape, c.tp, c.ep, "trainable")
    key = trace_key(shape, c, c.tp, cfg.parallel.sequence_parallel)
    saved = saved_bytes(key).stage(0, shape.n_layer, True, True, c.recompute, c.micro_batch) \
        + all_to_all_outputs(c, shape) if activations else 0
    # An all-reduce's result is a copy of one activation (ReduceFromTensorParallel clones its input).
    activation = c.micro_batch * shape.seq_len // c.cp * shape.d_model * 4
    buffers = activation + context_buffers(c, shape) + expert_buffers(c, shape)
    return _mesh_rank(c, cfg, facts.params_total, (trained.params_total, trained.tensor_count),
                      trained.muon_matrices(1), saved, buffers, loss_gradients(c, shape))


def _mesh_rank(c: Candidate, cfg: Config, numel: int, trained: tuple[int, int], muon: tuple[int, int],
               activations: int, buffers: int, loss: int) -> RankMemory:
    """A rank of the model-splitting strategies: the `numel` elements it holds whole, and the
    gradients of the `trained` (elements, tensors) of them (all of them but under LoRA; `muon`: those
    Muon steps, where it is the optimizer), in the precision's storage dtype, plus, with data (or
    context) parallel beside, the packed copy of those gradients the dp (cp) all-reduce sends. A
    backward may start (a later micro-batch's) with every gradient and buffer live: `at_loss`
    counts them whole."""
    stored = dtype_bytes(make_precision(c.precision, cfg.parallel.sharding.reduce_dtype).param_dtype)
    grads = trained[0] * stored
    packed = grads if c.dp > 1 or c.cp > 1 else 0
    return RankMemory(numel * stored, grads, optimizer_bytes(*trained, stored, cfg, muon), activations,
                      buffers + packed, staging=checkpoint_copy(cfg, *trained, stored, muon), loss=loss,
                      at_loss=grads + buffers + packed)


ZERO_STAGES = {name: s.zero_stage for name, s in SPECS.items() if s.planned and s.zero_stage is not None
               and not s.across_nodes}  # ddp 0 ... fsdp 3


def zero_textbook_bytes(shape: ModelShape, stage: int, world: int) -> dict[str, int]:
    """Model-state bytes per rank by the ZeRO paper's accounting of mixed-precision Adam: 2 bytes
    of fp16 parameters, 2 of fp16 gradients, 12 of fp32 master weights, momentum and variance per
    parameter, each sharded across the `world` ranks from its stage on (1: the 12, 2: + the
    gradients, 3: + the parameters). Shards are our padded per-unit ones, so with padding this
    is a few bytes above Ψ/N."""
    facts = model_facts(shape)
    full = facts.params_total
    shard = facts.shard_numel(world)
    return {
        "params": 2 * (shard if stage >= 3 else full),
        "grads": 2 * (shard if stage >= 2 else full),
        "optimizer": 12 * (shard if stage >= 1 else full),
    }
