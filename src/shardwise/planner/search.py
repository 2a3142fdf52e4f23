"""Evaluate every candidate, rank those that fit by predicted step time, recommend one, and find
each strategy's largest micro-batch that fits."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from shardwise.config import PRECISIONS, Config, ConfigError
from shardwise.planner.candidates import DEFAULT_PRECISIONS, POLICIES, Candidate, enumerate_candidates
from shardwise.planner.devices import DeviceProfile
from shardwise.planner.memory import DEFAULT_MARGIN, RankMemory, predict_memory
from shardwise.planner.model import PlanError, model_facts, model_shape
from shardwise.planner.timing import StepTime, predict_step_time

GiB = 2**30


@dataclass
class Evaluated:
    candidate: Candidate
    memory_by_stage: list[RankMemory]  # one entry unless a pipeline's stages differ
    step: StepTime
    limit: int

    @property
    def memory(self) -> RankMemory:
        """The rank that needs the most: the one that decides whether the candidate fits."""
        return max(self.memory_by_stage, key=lambda rank: rank.total)

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.limit

    @property
    def over_by(self) -> int:
        return max(0, self.memory.total - self.limit)


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

    @property
    def params_total(self) -> int:
        return model_facts(model_shape(self.cfg.model)).params_total


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
              max_batch: bool = False) -> Plan:
    """Every candidate for training `cfg` on `world` ranks (`nodes` nodes of world / nodes) of
    `device`, predicted, ranked, and one recommended."""
    if world < 1 or nodes < 1 or world % nodes:
        raise PlanError(f"world size {world} on {nodes} node(s): need a positive world size that the nodes share "
                        "evenly (--nproc N, or --nodes N --gpus-per-node G)")
    if not 0 <= margin < 1:
        raise PlanError(f"--margin {margin:g}: must be in [0, 1), the fraction added for the allocator")
    model_shape(cfg.model)  # only language models can be planned: say so before anything else
    device = dataclasses.replace(device, gpus_per_node=world // nodes)
    limit = memory_limit(device, memory_gb)
    candidates, refused = enumerate_candidates(cfg, world, precisions, policies, micro_batches, nodes)
    if not candidates:
        reasons = "\n".join(f"  {mesh}: {why}" for mesh, why in refused.items())
        raise PlanError(f"no candidate can train this config on {world} ranks; each way of using them is refused:\n"
                        f"{reasons}")
    evaluated = [evaluate(c, cfg, device, world, limit, margin) for c in candidates]
    # Ties (bf16 and fp16 compute alike on GPUs) go to the smaller footprint, then the simpler precision.
    fitting = sorted((e for e in evaluated if e.fits),
                     key=lambda e: (e.step.total, e.memory.total, PRECISIONS.index(e.candidate.precision)))
    over = sorted((e for e in evaluated if not e.fits), key=lambda e: e.over_by)
    recommended = fitting[0] if fitting else None
    plan = Plan(cfg, world, nodes, world // nodes, device, limit, margin, fitting + over, refused, recommended,
                _reason(fitting, over, limit))
    if max_batch:
        plan.max_batch = largest_micro_batches(cfg, world, device, limit, margin, precisions, policies, nodes)
    return plan


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
    line = (f"fastest predicted step ({best.step.total:.3g} s) of the {len(fitting)} candidates that fit in "
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
               shape.schedule)
        found[key] = _largest(shape, cfg, device, world, limit, margin)
    return [{"strategy": k[0], "dp": k[1], "pp": k[2], "tp": k[3], "precision": k[4], "recompute": k[5],
             "micro_batches": k[6], "schedule": k[7], "max_micro_batch": v}
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
