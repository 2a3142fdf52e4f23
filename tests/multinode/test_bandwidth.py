"""A rate-limited link between 2 nodes: the communication share measured in the ranks rises as the
planner predicts from the link's rate (shardwise bench multinode's measurement, on gpt-tiny)."""

from __future__ import annotations

import pytest

from shardwise.bench.multinode import run_bench
from shardwise.bench.netns import NetnsUnavailable, unavailable_reason

# 10 Mbit/s: gpt-tiny's 0.48 MB of gradients take ~0.4 s a step each way, twenty times its compute,
# so a busy machine's slower compute moves what the limit adds by little.
LIMITED = "10mbit"


@pytest.fixture(scope="module")
def cases() -> dict:
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"multi-node tests need network namespaces: {reason}")
    try:
        result = run_bench(6, ("ddp",), (None, LIMITED), preset="tiny", micro_batch=4, nproc=1)
    except NetnsUnavailable as error:
        pytest.skip(f"multi-node tests need network namespaces, and this machine cannot make them: {error}")
    return {case["rate"]: case for case in result["cases"]}


def test_a_rate_limited_link_raises_the_communication_share_as_the_planner_predicts(cases):
    free, limited = cases["unlimited"], cases[LIMITED]
    for side in ("measured", "predicted"):
        assert limited[side]["communication_share"] > free[side]["communication_share"], side
    measured, predicted = limited["measured"]["communication_share"], limited["predicted"]["communication_share"]
    assert abs(measured - predicted) <= 0.3 * predicted, (measured, predicted)


def test_what_the_limit_adds_to_a_step_is_what_the_planner_predicts_within_30_percent(cases):
    free, limited = cases["unlimited"], cases[LIMITED]
    measured = limited["measured"]["step_time_s"] - free["measured"]["step_time_s"]
    predicted = limited["predicted"]["step_time_s"] - free["predicted"]["step_time_s"]
    assert measured == pytest.approx(predicted, rel=0.3)
