"""`parallel.float8` (issue 73, its CPU part): the blocks' linear layers computing in float8 on
torch._scaled_mm, equal bit for bit to torchao 0.18's Float8Linear under the same recipe on the
same inputs (its output and both gradients; torchao is the anchor here only); the layers it
converts and leaves out; under ddp, zero2 and fsdp on 2 ranks equal to single with float8 on the
same micro-batches over 10 steps (and with LoRA over a float8 base), fsdp gathering tensorwise
weights as float8 bytes (half of bf16's); and what it does not compose with yet refused before
launch."""

from __future__ import annotations

import copy

import pytest
import torch
from distributed import run_ranks
from helpers import counted_memory, gpt_tiny, read_records, train_in_process, train_runs
from torch import nn

from shardwise.config.schema import ConfigError
from shardwise.models import build_model
from shardwise.parallel.float8 import E4M3, Float8Linear, convert_to_float8, recipe, to_float8

STEPS = 10
LORA = ("lora.rank=4", "train.lr=0.5")
FLOAT8 = ("train.optimizer=sgd", "train.lr=0.1", "train.warmup_steps=0", "train.micro_batch=4")


def cfg_for(out, strategy: str, world: int, *overrides: str):
    return gpt_tiny(out, strategy, world, *FLOAT8, *overrides, steps=STEPS)


class Block(nn.Module):
    """A block of one linear layer."""

    def __init__(self, layer: nn.Linear) -> None:
        super().__init__()
        self.layer = copy.deepcopy(layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def torchao_linear(layer: nn.Linear, name: str) -> Block:
    ao = pytest.importorskip("torchao.float8")
    block = Block(layer)
    ao.convert_to_float8_training(block, config=ao.Float8LinearConfig.from_recipe_name(name))
    return block


def ours_linear(layer: nn.Linear, name: str) -> Block:
    block = Block(layer)
    assert convert_to_float8(block, "Block", name)["layers"] == 1
    return block


@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_a_float8_linear_equals_torchaos_bit_for_bit(name, weight_dtype, bias):
    """The same casts (dynamic scales from the amax, float64 division, e4m3 / e5m2, saturated; rowwise
    scales rounded down to powers of 2) and the same three _scaled_mm calls: output, input gradient
    and weight gradient identical, on a 3-D input with an outlier (which rowwise confines to its row)."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 96, bias=bias).to(weight_dtype)
    ours, theirs = ours_linear(layer, name), torchao_linear(layer, name)
    x = torch.randn(4, 8, 64, dtype=torch.bfloat16) * 3
    x[1, 2, 5] = 300.0
    grad = torch.randn(4, 8, 96, dtype=torch.bfloat16)
    outs, inputs = [], []
    for module in (ours, theirs):
        xi = x.clone().requires_grad_()
        out = module(xi)
        out.backward(grad)
        outs.append(out)
        inputs.append(xi.grad)
    assert outs[0].dtype == torch.bfloat16 and torch.equal(outs[0], outs[1])
    assert torch.equal(inputs[0], inputs[1])
    assert torch.equal(ours.layer.weight.grad, theirs.layer.weight.grad)
    assert ours.layer.weight.grad.dtype == weight_dtype
    if bias:
        assert torch.equal(ours.layer.bias.grad, theirs.layer.bias.grad)
    # and it is float8, not a bf16 matmul: within e4m3's rounding of it, not equal
    exact = x.float() @ layer.weight.float().t() + (layer.bias.float() if bias else 0)
    assert not torch.equal(outs[0], exact.bfloat16())
    assert (outs[0].float() - exact).norm() / exact.norm() < 0.1


def test_under_autocast_the_weight_is_cast_as_f_linears_then_to_float8():
    """bf16-mixed: an fp32 master weight computes as its bf16 copy does (what zero1/zero2 keep and
    fsdp gathers), so the sharded strategies cast the same float8 weight as single."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 32)
    master, copy16 = ours_linear(layer, "tensorwise"), ours_linear(layer.to(torch.bfloat16), "tensorwise")
    x = torch.randn(16, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = master(x)
    assert torch.equal(mixed, copy16(x.bfloat16()))


def test_rowwise_scales_are_powers_of_2_one_a_row_and_saturate():
    x = torch.tensor([[1.0, -3.0], [1000.0, 0.5]])
    cast = to_float8(x, E4M3, recipe("rowwise"), -1)
    assert cast.scale.shape == (2, 1) and torch.equal(cast.scale.log2(), cast.scale.log2().floor())
    assert (cast.data.float() / cast.scale).sub(x).abs().max() <= 1000 * 2**-4  # e4m3: 3 mantissa bits
    whole = to_float8(torch.tensor([1e6, 1.0]), E4M3, recipe("tensorwise"), None)
    assert whole.data.float().max() == torch.finfo(E4M3).max  # the amax maps to the largest, no inf


def test_the_blocks_linear_layers_convert_and_the_rest_stays_as_it_is():
    """gpt-moe: each block's attention (qkv, proj) in float8, its router and experts not, nor the
    embeddings and head; the state dict's keys unchanged; a layer of a size the kernel cannot take
    (a width not a multiple of 16) left out by name."""
    from shardwise.config.schema import ModelConfig

    model = build_model(ModelConfig(name="gpt-moe", d_model=64, n_head=4, n_layer=2, d_ff=128, seq_len=16,
                                    vocab_size=256, n_experts=4, top_k=2, d_expert=32))
    keys = list(model.state_dict())
    found = convert_to_float8(model, "Block", "tensorwise")
    converted = sorted(name for name, m in model.named_modules() if isinstance(m, Float8Linear))
    assert converted == ["blocks.0.attn.proj", "blocks.0.attn.qkv", "blocks.1.attn.proj", "blocks.1.attn.qkv"]
    assert found == {"recipe": "tensorwise", "layers": 4, "left_out": []} and list(model.state_dict()) == keys
    odd = nn.Sequential(Block(nn.Linear(64, 24)), Block(nn.Linear(24, 64)), Block(nn.Linear(64, 64)))
    assert convert_to_float8(odd, "Block", "rowwise") == {"recipe": "rowwise", "layers": 1,
                                                          "left_out": ["0.layer", "1.layer"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("float8")
    singles = {"single-tensorwise": ("single", "parallel.precision=bf16-true", "parallel.float8=tensorwise"),
               "single-rowwise": ("single", "parallel.precision=bf16-true", "parallel.float8=rowwise"),
               "single-mixed": ("single", "parallel.precision=bf16-mixed", "parallel.float8=rowwise"),
               "single-recompute": ("single", "parallel.precision=bf16-true", "parallel.float8=tensorwise",
                                    "parallel.recompute=blocks"),
               "single-mb2": ("single", "parallel.precision=bf16-true", "parallel.float8=tensorwise",
                              "train.micro_batch=2"),
               "single-lora": ("single", "parallel.precision=bf16-true", "parallel.float8=tensorwise", *LORA),
               "single-mixed-tensorwise": ("single", "parallel.precision=bf16-mixed", "parallel.float8=tensorwise")}
    for name, (strategy, *overrides) in singles.items():
        train_in_process(cfg_for(root / name, strategy, 1, *overrides))
    two = {"ddp-tensorwise": ("ddp", "parallel.precision=bf16-true", "parallel.float8=tensorwise"),
           "zero2-tensorwise": ("zero2", "parallel.precision=bf16-true", "parallel.float8=tensorwise"),
           "fsdp-tensorwise": ("fsdp", "parallel.precision=bf16-true", "parallel.float8=tensorwise"),
           "fsdp-rowwise": ("fsdp", "parallel.precision=bf16-true", "parallel.float8=rowwise"),
           "ddp-mixed": ("ddp", "parallel.precision=bf16-mixed", "parallel.float8=rowwise"),
           "fsdp-lora": ("fsdp", "parallel.precision=bf16-true", "parallel.float8=tensorwise", *LORA),
           "tensor-tensorwise": ("tensor", "parallel.precision=bf16-mixed", "parallel.float8=tensorwise"),
           "tensor-rowwise": ("tensor", "parallel.precision=bf16-mixed", "parallel.float8=rowwise")}
    run_ranks(train_runs, 2, root, two, cfg_for)
    run_ranks(hsdp_run, 4, root)
    run_ranks(train_runs, 4, root, {"fsdp-tp2-tensorwise": ("fsdp", "parallel.tp=2", "parallel.precision=bf16-mixed",
                                                            "parallel.float8=tensorwise")}, cfg_for)
    return root


def hsdp_run(ctx, root) -> None:
    """hsdp on 2 "nodes" of 2 processes (as tests/multinode/test_hsdp.py runs it), micro-batches of 2."""
    import os

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        train_runs(ctx, root, {"hsdp-tensorwise": ("hsdp", "parallel.precision=bf16-true", "parallel.float8=tensorwise",
                                                   "train.micro_batch=2")}, cfg_for)
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]


def losses(run) -> list[float]:
    return [r["loss"] for r in read_records(run)]


@pytest.mark.parametrize("name, single", [("ddp-tensorwise", "single-tensorwise"),
                                          ("zero2-tensorwise", "single-tensorwise"),
                                          ("fsdp-tensorwise", "single-tensorwise"),
                                          ("fsdp-rowwise", "single-rowwise"), ("ddp-mixed", "single-mixed"),
                                          ("single-recompute", "single-tensorwise"),
                                          ("fsdp-lora", "single-lora")])
def test_float8_on_2_ranks_equals_single_with_float8_on_the_same_micro_batches(runs, name, single):
    """The activations' scales are a micro-batch's: single accumulates the two micro-batches of 4
    that the 2 ranks take one each. bf16-true: every strategy holds the same bf16 weights, so they
    agree to the bit; bf16-mixed under ddp too (zero and fsdp hold bf16 copies of what single keeps
    in fp32, and differ from single by bf16's rounding with or without float8). Recomputed blocks
    cast again what they cast the first time."""
    got, want = losses(runs / name), losses(runs / single)
    assert len(got) == STEPS and got == pytest.approx(want, rel=1e-5)
    summary = read_records(runs / name, "summary")[0]
    assert summary["float8"]["layers"] == 8 and summary["float8"]["left_out"] == []
    # fsdp gathers the tensorwise layers' weights as float8 bytes (rowwise: in bf16), LoRA's frozen ones too
    assert summary["float8"].get("gathered_in_float8") == {"fsdp-tensorwise": 8, "fsdp-rowwise": 0,
                                                           "fsdp-lora": 8}.get(name)


def test_hsdp_gathers_in_float8_within_a_node_and_trains_as_single_does_to_bf16s_accumulation(runs):
    """hsdp on 2 nodes of 2: each node gathers the float8 weights among its ranks (the scale's amax
    reduced over them). Single accumulates the 4 micro-batches' bf16 gradients in bf16, rounding at
    each sum, where hsdp sums them in fp32: bf16's rounding of a gradient (2**-8 relative) apart,
    which 10 steps of SGD keep within 1e-3 of the loss (8 of 10 steps differ by 1e-4 here)."""
    got, want = losses(runs / "hsdp-tensorwise"), losses(runs / "single-mb2")
    assert got[0] == want[0] and got == pytest.approx(want, rel=1e-3)
    assert read_records(runs / "hsdp-tensorwise", "summary")[0]["float8"]["gathered_in_float8"] == 8


def test_float8_trains_differently_from_bf16_but_close(runs, tmp_path):
    train_in_process(cfg_for(tmp_path / "bf16", "single", 1, "parallel.precision=bf16-true"))
    got, want = losses(runs / "single-tensorwise"), losses(tmp_path / "bf16")
    assert got != want and got == pytest.approx(want, rel=0.02)


@pytest.mark.parametrize("overrides, words", [
    (("parallel.precision=fp32",), "needs parallel.precision = 'bf16-mixed' or 'bf16-true', not 'fp32'"),
    (("parallel.strategy=pipeline", "launch.nproc=2"), "not parallel.strategy = 'pipeline' with pp = 2"),
    (("parallel.strategy=tensor", "launch.nproc=2", "parallel.sequence_parallel=true"),
     "not with parallel.sequence_parallel yet"),
    (("lora.rank=4", "lora.quantize=nf4"), "not with lora.quantize = 'nf4'"),
    (("model.name=mlp", "data.name=synthetic"), "model.name = 'mlp' has none"),
    (("parallel.float8=blockwise",), "parallel.float8 = 'blockwise'"),
])
def test_what_float8_does_not_compose_with_is_refused_in_one_line(tmp_path, overrides, words):
    from helpers import CONFIGS

    from shardwise.config.load import load_config

    with pytest.raises(ConfigError) as refused:
        load_config(CONFIGS / "gpt-tiny.toml", ["parallel.precision=bf16-mixed", "parallel.float8=tensorwise",
                                                "train.micro_batch=4", *overrides])
    assert words in str(refused.value) and "\n" not in str(refused.value)


def one_units_gather(ctx, root, name: str) -> dict:
    """fsdp (bf16-true) of gpt-tiny, its first block's unit gathered once by hand: the bytes the
    all-gather moved, the float8 weights' shard elements in it, and each gathered float8 weight
    against the whole bf16 weight cast on one rank (rank 0)."""
    from shardwise.trainer import Trainer

    trainer = Trainer(cfg_for(root / name, "fsdp", ctx.world_size, "parallel.precision=bf16-true",
                              f"parallel.float8={name}"), ctx)
    sharding = trainer.strategy.sharded.sharding
    unit = next(u for u in sharding.units if not u.root)
    sharding.free(unit)
    before = sharding.bytes_gathered
    sharding.start_gather(unit)
    sharding.finish_gather(unit)
    moved = sharding.bytes_gathered - before
    layers = unit.float8.layers if unit.float8 is not None else {}
    float8_elements = sum(unit.lengths[i] for i in layers)
    exact = []
    for i, layer in layers.items():  # the whole weight, from the master shards, cast on this rank alone
        shards = [torch.empty_like(unit.shards[i]) for _ in range(ctx.world_size)]
        torch.distributed.all_gather(shards, unit.shards[i].detach().contiguous())
        whole = torch.cat(shards)[: layer.weight.shape[0]]
        want = to_float8(whole.to(torch.bfloat16), E4M3, recipe("tensorwise"), None)
        exact.append(torch.equal(layer.gathered.data.view(torch.uint8), want.data.view(torch.uint8))
                     and torch.equal(layer.gathered.scale, want.scale))
    sharding.free(unit)
    return {"moved": moved, "float8_elements": float8_elements, "exact": exact, "layers": len(layers)}


def test_fsdp_gathers_tensorwise_weights_as_float8_bytes_half_of_bf16s(tmp_path):
    """One block unit's all-gather (input + output, as bytes_gathered counts): the float8 weights'
    part is one byte an element instead of bf16's two, the rest as before; each weight arrives as
    the whole weight's tensorwise cast, bit for bit (its scale from an all-reduced amax)."""
    bf16, float8 = (run_ranks(one_units_gather, 2, tmp_path, name)[0] for name in ("rowwise", "tensorwise"))
    assert float8["layers"] == 4 and bf16["layers"] == 0 and all(float8["exact"])
    world = 2
    assert bf16["moved"] - float8["moved"] == (world + 1) * float8["float8_elements"]  # a byte an element saved
    assert float8["float8_elements"] > 0.9 * (bf16["moved"] / 2 / (world + 1))  # nearly all of a block's bytes


def test_lora_over_a_float8_base_trains_its_adapters_alone(runs):
    """The frozen base computes in float8 (no gradient of its weights is computed), the adapters
    beside it in bf16: the loss falls."""
    got = losses(runs / "single-lora")
    assert got[-1] < got[0]
    assert read_records(runs / "single-lora", "summary")[0]["float8"]["layers"] == 8


def test_the_planner_counts_the_float8_gathers_bytes_and_buffers(tmp_path):
    """fsdp with tensorwise float8 on 2 ranks: the gathered peak the run counts (the root whole, the
    block computing, the next block's gather buffer: its float8 weights a byte each) is what the
    planner predicts, to the byte, and below bf16's; the rest of its memory as predicted (2%); its
    gathers' time shorter than bf16's by the bytes saved."""
    from shardwise.planner.candidates import Candidate
    from shardwise.planner.devices import load_profile
    from shardwise.planner.memory_model import gathers_in_float8, predict_memory
    from shardwise.planner.model import fsdp_gathered_bytes, model_facts, model_shape
    from shardwise.planner.timing import predict_step_time

    candidate = Candidate("fsdp", 2, 1, 1, "bf16-true", "none", 4)
    cases = [(candidate, cfg_for(tmp_path / name, "single", 1, f"parallel.float8={name}",
                                 "parallel.precision=bf16-true")) for name in ("tensorwise", "none")]
    counted = run_ranks(counted_memory, 2, cases)[0]
    for (case, base), got in zip(cases, counted, strict=True):
        facts = model_facts(model_shape(base.model))
        assert got["gathered_peak"] == fsdp_gathered_bytes(facts, 2, base.parallel.sharding.prefetch, True, 2,
                                                           gathers_in_float8(case, base)), base.parallel.float8
        want = predict_memory(case, base)[0]
        for key in ("params", "grads", "optimizer", "activations"):
            assert getattr(want, key) == pytest.approx(got[key], rel=0.02), (base.parallel.float8, key)
    assert counted[0]["gathered_peak"] < counted[1]["gathered_peak"]
    device = load_profile("h100-sxm")
    times = [predict_step_time(case, base, device, 2) for case, base in cases]
    assert times[0].communication_s < times[1].communication_s


def split_layer_casts(ctx, name: str) -> dict:
    """On 2 tp ranks, a float8 layer split as a column-parallel one (its output features) and as a
    row-parallel one (its input features), against the whole layer on one rank; an outlier sits in
    rank 1's half of the weight, which a scale not spanning the split would miss on rank 0."""
    import torch.distributed as dist

    from shardwise.parallel.float8 import Float8Split, float8_linear

    torch.manual_seed(0)
    whole = Block(nn.Linear(64, 64, bias=False))
    whole.layer.weight.data[40, 50] = 30.0  # rows 32.. (column) and columns 32.. (row) are rank 1's
    whole = ours_linear(whole.layer.to(torch.bfloat16), name)
    x = (torch.randn(8, 64) * 2).bfloat16()
    want = whole(x)
    rank, half = ctx.rank, slice(32 * ctx.rank, 32 * ctx.rank + 32)
    group = dist.group.WORLD
    column = float8_linear(x, whole.layer.weight[half].detach(), None, Float8Split(recipe(name), group, True))
    gathered = [torch.empty_like(column) for _ in range(2)]
    dist.all_gather(gathered, column.contiguous())
    row = float8_linear(x[:, half], whole.layer.weight[:, half].detach(), None, Float8Split(recipe(name), group, False))
    summed = row.float()
    dist.all_reduce(summed)
    alone = float8_linear(x, whole.layer.weight[half].detach(), None, Float8Split(recipe(name), None, True))
    return {"column": torch.equal(torch.cat(gathered, dim=1), want), "alone": torch.equal(alone, column),
            "row": ((summed - want.float()).norm() / want.float().norm()).item(), "rank": rank}


@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_a_split_layers_scales_span_its_split(name):
    """Column-parallel: every output column as the whole layer computes it, to the bit (its weight's
    scale spans the split). Row-parallel: the partial outputs, summed, within float8's rounding of
    the whole layer's (the casts are the same; only the sum's order differs)."""
    got = run_ranks(split_layer_casts, 2, name)
    assert all(r["column"] for r in got)
    assert all(r["row"] < 1e-2 for r in got)
    if name == "tensorwise":  # rank 0's weight scaled alone, without rank 1's outlier, casts otherwise
        assert not got[0]["alone"] and got[1]["alone"]


@pytest.mark.parametrize("name, single", [("tensor-tensorwise", "single-mixed-tensorwise"),
                                          ("tensor-rowwise", "single-mixed"),
                                          ("fsdp-tp2-tensorwise", "single-mixed-tensorwise")])
def test_float8_over_tensor_parallel_trains_as_single_does_to_bf16s_rounding(runs, name, single):
    """tensor on 2 ranks and fsdp x tp 2 on 4 (bf16-mixed), on single's micro-batches: every split
    operand cast with its whole tensor's scale (test_a_split_layers_scales_span_its_split), the
    row-parallel layers' partial outputs summed in bf16 where single sums in one matmul. bf16's
    rounding then differs, as without float8: the same 10 SGD steps at lr 0.1 differ from single by
    6e-5 of the loss under tensor without float8 (7.5e-5 in bf16-true), and float8 turns a value a
    bf16 rounding apart into one a float8 step apart (16 times bf16's): 1.1e-4 here with tensorwise.
    The first step's loss within 5e-5, every step's within 5e-4."""
    got, want = losses(runs / name), losses(runs / single)
    assert len(got) == STEPS and got[0] == pytest.approx(want[0], rel=5e-5)
    assert got == pytest.approx(want, rel=5e-4)
    assert read_records(runs / name, "summary")[0]["float8"]["layers"] == 8
