"""A rate-limited link between 2 nodes: the communication share measured in the ranks rises as the
planner predicts from the link's rate (shardwise bench multinode's measurement, on gpt-tiny), for
ddp's all-reduce and for zero1's reduce-scatter and all-gather (Gloo's reduce-scatter sends as much
as an all-reduce)."""

from __future__ import annotations

import pytest

from bench.multinode import run_bench
from bench.netns import NetnsUnavailable, unavailable_reason

# 10 Mbit/s: gpt-tiny's 0.48 MB of gradients take ~0.4 s a step each way, twenty times its compute,
# so a busy machine's slower compute moves what the limit adds by little.
LIMITED = "10mbit"


STRATEGIES = ("ddp", "zero1")
pytestmark = pytest.mark.root  # network namespaces


@pytest.fixture(scope="module")
def cases() -> dict:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"multi-node tests need network namespaces: {reason}")
    try:
        result = run_bench(6, STRATEGIES, (None, LIMITED), preset="tiny", micro_batch=4, nproc=1)
    except NetnsUnavailable as error:
        pytest.skip(f"multi-node tests need network namespaces, and this machine cannot make them: {error}")
    return {(case["strategy"], case["rate"]): case for case in result["cases"]}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_rate_limited_link_raises_the_communication_share_as_the_planner_predicts(cases, strategy):
    free, limited = cases[strategy, "unlimited"], cases[strategy, LIMITED]
    for side in ("measured", "predicted"):
        assert limited[side]["communication_share"] > free[side]["communication_share"], side
    measured, predicted = limited["measured"]["communication_share"], limited["predicted"]["communication_share"]
    assert abs(measured - predicted) <= 0.3 * predicted, (measured, predicted)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_what_the_limit_adds_to_a_step_is_what_the_planner_predicts_within_30_percent(cases, strategy):
    free, limited = cases[strategy, "unlimited"], cases[strategy, LIMITED]
    measured = limited["measured"]["step_time_s"] - free["measured"]["step_time_s"]
    predicted = limited["predicted"]["step_time_s"] - free["predicted"]["step_time_s"]
    assert measured == pytest.approx(predicted, rel=0.3)
