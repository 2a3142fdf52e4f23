"""The gpu-scale bench's harness on the CPU: jobs that are rank 0 of a fake process group of 8 and
16 hold what one rank of that world holds (the strategy's counted bytes equal the planner's), hsdp
shards over a node of 8 and fsdp over tensor parallel splits each block 8 ways first. On a GPU the
same jobs add the allocator's figures; here `shardwise bench gpu-scale` refuses."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shardwise.bench import gpu_scale
from shardwise.cli import main

# A Llama of 8 heads (tensor parallel 8 takes one each), 2 blocks, width 64.
LLAMA = """[model]
name = "hf-llama"
n_layer = 2
n_head = 8
n_kv_head = 8
d_model = 64
d_ff = 128
seq_len = 64
vocab_size = 256

[data]
name = "synthetic-tokens"
"""


def run_jobs_in_one_process(jobs: list[dict]) -> list[dict]:
    """The bench's workers one after another in one process (the bench gives each its own, for its
    own allocator peak, which the CPU does not report): one interpreter start, not one per job."""
    script = "import json, sys\nfrom shardwise.bench import gpu_scale\nfor job in json.loads(sys.argv[1]):\n" \
             "    gpu_scale.worker(job)"
    done = subprocess.run([sys.executable, "-c", script, json.dumps(jobs)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line[len(gpu_scale.RESULT):]) for line in done.stdout.splitlines()
            if line.startswith(gpu_scale.RESULT)]


def test_fake_world_jobs_hold_one_ranks_share_as_the_planner_predicts(tmp_path):
    config = tmp_path / "llama.toml"
    config.write_text(LLAMA)
    labels = (("fsdp", 8, "blocks"), ("hsdp", 16, "blocks"), ("fsdp-tp8", 16, "selective"),
              ("fsdp-native", 8, "blocks"))
    results = run_jobs_in_one_process([{"strategy": label, "world": world, "recompute": recompute, "seq_len": 64,
                                        "steps": 2, "config": str(config)} for label, world, recompute in labels])
    jobs = {label: result for (label, _, _), result in zip(labels, results, strict=True)}
    for label, job in jobs.items():
        assert job["fits"] and job["step_s"] > 0, (label, job)
        assert "max_allocated" not in job  # no device figures off a GPU
    for label in ("fsdp", "hsdp", "fsdp-tp8"):
        counted, predicted = jobs[label]["counted"], jobs[label]["predicted"]
        assert counted["params"] == predicted["params"] and counted["optimizer"] == predicted["optimizer"], label
        # the counter's view of the forward, as in the planner's tests: within one batch's token ids
        assert counted["activations"] == pytest.approx(predicted["activations"], rel=0.01), label
    # hsdp at 16 holds a node of 8's shards, fsdp at 8 the same; FSDP2 the same parameters as ours
    assert jobs["hsdp"]["counted"]["params"] == jobs["fsdp"]["counted"]["params"] \
        == jobs["fsdp-native"]["counted"]["params"]
    assert jobs["fsdp-native"]["predicted"] is None  # the planner predicts ours


def test_the_cli_refuses_gpu_scale_without_cuda(capsys):
    assert main(["bench", "gpu-scale"]) == 2
    assert "no CUDA device is here" in capsys.readouterr().err
