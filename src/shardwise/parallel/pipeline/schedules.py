"""Pipeline schedules as data: for each rank of a pipeline, the list of what it does, in order;
one plain function per schedule writes those lists, and `validate` proves they cannot deadlock
(simulate.py runs them with a cost per action to predict the timeline, the bubble and the
activations each rank holds; runner.py runs the same lists on the ranks).

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
  exactly when, run this way, some rank's next action can never become ready, which `run_order`
  finds and names.
"""

from __future__ import annotations

import functools
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
        return self._ranks[stage]

    @functools.cached_property
    def _ranks(self) -> tuple[int, ...]:
        """Each stage's rank."""
        stages = range(self.ranks * self.virtual)
        if self.v_shape:
            return tuple(s if s < self.ranks else len(stages) - 1 - s for s in stages)
        return tuple(s % self.ranks for s in stages)

    def peer(self, message: Action) -> int:
        """The rank a send goes to or a receive comes from."""
        kind, _, s = message
        return self.rank_of(s + 1 if kind in (SEND_F, RECV_B) else s - 1)

    def stages_of(self, rank: int) -> list[int]:
        """The stages `rank` holds, in the order the data meets them."""
        return list(self._stages_of[rank])

    @functools.cached_property
    def _stages_of(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(s for s in range(self.stages) if self.rank_of(s) == r) for r in range(self.ranks))


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
    virtual: int | None = 1  # stages per rank; None: any V >= 2 (parallel.pipeline.virtual_stages)
    splits_backward: bool = False  # B and W apart (W actions), or whole backwards (BW) only
    min_micro_batches: Callable[[int], int] = lambda ranks: 1


SCHEDULES: dict[str, ScheduleKind] = {
    "gpipe": ScheduleKind(gpipe),
    "1f1b": ScheduleKind(one_f_one_b),
    "interleaved-1f1b": ScheduleKind(interleaved_1f1b, virtual=None),
    "zb-h1": ScheduleKind(zb_h1, splits_backward=True),
    "zbv": ScheduleKind(zbv, v_shape=True, virtual=2, splits_backward=True),
    "dualpipev": ScheduleKind(dualpipev, v_shape=True, virtual=2, splits_backward=True,
                              min_micro_batches=lambda ranks: 2 * ranks),
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
        return SCHEDULES[self.name].splits_backward

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


@functools.cache  # one Layout per shape, so that its cached stage maps are worked out once
def layout_of(name: str, ranks: int, virtual: int | None = None) -> Layout:
    """Which rank holds which stage under schedule `name`, without its lists."""
    return Layout(ranks, virtual_stages(name, virtual), SCHEDULES[name].v_shape)


def check_micro_batches(name: str, ranks: int, micro_batches: int) -> None:
    least = SCHEDULES[name].min_micro_batches(ranks)
    if micro_batches < least:
        raise ScheduleError(f"{name} on {ranks} ranks needs at least {least} micro-batches, got {micro_batches}")


@functools.lru_cache(maxsize=256)
def build(name: str, ranks: int, micro_batches: int, virtual: int | None = None) -> Schedule:
    """Schedule `name` for `ranks` ranks and `micro_batches` micro-batches, communication added,
    checked as `validate` does (and kept: the same arguments give the same schedule)."""
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; expected one of {', '.join(SCHEDULES)}")
    kind = SCHEDULES[name]
    layout = layout_of(name, ranks, virtual)
    check_micro_batches(name, ranks, micro_batches)
    lists = with_communication(layout, kind.generate(layout, micro_batches))
    schedule = Schedule(name, layout, micro_batches, tuple(map(tuple, lists)))
    _check_computes(schedule)  # its messages are with_communication's own
    run_order(schedule)  # raises if the lists deadlock
    return schedule


def with_communication(layout: Layout, lists: Lists) -> Lists:
    """The compute lists with a receive just before each compute whose input is on another rank,
    and a send just after each whose output another rank needs."""
    return [_with_messages(layout, r, actions) for r, actions in enumerate(lists)]


def _with_messages(layout: Layout, rank: int, actions: list[Action]) -> list[Action]:
    last = layout.stages - 1
    # per stage of this rank: whether its input comes from, and its output goes to, another rank
    fed = {s: s > 0 and layout.rank_of(s - 1) != rank for s in layout.stages_of(rank)}
    feeds = {s: s < last and layout.rank_of(s + 1) != rank for s in layout.stages_of(rank)}
    out: list[Action] = []
    for a in actions:
        kind, i, s = a
        if kind == F:
            out += [Action(RECV_F, i, s), a] if fed[s] else [a]
            if feeds[s]:
                out.append(Action(SEND_F, i, s))
        elif kind in (B, BW):
            out += [Action(RECV_B, i, s), a] if feeds[s] else [a]
            if fed[s]:
                out.append(Action(SEND_B, i, s))
        else:
            out.append(a)
    return out


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError unless every stage runs exactly one forward and one backward (full, or
    B then W) of every micro-batch on its own rank, with exactly the messages that needs, in an
    order that cannot deadlock."""
    _check_computes(schedule)
    for r, actions in enumerate(schedule.actions):
        expected = _with_messages(schedule.layout, r, [a for a in actions if a.kind in COMPUTE])
        if sorted(expected) != sorted(actions):
            missing, extra = set(expected) - set(actions), set(actions) - set(expected)
            raise ScheduleError(f"rank {r}: its messages do not match its computes (missing "
                                f"{' '.join(map(str, missing)) or 'none'}; "
                                f"extra {' '.join(map(str, extra)) or 'none'})")
    run_order(schedule)  # raises if the lists deadlock


def _check_computes(schedule: Schedule) -> None:
    """Each action on its stage's rank, none twice, and every (micro-batch, stage) with F and BW,
    or F, B and W."""
    layout, m = schedule.layout, schedule.micro_batches
    for r, actions in enumerate(schedule.actions):
        mine = set(layout.stages_of(r))
        for a in actions:
            if a.stage not in mine or not 0 <= a.micro_batch < m:
                raise ScheduleError(f"rank {r} lists {a}, which is not one of its stages' {m} micro-batches")
        if len(set(actions)) != len(actions):
            twice = next(a for a, b in itertools.pairwise(sorted(actions)) if a == b)
            raise ScheduleError(f"rank {r} lists {twice} twice")
        kinds: dict[tuple[int, int], list[str]] = {(s, i): [] for s in mine for i in range(m)}
        for kind, i, s in actions:
            if kind in COMPUTE:
                kinds[s, i].append(kind)
        for (s, i), done in sorted(kinds.items()):
            if sorted(done) not in ([BW, F], [B, F, W]):
                raise ScheduleError(f"rank {r}: micro-batch {i} on stage {s} has {' '.join(done) or 'nothing'}; "
                                    "it needs F and BW, or F, B and W")


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


def run_order(schedule: Schedule) -> tuple[tuple[int, int, int, int], ...]:
    """Every action, (rank, its index in the rank's list, the position of the action before it on
    its rank, the position of the send it receives; -1 for none), in an order in which each comes
    after everything it waits for: the order a run takes them in, whatever the costs. Anything an
    action waits for on its own rank comes before it in its list, or the lists deadlock: then
    ScheduleError says what each stuck rank waits for."""
    layout = schedule.layout
    last = layout.stages - 1
    here: set[tuple] = set()  # (rank, *item): there
    sent: dict[tuple, int] = {}  # (to rank, *item) -> position of its send
    position = [0] * layout.ranks
    previous = [-1] * layout.ranks
    blocked: dict[tuple, int] = {}  # what a stopped rank waits for -> the rank
    order: list[tuple[int, int, int, int]] = []

    def missing(r: int, a: Action) -> list[tuple]:
        """What `a` on rank r waits for that is not there yet, as (rank, *item) keys."""
        item = message(a)
        waits = [] if item[2] < 0 or item[2] > last else [(r, *item)]  # the model's input, the loss's gradient
        if a.kind in (B, BW):  # and its own forward
            waits.append((r, "act", a.micro_batch, a.stage))
        table = sent if a.kind in (RECV_F, RECV_B) else here
        return [w for w in waits if w not in table]

    ready = list(range(layout.ranks))
    while ready:
        r = ready.pop()
        actions = schedule.actions[r]
        while position[r] < len(actions):
            a = actions[position[r]]
            kind, i, s = a
            if kind == F:
                made = (r, "act", i, s)
                waits = (r, "act", i, s - 1) if s > 0 and (r, "act", i, s - 1) not in here else None
            elif kind in (B, BW):
                made = (r, "grad", i, s)
                waits = next((w for w in ((r, "act", i, s), (r, "grad", i, s + 1))
                              if w not in here and w[3] <= last), None)
            elif kind in (RECV_F, RECV_B):
                made = (r, *message(a))
                waits = made if made not in sent else None
            else:  # W, SEND_F, SEND_B: after their compute on this rank
                made = None
                waits = (r, *message(a)) if (r, *message(a)) not in here else None
            if waits is not None:
                blocked[waits] = r
                break
            order.append((r, position[r], previous[r], sent[made] if kind in (RECV_F, RECV_B) else -1))
            previous[r] = len(order) - 1
            position[r] += 1
            if kind in (SEND_F, SEND_B):
                made = (layout.peer(a), *message(a))
                sent[made] = len(order) - 1
            elif made is not None:
                here.add(made)
            if made in blocked:
                ready.append(blocked.pop(made))
    stuck = [f"rank {r} at {actions[position[r]]} waits for "
             + " and ".join(str(w[1:]) for w in missing(r, actions[position[r]]))
             for r, actions in enumerate(schedule.actions) if position[r] < len(actions)]
    if stuck:
        raise ScheduleError(f"{schedule.name} deadlocks: " + "; ".join(stuck))
    return tuple(order)
