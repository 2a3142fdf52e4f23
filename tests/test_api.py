"""The Python API (`shardwise.setup` and its Run): every strategy in a user's own loop matches one
device on the same global batches, accumulation, fp16 skipping, checkpoints that reshard, the
errors; and examples/train_api.py under torchrun."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from helpers import REPO, assert_states_close
from safetensors.torch import load_file

import shardwise as sw
from shardwise.config.schema import ConfigError
from shardwise.data.corpus import TokenWindows, load_corpus, split_tokens
from shardwise.dist import DistContext
from shardwise.models import GPT, GPTConfig, loss_fn

STEPS = 10
BATCH = 8
SEQ_LEN = 32
# Clipping at 0.5 is active here (the gradient norm of these steps is larger); grad_accum 2.
OPTIONS = {"grad_accum": 2, "grad_clip": 0.5}


def shakespeare() -> TokenWindows:
    return TokenWindows(split_tokens(load_corpus("shakespeare"), 0.05)[0], SEQ_LEN)


def sgd(params) -> torch.optim.Optimizer:
    """SGD, not Adam: Adam turns the rounding noise of a near-zero gradient into a full-size step
    (FACTS-torch-cpu.md), and tensor parallel's other summation order moved one weight of 3072 by
    1e-6 over 10 steps. With SGD every parameter is held to rtol 1e-5."""
    return torch.optim.SGD(params, lr=0.3, momentum=0.9)


def train_gpt(strategy: str, steps: int = STEPS, inf_at: int | None = None, **options) -> dict:
    """The loop a user writes: `steps` global batches of a 2-block GPT on Shakespeare; returns the
    per-step mean losses, what each step() said, and the final weights (on rank 0)."""
    options = {**OPTIONS, **options}
    run = sw.setup(strategy, **options)
    model, optimizer = run.prepare(GPT(GPTConfig(2, 2, 32, SEQ_LEN, 256)), sgd)
    losses, stepped, total = [], [], 0.0
    for i, (inputs, targets) in enumerate(run.loader(shakespeare(), BATCH, steps=steps)):
        loss = loss_fn(model(inputs), targets)
        if inf_at == run.global_step and run.rank == 1:
            loss = loss * float("inf")
        run.backward(loss)
        stepped.append(run.step(optimizer))
        total += loss.item()
        if (i + 1) % run.grad_accum == 0:
            losses.append(run.reduce_mean(torch.tensor(total / run.grad_accum)).item())
            total = 0.0
    return {"losses": losses, "stepped": stepped, "state": run.strategy.view.full_state_dict(),
            "scale": run.scaler.scale if run.scaler else None, "skipped": run.skipped_steps}


def train_gpt_pipelined(strategy: str, **options) -> dict:
    """Under a pipeline each step is one call: forward_backward over the global batch's micro-batches."""
    run = sw.setup(strategy, **{**OPTIONS, **options})
    model, optimizer = run.prepare(GPT(GPTConfig(2, 2, 32, SEQ_LEN, 256)), sgd)
    batches = run.loader(shakespeare(), BATCH, steps=STEPS)
    losses = []
    for _ in range(STEPS):
        losses.append(run.forward_backward([next(batches) for _ in range(run.grad_accum)], loss_fn).item())
        assert run.step(optimizer)
    return {"losses": losses, "state": run.strategy.view.full_state_dict()}


def in_one_thread(fn, *args, **kwargs):
    """Run `fn` in this process with one thread, as every rank runs (thread count changes summation order)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        return fn(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)


def assert_same_training(got: dict, want: dict, rtol: float = 1e-5) -> None:
    assert len(got["losses"]) == len(want["losses"]) == STEPS
    worst = max(abs(a - b) / b for a, b in zip(got["losses"], want["losses"], strict=True))
    assert worst <= rtol, f"losses differ by {worst:.2e} relative"
    assert got["state"].keys() == want["state"].keys()
    assert_states_close(got["state"], want["state"], rtol=rtol, atol=1e-6)


@pytest.fixture(scope="module")
def single() -> dict:
    result = in_one_thread(train_gpt, "single")
    losses = result["losses"]
    assert losses[-1] < losses[0] - 1.0  # it learns
    assert result["stepped"] == [False, True] * STEPS  # accumulating, then stepping
    return result


DATA_PARALLEL = ("ddp", "ddp-native", "zero1", "zero2", "fsdp", "fsdp-native")


def on_2_ranks(ctx: DistContext, checkpoint: Path) -> dict[str, dict]:
    """Everything this file runs on 2 ranks, in one world (starting one costs seconds)."""
    results = {name: train_gpt(name) for name in (*DATA_PARALLEL, "tensor")}
    results.update({name: train_gpt_pipelined(name, micro_batches=2) for name in ("pipeline", "model-parallel")})
    results["manual"] = manual_accumulation()
    results["fp16"] = train_gpt("ddp", steps=4, precision="fp16-mixed", loss_scale_growth_interval=2, inf_at=1)
    save_sharded(checkpoint)
    with pytest.raises(ConfigError) as info:
        sw.setup("single")
    results["single-error"] = str(info.value)
    # What `shardwise train` refuses before launch, the API refuses once it knows the facts: the mesh
    # at setup, a micro-batch the pipeline cannot split evenly at its first batch (it trained 1.8e-3
    # off single from step 1, silently).
    with pytest.raises(ConfigError) as info:
        sw.setup("tensor", tp=2, dp=2)
    results["mesh-error"] = str(info.value)
    run = sw.setup("pipeline", micro_batches=2)
    run.prepare(GPT(GPTConfig(2, 2, 32, SEQ_LEN, 256)), sgd)
    tokens = torch.zeros(3, SEQ_LEN, dtype=torch.long)
    with pytest.raises(ConfigError) as info:
        run.forward_backward([(tokens, tokens)], loss_fn)
    results["micro-batch-error"] = str(info.value)
    return results


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, dict]:
    checkpoint = tmp_path_factory.mktemp("api-checkpoint")
    ranks = run_ranks(on_2_ranks, 2, checkpoint)
    return {**ranks[0], "fp16-by-rank": [r["fp16"] for r in ranks], "checkpoint": checkpoint}


@pytest.mark.parametrize("strategy", [*DATA_PARALLEL, "tensor", "pipeline", "model-parallel"])
def test_every_strategy_through_the_api_matches_single_over_10_steps_on_2_ranks(two_ranks, single, strategy):
    assert_same_training(two_ranks[strategy], single)


def manual_accumulation() -> dict:
    """Accumulating by hand (grad_accum = 1): no_sync around the first of two global batches of 4,
    losses halved. Batches 2k and 2k + 1 of 4 are batch k of 8: the samples `single` steps on."""
    run = sw.setup("ddp", grad_clip=0.5)
    model, optimizer = run.prepare(GPT(GPTConfig(2, 2, 32, SEQ_LEN, 256)), sgd)
    micro = iter(run.loader(shakespeare(), BATCH // 2, steps=2 * STEPS))
    losses = []
    for _ in range(STEPS):
        (x0, y0), (x1, y1) = next(micro), next(micro)
        with run.no_sync():
            first = loss_fn(model(x0), y0) / 2
            run.backward(first)
        second = loss_fn(model(x1), y1) / 2
        run.backward(second)
        assert run.step(optimizer)
        losses.append(run.reduce_mean((first + second).detach()).item())
    return {"losses": losses, "state": run.strategy.view.full_state_dict()}


def test_accumulating_by_hand_with_no_sync_matches_grad_accum(two_ranks, single):
    assert_same_training(two_ranks["manual"], single)


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(two_ranks):
    for result in two_ranks["fp16-by-rank"]:
        # global batch 1 (rank 1's loss made inf): accumulated, then skipped on both ranks
        assert result["stepped"] == [False, True, False, False, False, True, False, True]
        assert result["skipped"] == 1
        # 2 clean steps would double the scale; the overflow halved it and the next 2 doubled it back
        assert result["scale"] == 65536.0


def save_sharded(path: Path) -> None:
    """5 steps under fsdp, checkpointed, and the weights written as one file."""
    run = sw.setup("fsdp", **OPTIONS)
    model, optimizer = run.prepare(GPT(GPTConfig(2, 2, 32, SEQ_LEN, 256)), sgd)
    for inputs, targets in run.loader(shakespeare(), BATCH, steps=5):
        run.backward(loss_fn(model(inputs), targets))
        run.step(optimizer)
    run.save(path)
    run.save_weights(path / "model.safetensors")


def resume_single(path: Path) -> dict:
    run = sw.setup("single", **OPTIONS)
    model, optimizer = run.prepare(GPT(GPTConfig(2, 2, 32, SEQ_LEN, 256)), sgd)
    assert run.load(path) == 5
    loaded = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    losses, total = [], 0.0
    for i, (inputs, targets) in enumerate(run.loader(shakespeare(), BATCH, steps=STEPS - 5)):
        loss = loss_fn(model(inputs), targets)
        run.backward(loss)
        run.step(optimizer)
        total += loss.item()
        if i % 2:
            losses.append(total / 2)
            total = 0.0
    return {"losses": losses, "state": run.strategy.view.full_state_dict(), "step": run.global_step, "loaded": loaded}


def test_a_checkpoint_saved_by_fsdp_on_2_ranks_resumes_under_single(two_ranks, single):
    path = two_ranks["checkpoint"]
    assert sorted(p.name for p in (path / "checkpoints").iterdir()) == ["latest", "step-00000005"]
    resumed = in_one_thread(resume_single, path)
    assert resumed["step"] == STEPS
    saved = load_file(str(path / "model.safetensors"))  # run.save_weights: what the checkpoint holds
    assert saved and all(torch.equal(tensor, resumed["loaded"][name]) for name, tensor in saved.items())
    # the loader went on at global batch 5: the same losses as the uninterrupted run's last 5
    assert_same_training({**resumed, "losses": single["losses"][:5] + resumed["losses"]}, single)


def test_errors_name_the_bad_value(two_ranks):
    with pytest.raises(ConfigError, match="parallel.bucket in shardwise.setup: unknown key"):
        sw.setup("single", bucket=1)
    with pytest.raises(ConfigError, match="parallel.strategy = 'fdsp': unknown"):
        sw.setup("fdsp")
    with pytest.raises(ConfigError, match="strategy = 'ddp' needs the process group torchrun"):
        sw.setup("ddp")
    with pytest.raises(ConfigError, match="grad_accum = 0"):
        sw.setup("single", grad_accum=0)
    with pytest.raises(ConfigError, match="cp = 2: context parallel runs under `shardwise train`"):
        sw.setup("ddp", cp=2)
    tables = sw.setup("single", bucket_mb=4.0, pipeline={"schedule": "gpipe"}).cfg.parallel  # a table's key or whole
    assert (tables.ddp.bucket_mb, tables.pipeline.schedule) == (4.0, "gpipe")
    run = sw.setup("single", grad_accum=2)
    with pytest.raises(RuntimeError, match="call run.prepare"):
        run.backward(torch.ones(()))
    model, optimizer = run.prepare(torch.nn.Linear(2, 2), sgd)
    with pytest.raises(ValueError, match="batch_size = 3: must be a positive multiple of 2"):
        run.loader(torch.zeros(10, 2), 3)
    with pytest.raises(ValueError, match="not the optimizer run.prepare returned"):
        run.step(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match="grad_accum = 2 already defers"):
        run.no_sync()
    assert "strategy = 'single' runs on one process, but torchrun started 2" in two_ranks["single-error"]
    assert two_ranks["mesh-error"] == ("parallel.dp x pp x tp = 2 x 1 x 2 = 4: must equal the world size 2 (the "
                                       "processes torchrun started); give dp = 1")
    assert two_ranks["micro-batch-error"].startswith("parallel.pipeline.micro_batches = 2: must divide the 3 samples")


def test_the_loader_collates_map_style_datasets_and_gives_each_rank_its_slice():
    run = sw.setup("single", grad_accum=2)
    data = torch.utils.data.TensorDataset(torch.arange(12.0), torch.arange(12) * 10)
    batches = list(run.loader(data, 6))  # one epoch: 2 global batches of 6, as 2 micro-batches of 3 each
    assert [len(x) for x, _ in batches] == [3, 3, 3, 3]
    seen = torch.cat([x for x, _ in batches])
    assert sorted(seen.tolist()) == list(range(12)) and all(torch.equal(y, x.long() * 10) for x, y in batches)
    again = torch.cat([x for x, _ in run.loader(data, 6)])
    assert torch.equal(seen, again)  # deterministic: the seed's order


# --- the example script, under torchrun ---------------------------------------------------------

def example(path: str):
    spec = importlib.util.spec_from_file_location(Path(path).stem, REPO / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_api_example_under_torchrun_matches_one_process_and_resumes(tmp_path):
    """fsdp on 2 processes, 8 steps, checkpointed; then `single` resumes it to 16; the same as
    `single` for 16 steps in one go."""
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "examples/train_api.py", "--strategy", "fsdp", "--steps", "8", "--grad-accum", "2",
         "--save", str(tmp_path / "ckpt"), "--json", str(tmp_path / "fsdp.json")],
        cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "fsdp on 2 process(es)" in result.stdout
    fsdp = json.loads((tmp_path / "fsdp.json").read_text())
    train_api = example("examples/train_api.py")
    whole = in_one_thread(train_api.main, ["--steps", "16", "--grad-accum", "2"])
    resumed = in_one_thread(train_api.main, ["--steps", "16", "--grad-accum", "2", "--resume", str(tmp_path / "ckpt")])
    assert resumed["first_step"] == 8 and len(resumed["losses"]) == 8
    got = fsdp["losses"] + resumed["losses"]
    assert len(got) == 16
    assert max(abs(a - b) / b for a, b in zip(got, whole["losses"], strict=True)) <= 1e-5
    assert whole["losses"][-1] < whole["losses"][0] - 1.0
    assert abs(resumed["val_loss"] - whole["val_loss"]) <= 1e-5 * whole["val_loss"]


def test_dp_runs_through_the_api_in_one_process_and_param_server_is_refused(single):
    assert_same_training(in_one_thread(train_gpt, "dp", replicas=2), single)
    with pytest.raises(ConfigError, match="'param-server' runs only under `shardwise train`"):
        sw.setup("param-server")
