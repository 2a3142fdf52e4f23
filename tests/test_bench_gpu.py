"""The GPU benches' harness on the CPU (bench/fake_world.py): gpu-scale's jobs, rank 0 of a fake
process group of 8 and 16, hold what one rank of that world holds (the strategy's counted bytes
equal the planner's), hsdp shards over a node of 8 and fsdp over tensor parallel splits each block
8 ways first; gpu's jobs train every strategy it times (a pipeline's stages included) on a fake
world. On a GPU the same jobs add the device's figures; here `shardwise bench gpu` and `gpu-scale`
refuse."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import REPO

from bench import fake_world
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


def run_jobs_in_one_process(jobs: list[tuple[str, dict]]) -> list[dict]:
    """(bench module, job): the benches' workers one after another in one process (the benches give
    each its own, for its own allocator peak, which the CPU does not report): one interpreter start,
    not one per job."""
    script = "import importlib, json, sys\nfor module, job in json.loads(sys.argv[1]):\n" \
             "    importlib.import_module(module).worker(job)"
    done = subprocess.run([sys.executable, "-c", script, json.dumps(jobs)], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line[len(fake_world.RESULT):]) for line in done.stdout.splitlines()
            if line.startswith(fake_world.RESULT)]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, dict]:
    config = tmp_path_factory.mktemp("gpu") / "llama.toml"
    config.write_text(LLAMA)
    scale = (("fsdp", 8, "blocks"), ("hsdp", 16, "blocks"), ("fsdp-tp8", 16, "selective"),
             ("fsdp-native", 8, "blocks"))
    timed = (("single", 1, "tiny"), ("fsdp-native", 1, "tiny"), ("zero2", 8, "tiny"), ("pipeline", 8, "small"))
    results = run_jobs_in_one_process(
        [("bench.gpu_scale", {"strategy": label, "world": world, "recompute": recompute, "seq_len": 64,
                                        "steps": 2, "config": str(config)}) for label, world, recompute in scale]
        + [("bench.gpu", {"strategy": strategy, "world": world, "preset": preset, "micro_batch": 4,
                                    "steps": 3}) for strategy, world, preset in timed])
    names = [f"scale {label}" for label, _, _ in scale] + [f"gpu {strategy} {world}" for strategy, world, _ in timed]
    return dict(zip(names, results, strict=True))


def test_gpu_jobs_train_every_timed_strategy_on_a_fake_world(jobs):
    for name in ("gpu single 1", "gpu fsdp-native 1", "gpu zero2 8", "gpu pipeline 8"):
        job = jobs[name]
        assert job["step_s"] > 0 and job["flops_per_s"] > 0 and job["max_allocated"] is None, name
        # ours have the planner's prediction beside them; FSDP2, which it does not model, none
        assert (job["predicted_peak"] is None) == ("native" in name), name


def test_fake_world_jobs_hold_one_ranks_share_as_the_planner_predicts(jobs):
    jobs = {name.removeprefix("scale "): job for name, job in jobs.items() if name.startswith("scale ")}
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


def test_the_cli_refuses_the_gpu_benches_without_cuda(capsys):
    for name in ("gpu", "gpu-scale"):
        assert main(["bench", name]) == 2
        assert f"bench {name} measures a GPU and no CUDA device is here" in capsys.readouterr().err


def test_the_cuda_tests_name_strategies_that_exist():
    # tests/gpu runs only on a lent GPU: a strategy renamed here would otherwise be found there
    from gpu.test_cuda import WORLD_ONE

    from shardwise.validate import STRATEGIES

    assert set(WORLD_ONE) <= set(STRATEGIES)


def test_the_profile_of_a_gpu_job_finds_fsdps_gathers(tmp_path):
    out = tmp_path / "profile.json"
    done = subprocess.run([sys.executable, "-m", "bench.gpu_profile", "--strategy", "fsdp", "--preset", "tiny",
                           "--micro-batch", "2", "--steps", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    profile = json.loads(out.read_text())
    assert profile["step_s"] > 0
    # a unit's parameters gathered before its forward, and again before its backward, each step
    gathers = [row for row in profile["collectives"] if "allgather" in row["name"]]
    assert gathers and gathers[0]["calls"] >= 2 * 2


# A GPT whose vocabulary dwarfs the rest: the loss's gradients over the logits are half its step's peak.
WIDE_VOCABULARY = """[model]
name = "gpt"
n_layer = 2
n_head = 2
d_model = 64
d_ff = 256
seq_len = 256
vocab_size = 16384

[data]
name = "synthetic-tokens"
"""


# A Llama whose embedding and head dwarf its blocks and its short sequence's activations, as
# Llama-3-8B's over 64 ranks do: fsdp's peak is at the end of backward, the root's gradients reduced.
WIDE_LLAMA = """[model]
name = "hf-llama"
n_layer = 4
n_head = 4
n_kv_head = 2
d_model = 128
d_ff = 448
seq_len = 64
vocab_size = 32768

[data]
name = "synthetic-tokens"
"""

# A GPT-MoE whose experts outweigh the rest, split over 2 ranks: fsdp keeps their whole gradients to
# the end of backward, where they are reduce-scattered in the same order on every rank.
EXPERTS = WIDE_VOCABULARY.replace("gpt", "gpt-moe").replace("d_model = 64", "d_model = 128").replace(
    "d_ff = 256", "d_ff = 1024").replace("vocab_size = 16384", "vocab_size = 256\nn_experts = 16\ntop_k = 2").replace(
    "n_layer = 2", "n_layer = 4") + "\n[parallel]\nep = 2\n"

PEAK_JOBS = ("single:1:none", "ddp:1:none", "fsdp:8:blocks")
END_JOBS = ("fsdp:64:blocks", "fsdp-native:64:blocks")


@pytest.fixture(scope="module")
def step_peaks(tmp_path_factory) -> dict[str, dict]:
    """bench.gpu_profile's memory profile of each of PEAK_JOBS (gpu-scale jobs of the wide-vocabulary
    GPT at sequence 256) and END_JOBS (of the wide Llama at 64), one after another in one process
    (each job's group destroyed after it)."""
    folder = tmp_path_factory.mktemp("peaks")
    (folder / "wide.toml").write_text(WIDE_VOCABULARY)
    (folder / "llama.toml").write_text(WIDE_LLAMA)
    (folder / "experts.toml").write_text(EXPERTS)
    jobs = [(job.split(":"), "wide.toml", 256) for job in PEAK_JOBS]
    jobs += [(job.split(":"), "llama.toml", 64) for job in END_JOBS] + [(["fsdp", "8", "blocks"], "experts.toml", 32)]
    results = run_jobs_in_one_process([("bench.gpu_profile", {
        "strategy": strategy, "world": int(world), "recompute": recompute, "seq_len": seq,
        "config": str(folder / config)}) for (strategy, world, recompute), config, seq in jobs])
    return dict(zip((*PEAK_JOBS, *END_JOBS, "experts"), results, strict=True))


@pytest.mark.parametrize("job", PEAK_JOBS)
def test_the_planners_step_peak_is_what_the_profilers_memory_timeline_finds(step_peaks, job):
    """One step's peak in torch.profiler's memory timeline (bench.gpu_profile --memory): every
    tensor live at once, the bytes by what they are, beside the planner's `peak` (no margin). The
    peak is where backward starts: every activation, the logits' gradient and the loss's float32
    chunk, ddp's buckets, fsdp's gathered root."""
    memory = step_peaks[job]
    predicted, at_peak = memory["predicted"], memory["at_peak"]
    assert memory["peak"] == sum(at_peak.values())
    # measured on this CPU within 0.3% of the planner; the loss's backward made the logits' gradient
    # (autograd's own) and its float32 chunk (a temporary)
    assert memory["peak"] == pytest.approx(predicted["peak"], rel=0.02), (memory["peak"], predicted)
    assert at_peak["autograd_detail"] + at_peak["temporary"] == pytest.approx(predicted["loss"], rel=0.02)
    assert at_peak["optimizer_state"] == predicted["optimizer"]
    assert predicted["loss"] > memory["peak"] / 3  # the case this holds is one where the loss matters


def test_fsdps_peak_at_the_end_of_backward_is_the_planners_and_under_fsdp2s(step_peaks):
    """Where the root outweighs the rest (Llama-3-8B over 64 ranks), the step's peak is the root's
    reduce-scatter: its whole gradients and their float32 packed copy, its gathered parameters
    already freed. The planner's `at_end` is that moment; FSDP2 holds more there."""
    ours, native = step_peaks["fsdp:64:blocks"], step_peaks["fsdp-native:64:blocks"]
    predicted = ours["predicted"]
    assert predicted["peak"] == predicted["params"] + predicted["optimizer"] + predicted["at_end"]
    assert ours["peak"] == pytest.approx(predicted["peak"], rel=0.02), (ours["peak"], predicted)
    # nothing of the gathered root is left: the parameters live at the peak are this rank's shards
    assert ours["at_peak"]["parameter"] <= predicted["params"]
    assert ours["peak"] < 0.95 * native["peak"], (ours["peak"], native["peak"])


def test_fsdps_experts_split_over_ep_keep_their_whole_gradients_to_the_end_of_backward(step_peaks):
    """Split over ep, each layer's experts are units of their own, reduce-scattered once backward ends:
    there every layer's whole expert gradients are live at once, which the planner's `at_end` counts.
    Its peak is at most 6% over what the profile finds: as the first block's backward ends it counts
    every shard gradient, the experts' included, which are made later."""
    experts = step_peaks["experts"]
    predicted = experts["predicted"]
    waiting = 4 * 16 // 2 * 2 * 128 * 1024 * 2  # layers x a rank's experts x their two matrices, bf16
    assert experts["at_peak"]["gradient"] >= waiting
    assert experts["peak"] <= predicted["peak"] <= 1.06 * experts["peak"], (experts["peak"], predicted)
