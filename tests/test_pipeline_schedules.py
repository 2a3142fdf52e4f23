"""Pipeline schedules as data (parallel/pipeline/schedules.py): every schedule's lists are deadlock-free over
2 to 8 ranks and P to 4P micro-batches, the simulator gives each its known bubble and memory, and
the validator refuses lists that cannot run, saying why."""

from __future__ import annotations

import re

import pytest

from shardwise.parallel.pipeline.schedules import SCHEDULES, Action, Schedule, ScheduleError, build, validate
from shardwise.parallel.pipeline.simulate import Costs, Timeline, draw, peak_in_flight, simulate

RANKS = range(2, 9)


def micro_batch_counts(name: str, ranks: int) -> range:
    return range(max(ranks, SCHEDULES[name].min_micro_batches(ranks)), 4 * ranks + 1)


def bubble(name: str, ranks: int, micro_batches: int, virtual: int | None = None, **costs: float) -> float:
    schedule = build(name, ranks, micro_batches, virtual)
    return simulate(schedule, Costs.uniform(schedule.layout.stages, **costs)).bubble


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedule_is_valid_and_deadlock_free_on_2_to_8_ranks_with_p_to_4p_micro_batches(name):
    virtuals = (2, 3) if name == "interleaved-1f1b" else (None,)
    for ranks in RANKS:
        for m in micro_batch_counts(name, ranks):
            for virtual in virtuals:
                schedule = build(name, ranks, m, virtual)  # validates: raises on any deadlock
                forwards = [sum(a.kind == "F" for a in actions) for actions in schedule.actions]
                assert forwards == [m * schedule.layout.virtual] * ranks


def test_dualpipev_refuses_fewer_than_2p_micro_batches():
    with pytest.raises(ScheduleError, match="dualpipev on 4 ranks needs at least 8 micro-batches, got 7"):
        build("dualpipev", 4, 7)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_idle_p_minus_1_over_m_plus_p_minus_1_whatever_the_costs(name):
    for ranks in RANKS:
        for m in some_micro_batch_counts(ranks, ranks):
            expected = (ranks - 1) / (m + ranks - 1)
            assert bubble(name, ranks, m, forward=1.0, input_backward=1.5, weight_backward=0.5) == \
                pytest.approx(expected, abs=1e-12)


def test_zb_h1_idles_p_minus_1_forwards_a_third_of_1f1bs_idle_time_at_equal_costs():
    for ranks in RANKS:
        for m in micro_batch_counts("zb-h1", ranks):
            # each rank computes 3M (F, B, W of M micro-batches) and idles P - 1, where 1F1B idles 3 (P - 1)
            timeline = simulate(build("zb-h1", ranks, m), Costs.uniform(ranks))
            assert timeline.bubble == pytest.approx((ranks - 1) / (3 * m + ranks - 1), abs=1e-12)
            assert idle_time(timeline) == pytest.approx(one_f_one_b_idle_time(ranks, m) / 3)


def idle_time(timeline: Timeline) -> float:
    return timeline.makespan * timeline.bubble


def one_f_one_b_idle_time(ranks: int, micro_batches: int) -> float:
    return idle_time(simulate(build("1f1b", ranks, micro_batches), Costs.uniform(ranks)))


def some_micro_batch_counts(ranks: int, least: int) -> list[int]:
    """P, P + 1, 2P + 1 and 4P (from `least` on): even and uneven groups of P."""
    return [m for m in (ranks, ranks + 1, 2 * ranks + 1, 4 * ranks) if m >= least]


def test_interleaved_1f1b_shrinks_the_fill_and_drain_by_the_virtual_stages():
    for virtual in (2, 4):
        for ranks in RANKS:
            for m in some_micro_batch_counts(ranks, ranks):
                # a rank's V stages cost what its one stage costs under 1F1B
                schedule = build("interleaved-1f1b", ranks, m, virtual)
                timeline = simulate(schedule, Costs.uniform(ranks * virtual, *(3 * (1 / virtual,))))
                assert timeline.bubble == pytest.approx((ranks - 1) / (virtual * m + ranks - 1), abs=1e-12)
                assert idle_time(timeline) == pytest.approx(one_f_one_b_idle_time(ranks, m) / virtual)


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_zbv_and_dualpipev_idle_only_one_forward_per_hop_at_equal_costs(name):
    for ranks in RANKS:
        for m in some_micro_batch_counts(ranks, max(2 * ranks - 1, SCHEDULES[name].min_micro_batches(ranks))):
            # each of a rank's 2 stages costs half its layers': 6M F, B and W of half a 1F1B stage's
            timeline = simulate(build(name, ranks, m), Costs.uniform(2 * ranks, *(3 * (0.5,))))
            assert timeline.bubble == pytest.approx((ranks - 1) / (6 * m + ranks - 1), abs=1e-12)
            assert idle_time(timeline) == pytest.approx(one_f_one_b_idle_time(ranks, m) / 6)


def test_micro_batches_in_flight_per_rank():
    for ranks in (2, 4, 8):
        for m in (2 * ranks, 4 * ranks):
            every = [ranks] * ranks
            assert peak_in_flight(build("gpipe", ranks, m)) == [m] * ranks
            assert peak_in_flight(build("1f1b", ranks, m)) == [ranks - r for r in range(ranks)]
            assert peak_in_flight(build("zb-h1", ranks, m)) == every  # 1F1B's most, on every rank
            # counted in stages: one stage holds half the rank's layers
            assert peak_in_flight(build("zbv", ranks, m)) == [2 * ranks] * ranks
            assert peak_in_flight(build("dualpipev", ranks, m)) == [2 * ranks + 1] * ranks
            # the first group on V - 1 stages, 2 (P - r - 1) more warm-up forwards, and one in the steady state
            assert peak_in_flight(build("interleaved-1f1b", ranks, m, 2)) == \
                [ranks + 2 * (ranks - r - 1) + 1 for r in range(ranks)]


def test_a_message_takes_its_transfer_time_on_the_critical_path():
    schedule = build("gpipe", 3, 1)  # one micro-batch: F through 3 stages, then its backward back
    timeline = simulate(schedule, Costs.uniform(3, forward=1.0, input_backward=2.0, weight_backward=0.0,
                                                transfer=0.25))
    assert timeline.makespan == pytest.approx(3 * (1.0 + 2.0) + 4 * 0.25)
    assert [x.start for ranks in timeline.intervals for x in ranks] == pytest.approx([0, 8.0, 1.25, 5.75, 2.5, 3.5])


def test_per_stage_costs_make_the_slowest_stage_set_the_pace():
    schedule = build("1f1b", 2, 8)
    slow_last = Costs((1.0, 2.0), (1.0, 2.0), (0.0, 0.0))
    timeline = simulate(schedule, slow_last)
    # the slow stage computes without a break from the first forward's arrival; the run ends one backward later
    assert timeline.makespan == pytest.approx(1 + 8 * 4 + 1)
    assert timeline.bubble_per_rank == pytest.approx([1 - 8 * 2 / 34, 2 / 34])


def drop(schedule: Schedule, rank: int, action: Action) -> Schedule:
    lists = [list(actions) for actions in schedule.actions]
    lists[rank].remove(action)
    return Schedule(schedule.name, schedule.layout, schedule.micro_batches, tuple(map(tuple, lists)))


def swap(schedule: Schedule, rank: int, first: int, second: int) -> Schedule:
    lists = [list(actions) for actions in schedule.actions]
    lists[rank][first], lists[rank][second] = lists[rank][second], lists[rank][first]
    return Schedule(schedule.name, schedule.layout, schedule.micro_batches, tuple(map(tuple, lists)))


def parse(text: str) -> tuple[Action, ...]:
    """'F0@1 BW0@1' -> (Action('F', 0, 1), Action('BW', 0, 1))"""
    return tuple(Action(kind, int(i), int(s)) for kind, i, s in re.findall(r"([A-Z_]+)(\d+)@(\d+)", text))


def test_the_validator_names_a_deadlock_and_what_each_rank_waits_for():
    schedule = build("1f1b", 2, 2)
    assert schedule.actions == (parse("F0@0 SEND_F0@0 F1@0 SEND_F1@0 RECV_B0@0 BW0@0 RECV_B1@0 BW1@0"),
                                parse("RECV_F0@1 F0@1 BW0@1 SEND_B0@1 RECV_F1@1 F1@1 BW1@1 SEND_B1@1"))
    # rank 0 waits for micro-batch 0's gradient before it sends micro-batch 1, which rank 1 takes first
    deadlocked = Schedule("1f1b", schedule.layout, 2, (
        parse("F0@0 SEND_F0@0 RECV_B0@0 BW0@0 F1@0 SEND_F1@0 RECV_B1@0 BW1@0"),
        parse("RECV_F1@1 F1@1 BW1@1 SEND_B1@1 RECV_F0@1 F0@1 BW0@1 SEND_B0@1")))
    with pytest.raises(ScheduleError, match=r"1f1b deadlocks: rank 0 at RECV_B0@0 waits for \('grad', 0, 1\); "
                                            r"rank 1 at RECV_F1@1 waits for \('act', 1, 0\)$"):
        validate(deadlocked)
    backward_first = Schedule("1f1b", schedule.layout, 2, (schedule.actions[0], parse(
        "RECV_F1@1 F1@1 BW0@1 SEND_B0@1 RECV_F0@1 F0@1 BW1@1 SEND_B1@1")))
    with pytest.raises(ScheduleError, match=r"rank 1 at BW0@1 waits for \('act', 0, 1\)"):
        validate(backward_first)


def test_the_validator_refuses_missing_duplicated_or_misplaced_actions():
    schedule = build("zb-h1", 2, 2)
    with pytest.raises(ScheduleError, match="micro-batch 1 on stage 0 has F B; it needs F and BW, or F, B and W"):
        validate(drop(schedule, 0, Action("W", 1, 0)))
    with pytest.raises(ScheduleError, match="missing SEND_F0@0"):
        validate(drop(schedule, 0, Action("SEND_F", 0, 0)))
    twice = Schedule("zb-h1", schedule.layout, 2, (schedule.actions[0] + (Action("F", 0, 0),), schedule.actions[1]))
    with pytest.raises(ScheduleError, match="rank 0 lists F0@0 twice"):
        validate(twice)
    elsewhere = Schedule("zb-h1", schedule.layout, 2, (schedule.actions[0] + (Action("F", 0, 1),), schedule.actions[1]))
    with pytest.raises(ScheduleError, match="rank 0 lists F0@1, which is not one of its stages"):
        validate(elsewhere)
    w_before_b = swap(schedule, 1, *[schedule.actions[1].index(Action(k, 0, 1)) for k in ("B", "W")])
    with pytest.raises(ScheduleError, match=r"rank 1 at W0@1 waits for \('grad', 0, 1\)"):
        validate(w_before_b)


def test_virtual_stages_are_checked_against_the_schedule():
    assert build("interleaved-1f1b", 2, 4).layout.virtual == 2
    assert build("interleaved-1f1b", 2, 4, 3).layout.stages == 6
    with pytest.raises(ScheduleError, match="interleaved-1f1b needs at least 2 stages per rank"):
        build("interleaved-1f1b", 2, 4, 1)
    with pytest.raises(ScheduleError, match="zbv always has 2 stages per rank; leave it unset"):
        build("zbv", 2, 4, 3)
    with pytest.raises(ScheduleError, match="unknown schedule 'zb-h2'"):
        build("zb-h2", 2, 4)


def test_v_shaped_layouts_put_the_first_and_last_stage_on_rank_0():
    layout = build("zbv", 4, 8).layout
    assert [layout.stages_of(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    looped = build("interleaved-1f1b", 4, 8, 2).layout
    assert [looped.stages_of(r) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_draw_shows_each_rank_computing_and_idling():
    assert draw(simulate(build("1f1b", 2, 2), Costs.uniform(2))) == (
        "rank 0 |F0 F1  .  . BW0    . BW1\n"
        "rank 1 | . F0 BW0   F1 BW1    .  .")
