"""Pipeline schedules as data: for each rank of a pipeline, the list of what it does, in order;
one plain function per schedule writes those lists, `validate` proves they cannot deadlock, and
`simulate` runs them with a cost per action to predict the timeline, the bubble and the
activations each rank holds. `strategies/pipeline.py` runs the same lists.

- P ranks hold S = P x V stages, V per rank (virtual stages). A looped layout puts stage k on
  rank k mod P (interleaved 1F1B: rank 0 holds stages 0, P, 2P, ...); a V-shaped layout (ZBV,
  DualPipeV: V = 2) puts stages k and 2P-1-k on rank k, so the first rank also holds the last
  stage, which computes the loss.
- An action is a kind, a micro-batch i and a stage s:
  F       forward of i on s (the last stage's includes the loss)
  B       backward to s's input only: the input gradient the stage before needs
  W       the weight gradients of s for i, after its B
  BW      the full backward, B and W at once (the schedules that do not split it)
  SEND_F  F's output to the rank of stage s + 1;  RECV_F  F's input from the rank of s - 1
  SEND_B  B's input gradient to the rank of s - 1;  RECV_B  B's output gradient from the rank of s + 1
  Two stages on one rank hand activations over without a message.
- A rank runs its list in order. A send never waits (isend); a receive waits for its message; a
  compute waits for what it needs from this rank's earlier actions. So a set of lists deadlocks
  exactly when, run this way, some rank's next action can never become ready, which `simulate`
  finds and names.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

F, B, W, BW = "F", "B", "W", "BW"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (F, B, W, BW)


class ScheduleError(ValueError):
    """A schedule that cannot run: the wrong actions, or an order that deadlocks."""


class Action(NamedTuple):
    kind: str
    micro_batch: int
    stage: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}@{self.stage}"


@dataclass(frozen=True)
class Layout:
    """Which rank holds which stage: `ranks` x `virtual` stages, looped or V-shaped."""

    ranks: int
    virtual: int = 1
    v_shape: bool = False

    @property
    def stages(self) -> int:
        return self.ranks * self.virtual

    def rank_of(self, stage: int) -> int:
        if self.v_shape:
            return stage if stage < self.ranks else self.stages - 1 - stage
        return stage % self.ranks

    def peer(self, message: Action) -> int:
        """The rank a send goes to or a receive comes from."""
        kind, _, s = message
        return self.rank_of(s + 1 if kind in (SEND_F, RECV_B) else s - 1)

    def stages_of(self, rank: int) -> list[int]:
        """The stages `rank` holds, in the order the data meets them."""
        return [s for s in range(self.stages) if self.rank_of(s) == rank]


Lists = list[list[Action]]  # per rank, in order


# --- the schedules -------------------------------------------------------------------------------

def gpipe(layout: Layout, micro_batches: int) -> Lists:
    """All forwards, then all backwards: every stage holds all M micro-batches' activations."""
    return [[Action(F, i, r) for i in range(micro_batches)] + [Action(BW, i, r) for i in range(micro_batches)]
            for r in range(layout.ranks)]


def one_f_one_b(layout: Layout, micro_batches: int) -> Lists:
    """Warm-up forwards, then one forward one backward, then the remaining backwards: rank r
    starts micro-batch i's backward before micro-batch i + P - r's forward, so it holds at most
    P - r micro-batches."""
    lists = []
    for r in range(layout.ranks):
        warmup = min(layout.ranks - r - 1, micro_batches)
        actions = [Action(F, i, r) for i in range(warmup)]
        for i in range(micro_batches - warmup):
            actions += [Action(F, warmup + i, r), Action(BW, i, r)]
        actions += [Action(BW, i, r) for i in range(micro_batches - warmup, micro_batches)]
        lists.append(actions)
    return lists


def interleaved_1f1b(layout: Layout, micro_batches: int) -> Lists:
    """1F1B over V stages per rank (Megatron's interleaving): the micro-batches are cut into
    groups of at least P (M // P groups, the larger first), and forwards go through the rank's
    stages a group at a time, backwards through them in reverse; warm-up is the first group on
    V - 1 stages plus 2 (P - r - 1) forwards, so the first backward comes back as soon as it can.
    The fill and the drain shrink V times: the bubble is (P-1) / (V M + P-1)."""
    p, v = layout.ranks, layout.virtual
    rounds = max(1, micro_batches // p)
    sizes = [micro_batches // rounds + (g < micro_batches % rounds) for g in range(rounds)]
    group = [g for g, size in enumerate(sizes) for _ in range(size)]  # of each micro-batch
    lists = []
    for r in range(p):
        stages = layout.stages_of(r)
        order = [(group[i], c, i) for i in range(micro_batches) for c in range(v)]
        forwards = [Action(F, i, stages[c]) for _, c, i in sorted(order)]
        backwards = [Action(BW, i, stages[c]) for _, c, i in sorted(order, key=lambda gci: (gci[0], -gci[1], gci[2]))]
        warmup = min((v - 1) * sizes[0] + 2 * (p - r - 1), len(forwards))
        actions = forwards[:warmup]
        for k in range(len(forwards) - warmup):
            actions += [forwards[warmup + k], backwards[k]]
        actions += backwards[len(forwards) - warmup:]
        lists.append(actions)
    return lists


def zb_h1(layout: Layout, micro_batches: int) -> Lists:
    """1F1B with the backward split (Qi et al., "Zero Bubble Pipeline Parallelism", ZB-H1): the
    same forwards and input-gradient backwards B, and rank r lets r weight gradients W wait, to
    run them in the drain where 1F1B idles. 1F1B's memory; the bubble falls to about a third."""
    lists = []
    for r in range(layout.ranks):
        warmup = min(layout.ranks - r - 1, micro_batches)
        actions = [Action(F, i, r) for i in range(warmup)]
        for i in range(micro_batches):
            if warmup + i < micro_batches:
                actions.append(Action(F, warmup + i, r))
            actions.append(Action(B, i, r))
            if i >= r:
                actions.append(Action(W, i - r, r))
        actions += [Action(W, i, r) for i in range(max(0, micro_batches - r), micro_batches)]
        lists.append(actions)
    return lists


class _Writer:
    """One rank's list as the V-shaped schedules write it: each add takes the next micro-batch of
    its kind on its stage (B and BW count the same backwards; BW is also that micro-batch's W), and
    `queued_weight` adds the oldest weight gradient a split backward left waiting."""

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.next: dict[tuple[str, int], int] = {}
        self.waiting: list[int] = []  # stages, a W to come on each, oldest first

    def count(self, kind: str, stage: int) -> int:
        return self.next.get((kind, stage), 0)

    def add(self, kind: str, *stages: int) -> None:
        for stage in stages:
            i = self.count(B if kind == BW else kind, stage)
            self.actions.append(Action(kind, i, stage))
            for counted in {F: (F,), B: (B,), W: (W,), BW: (B, W)}[kind]:
                self.next[counted, stage] = i + 1

    def backward(self, stage: int, split: bool) -> None:
        self.add(B if split else BW, stage)
        if split:
            self.waiting.append(stage)

    def queued_weight(self) -> None:
        if self.waiting:
            self.add(W, self.waiting.pop(0))


def zbv(layout: Layout, micro_batches: int) -> Lists:
    """Zero bubble on a V (Qi et al., ZB-V): rank r holds stage r (down the V) and stage 2P-1-r
    (back up it). Forwards fill the V; then each round runs F, B and W on both stages, so with F,
    B and W equally long no rank idles but in the fill and the drain. Written for at least 2P - 1
    micro-batches; fewer run the same lists without the missing ones."""
    p = layout.ranks
    n = max(micro_batches, 2 * p - 1)
    lists = []
    for r in range(p):
        down, up = r, 2 * p - 1 - r
        rank = _Writer()
        for _ in range(2 * (p - r) - 1):
            rank.add(F, down)
        for _ in range(r):
            rank.add(F, up, down)
        for _ in range(p - r):
            rank.add(F, up)
            rank.add(B, up)
            rank.add(W, up)
        while rank.count(F, up) < rank.count(F, down) or rank.count(F, down) < n:
            if rank.count(F, down) < n:
                rank.add(F, down)
            for kind, stage in ((B, down), (W, down), (F, up), (B, up), (W, up)):
                rank.add(kind, stage)
        for _ in range(r):
            rank.add(B, down, up)
        for _ in range(p - r):
            rank.add(B, down)
            rank.add(W, down)
        for stage in (up, down):
            for _ in range(rank.count(B, stage) - rank.count(W, stage)):
                rank.add(W, stage)
        lists.append([a for a in rank.actions if a.micro_batch < micro_batches])
    return lists


def dualpipev(layout: Layout, micro_batches: int) -> Lists:
    """DualPipeV (DeepSeek-V3's DualPipe folded onto a V, as torch.distributed.pipelining has it):
    rank r holds stages r and 2P-1-r; after the fill, each round runs a forward of one stage
    beside the full backward of the other (the pairs DeepSeek overlaps with their communication;
    here one after the other), and the drain splits backwards so weight gradients fill it. Needs
    at least 2P micro-batches."""
    return [_dualpipev_rank(layout.ranks, r, micro_batches) for r in range(layout.ranks)]


def _dualpipev_rank(p: int, r: int, micro_batches: int) -> list[Action]:
    down, up = r, 2 * p - 1 - r
    rank = _Writer()
    for _ in range(2 * (p - r - 1)):
        rank.add(F, down)
    for _ in range(r + 1):
        rank.add(F, down, up)
    for _ in range(p - r - 1):
        rank.backward(up, split=True)
        rank.queued_weight()
        rank.add(F, up)
    for _ in range(micro_batches - 2 * p + r + 1):
        rank.add(F, down)
        rank.backward(up, split=False)
        rank.add(F, up)
        rank.backward(down, split=False)
    for _ in range(p - r - 1):
        rank.backward(up, split=False)
        rank.add(F, up)
        rank.backward(down, split=False)
    split = False
    for i in range(r + 1):  # the drain: its second half of backwards split
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        rank.backward(up, split)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        rank.backward(down, split)
    for _ in range(p - r - 1):
        rank.queued_weight()
        rank.backward(down, split)
    for _ in range(r + 1):
        rank.queued_weight()
    return rank.actions


@dataclass(frozen=True)
class ScheduleKind:
    generate: Callable[[Layout, int], Lists]
    v_shape: bool = False
    virtual: int | None = 1  # stages per rank; None: any V >= 2 (parallel.virtual_stages)
    min_micro_batches: Callable[[int], int] = lambda ranks: 1


SCHEDULES: dict[str, ScheduleKind] = {
    "gpipe": ScheduleKind(gpipe),
    "1f1b": ScheduleKind(one_f_one_b),
    "interleaved-1f1b": ScheduleKind(interleaved_1f1b, virtual=None),
    "zb-h1": ScheduleKind(zb_h1),
    "zbv": ScheduleKind(zbv, v_shape=True, virtual=2),
    "dualpipev": ScheduleKind(dualpipev, v_shape=True, virtual=2, min_micro_batches=lambda ranks: 2 * ranks),
}


# --- building, checking and simulating -----------------------------------------------------------

@dataclass(frozen=True)
class Schedule:
    """A schedule for one pipeline run of `micro_batches`: each rank's actions in order,
    communication included."""

    name: str
    layout: Layout
    micro_batches: int
    actions: tuple[tuple[Action, ...], ...]  # per rank

    @property
    def splits_backward(self) -> bool:
        return any(a.kind == W for actions in self.actions for a in actions)

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(map(str, actions)) for r, actions in enumerate(self.actions))


def virtual_stages(name: str, requested: int | None) -> int:
    """Stages per rank of schedule `name`: the interleaved one's are `requested` (unset: 2), the
    V-shaped ones' always 2, the others' 1."""
    kind = SCHEDULES[name]
    if kind.virtual is None:
        v = 2 if requested is None else requested
        if v < 2:
            raise ScheduleError(f"virtual_stages = {v}: {name} needs at least 2 stages per rank "
                                "(with 1 it is 1f1b)")
        return v
    if requested is not None and requested != kind.virtual:
        raise ScheduleError(f"virtual_stages = {requested}: {name} always has {kind.virtual} "
                            f"stage{'s' if kind.virtual > 1 else ''} per rank; leave it unset")
    return kind.virtual


def build(name: str, ranks: int, micro_batches: int, virtual: int | None = None) -> Schedule:
    """Schedule `name` for `ranks` ranks and `micro_batches` micro-batches, communication added,
    validated."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; expected one of {', '.join(SCHEDULES)}")
    kind = SCHEDULES[name]
    layout = Layout(ranks, virtual_stages(name, virtual), kind.v_shape)
    least = kind.min_micro_batches(ranks)
    if micro_batches < least:
        raise ScheduleError(f"{name} on {ranks} ranks needs at least {least} micro-batches, got {micro_batches}")
    lists = with_communication(layout, kind.generate(layout, micro_batches))
    schedule = Schedule(name, layout, micro_batches, tuple(map(tuple, lists)))
    validate(schedule)
    return schedule


def with_communication(layout: Layout, lists: Lists) -> Lists:
    """The compute lists with a receive just before each compute whose input is on another rank,
    and a send just after each whose output another rank needs."""
    return [_with_messages(layout, r, actions) for r, actions in enumerate(lists)]


def _with_messages(layout: Layout, rank: int, actions: list[Action]) -> list[Action]:
    def elsewhere(stage: int) -> bool:
        return 0 <= stage < layout.stages and layout.rank_of(stage) != rank

    out: list[Action] = []
    for a in actions:
        i, s = a.micro_batch, a.stage
        if a.kind == F and elsewhere(s - 1):
            out.append(Action(RECV_F, i, s))
        if a.kind in (B, BW) and elsewhere(s + 1):
            out.append(Action(RECV_B, i, s))
        out.append(a)
        if a.kind == F and elsewhere(s + 1):
            out.append(Action(SEND_F, i, s))
        if a.kind in (B, BW) and elsewhere(s - 1):
            out.append(Action(SEND_B, i, s))
    return out


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError unless every stage runs exactly one forward and one backward (full, or
    B then W) of every micro-batch on its own rank, with exactly the messages that needs, in an
    order that cannot deadlock."""
    layout, m = schedule.layout, schedule.micro_batches
    for r, actions in enumerate(schedule.actions):
        for a in actions:
            if not 0 <= a.stage < layout.stages or layout.rank_of(a.stage) != r or not 0 <= a.micro_batch < m:
                raise ScheduleError(f"rank {r} lists {a}, which is not one of its stages' {m} micro-batches")
        listed = sorted(actions)
        if len(set(listed)) != len(listed):
            twice = next(a for a, b in itertools.pairwise(listed) if a == b)
            raise ScheduleError(f"rank {r} lists {twice} twice")
        kinds = {(s, i): [] for s in layout.stages_of(r) for i in range(m)}
        for a in actions:
            if a.kind in COMPUTE:
                kinds[a.stage, a.micro_batch].append(a.kind)
        for (s, i), done in kinds.items():
            if sorted(done) not in ([BW, F], [B, F, W]):
                raise ScheduleError(f"rank {r}: micro-batch {i} on stage {s} has {' '.join(done) or 'nothing'}; "
                                    "it needs F and BW, or F, B and W")
        expected = _with_messages(layout, r, [a for a in actions if a.kind in COMPUTE])
        if sorted(expected) != listed:
            missing, extra = set(expected) - set(actions), set(actions) - set(expected)
            raise ScheduleError(f"rank {r}: its messages do not match its computes (missing "
                                f"{' '.join(map(str, missing)) or 'none'}; "
                                f"extra {' '.join(map(str, extra)) or 'none'})")
    simulate(schedule, Costs.uniform(layout.stages))


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


def message(a: Action) -> tuple[str, int, int]:
    """What a send sends or a receive waits for, or what a compute needs from before it (besides
    its own forward, for a backward): ("act", i, s) stage s's output for micro-batch i, ("grad",
    i, s) the gradient of stage s's input."""
    kind, i, s = a
    if kind in (F, RECV_F):
        return "act", i, s - 1
    if kind in (B, BW, RECV_B):
        return "grad", i, s + 1
    return ("act" if kind == SEND_F else "grad"), i, s  # SEND_F, SEND_B, W


def incoming(schedule: Schedule, rank: int) -> dict[int, list[tuple[str, int, int]]]:
    """Per peer, what it sends `rank`, in the order it sends them: the order to post receives in,
    so that each matches its send where messages between two ranks are matched in order."""
    layout = schedule.layout
    return {peer: [message(a) for a in actions if a.kind in (SEND_F, SEND_B) and layout.peer(a) == rank]
            for peer, actions in enumerate(schedule.actions) if peer != rank}


def simulate(schedule: Schedule, costs: Costs) -> Timeline:
    """Run every rank's list with these costs: each action starts when its rank is free and what it
    needs is there (a message `costs.transfer` after its send). Raises ScheduleError naming what
    each stuck rank waits for if the lists deadlock."""
    layout = schedule.layout
    last = layout.stages - 1
    here: dict[tuple[int, tuple], float] = {}  # (rank, item) -> when it is there
    messages: dict[tuple[int, tuple], float] = {}  # (to rank, item) -> when it arrives
    position, clock = [0] * layout.ranks, [0.0] * layout.ranks
    intervals: list[list[Interval]] = [[] for _ in range(layout.ranks)]

    def waits_for(r: int, a: Action) -> list[tuple[dict, tuple]]:
        """Where to look up when each thing `a` on rank r waits for is there."""
        item = message(a)
        waits = []
        if 0 <= item[2] <= last:  # the model's input and the loss's gradient are there from the start
            waits.append((messages if a.kind in (RECV_F, RECV_B) else here, (r, item)))
        if a.kind in (B, BW):  # and its own forward
            waits.append((here, (r, ("act", a.micro_batch, a.stage))))
        return waits

    def ready_at(r: int, a: Action) -> float | None:
        """When `a` can start on rank r, or None while something it needs is not there yet."""
        times = [table.get(key) for table, key in waits_for(r, a)]
        return None if None in times else max([clock[r], *times])

    def run(r: int, a: Action, start: float) -> None:
        kind, i, s = a
        end = start + costs.of(a)
        if kind in COMPUTE:
            intervals[r].append(Interval(a, start, end))
        if kind == F:
            here[r, ("act", i, s)] = end
        elif kind in (B, BW):
            here[r, ("grad", i, s)] = end
        elif kind in (SEND_F, SEND_B):
            messages[layout.peer(a), message(a)] = start + costs.transfer
        elif kind in (RECV_F, RECV_B):
            here[r, message(a)] = start
        clock[r] = end

    progress = True
    while progress:
        progress = False
        for r, actions in enumerate(schedule.actions):
            while position[r] < len(actions) and (start := ready_at(r, actions[position[r]])) is not None:
                run(r, actions[position[r]], start)
                position[r] += 1
                progress = True
    stuck = [f"rank {r} at {actions[position[r]]} waits for "
             + " and ".join(str(key[1]) for table, key in waits_for(r, actions[position[r]]) if key not in table)
             for r, actions in enumerate(schedule.actions) if position[r] < len(actions)]
    if stuck:
        raise ScheduleError(f"{schedule.name} deadlocks: " + "; ".join(stuck))
    return Timeline(schedule, tuple(map(tuple, intervals)))


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
