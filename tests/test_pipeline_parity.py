"""The schedules of today on real Gloo ranks: interleaved 1F1B, ZB-H1, ZBV and DualPipeV each train
as one device does (losses 1e-5, weights rtol 1e-5 under SGD, clipping active) on 2 and 4 stages,
with data parallel beside, with blocks recomputed; the split backward runs B before W and holds
what the simulator says; a checkpoint of a V-shaped pipeline resumes bit for bit. The same
schedules on 2 stages of a tiny transformers Llama (grouped-query attention) match its single run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from helpers import SGD, Crash, assert_matches_single, crash_at, gpt_tiny, losses, train_in_process
from safetensors.torch import load_file

from bench.pipeline import one_micro_batch_bytes
from shardwise.dist import DistContext
from shardwise.parallel.pipeline.simulate import peak_in_flight
from shardwise.trainer import Trainer

os.environ["HF_HUB_OFFLINE"] = "1"  # set before transformers is first imported, here and in every rank

STEPS = 10  # as test_model_parallel.py's
SCHEDULES = ("interleaved-1f1b", "zb-h1", "zbv", "dualpipev")
# a transformers Llama of 4 heads over 2 key/value heads, width 32 (tests/test_model_families.py's)
LLAMA = ("model.name=hf-llama", "model.n_head=4", "model.n_kv_head=2", "model.d_model=32", "model.d_ff=64",
         "model.seq_len=32")


def cfg_for(out: Path, strategy: str, nproc: int, layers: int, *overrides: str):
    """test_model_parallel's runs (gpt-tiny, a global batch of 8, clipping active) with `layers` blocks."""
    return gpt_tiny(out, strategy, nproc, f"model.n_layer={layers}", "train.micro_batch=8", *SGD, "train.grad_clip=0.5",
                    *overrides, steps=STEPS)


def train_runs(ctx: DistContext, root: Path, runs: dict[str, tuple[int, tuple[str, ...]]]) -> None:
    for name, (layers, overrides) in runs.items():
        Trainer(cfg_for(root / name, "pipeline", ctx.world_size, layers, *overrides), ctx).fit()


@pytest.fixture(scope="module")
def singles(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("single")
    for layers in (4, 8):
        train_in_process(cfg_for(root / f"single-{layers}", "single", 1, layers))
    train_in_process(cfg_for(root / "single-llama", "single", 1, 4, *LLAMA))
    return root


# --- 2 stages: 4 blocks, as 4 stages of one block where a rank holds 2 -------------------------

TWO_RANK_RUNS = {
    **{schedule: (4, (f"parallel.pipeline.schedule={schedule}",
                      "parallel.pipeline.micro_batches=4")) for schedule in SCHEDULES},
    **{f"{schedule}-recompute": (4, (f"parallel.pipeline.schedule={schedule}", "parallel.pipeline.micro_batches=4",
                                     "parallel.recompute=blocks")) for schedule in SCHEDULES},
    **{f"llama-{schedule}": (4, (*LLAMA, f"parallel.pipeline.schedule={schedule}", "parallel.pipeline.micro_batches=4"))
       for schedule in SCHEDULES},
}


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pp2")
    run_ranks(train_runs, 2, root, TWO_RANK_RUNS)
    return root


@pytest.mark.parametrize("run", TWO_RANK_RUNS)
def test_matches_single_device_over_10_steps_on_2_stages(two_rank_runs, singles, run):
    assert_matches_single(two_rank_runs / run, singles / ("single-llama" if run.startswith("llama") else "single-4"),
                          STEPS)


# --- 4 stages (8 blocks), and 2 replicas of 2 stages ----------------------------------------------

FOUR_RANK_RUNS = {
    "interleaved-1f1b": (8, ("parallel.pipeline.schedule=interleaved-1f1b", "parallel.pipeline.micro_batches=8")),
    "zb-h1": (8, ("parallel.pipeline.schedule=zb-h1", "parallel.pipeline.micro_batches=4")),
    "zbv": (8, ("parallel.pipeline.schedule=zbv", "parallel.pipeline.micro_batches=8")),
    "dualpipev": (8, ("parallel.pipeline.schedule=dualpipev", "parallel.pipeline.micro_batches=8")),
    **{f"dp2-{schedule}": (4, (f"parallel.pipeline.schedule={schedule}", "parallel.dp=2", "train.micro_batch=4",
                               "parallel.pipeline.micro_batches=4")) for schedule in SCHEDULES},
}


@pytest.fixture(scope="module")
def four_rank_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pp4")
    run_ranks(train_runs, 4, root, FOUR_RANK_RUNS)
    return root


@pytest.mark.parametrize("run", FOUR_RANK_RUNS)
def test_matches_single_device_over_10_steps_on_4_ranks(four_rank_runs, singles, run):
    layers = FOUR_RANK_RUNS[run][0]
    assert_matches_single(four_rank_runs / run, singles / f"single-{layers}", STEPS)


# --- what the split backward runs and holds ------------------------------------------------------

def split_behaviour(ctx: DistContext, root: Path) -> dict:
    """Per schedule, on this rank: the order of the first step's computes, the most bytes of saved
    activations held at once, and one micro-batch's bytes on the rank's stages."""
    out = {}
    for schedule in ("1f1b", "zb-h1", "zbv"):
        trainer = Trainer(cfg_for(root / schedule, "pipeline", 2, 4, f"parallel.pipeline.schedule={schedule}",
                                  "parallel.pipeline.micro_batches=4"), ctx)
        trainer.train_step(0)  # the trainer counts activations in its first step
        out[schedule] = {"order": [f"{kind}{i}@{s}" for kind, i, s, _, _ in trainer.strategy.timeline],
                         "peak": trainer.activation_bytes, "one": one_micro_batch_bytes(trainer, 2),
                         "in flight": peak_in_flight(trainer.strategy.schedule)[ctx.rank]}
    return out


@pytest.fixture(scope="module")
def behaviour(tmp_path_factory) -> list[dict]:
    return run_ranks(split_behaviour, 2, tmp_path_factory.mktemp("split"))


def test_zb_h1_runs_each_input_gradient_before_its_weight_gradient_in_the_schedules_order(behaviour):
    stage0, stage1 = behaviour
    # rank 1 lets one weight gradient wait (ZB-H1: rank r defers r), rank 0 none
    assert stage0["zb-h1"]["order"] == ["F0@0", "F1@0", "B0@0", "W0@0", "F2@0", "B1@0", "W1@0", "F3@0", "B2@0",
                                        "W2@0", "B3@0", "W3@0"]
    assert stage1["zb-h1"]["order"] == ["F0@1", "B0@1", "F1@1", "B1@1", "W0@1", "F2@1", "B2@1", "W1@1", "F3@1",
                                        "B3@1", "W2@1", "W3@1"]


def test_split_schedules_hold_the_micro_batches_the_simulator_counts(behaviour):
    """The simulator counts a micro-batch held from its forward to its W; B already frees what
    only the input gradient needed above the stage's last weights (the loss's log-probabilities)."""
    for rank, r in enumerate(behaviour):
        one_f_one_b, zb_h1, zbv = r["1f1b"], r["zb-h1"], r["zbv"]
        assert one_f_one_b["peak"] == one_f_one_b["in flight"] * one_f_one_b["one"] == (2 - rank) * r["1f1b"]["one"]
        assert zb_h1["in flight"] == 2  # P on every rank
        assert zb_h1["in flight"] - 1 < zb_h1["peak"] / zb_h1["one"] <= zb_h1["in flight"]
        # two stages per rank, each half its blocks: 2P (micro-batch, stage) pairs, P micro-batches' worth
        assert zbv["in flight"] == 4
        assert 1.5 < zbv["peak"] / zbv["one"] <= 2


# --- checkpoints --------------------------------------------------------------------------------

SAVED_AT, CRASH_AT = 5, 7
ZBV = ("parallel.pipeline.schedule=zbv", "parallel.pipeline.micro_batches=4", f"train.checkpoint_every={SAVED_AT}")


def checkpointed_runs(ctx: DistContext, root: Path) -> None:
    """zbv straight; zbv saved at step 5, crashed at 7 and resumed; zbv saved, resumed under ddp."""
    Trainer(cfg_for(root / "straight", "pipeline", 2, 4, *ZBV), ctx).fit()
    for run, resumed_by in (("resumed", "pipeline"), ("to-ddp", "ddp")):
        with pytest.raises(Crash):
            crash_at(Trainer(cfg_for(root / run, "pipeline", 2, 4, *ZBV), ctx), CRASH_AT).fit()
        overrides = ZBV if resumed_by == "pipeline" else ("train.micro_batch=4",)
        Trainer(cfg_for(root / run, resumed_by, 2, 4, "run.resume=true", *overrides), ctx).fit()


def test_a_zbv_checkpoint_resumes_bit_for_bit_and_reshards_to_data_parallel(tmp_path, singles):
    run_ranks(checkpointed_runs, 2, tmp_path)
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    got, want = (load_file(str(tmp_path / run / "model.safetensors")) for run in ("resumed", "straight"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    reference = losses(singles / "single-4")
    for step, loss in enumerate(losses(tmp_path / "to-ddp")[SAVED_AT:], SAVED_AT):
        assert abs(loss - reference[step]) <= 1e-5 * reference[step], step + 1
