"""The moe bench's arithmetic on made-up step records: medians, the all-to-all's share, ratios to
ep 1 of the same world, and the parameter bytes that splitting the experts predicts, whose expert
bytes are those of the model the jobs train."""

from __future__ import annotations

import pytest
from helpers import CONFIGS

from bench import moe
from shardwise.config.load import load_config
from shardwise.models import build_model
from shardwise.models.moe import moe_layers


def record(step_time_s: float, params: int, ep_rank_pairs: list[int] | None = None) -> dict:
    router = {"tokens_per_expert": [[1] * 8, [1] * 8], "imbalance": [1.0, 2.0]}
    if ep_rank_pairs is not None:
        mean = sum(ep_rank_pairs) / len(ep_rank_pairs)
        router |= {"tokens_per_ep_rank": [ep_rank_pairs] * 2, "ep_imbalance": [max(ep_rank_pairs) / mean] * 2,
                   "all_to_all_s": step_time_s / 4}
    memory = {"params": params, "grads": params, "optimizer": 2 * params}
    return {"step_time_s": step_time_s, "router": router, "memory": memory, "memory_by_rank": [memory] * 4}


def test_the_expert_bytes_are_those_of_the_model_the_jobs_train():
    cfg = load_config(CONFIGS / "gpt-tiny.toml", [*moe.MODEL, "run.out=unused"])
    experts = [p for layer in moe_layers(build_model(cfg.model)) for p in layer.experts.parameters()]
    assert moe.expert_bytes() == sum(p.numel() * p.element_size() for p in experts)


def test_a_variant_is_its_median_step_its_all_to_all_share_and_its_bytes_beside_the_prediction():
    replicated = moe.expert_bytes() + 1000
    split = 1000 + moe.expert_bytes() // 2
    variants = {
        "ep1": moe.summarise([record(t, replicated) for t in (0.4, 0.2, 0.3)], tokens_per_step=600),
        "ep2": moe.summarise([record(t, split, [300, 100]) for t in (0.1, 0.3, 0.2)], tokens_per_step=600),
    }
    assert variants["ep1"]["tokens_per_s"] == pytest.approx(2000) and "all_to_all_share" not in variants["ep1"]
    assert variants["ep2"]["all_to_all_share"] == pytest.approx(0.25)
    assert variants["ep2"]["ep_imbalance"] == pytest.approx(1.5)
    assert variants["ep2"]["expert_imbalance"] == pytest.approx(1.5)  # the layers' mean
    moe.compare(variants, {"ep1": [2000.0, 1000.0], "ep2": [3000.0, 3000.0]})
    assert variants["ep2"]["vs_ep1"] == pytest.approx(1.5) and variants["ep2"]["vs_ep1_by_round"] == [1.5, 3.0]
    assert variants["ep2"]["vs_ep1_median_of_rounds"] == pytest.approx(2.25)
    assert variants["ep2"]["params_as_predicted"] and variants["ep1"]["params_as_predicted"]
    assert variants["ep2"]["bytes_vs_ep1"]["optimizer"] == pytest.approx(split / replicated)


def test_each_job_is_compared_with_ep_1_on_as_many_ranks():
    assert {name: moe.baseline_of(name) for name in moe.JOBS} == {
        "ep1": "ep1", "ep2": "ep1", "ep4": "ep1", "2-ranks-ep1": "2-ranks-ep1", "2-ranks-ep2": "2-ranks-ep1"}
