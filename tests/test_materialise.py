"""Models built on the meta device: every strategy materialises what its rank keeps, with the very
values `single` starts from (bit for bit, on 2 and 4 ranks, for the GPT, the transformers families
and the CNN/MLP); fsdp's setup holds its shards and one unit, a pipeline stage its own part, a
tensor rank its shards and one block, as the planner predicts; pretrained weights load into each
rank's part; bad models and bad weights are refused by name."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from torch import nn

import shardwise as sw
from shardwise.config.load import load_config
from shardwise.config.registry import SPECS
from shardwise.config.schema import Config
from shardwise.dist import DistContext, init_distributed
from shardwise.materialise import Materialiser, build_on_meta, init_context
from shardwise.memory import reset_peak_resident, resident_bytes, return_free_memory
from shardwise.models import build_model
from shardwise.planner.candidates import Candidate
from shardwise.planner.phases import predict_setup_bytes
from shardwise.strategies.classes import make_strategy
from shardwise.strategies.param_server import server_parameters
from shardwise.weights import WeightsError

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is first imported, here and in every rank

SEED = 5
FAMILIES = {"gpt": (), "hf-llama": ("model.n_head=4", "model.n_kv_head=2"), "hf-qwen2": (), "hf-gpt2": (),
            "cnn": ("data.name=synthetic-images",), "mlp": ("data.name=synthetic-images",)}
DATA_PARALLEL = [name for name, s in SPECS.items() if not s.splits_model and not s.one_process
                 and not s.parameter_servers]
SPLITTING = [name for name, s in SPECS.items() if s.splits_model]
SPLIT_FAMILIES = ("gpt", "hf-llama", "hf-qwen2", "hf-gpt2")  # those with a parallel plan (models/plans.py)
# On 4 ranks the mesh strategies run two of their own dimension beside two of another.
MESH_ON_4 = {"pipeline": ("parallel.tp=2",), "model-parallel": ("parallel.dp=2",), "tensor": ("parallel.dp=2",)}


def config(family: str, strategy: str, world: int, *extra: str) -> Config:
    return load_config(None, [f"model.name={family}", *FAMILIES[family], f"parallel.strategy={strategy}",
                              f"launch.nproc={world}", "train.micro_batch=2", "parallel.pipeline.micro_batches=2",
                              f"train.seed={SEED}", *extra])


def meta_model(cfg: Config) -> nn.Module:
    with init_context():
        return build_model(cfg.model)


def step0(cfg: Config, ctx: DistContext) -> dict[str, torch.Tensor]:
    """The whole initial state a strategy materialises from a meta-built model, gathered on rank 0."""
    strategy = make_strategy(cfg.parallel, ctx, cfg.train.seed)
    strategy.wrap(meta_model(cfg))
    return strategy.view.full_state_dict()


def cases(world: int) -> dict[str, Config]:
    out = {f"{family} {strategy}": config(family, strategy, world)
           for family in FAMILIES for strategy in DATA_PARALLEL}
    out |= {f"{family} {strategy}": config(family, strategy, world, *(MESH_ON_4[strategy] if world == 4 else ()))
            for family in SPLIT_FAMILIES for strategy in SPLITTING}
    return out


def every_strategy(ctx: DistContext) -> dict[str, dict[str, torch.Tensor]]:
    states = {}
    for label, cfg in cases(ctx.world_size).items():
        # hsdp: two nodes of two processes on 4 ranks (one node of 2 on 2)
        os.environ["LOCAL_WORLD_SIZE"] = str(2 if ctx.world_size == 4 else ctx.world_size)
        state = step0(cfg, ctx)
        if ctx.is_main:
            states[label] = state
    return states


@pytest.fixture(scope="module")
def single() -> dict[str, dict[str, torch.Tensor]]:
    threads = torch.get_num_threads()
    try:
        ctx = init_distributed(threads_per_rank=1)
        return {family: step0(config(family, "single", 1), ctx) for family in FAMILIES}
    finally:
        torch.set_num_threads(threads)


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], label: str) -> None:
    assert got.keys() == want.keys(), label
    different = [key for key in want if not torch.equal(got[key], want[key])]
    assert not different, f"{label}: {len(different)} tensor(s) differ from single's, e.g. {different[0]}"


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_every_strategy_starts_from_singles_weights_bit_for_bit(single, world):
    states = run_ranks(every_strategy, world)[0]
    assert len(states) == len(FAMILIES) * len(DATA_PARALLEL) + len(SPLIT_FAMILIES) * len(SPLITTING)
    for label, state in states.items():
        assert_same_state(state, single[label.split()[0]], f"{label} on {world} ranks")


V_STAGES = ("model.n_layer=4", "train.micro_batch=4",
            "parallel.pipeline.micro_batches=4")  # 2 ranks x 2 stages of a block


def stages_per_rank(ctx: DistContext) -> dict[str, dict[str, torch.Tensor]]:
    states = {}
    for family in ("gpt", "hf-gpt2"):  # GPT-2's head is tied to its embedding: a V holds both on rank 0
        for schedule in ("interleaved-1f1b", "zbv"):
            state = step0(config(family, "pipeline", ctx.world_size, *V_STAGES,
                                 f"parallel.pipeline.schedule={schedule}"), ctx)
            if ctx.is_main:
                states[f"{family} {schedule}"] = state
    return states


def test_two_stages_per_rank_materialise_both_as_single_initialises_them():
    states = run_ranks(stages_per_rank, 2)[0]
    threads = torch.get_num_threads()
    try:
        ctx = init_distributed(threads_per_rank=1)
        singles = {family: step0(config(family, "single", 1, *V_STAGES), ctx) for family in ("gpt", "hf-gpt2")}
    finally:
        torch.set_num_threads(threads)
    assert len(states) == 4
    for label, state in states.items():
        assert_same_state(state, singles[label.split()[0]], label)


def test_dp_and_the_parameter_servers_start_from_singles_weights(single):
    ctx = init_distributed(threads_per_rank=torch.get_num_threads())
    for family in ("gpt", "cnn"):
        assert_same_state(step0(config(family, "dp", 1), ctx), single[family], f"{family} dp")
    cfg = config("gpt", "param-server", 4, "parallel.param_server.servers=2")
    shares = [server_parameters(cfg, index) for index in range(2)]
    assert all(shares) and not shares[0].keys() & shares[1].keys()  # each parameter on one server
    served = {name: param.detach() for share in shares for name, param in share.items()}
    names = [name for name, _ in meta_model(cfg).named_parameters()]
    assert_same_state(served, {name: single["gpt"][name] for name in names}, "param-server's servers")


def test_the_gpt_is_initialised_as_gpt2_whatever_the_group_order():
    cfg = config("gpt", "single", 1, "model.n_layer=4", "model.d_model=128")
    forward, backward = meta_model(cfg), meta_model(cfg)
    Materialiser(forward, "Block", SEED).materialise_all(torch.device("cpu"), None)
    reverse = Materialiser(backward, "Block", SEED)
    for group in reversed(reverse.groups):
        reverse.materialise(group, torch.device("cpu"), None)
    assert_same_state(backward.state_dict(), forward.state_dict(), "groups materialised in reverse")
    assert forward.head.weight is forward.tok_emb.weight  # the tie kept
    residual = torch.cat([forward.blocks[i].mlp.down.weight.flatten() for i in range(4)])
    assert abs(residual.std().item() - 0.02 / math.sqrt(8)) < 0.0005
    assert abs(forward.blocks[0].attn.qkv.weight.std().item() - 0.02) < 0.0005
    assert torch.equal(forward.ln_f.weight, torch.ones(128))
    other = meta_model(cfg)
    Materialiser(other, "Block", SEED + 1).materialise_all(torch.device("cpu"), None)
    assert not torch.equal(other.tok_emb.weight, forward.tok_emb.weight)  # the seed matters


# --- bad models -----------------------------------------------------------------------------

class Gain(nn.Module):
    """A module with a parameter and no init of its own, built with an argument."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))


class Scale(nn.Module):
    """A module with no init of its own, built without arguments: its constructor's constants."""

    def __init__(self, start: float = 0.5) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((3,), start))


class Blank(nn.Module):
    """Built without arguments, its parameter's memory left as it was found."""

    def __init__(self) -> None:
        super().__init__()
        self.blank = nn.Parameter(torch.empty(3))


def test_a_factory_that_builds_real_tensors_is_refused_naming_the_tensor():
    def factory() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2, device="cpu"))

    with pytest.raises(ValueError, match=r"built 1\.weight on cpu, not on the meta device"):
        build_on_meta(factory, "run.prepare")


def test_a_module_no_init_covers_is_named_and_a_half_meta_model_refused():
    with init_context():
        model = nn.Sequential(nn.Linear(3, 3), Gain(3))
    with pytest.raises(ValueError, match=r"1\.gain was not initialised by its module's init \(Gain has no"):
        Materialiser(model, None, 0).materialise_all(torch.device("cpu"), None)
    # The same found before any worker starts, on small stand-ins, the model still on meta; a model
    # whose every tensor an init reaches passes, GPT-2 124M's sizes too (its embeddings cut)
    with pytest.raises(ValueError, match=r"1\.gain was not initialised by its module's init \(Gain has no"):
        Materialiser(model, None, 0).check_initialisable()
    assert all(t.is_meta for t in model.parameters())
    with init_context():
        large = build_model(load_config(None, ["model.preset=gpt2-124m"]).model)
    Materialiser(large, "Block", 0).check_initialisable()
    # A module its class builds without arguments takes its constructor's values (Apertus' xIELU's
    # constants), but not memory its constructor left uninitialised
    with init_context():
        scaled, blank = nn.Sequential(nn.Linear(3, 3), Scale()), nn.Sequential(nn.Linear(3, 3), Blank())
    Materialiser(scaled, None, 0).materialise_all(torch.device("cpu"), None)
    assert scaled[1].scale.tolist() == [0.5] * 3
    with pytest.raises(ValueError, match=r"1\.blank was not initialised by its module's init \(Blank has no"):
        Materialiser(blank, None, 0).materialise_all(torch.device("cpu"), None)
    half = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3, device="meta"))
    run = sw.setup("single")
    with pytest.raises(ValueError, match=r"partly on the meta device \(1\.weight.*partly real \(0\.weight"):
        run.prepare(half, lambda params: torch.optim.SGD(params, lr=0.1))


# --- fsdp's setup: its shards and one unit ---------------------------------------------------

# Large enough that a unit (12.6 MB) dwarfs the runtime's noise; 4 blocks, so 4 ranks' shards are small.
SETUP_GPT = ("model.d_model=512", "model.n_head=8", "model.n_layer=4")


def fsdp_setup(ctx: DistContext) -> dict[str, int]:
    warm_up = config("gpt", "fsdp", ctx.world_size)  # the runtime's baseline: fsdp's code loaded and run once
    step0(warm_up, ctx)
    cfg = config("gpt", "fsdp", ctx.world_size, *SETUP_GPT)
    model = meta_model(cfg)
    strategy = make_strategy(cfg.parallel, ctx, SEED)
    return_free_memory()  # a pooled rank's earlier calls leave no freed memory for this one to reuse unseen
    reset_peak_resident()
    baseline = resident_bytes()[0]
    strategy.wrap(model)
    shards = sum(unit.shard_buffer.numel() * 4 for unit in strategy.sharding.units)
    return {"rss": resident_bytes()[1] - baseline, "counted": strategy.setup_peak_bytes, "shards": shards,
            "unit": max(unit.full_bytes for unit in strategy.sharding.units),
            "full": sum(p.numel() * 4 for p in meta_model(cfg).parameters())}


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_setup_holds_its_shards_and_one_unit_as_the_planner_predicts(world):
    ranks = run_ranks(fsdp_setup, world)
    predicted = predict_setup_bytes(Candidate("fsdp", world, 1, 1, "fp32", "none", 2),
                                    config("gpt", "fsdp", world, *SETUP_GPT))
    for r in ranks:
        bound = 1.1 * (r["shards"] + r["unit"])
        assert r["counted"] <= bound and r["rss"] <= bound, r
        assert abs(predicted - r["counted"]) <= 0.1 * r["counted"], (predicted, r)
        # The whole model never existed on any rank: with it, resident memory would reach `full` and
        # more (2 ranks' shards and a unit are 0.75 of it, so no tighter bound holds RSS's noise).
        assert r["counted"] < 0.8 * r["full"] and r["rss"] < r["full"], r


# --- pipeline and tensor: a stage's blocks, a rank's shards -----------------------------------

def mesh_setup(ctx: DistContext, strategy_name: str) -> dict[str, int]:
    step0(config("gpt", strategy_name, ctx.world_size), ctx)  # the runtime's baseline, as fsdp_setup's
    cfg = config("gpt", strategy_name, ctx.world_size, *SETUP_GPT)
    model = meta_model(cfg)
    block = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    strategy = make_strategy(cfg.parallel, ctx, SEED)
    return_free_memory()
    reset_peak_resident()
    baseline = resident_bytes()[0]
    strategy.wrap(model)
    return {"rss": resident_bytes()[1] - baseline, "counted": strategy.setup_peak_bytes, "block": block,
            "held": sum(p.numel() * 4 for p in strategy.local_parameters()),
            "full": sum(p.numel() * 4 for p in meta_model(cfg).parameters())}


@pytest.mark.parametrize("strategy", ["pipeline", "tensor"])
def test_a_stage_or_a_tensor_shard_materialises_its_part_and_one_block_as_the_planner_predicts(strategy):
    pp, tp = (2, 1) if strategy == "pipeline" else (1, 2)
    predicted = predict_setup_bytes(Candidate(strategy, 1, pp, tp, "fp32", "none", 2),
                                    config("gpt", strategy, 2, *SETUP_GPT))
    ranks = run_ranks(mesh_setup, 2, strategy)
    for r in ranks:
        bound = 1.1 * (r["held"] + r["block"])
        assert r["held"] <= r["counted"] <= bound and r["rss"] <= bound, r
        # The whole model never existed on any rank: with it, resident memory would reach `full` and
        # more (2 ranks' shards and a unit are 0.75 of it, so no tighter bound holds RSS's noise).
        assert r["counted"] < 0.8 * r["full"] and r["rss"] < r["full"], r
    most = max(r["counted"] for r in ranks)  # the planner predicts the worst rank
    assert abs(predicted - most) <= 0.1 * most, (predicted, ranks)


# --- pretrained weights ---------------------------------------------------------------------

def tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                       bos_token_id=None, eos_token_id=None)


def load_pretrained(ctx: DistContext, llama_dir: Path, gpt_file: Path) -> dict[str, dict[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    out = {}
    for strategy in ("fsdp", "zero2", "fsdp-native", "ddp"):
        run = sw.setup(strategy)
        run.prepare(lambda: AutoModelForCausalLM.from_config(tiny_llama_config()),
                    lambda params: torch.optim.SGD(params, lr=0.1), weights=llama_dir)
        out[f"llama {strategy}"] = run.strategy.view.full_state_dict()
    for strategy in ("fsdp", "pipeline", "tensor"):
        cfg = config("gpt", strategy, ctx.world_size)
        run = sw.setup(strategy, seed=SEED)
        run.prepare(meta_model(cfg), lambda params: torch.optim.SGD(params, lr=0.1), weights=gpt_file)
        out[f"gpt {strategy}"] = run.strategy.view.full_state_dict()
    return out


def test_pretrained_weights_load_into_every_ranks_part(tmp_path):
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    llama = AutoModelForCausalLM.from_config(tiny_llama_config()).to(torch.bfloat16)  # cast on load
    llama.save_pretrained(tmp_path / "llama")
    gpt = build_model(config("gpt", "single", 1).model)  # an ordinary GPT: other values than SEED's
    save_model(gpt, str(tmp_path / "gpt.safetensors"))
    states = run_ranks(load_pretrained, 2, tmp_path / "llama", tmp_path / "gpt.safetensors")[0]
    for label, state in states.items():
        want = llama.state_dict() if label.startswith("llama") else gpt.state_dict()
        assert_same_state(state, {k: v.float() for k, v in want.items()}, label)


def test_weights_of_another_shape_or_missing_a_parameter_are_named(tmp_path):
    from safetensors.torch import save_file

    cfg = config("gpt", "single", 1)
    state = dict(build_model(cfg.model).state_dict())
    del state["head.weight"]  # the tie: the file holds it once
    wrong = {**state, "blocks.1.mlp.up.weight": torch.zeros(256, 64 + 1)}
    save_file(wrong, str(tmp_path / "wrong.safetensors"))
    missing = {k: v for k, v in state.items() if k != "ln_f.bias"}
    save_file(missing, str(tmp_path / "missing.safetensors"))
    for name, message in (("wrong", r"blocks\.1\.mlp\.up\.weight: \[256, 64\] in the model, \[256, 65\] in wrong"),
                          ("missing", r"ln_f\.bias: not in the file")):
        run = sw.setup("single")
        with pytest.raises(WeightsError, match=message):
            run.prepare(meta_model(cfg), lambda params: torch.optim.SGD(params, lr=0.1),
                        weights=tmp_path / f"{name}.safetensors")


def test_a_factory_model_and_a_meta_model_train_alike_through_the_api():
    cfg = config("gpt", "single", 1)
    runs = []
    for model in (lambda: build_model(cfg.model), meta_model(cfg)):
        run = sw.setup("single", seed=SEED)
        prepared, _ = run.prepare(model, lambda params: torch.optim.SGD(params, lr=0.1))
        runs.append(prepared.state_dict())
    assert_same_state(runs[0], runs[1], "factory vs meta model")


# --- checkpoints: a rank reads its part of a stored tensor -----------------------------------

def load_a_shard(ctx: DistContext, path: Path) -> dict[str, int]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from shardwise.checkpoint import safe_reader

    rows = 4096 // ctx.world_size
    local = torch.zeros(rows, 4096)
    shard = DTensor.from_local(local, init_device_mesh("cpu", (ctx.world_size,)), [Shard(0)], run_check=False)
    reader = safe_reader(path)
    return_free_memory()
    reset_peak_resident()
    baseline = resident_bytes()[0]
    dcp.load({"w": shard}, storage_reader=reader)
    read = resident_bytes()[1] - baseline
    expected = torch.arange(4096 * 4096, dtype=torch.float32).view(4096, 4096)[ctx.rank * rows:(ctx.rank + 1) * rows]
    return {"equal": torch.equal(local, expected), "read": read}


def test_a_rank_reads_only_its_shard_of_a_tensor_saved_whole(tmp_path):
    import torch.distributed.checkpoint as dcp

    whole = torch.arange(4096 * 4096, dtype=torch.float32).view(4096, 4096)  # 64 MiB, as single saves it
    dcp.save({"w": whole}, checkpoint_id=tmp_path, no_dist=True)
    for rank in run_ranks(load_a_shard, 4, tmp_path):
        assert rank["equal"]
        # Its 16 MiB of rows, mapped from the file and copied; not the 64 MiB tensor read whole.
        assert rank["read"] < 0.5 * whole.numel() * 4, rank
