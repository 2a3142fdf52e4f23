"""What a rank holds at the peak of each phase of a run beyond its steps: while its strategy makes
the model (setup), and at the load, evaluation, checkpoint and final weights, beside the steps'
peak (memory_model.predict_memory)."""

from __future__ import annotations

import math

from shardwise.config.schema import Config
from shardwise.models.cross_entropy import chunk_rows
from shardwise.planner.candidates import Candidate
from shardwise.planner.memory_model import (
    DEFAULT_MARGIN,
    RankMemory,
    blocks_per_unit,
    dtype_bytes,
    gathers_in_float8,
    model_state,
    predict_memory,
    working_dtype,
)
from shardwise.planner.model import (
    ModelShape,
    fsdp_gathered_bytes,
    in_units,
    model_facts,
    model_shape,
    rank_facts,
    stage_bounds,
)
from shardwise.precision import make_precision


def predict_setup_bytes(candidate: Candidate, cfg: Config) -> int:
    """The most bytes a rank holds while its strategy materialises the meta-built model, before
    the first step (what ShardedDataParallel counts as `setup_peak_bytes`). fsdp and hsdp make one
    unit whole at a time, in order, keep its shards and free it: at the peak, the shards made so
    far and one whole unit. zero1 and zero2 make the whole model, then lay each unit out as they
    keep it (whole parameters in the working dtype, master shards, zero1's gradient buffer): the
    larger of the two, and one unit's layout beside. pipeline, model-parallel and tensor make
    their stage's blocks one at a time, each whole until its tp split: at the peak, the stage
    they keep and one whole block beside its shard, as do the sharded strategies over pipeline
    stages before they shard the stage (within what a step holds). Every other strategy makes the
    whole model."""
    shape = model_shape(cfg.model, cfg.lora)
    facts = model_facts(shape)
    precision = make_precision(candidate.precision, cfg.parallel.sharding.reduce_dtype)
    stored = dtype_bytes(precision.param_dtype)
    if candidate.spec.splits_model or candidate.pp > 1:
        held = rank_facts(shape, candidate.tp)
        passing = facts.block.numel - held.block.numel  # the whole block being split, beyond its shard
        stages = stage_bounds(shape, candidate.pp)
        return max(held.stage(s == 0, s == len(stages) - 1, stop - start)[0] + passing
                   for s, (start, stop) in enumerate(stages)) * stored
    world = candidate.shard or candidate.dp
    stage = candidate.spec.zero_stage
    if not stage:
        return facts.params_total * stored
    # a block's experts split over ep as it is made; a unit's blocks made one by one, sharded together
    per_unit = blocks_per_unit(candidate, cfg)
    held = in_units(rank_facts(shape, candidate.tp, candidate.ep), per_unit)
    if candidate.tp > 1:  # a unit's blocks made whole in turn and split over tp, then its tp parts sharded
        shards = held.unit_shards(world)
        made = [facts.block] * held.n_layer + [facts.root]
        return max(sum(shards[: i + 1]) + whole.numel + part.numel
                   for i, (whole, part) in enumerate(zip(made, held.units, strict=True))) * stored
    if stage == 3:
        shards = held.unit_shards(world)
        return max(sum(shards[: i + 1]) + unit.numel
                   for i, unit in enumerate(in_units(facts, per_unit).units)) * stored
    state = model_state(stage, precision, held, world, cfg)
    largest = max(held.unit_padded(world)) * dtype_bytes(working_dtype(precision))
    return max(facts.params_total * stored, state.params + state.grads) + largest




def predict_phases(candidate: Candidate, cfg: Config, margin: float = DEFAULT_MARGIN) -> dict[str, int]:
    """The busiest rank's bytes at the peak of each phase of a run, as the trainer's summary
    measures them (`phases_by_rank`, above the runtime's resident set):

    - setup: `predict_setup_bytes`; steps: `predict_memory`'s total, margin included.
    - Between steps a rank keeps its parameters, its optimizer state and the gradient buffers that
      outlive a step (ddp's buckets, zero1's buffer): `kept`. Checkpoints are written from the live
      tensors, one at a time, so a save holds what is kept.
    - load: `kept` and a gradient per optimizer parameter: a load makes the optimizer's state
      (absent until the first step) by one step on zero gradients, dropped after.
    - eval: `kept`, fsdp's gathered parameters as in a step, and one forward's largest temporaries,
      which nothing saves: the MLP's hidden activations, or the logits and their softmax.
    - final_weights: `kept`, and on rank 0 the largest tensor, whole: received in place from its
      shards (or from the stage that holds it), and twice under tensor parallel, which joins the
      shards it receives; once more, in float32, where the storage dtype is narrower than the file's.
    Margin: the steps' only (allocator fragmentation and the optimizer step's temporaries)."""
    steps = max(rank.total for rank in predict_memory(candidate, cfg, margin))
    ranks = predict_memory(candidate, cfg, 0.0, activations=False)
    shape = model_shape(cfg.model, cfg.lora)
    precision = make_precision(candidate.precision, cfg.parallel.sharding.reduce_dtype)
    persistent = candidate.spec.zero_stage in (0, 1)  # ddp's buckets, zero1's gradient buffer
    kept = max(r.params + r.optimizer + (r.grads if persistent else 0) for r in ranks)
    master = max(_optimizer_grads(candidate, cfg, r) for r in ranks)
    stored = dtype_bytes(precision.param_dtype)
    largest = max(math.prod(s) for s in (*model_facts(shape).block.shapes, *model_facts(shape).root.shapes))
    gathers = 2 if candidate.tp > 1 else 1
    if candidate.spec.mesh_dim == "dp" and not candidate.spec.zero_stage and candidate.ep == 1:
        gathers = 0  # every rank holds it whole
    final = gathers * largest * stored + (largest * 4 if stored < 4 else 0)
    gathered = 0
    if candidate.spec.zero_stage == 3:
        gathered = fsdp_gathered_bytes(in_units(rank_facts(shape, candidate.tp, candidate.ep),
                                                blocks_per_unit(candidate, cfg)),
                                       candidate.shard or candidate.dp * candidate.cp, cfg.parallel.sharding.prefetch,
                                       True, dtype_bytes(working_dtype(precision)), gathers_in_float8(candidate, cfg))
    return {"setup": predict_setup_bytes(candidate, cfg), "load": kept + master, "steps": steps,
            "eval": kept + gathered + _forward_temporaries(candidate, shape), "checkpoint": kept,
            "final_weights": kept + final}


def _optimizer_grads(candidate: Candidate, cfg: Config, rank: RankMemory) -> int:
    """Bytes of one gradient per parameter the optimizer steps: the master shards' under the
    sharded strategies, else the rank's parameters'."""
    stage = candidate.spec.zero_stage
    if not stage:
        return rank.params
    facts = rank_facts(model_shape(cfg.model, cfg.lora), candidate.tp, candidate.ep)
    world = candidate.shard or candidate.dp * candidate.cp
    return facts.shard_numel(world) * dtype_bytes(make_precision(candidate.precision).param_dtype)


def _forward_temporaries(candidate: Candidate, shape: ModelShape) -> int:
    """The most a forward without autograd holds beyond its input at once: an MLP's hidden
    activations before and after the nonlinearity, or the logits and one float32 chunk of rows
    of them (the loss's, models/cross_entropy.py)."""
    tokens = candidate.micro_batch * shape.seq_len // candidate.cp
    element = dtype_bytes(make_precision(candidate.precision).compute_dtype)
    loss = tokens * shape.vocab_size * element + min(tokens, chunk_rows(shape.vocab_size)) * shape.vocab_size * 4
    return max(tokens * 2 * shape.d_ff // candidate.tp * element, loss)
