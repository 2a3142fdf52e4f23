"""Compile per block (`train.compile`, compile.py): each block's forward through inductor trains as
the eager model does under every strategy that splits by blocks, on real Gloo ranks, and each
distinct block compiles once."""

from __future__ import annotations

from pathlib import Path

import pytest
from distributed import run_ranks
from helpers import SGD, gpt_tiny, inductor_cache_lock, losses, read_records, train_in_process, train_runs

STEPS = 10
# name -> (strategy, overrides): every strategy that splits by blocks, on 2 ranks. Each block sees a
# micro-batch of 4 wherever it can (the pipeline's 2 micro-batches of its 8): inductor's kernels are
# specialised to shapes, and blocks of one shape share them through its cache (runs, below).
RUNS = {
    "ddp": ("ddp",),
    "fsdp": ("fsdp",),
    "fsdp-tp2": ("fsdp", "parallel.tp=2"),
    "pipeline-pp2": ("pipeline", "parallel.pp=2", "parallel.pipeline.micro_batches=2", "train.micro_batch=8"),
}


def train_cfg(out: Path, strategy: str, nproc: int, *overrides: str):
    return gpt_tiny(out, strategy, nproc, *SGD, "train.micro_batch=4", *overrides, steps=STEPS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Single eager and compiled here, then each strategy compiled, in one 2-rank world. The
    strategies' eager runs are held to single's within 1e-5 by their own tests: single eager is the
    reference. Single compiles first, alone, and the ranks find most of its kernels in inductor's
    cache: on a fresh machine's empty cache, both ranks compiled each kernel at once, and each shape
    had its own (57 kernels and 71 core-s here, against 33 and 49)."""
    root = tmp_path_factory.mktemp("compile")
    train_in_process(train_cfg(root / "single", "single", 1))
    with inductor_cache_lock():
        train_in_process(train_cfg(root / "single-compiled", "single", 1, "train.compile=true"))
    compiled = {f"{name}-compiled": (*run, "train.compile=true") for name, run in RUNS.items()}
    run_ranks(train_runs, 2, root, compiled, train_cfg, timeout=600)
    return root


@pytest.mark.parametrize("name", ["single", *RUNS])
def test_compiled_blocks_train_as_the_eager_model_does(runs, name):
    eager, compiled = losses(runs / "single"), losses(runs / f"{name}-compiled")
    assert len(compiled) == STEPS
    # inductor fuses each block's elementwise work, so fp32 rounding differs: within 1e-4 of eager
    for step, (a, b) in enumerate(zip(compiled, eager, strict=True)):
        assert a == pytest.approx(b, rel=1e-4), f"step {step + 1}"
    assert eager[-1] < eager[0] - 0.5  # and the loss moved


@pytest.mark.parametrize("name", ["single", *RUNS])
def test_each_distinct_block_compiles_once(runs, name):
    summary = read_records(runs / f"{name}-compiled", "summary")[0]
    # gpt-tiny's blocks are alike: one graph for training, one for the evaluation's no_grad
    assert summary["compile"]["graphs"] == 2
    assert summary["compile"]["seconds"] > 0
    assert "compile" not in read_records(runs / "single", "summary")[0]
