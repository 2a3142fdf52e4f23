"""`shardwise plan`'s pruned search against the exhaustive one: the same recommendation, the same
ranking of what both keep, the same candidates shown over the limit; and the pruning rules
(twin precisions, gpipe dominated by 1f1b) hold on every candidate the exhaustive search costs."""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable

import pytest
from helpers import CONFIGS

from shardwise.config.load import load_config
from shardwise.config.schema import Config
from shardwise.planner import load_profile, make_plan
from shardwise.planner.search import Evaluated, Plan


def tiny(name: str = "gpt", global_batch: int = 16, **model: object) -> Config:
    sizes = [f"model.{key}={value}" for key, value in model.items()]
    return load_config(CONFIGS / "gpt-tiny.toml", [f"model.name={name}", *sizes, f"train.global_batch={global_batch}",
                                                   "run.out=unused"])


# (config, world, nodes, device, GiB per rank): limits that some candidates do not fit, and one none fits.
CASES = {
    "gpt tiny, 8 H100s on 2 nodes": (lambda: tiny(), 8, 2, "h100-sxm", 0.0015),
    "gpt small, 4 CPU ranks": (lambda: tiny(preset="small", global_batch=8), 4, 1, "cpu", 0.08),
    "gpt small, 4 CPU ranks, 3 fit": (lambda: tiny(preset="small", global_batch=8), 4, 1, "cpu", 0.05),
    "llama tiny, 4 H100s": (lambda: tiny("hf-llama", n_kv_head=1), 4, 1, "h100-sxm", 0.003),
    "gpt tiny, nothing fits": (lambda: tiny(), 4, 1, "h100-sxm", 0.0005),
}


def row(e: Evaluated) -> tuple:
    return e.candidate, e.twins, e.memory.total, e.step.total


def undominated(plan: Plan, rows: list[Evaluated]) -> list[tuple]:
    """The rows but gpipe pipelines whose 1f1b twin is a candidate too: the pruned search drops those."""
    candidates = {e.candidate for e in plan.ranked}
    return [row(e) for e in rows
            if e.candidate.schedule != "gpipe" or dataclasses.replace(e.candidate, schedule="1f1b") not in candidates]


def plan_both_ways(case: str) -> tuple[Plan, Plan]:
    make_config, world, nodes, device, limit = CASES[case]
    kwargs = dict(nodes=nodes, memory_gb=limit)
    cfg = make_config()
    return (make_plan(cfg, world, load_profile(device), top=4, **kwargs),
            make_plan(cfg, world, load_profile(device), exhaustive=True, **kwargs))


@pytest.fixture(scope="module")
def both() -> Callable[[str], tuple[Plan, Plan]]:
    """A case's pruned and exhaustive plans, made once for the module's tests (they only read them)."""
    return functools.cache(plan_both_ways)


@pytest.mark.parametrize("case", list(CASES))
def test_the_pruned_search_recommends_and_ranks_as_the_exhaustive_one(both, case):
    pruned, exhaustive = both(case)
    assert pruned.reason == exhaustive.reason
    if exhaustive.recommended is None:
        assert pruned.recommended is None
    else:
        assert row(pruned.recommended) == row(exhaustive.recommended)
    kept, every = [row(e) for e in pruned.fitting], undominated(exhaustive, exhaustive.fitting)
    assert kept[:4] == every[:4]  # the top the table shows
    positions = [every.index(r) for r in kept]  # ValueError if the pruned search kept a row the exhaustive lacks
    assert positions == sorted(positions)
    assert [row(e) for e in pruned.shown_over[:3]] == undominated(exhaustive, exhaustive.shown_over)[:3]
    assert pruned.candidates == exhaustive.candidates
    assert len(pruned.ranked) < len(exhaustive.ranked)
    assert sum(pruned.pruned.values()) > 0


def test_the_pruned_search_counts_every_candidate_once(both):
    pruned, exhaustive = both("gpt tiny, 8 H100s on 2 nodes")
    costed = sum(1 + len(e.twins) for e in pruned.ranked)
    assert costed + sum(pruned.pruned.values()) == pruned.candidates == sum(1 + len(e.twins) for e in exhaustive.ranked)


def test_twin_precisions_are_costed_once_only_where_the_exhaustive_search_predicts_them_alike(both):
    _, gpu = both("gpt tiny, 8 H100s on 2 nodes")
    # costed apart, bf16-mixed and fp16-mixed came out identical on every row: one row names both
    assert all(e.twins == ("fp16-mixed",) for e in gpu.ranked if e.candidate.precision == "bf16-mixed")
    assert not any(e.candidate.precision == "fp16-mixed" for e in gpu.ranked)
    cpu, _ = both("gpt small, 4 CPU ranks")  # a CPU's fp16 matmuls are far slower: no twins
    assert not any(e.twins for e in cpu.ranked)


def test_gpipe_is_never_faster_nor_smaller_than_the_same_pipeline_under_1f1b(both):
    _, exhaustive = both("gpt tiny, 8 H100s on 2 nodes")
    by_candidate = {e.candidate: e for e in exhaustive.ranked}
    gpipes = [e for e in exhaustive.ranked if e.candidate.schedule == "gpipe"]
    assert gpipes
    for gpipe in gpipes:
        one_f_one_b = by_candidate[dataclasses.replace(gpipe.candidate, schedule="1f1b")]
        # equal where every stage's backward is the same multiple of its forward; 1f1b faster where
        # recomputing every:K blocks makes them differ (the simulator runs both schedules' lists);
        # the simulator sums each in its own order: the last bit may differ
        assert one_f_one_b.step.total <= gpipe.step.total * (1 + 1e-12)
        assert all(a.total <= b.total for a, b in zip(one_f_one_b.memory_by_stage, gpipe.memory_by_stage, strict=True))


def test_planning_leaves_the_base_config_as_the_user_set_it():
    """Each candidate's config is its own: no candidate's pipeline settings leak into the base (the
    plan's `cfg`, which `--measure` trains from)."""
    cfg = tiny()
    before = copy.deepcopy(cfg)
    plan = make_plan(cfg, 4, load_profile("cpu"), precisions=("fp32",), policies=("none",), exhaustive=True)
    assert any(e.candidate.schedule for e in plan.ranked)  # pipeline candidates were weighed
    assert cfg == before and plan.cfg == before
