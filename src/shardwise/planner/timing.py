"""Predicted step time: computation from FLOPs over the device's matmul throughput, communication
from what each collective moves over the link it crosses, and how much of the communication
each strategy hides behind computation.

- Computation: 6 FLOPs per token per parameter that a matmul uses (every block's, whatever the
  family: a Llama's SwiGLU and smaller k and v count as built; the head's, tied or not; not the
  embeddings') plus attention's 12 x width x sequence per block, split between the blocks and the
  rest so tensor and pipeline parallel divide the right part, plus one more forward of every
  recomputed block (`blocks`, `every:K`; `selective` redoes only elementwise work, counted below).
  A micro-step's backward is two thirds of it. Under LoRA a frozen parameter costs 4, not 6 (no
  weight gradient), and only the adapters' gradients are reduced and stepped (fsdp still gathers
  every unit).
- Communication, per rank, ring algorithms: all-reduce moves 2(n-1)/n of the buffer, all-gather
  and reduce-scatter (n-1)/n of the whole, point to point the buffer; each hop adds a latency. A
  group whose ranks span nodes runs at the inter-node bandwidth (the mesh is tp innermost, then
  pp, then dp, so tp groups stay inside a node when they fit). The sharded strategies issue one
  collective per unit and ddp one per bucket, each paying its hops' latency, which in a measured
  profile includes the ranks' skew at a blocking collective.
- Overlap (the device profile's `overlap` of the compute it may hide behind):
  `ddp` all-reduces buckets during the last backward; `zero1` reduce-scatters after backward and
  all-gathers after the step (16-bit under mixed precision, as fsdp's gathers), nothing hidden;
  `zero2` reduce-scatters during backward, all-gathers after the step; `fsdp` all-gathers each
  unit during the previous one's forward and backward and reduce-scatters during backward, only
  the first gather exposed; `hsdp` is `fsdp` over a node's ranks plus an all-reduce of the
  gradient shards across nodes after backward, exposed; `pipeline`
  runs its schedule's lists through the simulator (parallel.pipeline.simulate.simulate: each stage's
  forward, input and weight gradients a third each of its micro-step, the recomputation in the
  input gradients), which gives the busiest rank's compute, the bubble (1F1B's (P-1)/(M+P-1) for
  equal stages) and the activation messages on the critical path; `tensor` all-reduces
  activations 4 times per block on the critical path; the model-splitting strategies' dp
  all-reduce runs after backward.
- Context parallel (`cp` ranks per sequence): a rank computes 1/cp of each sample's FLOPs (its
  tokens' share of the matmuls; its queries attend to the whole sequence). `ring` passes every
  layer's keys and values (fp32) cp - 1 times forward and again backward, and their gradients cp
  times, point to point, hidden (up to `overlap`) behind the layer's attention, and adds operators
  for each block it computes and merges; `all-to-all` exchanges every layer's q, k, v and output
  forward and their gradients backward, on the critical path. Gradients are averaged over all dp x
  cp ranks.
- Every operator costs the device profile's `op_overhead_s` on top (a kernel launch; on a CPU a
  trip through the dispatcher), which decides small models' steps: a forward's operators are
  counted on fake tensors, and a forward and backward is taken as 3 times a forward's.
- `selective` recomputes the elementwise work whose results it no longer keeps: the bytes it saves
  less than `none` (traced), read and written again at the device's memory bandwidth.
- The optimizer step reads and writes each element it steps about 8 times (AdamW: parameter,
  gradient, two moments, and clipping's read) at the device's memory bandwidth. Muon adds its
  Newton-Schulz matmuls, shared among a ZeRO group's ranks, and their all-to-alls there.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

from shardwise.config.schema import Config
from shardwise.parallel.pipeline.schedules import SCHEDULES, Layout, Schedule, layout_of
from shardwise.parallel.pipeline.simulate import Costs, makespan
from shardwise.planner.candidates import Candidate
from shardwise.planner.devices import DeviceProfile
from shardwise.planner.memory_model import (
    blocks_per_unit,
    computing_params_dtype,
    dtype_bytes,
    expert_rows,
    gathers_in_float8,
    pipeline_schedule,
    trace_key,
    working_dtype,
)
from shardwise.planner.model import (
    ModelFacts,
    ModelShape,
    in_units,
    model_facts,
    model_shape,
    rank_facts,
    stage_bounds,
)
from shardwise.planner.traces import forward_ops, saved_bytes
from shardwise.precision import make_precision
from shardwise.recompute import parse_policy

# Muon's momentum and Nesterov update read and write about as much as AdamW's moments (its
# Newton-Schulz is matmuls: `_newton_schulz_s`)
OPTIMIZER_ACCESSES = {"adamw": 8, "sgd": 5, "muon": 8}
RING_OPS_PER_BLOCK = 10  # ring attention's operators per block: the kernel, the merge's exps and sums, indexing


@dataclass
class StepTime:
    compute_s: float  # matmul FLOPs, selective recomputation's elementwise traffic, per-operator overhead
    communication_s: float  # every collective's time, hidden or not
    exposed_communication_s: float  # the part not hidden behind computation
    bubble_s: float  # pipeline stages idle
    optimizer_s: float
    all_to_all_s: float = 0.0  # expert parallel's all-to-alls: part of the exposed communication

    @property
    def total(self) -> float:
        return self.compute_s + self.exposed_communication_s + self.bubble_s + self.optimizer_s

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


def all_reduce_s(nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    if ranks == 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / bandwidth + 2 * (ranks - 1) * latency


def all_gather_s(nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """All-gather (or reduce-scatter) of a `nbytes` whole."""
    if ranks == 1:
        return 0.0
    return (ranks - 1) / ranks * nbytes / bandwidth + (ranks - 1) * latency


def _spans_nodes(size: int, stride: int, per_node: int) -> bool:
    """Whether a group of `size` ranks `stride` apart in rank order leaves one node."""
    return size > 1 and size * stride > per_node


def _hidden(comm: float, compute: float, overlap: float) -> float:
    """What is left exposed of `comm` run alongside `compute`, `overlap` of which can hide it."""
    return comm - min(comm, overlap * compute)


@dataclass(frozen=True)
class _Flops:
    """Training FLOPs per token: one block's, and the rest's (embeddings do no matmul; the final
    norm and head do, tied or not)."""

    block: float
    outside: float

    @classmethod
    def of(cls, shape: ModelShape, tp: int = 1) -> _Flops:
        """A frozen parameter (LoRA's model) costs 4 FLOPs a token, not 6: no weight gradient."""
        facts = rank_facts(shape, tp)
        attention = 12 * shape.d_model * shape.seq_len / tp
        if not shape.lora_rank:
            return cls(6 * facts.block_active + attention, 6 * facts.head.numel)
        trained = rank_facts(shape, tp, part="trainable")  # the adapters, dense: active for every token
        frozen_block, frozen_head = facts.block_active - trained.block.numel, facts.head.numel - trained.head.numel
        return cls(6 * trained.block.numel + 4 * frozen_block + attention, 6 * trained.head.numel + 4 * frozen_head)


def compute_dtype(precision: str) -> str:
    return {"fp32": "fp32", "bf16-mixed": "bf16", "fp16-mixed": "fp16", "bf16-true": "bf16"}[precision]


def _recomputed(policy: str, start: int, stop: int) -> int:
    """Blocks in [start, stop) whose forward runs again in backward."""
    kind, every = parse_policy(policy)
    if kind in ("none", "selective"):
        return 0
    return len(range(-(-start // every) * every, stop, every))


def predict_step_time(c: Candidate, cfg: Config, device: DeviceProfile, world: int, traced: bool = True) -> StepTime:
    """Seconds one optimizer step of `cfg.train.global_batch` samples takes under `c`. Without
    `traced`, a lower bound that traces no activations: `selective`'s re-done elementwise work is
    left out (the operators are still counted, once per model)."""
    return _step_time(c, cfg, model_shape(cfg.model, cfg.lora), device, world, traced, {})


def step_time_bounds(candidates: list[Candidate], cfg: Config, device: DeviceProfile, world: int) -> list[float]:
    """predict_step_time(c, cfg, device, world, traced=False).total of each candidate, what
    depends on a pipeline's mesh alone worked out once for all the candidates that share it (the
    search bounds every candidate, hundreds of thousands)."""
    shape = model_shape(cfg.model, cfg.lora)
    meshes: dict[tuple, _PipelineMesh] = {}
    return [_step_time(c, cfg, shape, device, world, False, meshes).total for c in candidates]


def _step_time(c: Candidate, cfg: Config, shape: ModelShape, device: DeviceProfile, world: int, traced: bool,
               meshes: dict[tuple, _PipelineMesh]) -> StepTime:
    """predict_step_time for `shape` (cfg's model); a pipeline's mesh taken from `meshes`, or
    worked out and added there (`meshes` holds those of one cfg and device)."""
    if c.spec.mesh_dim == "pp" or c.pp > 1:
        key = (c.strategy, c.dp, c.pp, c.tp, c.cp, c.ep, c.shard, c.schedule)
        mesh = meshes.get(key)
        if mesh is None:
            mesh = meshes[key] = _PipelineMesh.of(c, shape, device)
        return _pipeline(c, cfg, shape, device, traced, mesh)
    if c.spec.mesh_dim == "tp":
        return _tensor(c, cfg, shape, device, traced)
    if c.spec.across_nodes:
        return _hsdp(c, cfg, shape, device, world, traced)
    return _data_parallel(c, cfg, shape, device, world, traced)


def _optimizer_s(numel: int, stored: int, cfg: Config, device: DeviceProfile) -> float:
    return OPTIMIZER_ACCESSES[cfg.train.optimizer] * numel * stored / device.memory_bandwidth


def _newton_schulz_s(shape: ModelShape, layers: int, owners: int, cfg: Config, device: DeviceProfile,
                     inter_node: bool) -> float:
    """Muon's orthogonalization on one rank holding `layers` blocks: their matrices' Newton-Schulz
    iterations (a matrix m x n, m <= n, as the plain model holds it: x x^T, its square and that
    times x, 4 m^2 n + 2 m^3 FLOPs; a fused projection taken whole), divided among the `owners`
    ranks that split them (ZeRO's and tensor parallel's: each matrix its owner's), whose two
    all-to-alls bring each owner its matrices' parts and hand the results back: 2 (N - 1) / N^2 of
    them each way."""
    if cfg.train.optimizer != "muon":
        return 0.0
    facts = model_facts(shape)
    matrices = [s for s in facts.dense.shapes + facts.experts.shapes if len(s) >= 2]
    flops = sum(math.prod(s[:-2]) * (4 * min(s[-2:]) ** 2 * max(s[-2:]) + 2 * min(s[-2:]) ** 3) for s in matrices)
    dtype = cfg.train.muon.ns_dtype
    seconds = layers * cfg.train.muon.ns_steps * flops / owners / device.flops(dtype)
    if owners > 1:
        elements = layers * sum(math.prod(s) for s in matrices)
        seconds += 4 * (owners - 1) / owners**2 * elements * (2 if dtype == "bf16" else 4) \
            / device.bandwidth(inter_node, "all_gather")
    return seconds


@functools.cache
def _stage_work(shape: ModelShape, tp: int, policy: str, blocks: int, recomputed: int, first: bool,
                last: bool) -> tuple[float, int]:
    """(FLOPs per sample, operators) of one forward and backward through `blocks` blocks of which
    `recomputed` run their forward again, and the parts outside the blocks a first or last stage
    holds, on one rank of tensor-parallel degree `tp`."""
    flops = _Flops.of(shape, tp)
    per_token = (blocks + recomputed / 3) * flops.block + last * flops.outside
    ops = forward_ops(shape)
    return shape.seq_len * per_token, 3 * (blocks * ops.block + (first or last) * ops.outside)


def micro_step_s(c: Candidate, shape: ModelShape, device: DeviceProfile, start: int, stop: int, first: bool,
                 last: bool, batch: float, traced: bool = True) -> float:
    """One forward and backward of `batch` samples through blocks [start, stop) (and the parts
    outside the blocks a first or last stage holds) on one rank of tensor-parallel degree c.tp and
    context-parallel degree c.cp."""
    return _blocks_s(c, shape, device, stop - start, _recomputed(c.recompute, start, stop), first, last, batch, traced)


def _blocks_s(c: Candidate, shape: ModelShape, device: DeviceProfile, blocks: int, recomputed: int, first: bool,
              last: bool, batch: float, traced: bool) -> float:
    """micro_step_s through `blocks` blocks of which `recomputed` run their forward again: all it
    depends on of which blocks they are."""
    flops, ops = _stage_work(shape, c.tp, c.recompute, blocks, recomputed, first, last)
    if c.cp > 1 and c.cp_mode == "ring":  # forward and backward attend to 2 cp + 1 chunk pairs per layer
        ops += 2 * blocks * (2 * c.cp + 1) * RING_OPS_PER_BLOCK
    seconds = batch * flops / c.cp / device.flops(compute_dtype(c.precision)) + ops * device.op_overhead_s
    if c.recompute == "selective" and traced:
        saved = saved_bytes(trace_key(shape, c, c.tp))
        dropped = saved.block.at(batch) - saved.selective.at(batch)
        seconds += 2 * blocks * dropped / device.memory_bandwidth
    return seconds


@functools.cache
def _padded_numel(shape: ModelShape, world: int, tp: int = 1) -> int:
    """Elements every rank's padded shards of every unit add up to (what a sharded collective moves):
    of a tensor-parallel rank's part under tensor parallel."""
    return rank_facts(shape, tp).padded_numel(world)


def _sharded_collective_s(collective: Callable[[float, int, float, float], float], facts: ModelFacts, ranks: int,
                          element: float, bandwidth: float, latency: float) -> float:
    """One pass of `collective` (all-gather or reduce-scatter) over every unit of `facts` sharded over
    `ranks` ranks: with expert parallel, the experts' part over the ranks / ep holding the same ones."""
    whole = facts.padded_numel(ranks)
    if facts.ep == 1:
        return collective(whole * element, ranks, bandwidth, latency)
    replicas = ranks // facts.ep
    experts = facts.n_layer * replicas * facts.experts.sharded_numel(replicas)
    return collective((whole - experts) * element, ranks, bandwidth, latency) \
        + collective(experts * element, replicas, bandwidth, latency)


def _exchanges(c: Candidate, shape: ModelShape) -> float:
    """Row all-to-alls of one micro-step: in every MoE layer, out to the experts' ranks and back in
    forward, the gradients both ways in backward, and a recomputed forward's two again."""
    return shape.n_layer * 4 + 2 * _recomputed(c.recompute, 0, shape.n_layer)


def expert_parallel_s(c: Candidate, shape: ModelShape, device: DeviceProfile) -> float:
    """One micro-step's expert-parallel all-to-alls, on the critical path (a layer's experts wait
    for their rows): each rank sends (ep - 1) / ep of its rows (routing balanced), and the counts'
    exchange before each adds its hops' latency."""
    if c.ep == 1:
        return 0.0
    rows = expert_rows(c, shape) * shape.d_model * dtype_bytes(computing_params_dtype(c))
    bandwidth = device.bandwidth(_spans_nodes(c.ep, c.tp, device.gpus_per_node), "all_gather")
    one = all_gather_s(rows, c.ep, bandwidth, device.latency_s) + (c.ep - 1) * device.latency_s
    return _exchanges(c, shape) * one


def expert_exchange_bytes(c: Candidate, cfg: Config) -> int:
    """Bytes one rank sends in expert parallel's all-to-alls over an optimizer step (routing balanced)."""
    shape = model_shape(cfg.model, cfg.lora)
    micro_steps = cfg.train.global_batch // (c.dp * c.micro_batch)
    rows = expert_rows(c, shape) * shape.d_model * dtype_bytes(computing_params_dtype(c))
    return int(micro_steps * _exchanges(c, shape) * rows * (c.ep - 1) / c.ep)


def _data_parallel(c: Candidate, cfg: Config, shape: ModelShape, device: DeviceProfile, world: int,
                   traced: bool) -> StepTime:
    """Replicated or sharded over the data-parallel (and cp) ranks; over tensor parallel, each
    tp rank's part so, and each block's four activation all-reduces over tp on top, exposed."""
    per_unit = blocks_per_unit(c, cfg)
    facts = in_units(rank_facts(shape, c.tp, c.ep, "trainable"), per_unit)  # what gradients reduce: LoRA's adapters
    units = in_units(rank_facts(shape, c.tp, c.ep), per_unit)  # what fsdp gathers: every parameter
    precision = make_precision(c.precision, cfg.parallel.sharding.reduce_dtype)
    micro_steps = cfg.train.global_batch // (c.dp * c.micro_batch)
    micro_step = micro_step_s(c, shape, device, 0, shape.n_layer, True, True, c.micro_batch, traced)
    compute = micro_steps * micro_step
    backward = 2 / 3 * micro_step  # what the last micro-step's communication may hide behind
    ranks = c.dp * c.cp  # that average gradients: a replica's cp ranks each hold a share of its tokens
    inter_node = _spans_nodes(ranks, c.tp, device.gpus_per_node)
    latency = device.latency_s
    stored = dtype_bytes(precision.param_dtype)
    gathered = dtype_bytes(working_dtype(precision))  # zero1/zero2's updated shards, fsdp's units: 16-bit if mixed
    gather_bandwidth = device.bandwidth(inter_node, "all_gather")
    scatter_bandwidth = device.bandwidth(inter_node, "reduce_scatter")
    reduce_s = _sharded_collective_s(all_gather_s, facts, ranks, dtype_bytes(precision.reduce_dtype),
                                     scatter_bandwidth, latency)
    if gathers_in_float8(c, cfg):  # the blocks' float8 weights one byte an element: the units' bytes, averaged
        float8 = units.n_layer * ranks * units.float8.sharded_numel(ranks)
        whole = units.padded_numel(ranks)
        gathered = (whole * gathered - float8 * (gathered - 1)) / whole
    gather_s = _sharded_collective_s(all_gather_s, units if c.spec.zero_stage == 3 else facts, ranks, gathered,
                                     gather_bandwidth, latency)
    # One collective per unit (per bucket for ddp); each pays its hops' latency.
    per_unit = (len(facts.units) - 1) * (ranks - 1) * latency
    stage = c.spec.zero_stage
    if stage == 0:
        grads = facts.params_total * stored
        experts = facts.n_layer * facts.experts.numel * stored if facts.ep > 1 else 0  # kept out of the buckets
        buckets = math.ceil((grads - experts) / (cfg.parallel.ddp.bucket_mb * 2**20))
        comm = all_reduce_s(grads - experts, ranks, device.bandwidth(inter_node), latency) \
            + (buckets - 1) * 2 * (ranks - 1) * latency \
            + all_reduce_s(experts, ranks // facts.ep, device.bandwidth(inter_node), latency)
        exposed = _hidden(comm, backward, device.overlap)
        stepped = facts.params_total
    elif stage in (1, 2):
        reduce = reduce_s + per_unit
        gather = gather_s + per_unit
        comm = reduce + gather
        exposed = gather + (reduce if stage == 1 else _hidden(reduce, backward, device.overlap))
        stepped = facts.shard_numel(ranks)
    else:  # fsdp: every micro-step gathers for forward and for backward; the last also reduce-scatters
        gather = gather_s + per_unit
        reduce = reduce_s + per_unit
        first_units = gather / max(1, len(units.units)) * 2  # the root and the first block, before any compute
        comm = micro_steps * 2 * gather + reduce
        exposed = micro_steps * (first_units + _hidden(gather - first_units, micro_step / 3, device.overlap)
                                 + _hidden(gather, backward, device.overlap))
        exposed += _hidden(reduce, max(0.0, backward - gather), device.overlap)
        stepped = facts.shard_numel(ranks)
    context, context_exposed = context_s(c, shape, device)
    all_to_all = micro_steps * expert_parallel_s(c, shape, device)
    tensor = micro_steps * _tensor_parallel_s(c, shape, device) + all_to_all
    optimizer = _optimizer_s(stepped, stored, cfg, device) \
        + _newton_schulz_s(shape, shape.n_layer, (ranks if stage else 1) * c.tp, cfg, device, inter_node)
    return StepTime(compute, comm + micro_steps * context + tensor, exposed + micro_steps * context_exposed + tensor,
                    0.0, optimizer, all_to_all)


def _tensor_parallel_s(c: Candidate, shape: ModelShape, device: DeviceProfile) -> float:
    """One micro-step's tensor-parallel communication: four all-reduces of an activation per block
    (two in forward, two in backward), which nothing hides (the next layer needs them)."""
    if c.tp == 1:
        return 0.0
    tokens = c.micro_batch * shape.seq_len / c.cp  # this rank's
    bandwidth = device.bandwidth(_spans_nodes(c.tp, 1, device.gpus_per_node))
    return 4 * shape.n_layer * all_reduce_s(tokens * shape.d_model * 4, c.tp, bandwidth, device.latency_s)


def context_s(c: Candidate, shape: ModelShape, device: DeviceProfile) -> tuple[float, float]:
    """(communication, the part not hidden) of context parallel in one micro-step's forward and
    backward, every layer: ring's point-to-point hops of keys and values (and their gradients)
    behind the layer's attention, all-to-all's exchanges of q, k, v and the output exposed."""
    if c.cp == 1:
        return 0.0, 0.0
    tokens = c.micro_batch * shape.seq_len / c.cp  # this rank's
    head_dim = shape.d_model // shape.n_head
    heads, kv_heads = shape.n_head // c.tp, shape.n_kv_head // c.tp  # this tp rank's
    inter_node = _spans_nodes(c.cp, c.pp * c.tp, device.gpus_per_node)
    if c.cp_mode == "ring":
        keys_values = 2 * tokens * kv_heads * head_dim * 4
        hop = keys_values / device.bandwidth(inter_node, "p2p") + device.latency_s
        comm = shape.n_layer * (3 * c.cp - 2) * hop  # cp - 1 forward, cp - 1 backward, cp of gradients
        attention = shape.n_layer * tokens * 12 * shape.d_model / c.tp * shape.seq_len / device.flops(
            compute_dtype(c.precision))
        return comm, _hidden(comm, attention, device.overlap)
    kv_heads = kv_heads if kv_heads % c.cp == 0 else heads
    element = dtype_bytes(make_precision(c.precision).compute_dtype)
    qkv, out = (tokens * count * head_dim * element for count in (heads + 2 * kv_heads, heads))
    bandwidth = device.bandwidth(inter_node, "all_gather")  # each rank sends (cp - 1) / cp of what it holds
    exchanges = sum(all_gather_s(nbytes, c.cp, bandwidth, device.latency_s) for nbytes in (qkv, out))
    comm = shape.n_layer * 2 * exchanges  # forward, and the gradients backward
    return comm, comm


def _hsdp(c: Candidate, cfg: Config, shape: ModelShape, device: DeviceProfile, world: int, traced: bool) -> StepTime:
    """fsdp within a node (on the node's share of the global batch), then the gradient shards
    all-reduced across the nodes after backward, nothing left to hide behind."""
    replicas = c.dp // c.shard
    node_batch = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train,
                                                                     global_batch=cfg.train.global_batch // replicas))
    within = _data_parallel(dataclasses.replace(c, strategy="fsdp", dp=c.shard, shard=None), node_batch, shape,
                            device, c.shard, traced)
    stored = dtype_bytes(make_precision(c.precision).param_dtype)
    shards = _padded_numel(shape, c.shard, c.tp) // c.shard * stored
    across = all_reduce_s(shards, replicas, device.bandwidth(replicas > 1), device.latency_s)
    return dataclasses.replace(within, communication_s=within.communication_s + across,
                               exposed_communication_s=within.exposed_communication_s + across)


def _mesh_dp_all_reduce(c: Candidate, numel: int, device: DeviceProfile) -> float:
    """The model-splitting strategies average every gradient over the cp group, then over the dp
    group, after backward; hsdp over stages over a node's dp ranks, then each shard across the
    nodes."""
    over_cp = all_reduce_s(numel * 4, c.cp, device.bandwidth(_spans_nodes(c.cp, c.pp * c.tp, device.gpus_per_node)),
                           device.latency_s)
    if c.spec.across_nodes and c.shard:
        stride = c.cp * c.pp * c.tp
        within = all_reduce_s(numel * 4, c.shard, device.bandwidth(_spans_nodes(c.shard, stride, device.gpus_per_node)),
                              device.latency_s)
        replicas = c.dp // c.shard
        across = all_reduce_s(numel * 4 // c.shard, replicas, device.bandwidth(replicas > 1), device.latency_s)
        return over_cp + within + across
    bandwidth = device.bandwidth(_spans_nodes(c.dp, c.cp * c.pp * c.tp, device.gpus_per_node))
    return over_cp + all_reduce_s(numel * 4, c.dp, bandwidth, device.latency_s)


def _tensor(c: Candidate, cfg: Config, shape: ModelShape, device: DeviceProfile, traced: bool) -> StepTime:
    micro_steps = cfg.train.global_batch // (c.dp * c.micro_batch)
    compute = micro_steps * micro_step_s(c, shape, device, 0, shape.n_layer, True, True, c.micro_batch, traced)
    all_to_all = micro_steps * expert_parallel_s(c, shape, device)
    tp_comm = micro_steps * _tensor_parallel_s(c, shape, device) + all_to_all
    numel = rank_facts(shape, c.tp, c.ep, "trainable").params_total  # what trains: under LoRA its adapters
    dp_comm = _mesh_dp_all_reduce(c, numel, device)
    context, context_exposed = (micro_steps * t for t in context_s(c, shape, device))
    optimizer = _optimizer_s(numel, 4, cfg, device) \
        + _newton_schulz_s(shape, shape.n_layer, c.tp, cfg, device, _spans_nodes(c.tp, 1, device.gpus_per_node))
    return StepTime(compute, tp_comm + dp_comm + context, tp_comm + dp_comm + context_exposed, 0.0, optimizer,
                    all_to_all)


@dataclass(frozen=True)
class _PipelineMesh:
    """What a pipeline candidate's step takes from its mesh and schedule alone (strategy, dp, pp,
    tp, cp, ep, shard, schedule), not from its precision, recomputation or batch."""

    layout: Layout
    bounds: tuple[tuple[int, int], ...]  # each stage's [start, stop) of blocks
    bandwidth: float  # of the sends between two ranks' stages
    boundaries: int  # between two ranks' stages
    blocks: int  # the busiest rank's
    tp_bandwidth: float  # of a block's tensor-parallel all-reduces
    tied: float  # seconds: the tied embeddings' all-reduce between the first and last stage's ranks
    dp_all_reduce: float  # seconds: a stage's gradients averaged (_mesh_dp_all_reduce)
    stepped: int  # elements a rank's optimizer steps

    @classmethod
    def of(cls, c: Candidate, shape: ModelShape, device: DeviceProfile) -> _PipelineMesh:
        facts = rank_facts(shape, c.tp, c.ep)
        layout = layout_of(c.schedule or "gpipe", c.pp)
        bounds = stage_bounds(shape, layout.stages)
        bandwidth = device.bandwidth(_spans_nodes(c.pp, c.tp, device.gpus_per_node), "p2p")
        boundaries = sum(layout.rank_of(s) != layout.rank_of(s + 1) for s in range(layout.stages - 1))
        blocks = max(sum(bounds[s][1] - bounds[s][0] for s in layout.stages_of(r)) for r in range(c.pp))
        tp_bandwidth = device.bandwidth(_spans_nodes(c.tp, 1, device.gpus_per_node))
        trained = rank_facts(shape, c.tp, c.ep, "trainable")  # under LoRA its adapters: what a stage reduces and steps
        stage_numel = blocks * trained.block.numel + trained.root.numel
        tied = 0.0
        if facts.tied and layout.rank_of(0) != layout.rank_of(layout.stages - 1):  # first + last stage
            tied = all_reduce_s(facts.tied * 4, 2, bandwidth, device.latency_s)
        # The sharded strategies over stages move what the replicas' all-reduce does, a reduce-scatter
        # after the schedule and an all-gather (before the next one under fsdp), as exposed; their
        # optimizer steps on a dp shard.
        stepped = stage_numel // (c.shard or c.dp) if c.spec.zero_stage else stage_numel
        return cls(layout, bounds, bandwidth, boundaries, blocks, tp_bandwidth, tied,
                   _mesh_dp_all_reduce(c, stage_numel, device), stepped)


def _pipeline(c: Candidate, cfg: Config, shape: ModelShape, device: DeviceProfile, traced: bool,
              mesh: _PipelineMesh) -> StepTime:
    """The candidate's schedule simulated (parallel.pipeline.simulate.simulate) with each stage's forward,
    input- and weight-gradient times: the busiest rank's compute and the rest of the run, idle (the
    bubble). Without `traced`, a bound that runs no simulation instead (`_fewest_idle`). On the
    critical path besides: the first micro-batch's activations crossing every boundary between two
    ranks' stages during the fill, and the last one's gradients during the drain; in between,
    messages travel while the ranks compute. Under expert parallel a stage's experts are split ep
    ways, and each micro-batch's all-to-alls in the busiest rank's MoE layers are exposed."""
    runs = c.micro_batches  # 1 where the model is split without pipelining
    per_run = c.micro_batch / runs
    layout = mesh.layout
    activation = per_run * shape.seq_len / c.cp * shape.d_model * 4
    # Candidates differing only in data parallelism, batch or schedule have the same stages.
    costs = _stage_costs(c.replace(dp=1, micro_batch=1, micro_batches=1, schedule=None), shape, device,
                         mesh.bounds, per_run, traced)
    busy = runs * _busiest(layout, costs)
    if traced:
        run = _simulated(pipeline_schedule(c.schedule, c.pp, runs), costs)
    else:
        run = _fewest_idle(c.schedule or "gpipe", layout, costs, runs)
    pipeline_runs = cfg.train.global_batch // (c.dp * c.micro_batch)
    compute = pipeline_runs * busy
    bubble = pipeline_runs * (run - busy)
    sends = pipeline_runs * 2 * mesh.boundaries * (activation / mesh.bandwidth + device.latency_s)
    tp_comm = 0.0
    if c.tp > 1:
        per_block = all_reduce_s(per_run * shape.seq_len * shape.d_model * 4, c.tp, mesh.tp_bandwidth,
                                 device.latency_s)
        tp_comm = pipeline_runs * runs * 4 * mesh.blocks * per_block
    # expert_parallel_s and context_s are a micro-step's over every layer: the busiest rank's share of the
    # layers, per micro-batch
    per_micro_batch = c.replace(micro_batch=c.micro_batch // runs)
    share = pipeline_runs * runs * mesh.blocks / shape.n_layer
    all_to_all = share * expert_parallel_s(per_micro_batch, shape, device)
    context, context_exposed = (share * t for t in context_s(per_micro_batch, shape, device))
    comm = sends + tp_comm + mesh.tied + mesh.dp_all_reduce + all_to_all
    owners = c.tp * ((c.shard or c.dp) if c.spec.zero_stage else 1)
    optimizer = _optimizer_s(mesh.stepped, 4, cfg, device) \
        + _newton_schulz_s(shape, mesh.blocks, owners, cfg, device, _spans_nodes(owners, 1, device.gpus_per_node))
    return StepTime(compute, comm + context, comm + context_exposed, bubble, optimizer, all_to_all)


@functools.lru_cache(maxsize=4096)
def _busiest(layout: Layout, costs: Costs) -> float:
    """One micro-batch's compute on the busiest rank: every stage it holds, forward and backward."""
    return max(sum(costs.forward[s] + costs.input_backward[s] + costs.weight_backward[s] for s in layout.stages_of(r))
               for r in range(layout.ranks))


@functools.lru_cache(maxsize=4096)
def _fewest_idle(name: str, layout: Layout, costs: Costs, micro_batches: int) -> float:
    """A run no shorter than the simulator's, in closed form: no rank starts before the first
    micro-batch's forward reaches its first stage, and each computes all its work; where every
    rank holds one stage and ends on a whole backward (gpipe, 1f1b), the last micro-batch's
    backward then still crosses every stage before it. Equal to the simulated run where stages
    cost alike."""
    forward, backward = costs.forward, [b + w for b, w in zip(costs.input_backward, costs.weight_backward, strict=True)]
    whole = layout.virtual == 1 and not SCHEDULES[name].splits_backward
    longest = 0.0
    for r in range(layout.ranks):
        first = layout.stages_of(r)[0]
        work = micro_batches * sum(forward[s] + backward[s] for s in layout.stages_of(r))
        drain = sum(backward[:first]) if whole else 0.0
        longest = max(longest, sum(forward[:first]) + work + drain)
    return longest


@functools.lru_cache(maxsize=4096)
def _stage_costs(c: Candidate, shape: ModelShape, device: DeviceProfile, bounds: tuple[tuple[int, int], ...],
                 per_run: float, traced: bool) -> Costs:
    """Each stage's forward, input-gradient (B) and weight-gradient (W) time for one micro-batch:
    a third each of its forward and backward, and B also the recomputation."""
    plain = dataclasses.replace(c, recompute="none")
    last = len(bounds) - 1
    # Stages alike in blocks, recomputed blocks and place (first, last) take alike: most of a
    # pipeline's, and under recompute = "none" `c`'s and `plain`'s, each worked out once.
    alike: dict[tuple[str, int, int, bool, bool], float] = {}

    def seconds(candidate: Candidate, start: int, stop: int, s: int) -> float:
        key = (candidate.recompute, stop - start, _recomputed(candidate.recompute, start, stop), s == 0, s == last)
        if key not in alike:
            alike[key] = _blocks_s(candidate, shape, device, *key[1:], per_run, traced)
        return alike[key]

    forward, input_backward, weight_backward = [], [], []
    for s, (start, stop) in enumerate(bounds):
        total = seconds(c, start, stop, s)
        third = seconds(plain, start, stop, s) / 3
        forward.append(third)
        input_backward.append(total - 2 * third)
        weight_backward.append(third)
    return Costs(tuple(forward), tuple(input_backward), tuple(weight_backward))


@functools.lru_cache(maxsize=4096)
def _simulated(schedule: Schedule, costs: Costs) -> float:
    """When one pipeline run ends."""
    return makespan(schedule, costs)
