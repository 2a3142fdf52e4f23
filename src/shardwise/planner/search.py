"""Evaluate the candidates, rank those that fit by predicted step time, recommend one, and find
each strategy's largest micro-batch that fits.

Costing a candidate (its memory traced, its time) is cheap, but a large world has many thousands,
most of which cannot win, so by default the search prunes before it costs:
- twins: precisions predicted alike on this device (bf16-mixed and fp16-mixed on a GPU: the same
  stored dtypes, 16-bit compute of the same throughput) are costed once, one row naming both;
- dominated: a gpipe pipeline runs no faster than the same one under 1f1b (as fast where its
  stages' backwards are alike multiples of their forwards; slower where recomputation makes them
  differ, the simulator finds) and holds no less, so only 1f1b is costed;
- best first: every candidate's step time is cheap to bound without a trace (all of it but
  `selective`'s re-done elementwise work, which only adds, and for a pipeline, the simulated idle
  beyond a closed-form least, equal where stages cost alike), so candidates are taken fastest first;
  one whose memory is over the limit even without its activations cannot fit and is not traced;
  the search stops once the `top` fastest that fit are known and the next candidate is slower,
  having found the best candidate of another strategy than the recommended one (for the reason).
  Candidates over the limit but faster than the recommendation are costed, closest first.
`exhaustive=True` costs every candidate (what `--plot` draws); `tests/test_planner.py` holds the
pruned search to it: the same recommendation and the same ranking of what both keep."""

from __future__ import annotations

import copy
import dataclasses
import functools
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from shardwise.config.registry import spec
from shardwise.config.schema import PRECISIONS, Config, ConfigError
from shardwise.elastic import range_setting
from shardwise.planner.candidates import DEFAULT_PRECISIONS, POLICIES, Candidate, enumerate_candidates
from shardwise.planner.devices import DeviceProfile
from shardwise.planner.memory_model import DEFAULT_MARGIN, RankMemory, dtype_bytes, predict_memory
from shardwise.planner.model import ModelShape, PlanError, model_facts, model_shape, split_refusal
from shardwise.planner.timing import StepTime, compute_dtype, predict_step_time, step_time_bounds
from shardwise.precision import make_precision

GiB = 2**30
TOP = 15  # candidates that fit the table shows (and the pruned search keeps), unless told otherwise
CLOSEST = 3  # candidates over the limit the table shows


@dataclass
class Evaluated:
    candidate: Candidate
    memory_by_stage: list[RankMemory]  # one entry unless a pipeline's stages differ
    step: StepTime
    limit: int
    twins: tuple[str, ...] = ()  # other precisions predicted exactly alike (this row stands for them too)

    @functools.cached_property
    def memory(self) -> RankMemory:
        """The rank that needs the most: the one that decides whether the candidate fits."""
        return max(self.memory_by_stage, key=lambda rank: rank.total)

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.limit

    @property
    def over_by(self) -> int:
        return max(0, self.memory.total - self.limit)

    @property
    def precisions(self) -> tuple[str, ...]:
        return (self.candidate.precision, *self.twins)

    def rank_key(self) -> tuple:
        """Fastest first; ties (bf16 and fp16 compute alike on GPUs) to the smaller footprint, then
        the simpler precision, then 1f1b (fewer micro-batches held on later stages)."""
        c = self.candidate
        return self.step.total, self.memory.total, PRECISIONS.index(c.precision), c.schedule == "gpipe"


@dataclass
class Plan:
    cfg: Config
    world_size: int
    nodes: int
    gpus_per_node: int
    device: DeviceProfile
    memory_limit: int
    margin: float
    ranked: list[Evaluated]  # those that fit, fastest first, then the rest, closest to fitting first
    refused: dict[str, str]  # mesh -> why the trainer would refuse every variant of it
    recommended: Evaluated | None
    reason: str
    max_batch: list[dict[str, object]] | None = None
    candidates: int = 0  # every candidate the trainer accepts, twins counted apart
    pruned: dict[str, int] = field(default_factory=dict)  # why candidates were not costed: how many

    @property
    def params_total(self) -> int:
        return model_facts(model_shape(self.cfg.model, self.cfg.lora)).params_total

    @property
    def params_active(self) -> int:
        """The parameters a token computes with: all but the experts it is not routed to."""
        return model_facts(model_shape(self.cfg.model, self.cfg.lora)).active_total

    @property
    def fitting(self) -> list[Evaluated]:
        return [e for e in self.ranked if e.fits]

    @property
    def shown_over(self) -> list[Evaluated]:
        """Candidates over the limit worth showing: those faster than the recommendation (all of them
        if nothing fits), closest to fitting first."""
        best = self.recommended
        return [e for e in self.ranked if not e.fits and (best is None or e.step.total < best.step.total)]


def evaluate(candidate: Candidate, cfg: Config, device: DeviceProfile, world: int, limit: int,
             margin: float = DEFAULT_MARGIN) -> Evaluated:
    return Evaluated(candidate, predict_memory(candidate, cfg, margin),
                     predict_step_time(candidate, cfg, device, world), limit)


def memory_limit(device: DeviceProfile, memory_gb: float | None) -> int:
    """Bytes one rank may use: `--memory-gb` GiB if given, else the device's less what its
    runtime reserves."""
    if memory_gb is None:
        return device.memory_bytes - device.reserved_bytes
    if memory_gb <= 0:
        raise PlanError(f"--memory-gb {memory_gb:g}: must be > 0 (GiB one rank may use)")
    return int(memory_gb * GiB)


def make_plan(cfg: Config, world: int, device: DeviceProfile, *, nodes: int = 1, memory_gb: float | None = None,
              margin: float = DEFAULT_MARGIN, precisions: tuple[str, ...] = DEFAULT_PRECISIONS,
              policies: tuple[str, ...] = POLICIES, micro_batches: list[int] | None = None,
              max_batch: bool = False, top: int = TOP, exhaustive: bool = False) -> Plan:
    """The candidates for training `cfg` on `world` ranks (`nodes` nodes of world / nodes) of
    `device`, predicted, ranked, and one recommended: the `top` fastest that fit and what could
    beat them, or with `exhaustive` every candidate."""
    if world < 1 or nodes < 1 or world % nodes:
        raise PlanError(f"world size {world} on {nodes} node(s): need a positive world size that the nodes share "
                        "evenly (--nproc N, or --nodes N --gpus-per-node G)")
    if not 0 <= margin < 1:
        raise PlanError(f"--margin {margin:g}: must be in [0, 1), the fraction added for the allocator")
    if cfg.train.objective in ("dpo", "ipo") and cfg.train.reference == "copy":  # a second model, not counted
        raise PlanError("train.reference = 'copy': the planner does not count the frozen copy of the model beside "
                        "the policy yet; plan with train.reference = 'pass', whose table of reference "
                        "log-probabilities is a few bytes a pair")
    if cfg.train.optimizer == "muon" and cfg.train.muon.params is not None:  # names: the planner counts shapes
        raise PlanError(f"train.muon.params = {cfg.train.muon.params!r}: the planner counts Muon's default split "
                        "(the blocks' matrices) alone; unset it to plan, or plan with adamw, whose state bounds Muon's")
    if top < 1:
        raise PlanError(f"--top {top}: must be >= 1, the candidates that fit to find and show")
    model_shape(cfg.model, cfg.lora)  # only language models can be planned: say so before anything else
    device = dataclasses.replace(device, gpus_per_node=world // nodes)
    limit = memory_limit(device, memory_gb)
    candidates, refused = enumerate_candidates(cfg, world, precisions, policies, micro_batches, nodes)
    candidates = _splittable(candidates, refused, model_shape(cfg.model, cfg.lora))
    if not candidates:
        reasons = "\n".join(f"  {mesh}: {why}" for mesh, why in refused.items())
        raise PlanError(f"no candidate can train this config on {world} ranks; each way of using them is refused:\n"
                        f"{reasons}")
    cost = functools.partial(evaluate, cfg=cfg, device=device, world=world, limit=limit, margin=margin)
    if exhaustive:
        evaluated, pruned = _collapse_twins([cost(c) for c in candidates]), {}
    else:
        evaluated, pruned = _pruned_search(candidates, cfg, device, world, limit, margin, top, cost)
    fitting = sorted((e for e in evaluated if e.fits), key=Evaluated.rank_key)
    over = sorted((e for e in evaluated if not e.fits), key=lambda e: (e.over_by, e.rank_key()))
    recommended = fitting[0] if fitting else None
    plan = Plan(cfg, world, nodes, world // nodes, device, limit, margin, fitting + over, refused, recommended,
                _reason(fitting, over, limit), candidates=len(candidates), pruned=pruned)
    if max_batch:
        plan.max_batch = largest_micro_batches(cfg, world, device, limit, margin, precisions, policies, nodes)
    return plan


def _splittable(candidates: list[Candidate], refused: dict[str, str], shape: ModelShape) -> list[Candidate]:
    """`candidates` less those that split the model (tp or pp > 1) where its plan does not fit it,
    each such mesh among the `refused` with why (what the worker's plan check would raise)."""
    split = [c for c in candidates if c.tp > 1 or c.pp > 1]
    why = split_refusal(shape) if split else None
    if why is None:
        return candidates
    for c in split:
        refused.setdefault(c.mesh, why)
    return [c for c in candidates if not (c.tp > 1 or c.pp > 1)]


def _figures(e: Evaluated) -> tuple:
    return (tuple(tuple(rank.as_dict().values()) for rank in e.memory_by_stage), tuple(e.step.as_dict().values()))


def _collapse_twins(evaluated: list[Evaluated]) -> list[Evaluated]:
    """One row per distinct plan: candidates differing only in precision whose predictions are
    identical become one, named by the first precision, the others its twins."""
    rows: dict[tuple, Evaluated] = {}
    for e in sorted(evaluated, key=lambda e: PRECISIONS.index(e.candidate.precision)):
        key = (dataclasses.replace(e.candidate, precision=""), _figures(e))
        if key in rows:
            rows[key].twins += (e.candidate.precision,)
        else:
            rows[key] = e
    return list(rows.values())


def precision_twins(precisions: tuple[str, ...], cfg: Config, device: DeviceProfile) -> dict[str, str]:
    """Each precision -> the first of `precisions` predicted exactly alike on `device`: the same
    stored and reduce dtypes, mixed or not alike, a compute dtype of the same size and the same
    matmul throughput (bf16-mixed and fp16-mixed on a GPU; not on a CPU, whose fp16 is slow)."""
    def signature(name: str) -> tuple:
        p = make_precision(name, cfg.parallel.sharding.reduce_dtype)
        return (p.param_dtype, p.reduce_dtype, p.mixed, dtype_bytes(p.compute_dtype), device.flops(compute_dtype(name)))

    first: dict[tuple, str] = {}
    return {name: first.setdefault(signature(name), name) for name in sorted(precisions, key=PRECISIONS.index)}


def _pruned_search(candidates: list[Candidate], cfg: Config, device: DeviceProfile, world: int, limit: int,
                   margin: float, top: int, cost: Callable[[Candidate], Evaluated]) -> tuple[list[Evaluated],
                                                                                           dict[str, int]]:
    pruned = {"dominated": 0, "cannot_fit": 0, "slower": 0}  # candidates not costed, twins included
    twin_of = precision_twins(tuple({c.precision for c in candidates}), cfg, device)
    accepted = set(candidates)
    twins: dict[Candidate, list[str]] = {}
    for c in candidates:
        representative = c
        if twin_of[c.precision] != c.precision:  # most candidates are their own
            twin = c.replace(precision=twin_of[c.precision])
            representative = twin if twin in accepted else c
        alike = twins.setdefault(representative, [])
        if representative is not c:
            alike.append(c.precision)
    distinct = []
    for c, alike in twins.items():
        if c.schedule == "gpipe" and c.replace(schedule="1f1b") in accepted:
            pruned["dominated"] += 1 + len(alike)
        else:
            distinct.append(c)
    # Fastest first by a bound that traces and simulates nothing (exact but for selective's re-done
    # elementwise work and a pipeline's idle beyond its closed-form least).
    bounds = step_time_bounds(distinct, cfg, device, world)
    queue = [(bound, i, c) for i, (bound, c) in enumerate(zip(bounds, distinct, strict=True))]
    heapq.heapify(queue)
    fastest: list[float] = []  # exact times of the fastest `top` that fit, as a max-heap (negated)
    kept: list[Evaluated] = []
    over_bound: list[tuple[int, float, Candidate]] = []  # (memory lower bound, time bound, candidate)
    best: Evaluated | None = None
    fastest_by_strategy: dict[str, float] = {}  # exact time of the fastest that fits, per strategy

    def lower_bound(c: Candidate) -> int:
        return max(rank.total for rank in predict_memory(c, cfg, margin, activations=False))

    while queue:
        bound, _, c = heapq.heappop(queue)
        threshold = -fastest[0] if len(fastest) >= top else math.inf
        if bound > threshold:
            # Beyond the top: only the best candidate of another strategy is still wanted.
            rival_time = min((t for s, t in fastest_by_strategy.items() if s != best.candidate.strategy),
                             default=math.inf)
            if bound > rival_time or c.strategy == best.candidate.strategy:
                pruned["slower"] += 1 + len(twins[c])
                continue
        lower = lower_bound(c)
        if lower > limit:
            pruned["cannot_fit"] += 1 + len(twins[c])
            over_bound.append((lower, bound, c))
            continue
        e = cost(c)
        e.twins = tuple(twins[c])
        if e.fits:
            if bound <= threshold:
                heapq.heappush(fastest, -e.step.total)
                if len(fastest) > top:
                    heapq.heappop(fastest)
            if best is None or e.rank_key() < best.rank_key():
                best = e
            fastest_by_strategy[c.strategy] = min(e.step.total, fastest_by_strategy.get(c.strategy, math.inf))
            kept.append(e)
        elif bound <= threshold:
            kept.append(e)
        else:  # over the limit, and found looking for another strategy's best: not shown
            pruned["slower"] += 1 + len(twins[c])
    closest = _closest_over(kept, over_bound, best, cost, twins)
    pruned["cannot_fit"] -= sum(1 + len(e.twins) for e in closest)
    return kept + closest, pruned


def _closest_over(kept: list[Evaluated], over_bound: list[tuple[int, float, Candidate]], best: Evaluated | None,
                  cost: Callable[[Candidate], Evaluated], twins: dict[Candidate, list[str]]) -> list[Evaluated]:
    """Those of the candidates pruned as unable to fit that are among the CLOSEST to fitting of
    those the table shows (faster than the best; all if nothing fits): costed in order of their
    lower bound until the next cannot beat the closest found."""
    faster = math.inf if best is None else best.step.total
    shown = sorted(e.memory.total for e in kept if not e.fits and e.step.total < faster)
    found = []
    for lower, bound, c in sorted(over_bound, key=lambda item: item[0]):
        if bound >= faster:
            continue
        if len(shown) >= CLOSEST and lower > shown[CLOSEST - 1]:
            break
        e = cost(c)
        e.twins = tuple(twins[c])
        if e.step.total < faster:
            found.append(e)
            shown = sorted([*shown, e.memory.total])
    return found


def _gib(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB"


def _reason(fitting: list[Evaluated], over: list[Evaluated], limit: int) -> str:
    """One line on why the first candidate is recommended (or why none is)."""
    if not fitting:
        closest = over[0]
        return (f"nothing fits in {_gib(limit)} per rank; closest: {closest.candidate.label} needs "
                f"{_gib(closest.memory.total)} ({_gib(closest.over_by)} over): add ranks, recompute, or shrink "
                "the batch")
    best = fitting[0]
    line = (f"fastest predicted step ({best.step.total:.3g} s) of the candidates that fit in "
            f"{_gib(limit)} per rank, using {_gib(best.memory.total)}")
    rival = next((e for e in fitting if e.candidate.strategy != best.candidate.strategy), None)
    if rival is not None:
        line += (f"; the best other strategy, {rival.candidate.strategy}, is predicted "
                 f"{rival.step.total / best.step.total:.2f}x slower")
    return line


def largest_micro_batches(cfg: Config, world: int, device: DeviceProfile, limit: int, margin: float,
                          precisions: tuple[str, ...], policies: tuple[str, ...],
                          nodes: int = 1) -> list[dict[str, object]]:
    """For every strategy, mesh, precision and recomputation, the largest micro-batch (samples per
    forward on one replica) whose predicted memory fits; 0 if not even one sample does. Each
    is searched with the global batch set to one micro-batch per replica."""
    found: dict[tuple, int] = {}
    # The shapes to search: every candidate with a micro-batch of 8, so pipelines offer M = 2, 4, 8.
    probe = copy.deepcopy(cfg)
    probe.train.global_batch = world * 8
    shapes, _ = enumerate_candidates(probe, world, precisions, policies, micro_batches=[8], nodes=nodes)
    for shape in {dataclasses.replace(c, micro_batch=c.micro_batches) for c in shapes}:
        key = (shape.strategy, shape.dp, shape.pp, shape.tp, shape.precision, shape.recompute, shape.micro_batches,
               shape.schedule, shape.cp, shape.cp_mode, shape.ep)
        found[key] = _largest(shape, cfg, device, world, limit, margin)
    return [{"strategy": k[0], "dp": k[1], "pp": k[2], "tp": k[3], "precision": k[4], "recompute": k[5],
             "micro_batches": k[6], "schedule": k[7], "cp": k[8], "cp_mode": k[9], "ep": k[10],
             "max_micro_batch": v}
            for k, v in sorted(found.items(), key=lambda kv: str(kv[0]))]


def _largest(shape: Candidate, cfg: Config, device: DeviceProfile, world: int, limit: int, margin: float) -> int:
    """Largest multiple of the pipeline's micro-batch count that fits (memory grows with it)."""
    unit = shape.micro_batches

    def fits(multiple: int) -> bool:
        candidate = dataclasses.replace(shape, micro_batch=unit * multiple)
        try:
            run_cfg = candidate.config(cfg, world, global_batch=candidate.dp * candidate.micro_batch)
        except ConfigError:
            return False
        return evaluate(candidate, run_cfg, device, world, limit, margin).fits

    if not fits(1):
        return 0
    low, high = 1, 2
    while fits(high):
        low, high = high, high * 2
        if high > 2**24:
            return low * unit
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low * unit


def check_smallest_fits(cfg: Config, limit_bytes: int) -> None:
    """An elastic range's (elastic.py) smallest world, where each rank holds the most, within
    `limit_bytes` a rank as the planner predicts it (its memory model: steps, margin included); a
    strategy or model it does not plan is not checked."""
    launch = cfg.launch
    if launch.min_nnodes is None or not spec(cfg.parallel.strategy).planned:
        return
    world = launch.nproc * launch.min_nnodes
    try:
        held = max(rank.total for rank in predict_memory(Candidate.of(cfg, world), cfg))
    except PlanError:
        return
    if held > limit_bytes:
        raise ConfigError(f"{range_setting(launch)}: on {launch.min_nnodes} node(s), a world of {world}, a rank "
                          f"would hold {held / 2**30:.2f} GiB (the planner's prediction) of the "
                          f"{limit_bytes / 2**30:.2f} GiB it has; raise the fewest nodes, or plan for them "
                          "(shardwise plan --nodes N)")
