"""Sequence parallel (`parallel.sequence_parallel`) on shardwise's GPT: the same training as one
device under `tensor` and under pipeline x tensor, in fp32 and mixed precision with recomputation;
the saved activations per rank fall by what the planner predicts; bad settings refused before
launch. (The transformers families under it: tests/test_model_families.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from distributed import run_ranks
from helpers import CONFIGS, SGD, assert_same_training, gpt_tiny, read_records, train_in_process, train_runs

from shardwise.config.load import load_config
from shardwise.config.schema import ConfigError
from shardwise.dist import DistContext
from shardwise.planner.candidates import Candidate
from shardwise.planner.memory_model import predict_memory
from shardwise.trainer import Trainer

STEPS = 10


def cfg_for(out: Path, strategy: str, nproc: int, *overrides: str):
    """gpt-tiny with 4 heads and 3 blocks on Shakespeare, a global batch of 8, SGD, clipping active."""
    return gpt_tiny(out, strategy, nproc, "model.n_head=4", "model.n_layer=3", "train.micro_batch=8", *SGD,
                    "train.grad_clip=0.5", *overrides, steps=STEPS)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("single") / "single"
    train_in_process(cfg_for(out, "single", 1))
    return out


TWO_RANK_RUNS = {
    "tensor-sp": ("tensor", "parallel.sequence_parallel=true"),
    "tensor-sp-recompute": ("tensor", "parallel.sequence_parallel=true", "parallel.recompute=blocks"),
    "tensor-sp-accum2": ("tensor", "parallel.sequence_parallel=true", "train.micro_batch=4"),
    "tensor-sp-bf16": ("tensor", "parallel.sequence_parallel=true", "parallel.precision=bf16-mixed"),
}


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sp2")
    run_ranks(train_runs, 2, root, TWO_RANK_RUNS, cfg_for)
    return root


def test_tensor_with_sequence_parallel_matches_single_device_on_2_ranks(two_rank_runs, single):
    for name in ("tensor-sp", "tensor-sp-recompute", "tensor-sp-accum2"):
        assert_same_training(two_rank_runs / name, single, STEPS)


def test_sequence_parallel_in_bf16_mixed_trains_as_one_device_does(two_rank_runs, tmp_path):
    """Its column layers' backward computes in bf16 as autocast's matmul does. The split moves where
    bf16 rounds (partial sums, the sequence's parts), as plain tensor parallel's does: within 5e-4
    relative, test_precision's bound for tensor and pipeline (measured on default, avx2 and
    avx512 kernels)."""
    train_in_process(cfg_for(tmp_path / "single-bf16", "single", 1, "parallel.precision=bf16-mixed"))
    got = [r["loss"] for r in read_records(two_rank_runs / "tensor-sp-bf16")]
    want = [r["loss"] for r in read_records(tmp_path / "single-bf16")]
    assert max(abs(a - b) / b for a, b in zip(got, want, strict=True)) < 5e-4  # measured 1.9e-5 to 3.3e-5


def test_pipeline_of_tensor_parallel_stages_with_sequence_parallel_matches_single_device_on_4_ranks(tmp_path, single):
    runs = {"pp2-tp2-sp": ("pipeline", "parallel.tp=2", "parallel.sequence_parallel=true",
                           "parallel.pipeline.micro_batches=2")}
    run_ranks(train_runs, 4, tmp_path, runs, cfg_for)
    assert_same_training(tmp_path / "pp2-tp2-sp", single, STEPS)


# --- saved activations: measured against the planner ----------------------------------------------

LLAMA = ("model.name=hf-llama", "model.n_kv_head=2")  # grouped-query attention, rotary cos/sin saved per stage
CASES = [(Candidate("tensor", 1, 1, 2, "fp32", "none", 4), ()),
         (Candidate("tensor", 1, 1, 2, "bf16-mixed", "selective", 4), ()),
         (Candidate("tensor", 1, 1, 2, "fp32", "blocks", 4), ()),
         (Candidate("tensor", 1, 1, 2, "fp32", "none", 4), LLAMA),
         (Candidate("tensor", 1, 1, 2, "bf16-mixed", "every:2", 4), LLAMA)]


def base_config(sequence_parallel: bool, model: tuple[str, ...]):
    return load_config(CONFIGS / "gpt-tiny.toml", [
        "model.n_layer=4", "model.n_head=4", "train.global_batch=4", "train.micro_batch=4", "train.steps=1",
        "run.out=unused", "parallel.strategy=tensor", "launch.nproc=2",
        f"parallel.sequence_parallel={str(sequence_parallel).lower()}", *model])


def counted_activations(ctx: DistContext) -> dict[tuple[int, bool], int]:
    """The bytes saved for backward this rank counts in one step of each case, with and without
    sequence parallel."""
    out = {}
    for case, (candidate, model) in enumerate(CASES):
        for sequence_parallel in (False, True):
            trainer = Trainer(candidate.config(base_config(sequence_parallel, model), ctx.world_size), ctx)
            trainer.train_step(0)
            out[case, sequence_parallel] = trainer.activation_bytes
    return out


def test_sequence_parallel_cuts_saved_activations_by_what_the_planner_predicts():
    counted = run_ranks(counted_activations, 2)
    for case, (candidate, model) in enumerate(CASES):
        label = f"{candidate.label} {' '.join(model)}"
        predicted = {sp: predict_memory(candidate, base_config(sp, model))[0].activations for sp in (False, True)}
        for rank in range(2):
            got = {sp: counted[rank][case, sp] for sp in (False, True)}
            assert got[True] < got[False], label
            fall, predicted_fall = got[False] - got[True], predicted[False] - predicted[True]
            assert fall == pytest.approx(predicted_fall, rel=0.10), (label, rank, fall, predicted_fall)
            assert got[True] == pytest.approx(predicted[True], rel=0.10), (label, rank)


# --- refused before launch ------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (("parallel.strategy=ddp", "launch.nproc=2"), "only zero1, zero2, fsdp, hsdp, pipeline, model-parallel, tensor"),
    (("parallel.strategy=fsdp", "launch.nproc=2"), "needs parallel.tp >= 2"),
    (("parallel.strategy=pipeline", "launch.nproc=2"), "needs parallel.tp >= 2"),
    (("parallel.strategy=tensor", "launch.nproc=2", "model.seq_len=63"), "must divide model.seq_len = 63"),
])
def test_sequence_parallel_is_refused_where_it_cannot_split_the_sequence(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(CONFIGS / "gpt-tiny.toml", ["parallel.sequence_parallel=true", *overrides])
