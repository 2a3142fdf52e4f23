"""Pipeline schedules simulated: each rank's list of actions (schedules.py) run with a cost per
action, in the order `run_order` proves possible, to predict the timeline (each compute's start
and end), the makespan, each rank's bubble and the activations each rank holds at its peak; and
a timeline drawn as text. The planner predicts a pipeline's step from these, and the docs'
pictures of the schedules are drawn by them."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from shardwise.parallel.pipeline.schedules import (
    BW,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    Schedule,
    W,
    run_order,
)


@dataclass(frozen=True)
class Costs:
    """Seconds (or any unit) per action, per stage; a message's transfer time."""

    forward: tuple[float, ...]
    input_backward: tuple[float, ...]
    weight_backward: tuple[float, ...]
    transfer: float = 0.0

    @classmethod
    def uniform(cls, stages: int, forward: float = 1.0, input_backward: float = 1.0, weight_backward: float = 1.0,
                transfer: float = 0.0) -> Costs:
        return cls((forward,) * stages, (input_backward,) * stages, (weight_backward,) * stages, transfer)

    def of(self, action: Action) -> float:
        kind, _, s = action
        if kind == F:
            return self.forward[s]
        if kind in (B, BW):
            return self.input_backward[s] + (self.weight_backward[s] if kind == BW else 0.0)
        return self.weight_backward[s] if kind == W else 0.0  # messages take their rank no time


@dataclass(frozen=True)
class Interval:
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """A simulated run: when each rank computed what. The run starts at 0 on every rank and ends
    when the last rank finishes (`makespan`)."""

    schedule: Schedule
    intervals: tuple[tuple[Interval, ...], ...]  # per rank, compute actions only

    @property
    def makespan(self) -> float:
        return max((ranks[-1].end for ranks in self.intervals if ranks), default=0.0)

    @property
    def bubble_per_rank(self) -> list[float]:
        """The fraction of the run each rank idles."""
        return [1 - sum(x.end - x.start for x in ranks) / self.makespan for ranks in self.intervals]

    @property
    def bubble(self) -> float:
        return sum(self.bubble_per_rank) / len(self.intervals)

    @property
    def peak_in_flight(self) -> list[int]:
        return peak_in_flight(self.schedule)


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per rank, the most (micro-batch, stage) pairs whose activations it holds at once: from a
    forward until its weight gradients are done (W, or BW). One pair is 1/V of the activations
    one micro-batch leaves on the rank's layers."""
    return [int(peak) for peak in peak_held(schedule, [1] * schedule.layout.stages)]


def peak_held(schedule: Schedule, held: list[float]) -> list[float]:
    """Per rank, the most it holds at once when a forward on stage s leaves `held[s]` (bytes, say)
    until its weight gradients are done."""
    peaks = []
    for actions in schedule.actions:
        now = peak = 0.0
        for kind, _, s in actions:
            now += held[s] if kind == F else -held[s] if kind in (W, BW) else 0.0
            peak = max(peak, now)
        peaks.append(peak)
    return peaks


def simulate(schedule: Schedule, costs: Costs) -> Timeline:
    """Run every rank's list with these costs: each action starts when its rank is free and what it
    needs is there (a message `costs.transfer` after its send). Raises ScheduleError naming what
    each stuck rank waits for if the lists deadlock."""
    intervals: list[list[Interval]] = [[] for _ in schedule.actions]
    for (r, k, *_), end in zip(_computes(schedule), _compute_ends(schedule, costs), strict=True):
        a = schedule.actions[r][k]
        intervals[r].append(Interval(a, end - costs.of(a), end))
    return Timeline(schedule, tuple(map(tuple, intervals)))


def makespan(schedule: Schedule, costs: Costs) -> float:
    """When the last rank finishes, as `simulate` runs the lists (without the timeline)."""
    return max(_compute_ends(schedule, costs), default=0.0)


def _compute_ends(schedule: Schedule, costs: Costs) -> list[float]:
    """When each compute of `_computes` ends."""
    f, b, w, transfer = costs.forward, costs.input_backward, costs.weight_backward, costs.transfer
    ends: list[float] = []
    for _, _, kind, stage, before, senders in _computes(schedule):
        start = ends[before] if before >= 0 else 0.0
        for sender in senders:  # a message leaves when the compute before its send ends
            arrival = (ends[sender] if sender >= 0 else 0.0) + transfer
            start = arrival if arrival > start else start
        ends.append(start + (f[stage] if kind == F else b[stage] if kind == B else w[stage] if kind == W
                             else b[stage] + w[stage]))
    return ends


@functools.lru_cache(maxsize=256)
def _computes(schedule: Schedule) -> tuple[tuple[int, int, str, int, int, tuple[int, ...]], ...]:
    """The computes in an order in which each comes after what it waits for: (rank, index in its
    list, kind, stage, position of the compute before it on its rank, positions of the computes
    before the sends of the messages it waits for since that one; -1: none, time 0). Messages
    take their ranks no time, so these are all a run's times hang on."""
    last_compute: dict[int, int] = {}  # rank -> position of its latest compute
    sender_of: dict[tuple[int, int], int] = {}  # (rank, index) of a send -> the compute before it
    waiting: dict[int, list[int]] = {}  # rank -> the senders of the messages received since its latest compute
    computes: list[tuple[int, int, str, int, int, tuple[int, ...]]] = []
    order = run_order(schedule)
    for r, k, _, sent in order:
        kind, _, stage = schedule.actions[r][k]
        if kind in (SEND_F, SEND_B):
            sender_of[r, k] = last_compute.get(r, -1)
        elif kind in (RECV_F, RECV_B):
            send_rank, send_index = order[sent][:2]
            waiting.setdefault(r, []).append(sender_of[send_rank, send_index])
        else:
            computes.append((r, k, kind, stage, last_compute.get(r, -1), tuple(waiting.pop(r, ()))))
            last_compute[r] = len(computes) - 1
    return tuple(computes)


@functools.lru_cache(maxsize=256)
def draw(timeline: Timeline, unit: float = 1.0) -> str:
    """The timeline as text, a row per rank, 3 characters per `unit` of time: each compute labelled
    with its kind and micro-batch (lower case on a rank's second stage), idle time as dots."""
    rows = []
    columns = round(timeline.makespan / unit)
    for r, intervals in enumerate(timeline.intervals):
        cells = [" . "] * columns
        stages = timeline.schedule.layout.stages_of(r)
        for x in intervals:
            first, stop = round(x.start / unit), round(x.end / unit)
            label = f"{x.action.kind}{x.action.micro_batch}"
            if stages.index(x.action.stage) % 2:
                label = label.lower()
            text = label.ljust(3 * (stop - first))
            for k in range(first, stop):
                cells[k] = text[3 * (k - first):3 * (k - first) + 3]
        rows.append(f"rank {r} |" + "".join(cells).rstrip())
    return "\n".join(rows)
