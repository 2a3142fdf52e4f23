"""The strategies that split a model, on the model families with a parallel plan (models/plans.py):
tiny transformers Llama (grouped-query attention: 4 heads, 2 key/value heads), Qwen2 (biases on q, k
and v) and GPT-2 (Conv1D layers, weights [in, out], the head tied to the embedding), built from the
config (`model.name = "hf-*"`), each under `tensor` (with and without sequence parallel), `pipeline`
(2 and 3 stages, GPipe and 1F1B), `model-parallel` and dp x pp x tp, held to parity with `single`
over 10 steps of Shakespeare with clipping active.

SGD with momentum, not AdamW: Qwen2's key bias has an exact gradient of zero (softmax ignores a
constant added to every score), so its gradient is rounding noise, which Adam's normalisation turns
into full-size steps that differ between any two summation orders (FACTS-torch-cpu.md). Under SGD
that noise moves the bias by lr x 1e-9, and every tensor is held to rtol 1e-5, atol 1e-6."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from helpers import CONFIGS, SGD, assert_same_training, assert_states_close, gpt_tiny, read_records, train_in_process

import shardwise as sw
from shardwise.config.load import load_config
from shardwise.config.schema import ConfigError
from shardwise.data.corpus import TokenWindows, load_corpus, split_tokens
from shardwise.dist import DistContext
from shardwise.models import build_model, loss_fn
from shardwise.models.plans import ParallelPlan, PlanError, Region, locate, plan_for
from shardwise.trainer import Trainer

os.environ["HF_HUB_OFFLINE"] = "1"  # set before transformers is first imported, here and in every rank

STEPS = 10
FAMILIES = {
    "llama": ("model.name=hf-llama", "model.n_kv_head=2"),
    "qwen2": ("model.name=hf-qwen2", "model.n_kv_head=2"),
    "gpt2": ("model.name=hf-gpt2",),
}


def cfg_for(out: Path, family: str, strategy: str, nproc: int, *overrides: str):
    """3 blocks of width 32, 4 heads, a 32-token context; a global batch of 8 in one micro-batch."""
    return gpt_tiny(out, strategy, nproc, *FAMILIES[family], "model.n_layer=3", "model.n_head=4", "model.d_model=32",
                    "model.d_ff=64", "model.seq_len=32", "train.micro_batch=8", *SGD, "train.warmup_steps=2",
                    "train.grad_clip=0.5", *overrides, steps=STEPS)


def train_runs(ctx: DistContext, root: Path, runs: dict[str, tuple[str, ...]],
               families: dict[str, tuple[str, ...]] | None = None) -> dict[str, dict]:
    """Each run of every family (or of the `families` named for it); returns per run the bytes
    saved for backward this rank counted."""
    out = {}
    for family in FAMILIES:
        for name, (strategy, *overrides) in runs.items():
            if families is not None and family not in families[name]:
                continue
            trainer = Trainer(cfg_for(root / family / name, family, strategy, ctx.world_size, *overrides), ctx)
            trainer.fit()
            out[family, name] = trainer.activation_bytes
    return out


@pytest.fixture(scope="module")
def singles(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("single")
    for family in FAMILIES:
        train_in_process(cfg_for(root / family, family, "single", 1))
    return root


def assert_matches_single(run: Path, single: Path) -> None:
    assert_same_training(run, single, STEPS)
    (got,), (want,) = read_records(run, "summary"), read_records(single, "summary")
    assert abs(got["val_loss"] - want["val_loss"]) <= 1e-5 * want["val_loss"]


def test_clipping_is_active_and_every_family_learns_in_these_runs(singles):
    for family in FAMILIES:
        losses = [r["loss"] for r in read_records(singles / family)]
        assert losses[-1] < losses[0] - 0.3, family
    train_in_process(cfg_for(singles / "llama-unclipped", "llama", "single", 1, "train.grad_clip=0"))
    clipped = [r["loss"] for r in read_records(singles / "llama")]
    free = [r["loss"] for r in read_records(singles / "llama-unclipped")]
    assert clipped[0] == free[0] and abs(clipped[-1] - free[-1]) > 1e-4


TWO_RANK_RUNS = {
    "tensor": ("tensor",),
    "tensor-sp": ("tensor", "parallel.sequence_parallel=true"),
    "gpipe": ("pipeline", "parallel.pipeline.schedule=gpipe"),
    "1f1b": ("pipeline", "parallel.pipeline.schedule=1f1b"),
    "model-parallel": ("model-parallel",),
}


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("families2")
    return root, run_ranks(train_runs, 2, root, TWO_RANK_RUNS)[0]


@pytest.mark.parametrize("run", TWO_RANK_RUNS)
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_single_device_over_10_steps_on_2_ranks(two_rank_runs, singles, family, run):
    root, _ = two_rank_runs
    assert_matches_single(root / family / run, singles / family)


THREE_STAGE_RUNS = {
    "gpipe": ("pipeline", "parallel.pipeline.schedule=gpipe"),
    "1f1b": ("pipeline", "parallel.pipeline.schedule=1f1b"),
}


@pytest.mark.parametrize("run", THREE_STAGE_RUNS)
@pytest.mark.parametrize("family", FAMILIES)
def test_3_stages_match_single_device(three_stage_runs, singles, family, run):
    assert_matches_single(three_stage_runs / family / run, singles / family)


@pytest.fixture(scope="module")
def three_stage_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("families3")
    run_ranks(train_runs, 3, root, THREE_STAGE_RUNS)
    return root


def plain_counts(family: str) -> dict[str, int]:
    """Parameters of the plain model: all (a tied weight once), the tied ones, and what tensor
    parallel splits (the plan's column layers' weights and biases, its row layers' weights)."""
    model = build_model(cfg_for(Path("unused"), family, "single", 1).model)
    located = locate(model)
    first = {id(p) for m in located.first.values() for p in m.parameters()}
    tied = sum(p.numel() for m in located.last.values() for p in m.parameters() if id(p) in first)
    split = 0
    for block in located.blocks:
        for region in located.plan.regions:
            module = block.get_submodule(region.module)
            split += module.get_submodule(region.row).weight.numel()
            split += sum(p.numel() for c in region.columns for p in module.get_submodule(c.name).parameters())
    return {"total": sum(p.numel() for p in model.parameters()), "tied": tied, "split": split}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_stage_holds_its_own_parameters_and_each_tensor_rank_half_of_every_split_matrix(two_rank_runs,
                                                                                              family):
    root, activations = two_rank_runs
    c = plain_counts(family)
    stages = [m["params"] for m in read_records(root / family / "1f1b")[-1]["memory_by_rank"]]
    assert sum(stages) == 4 * (c["total"] + c["tied"]) and min(stages) > 0  # a tied head: a copy on the last stage
    shards = [m["params"] for m in read_records(root / family / "tensor")[-1]["memory_by_rank"]]
    assert shards == [4 * (c["total"] - c["split"] // 2)] * 2
    assert c["tied"] == (32 * 256 if family == "gpt2" else 0)  # only GPT-2 ties its head to its embedding
    # sequence parallel keeps less for backward (by how much, against the planner: test_sequence_parallel.py)
    assert activations[family, "tensor-sp"] < activations[family, "tensor"]


# --- the Python API on a transformers model as the user built it ----------------------------------

def tiny_llama(kv_heads: int = 2) -> torch.nn.Module:
    """A LlamaForCausalLM as transformers builds it: 3 layers, 4 heads, `kv_heads` key/value heads."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    return AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=kv_heads, max_position_embeddings=32, bos_token_id=None, eos_token_id=None))


def lm_loss(outputs, targets: torch.Tensor) -> torch.Tensor:
    """The loss of a transformers model's output (a pipeline hands over its logits)."""
    return loss_fn(outputs if isinstance(outputs, torch.Tensor) else outputs.logits, targets)


def train_api(strategy: str, **options) -> dict:
    """A user's loop, each step one `forward_backward` over the global batch's 2 micro-batches."""
    run = sw.setup(strategy, grad_accum=2, grad_clip=0.5, **options)
    model, optimizer = run.prepare(tiny_llama(), lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    data = TokenWindows(split_tokens(load_corpus("shakespeare"), 0.05)[0], 32)
    batches = list(run.loader(data, 8, steps=STEPS))
    losses = []
    for step in range(STEPS):
        losses.append(run.forward_backward(batches[2 * step: 2 * step + 2], lm_loss).item())
        run.step(optimizer)
    return {"losses": losses, "state": run.strategy.view.full_state_dict()}


def api_runs(ctx: DistContext) -> dict:
    out = {"tensor": train_api("tensor"), "tensor-sp": train_api("tensor", sequence_parallel=True),
           "pipeline": train_api("pipeline", micro_batches=2)}
    run = sw.setup("tensor")
    # What `shardwise train` refuses before launch, run.prepare refuses as a ConfigError
    try:
        run.prepare(tiny_llama(kv_heads=1), torch.optim.SGD)
    except ConfigError as error:
        out["one kv head"] = str(error)
    try:
        run.prepare(torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.optim.SGD)
    except ConfigError as error:
        out["no plan"] = str(error)
    return out


@pytest.fixture(scope="module")
def api(tmp_path_factory) -> tuple[dict, dict]:
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # as every rank: thread count changes summation order
        single = train_api("single")
    finally:
        torch.set_num_threads(threads)
    return run_ranks(api_runs, 2)[0], single


@pytest.mark.parametrize("strategy", ["tensor", "tensor-sp", "pipeline"])
def test_python_api_splits_a_transformers_llama_as_one_device_trains_it(api, strategy):
    got, single = api[0][strategy], api[1]
    assert single["losses"][-1] < single["losses"][0] - 0.3  # it learns
    worst = max(abs(a - b) / b for a, b in zip(got["losses"], single["losses"], strict=True))
    assert worst <= 1e-5, f"losses differ by {worst:.2e} relative"
    assert got["state"].keys() == single["state"].keys()
    assert_states_close(got["state"], single["state"], rtol=1e-5, atol=1e-6)


def test_python_api_refuses_a_split_the_model_does_not_allow_naming_what_it_needs(api):
    errors = api[0]
    assert "must divide the attention's 1 key/value heads" in errors["one kv head"]
    assert "no parallel plan for Sequential" in errors["no plan"] and "parallel_plan" in errors["no plan"]


# --- the CLI, and the 8-rank mesh -----------------------------------------------------------------

@pytest.mark.slow
def test_cli_trains_qwen2_tensor_parallel_with_sequence_parallel_as_one_device(tmp_path, singles):
    """`shardwise train --set model.name=hf-qwen2 ... --strategy tensor --nproc 2` through torchrun."""
    import subprocess
    import sys

    from helpers import REPO

    cfg = cfg_for(tmp_path / "cli", "qwen2", "tensor", 2, "parallel.sequence_parallel=true")
    cfg.save(tmp_path / "qwen2.toml")
    result = subprocess.run([sys.executable, "-m", "shardwise.cli", "train", str(tmp_path / "qwen2.toml")],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "tensor on 2 process(es)" in result.stdout
    assert_matches_single(tmp_path / "cli", singles / "qwen2")


@pytest.mark.slow
def test_dp2_pp2_tp2_matches_single_device_on_8_ranks_for_every_family(tmp_path, singles):
    runs = {"dp2-pp2-tp2-sp": ("pipeline", "parallel.dp=2", "parallel.tp=2", "train.micro_batch=4",
                               "parallel.pipeline.micro_batches=2", "parallel.pipeline.schedule=gpipe",
                               "parallel.sequence_parallel=true")}
    # Each plan once: the Llama plan (through Qwen2) and GPT-2's Conv1D, with sequence parallel. The Llama
    # itself over a mesh: fsdp x tp2 and fsdp x pp2 (test_compositions); tensor and pipeline alone above.
    families = {"dp2-pp2-tp2-sp": ("qwen2", "gpt2")}
    run_ranks(train_runs, 8, tmp_path, runs, families, timeout=600)
    for name, trained in families.items():
        for family in trained:
            assert_matches_single(tmp_path / family / name, singles / family)


# --- refused before any worker starts --------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (("model.name=hf-llama", "model.n_head=4", "model.n_kv_head=2", "parallel.strategy=tensor", "launch.nproc=4"),
     "parallel.tp = 4: must divide model.n_kv_head = 2"),
    (("model.name=hf-gpt2", "model.n_head=4", "parallel.strategy=tensor", "launch.nproc=3", "model.d_model=96"),
     "parallel.tp = 3: must divide model.n_head = 4"),
    (("model.name=hf-llama", "model.n_head=4", "model.d_ff=66", "parallel.strategy=tensor", "launch.nproc=4"),
     "parallel.tp = 4: must divide model.d_ff = 66"),
    (("model.name=hf-llama", "parallel.strategy=pipeline", "parallel.block=LlamaMLP", "launch.nproc=2"),
     "parallel.block = 'LlamaMLP': pipeline cuts and splits the llama plan's blocks (LlamaDecoderLayer)"),
    (("model.name=hf-gpt2", "parallel.strategy=pipeline", "parallel.block=GPT2MLP", "launch.nproc=2"),
     "parallel.block = 'GPT2MLP': pipeline cuts and splits the gpt2 plan's blocks (GPT2Block)"),
    (("model.name=cnn", "data.name=digits", "parallel.strategy=pipeline", "launch.nproc=2"),
     "model.name = 'cnn' has none (plans exist for gpt, hf-gpt2, gpt-moe, hf-mixtral, hf-qwen3-moe, and every "
     "transformers family that declares one: hf, hf-llama, hf-qwen2, hf-deepseek-v3). A plan names the class of "
     "its repeated block"),
])
def test_a_split_the_model_cannot_take_is_refused_before_launch(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(CONFIGS / "gpt-tiny.toml", list(overrides))
    assert message in str(error.value)


class Tower(torch.nn.Module):
    """A model of its own family: embedding, blocks in a ModuleList, final norm and head."""

    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList(TowerBlock() for _ in range(2))
        self.norm = torch.nn.LayerNorm(8)
        self.out = torch.nn.Linear(8, 16)
        self.scale = torch.nn.Parameter(torch.ones(8)) if extra else None


class TowerBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


TOWER = ParallelPlan(family="tower", models=(), blocks=("TowerBlock",),
                     regions=(Region("mlp", column=("0",), row="2"),), first_stage=("embed",),
                     last_stage=("norm", "out"))


def test_a_plan_finds_its_modules_by_name_and_says_what_does_not_fit():
    located = locate(Tower(), TOWER)
    assert (located.layers, list(located.first), list(located.last)) == ("layers", ["embed"], ["norm", "out"])
    with pytest.raises(PlanError, match="parameter 'scale' is outside the blocks and in neither"):
        locate(Tower(extra=True), TOWER)
    with pytest.raises(PlanError, match="'head' matches no module outside the blocks"):
        locate(Tower(), dataclasses.replace(TOWER, last_stage=("norm", "head")))
    with pytest.raises(PlanError, match="first_stage module 'norm' is a LayerNorm"):
        locate(Tower(), dataclasses.replace(TOWER, first_stage=("norm",), last_stage=("out",)))
    with pytest.raises(PlanError, match="no parallel plan for Tower"):
        locate(Tower())
    tower = Tower()
    tower.parallel_plan = TOWER  # a model of its own family carries its plan
    assert plan_for(tower) is TOWER and locate(tower).plan is TOWER
