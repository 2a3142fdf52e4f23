"""QLoRA: the target layers' frozen weights stored in NF4 (nf4.py), adapters beside them in the
compute dtype; trained under ddp, zero1, zero2, fsdp and hsdp as on one device, fsdp holding half the 4-bit
base on each of two ranks, pretrained weights quantized as they load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from helpers import CONFIGS, SGD, assert_same_training, gpt_tiny, in_process, read_records, train_runs
from safetensors.torch import load_file, save_model

from shardwise.cli import main
from shardwise.config.load import load_config
from shardwise.dist import DistContext
from shardwise.lora import apply_lora
from shardwise.models import build_model
from shardwise.nf4 import BLOCK, LEVELS, NF4Linear, dequantize, quantize, quantize_layers, row_bytes
from shardwise.trainer import Trainer

STEPS = 6
ADAPTED = ("attn.qkv", "attn.proj", "mlp.up", "mlp.down")


def test_a_row_is_stored_in_4_127_bits_a_weight_each_within_half_a_level_of_its_block():
    torch.manual_seed(0)
    weight = torch.randn(6, 8192) * 0.02
    weight[2, :BLOCK] = 0  # a block of zeros stays zeros
    packed = quantize(weight)
    assert packed.dtype == torch.uint8 and packed.shape == (6, row_bytes(8192))
    assert 4.12 < row_bytes(8192) * 8 / 8192 < 4.14  # QLoRA's 4.127: indices, int8 scales, a few fp32
    restored = dequantize(packed, 8192, torch.float32)
    blocks, got = weight.view(6, -1, BLOCK), restored.view(6, -1, BLOCK)
    absmax = blocks.abs().amax(dim=2, keepdim=True)
    widest_gap = max(b - a for a, b in zip(LEVELS, LEVELS[1:], strict=False))
    # Half the widest gap between levels, of the block's scale, and the scale's own int8 rounding.
    assert ((got - blocks).abs() <= absmax * (widest_gap / 2 + 0.01)).all()
    assert restored[2, :BLOCK].abs().max() == 0
    assert 0.08 < ((restored - weight).norm() / weight.norm()).item() < 0.1  # NF4's usual error on normal weights
    assert torch.equal(quantize(weight[3:5]), packed[3:5])  # a row's bytes are its own: rows shard as they are


def test_an_nf4_layer_keeps_its_name_adapter_and_hook_and_computes_with_the_dequantized_weight():
    torch.manual_seed(0)
    model = build_model(load_config(None).model)
    names = apply_lora(model, 4, 8.0, 0.0, None, seed=0)
    layer = model.blocks[0].attn.qkv
    torch.nn.init.normal_(layer.lora.B)
    x, weight = torch.randn(3, 64), layer.weight.detach().clone()
    quantize_layers(model, names, torch.float32)
    assert isinstance(layer, NF4Linear) and layer is model.blocks[0].attn.qkv
    assert layer.weight.dtype == torch.uint8 and not layer.weight.requires_grad
    stored = dequantize(layer.weight, 64, torch.float32)
    torch.testing.assert_close(layer(x), x @ stored.T + 2.0 * (x @ layer.lora.A.T @ layer.lora.B.T))
    assert 0.05 < ((stored - weight).norm() / weight.norm()).item() < 0.12
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"blocks.{b}.{m}.lora.{x}" for b in (0, 1) for m in ADAPTED for x in "AB"}


def cfg_for(out: Path, strategy: str, world: int, *overrides: str):
    return gpt_tiny(out, strategy, world, "train.micro_batch=4", *SGD, "train.lr=0.5", "lora.rank=4",
                    "lora.alpha=8", "lora.quantize=nf4", *overrides, steps=STEPS)


@pytest.fixture(scope="module")
def qlora_runs(tmp_path_factory) -> tuple[Path, Path, dict]:
    """A pretrained gpt-tiny; QLoRA on it under single (its packed weights kept), and under ddp,
    zero1, zero2, fsdp and hsdp (one node: sharded over it) on two ranks; and fsdp from the seed's
    initial weights."""
    root = tmp_path_factory.mktemp("qlora")
    torch.manual_seed(7)
    pretrained = root / "pretrained.safetensors"
    save_model(build_model(load_config(CONFIGS / "gpt-tiny.toml").model), str(pretrained))
    weights = f"model.weights={pretrained}"
    packed = in_process(_train_single, root, weights)
    run_ranks(train_runs, 2, root, {"ddp": ("ddp", weights), "zero1": ("zero1", weights), "zero2": ("zero2", weights),
                                    "fsdp": ("fsdp", weights), "hsdp": ("hsdp", weights), "fsdp-init": ("fsdp",)},
              cfg_for)
    return root, pretrained, packed


def _train_single(ctx: DistContext, root: Path, weights: str) -> dict:
    cfg = cfg_for(root / "single", "single", 1, weights, f"train.checkpoint_every={STEPS}")
    cfg.save(root / "single" / "config.toml")  # as `shardwise train` writes it
    trainer = Trainer(cfg, ctx)
    trainer.fit()
    return {n: p.detach().clone() for n, p in trainer.strategy.module.named_parameters() if p.dtype == torch.uint8}


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp", "hsdp"])
def test_qlora_trains_as_one_device_does(qlora_runs, strategy):
    root, _, _ = qlora_runs
    assert_same_training(root / strategy, root / "single", STEPS)


def test_pretrained_weights_are_quantized_as_they_load_and_the_final_weights_merge_onto_the_4_bit_base(qlora_runs):
    root, pretrained, packed = qlora_runs
    plain = load_file(str(pretrained))
    assert set(packed) == {f"blocks.{b}.{m}.weight" for b in (0, 1) for m in ADAPTED}
    for name, held in packed.items():
        assert torch.equal(held, quantize(plain[name])), name
    final = load_file(str(root / "single" / "model.safetensors"))
    assert final["blocks.0.mlp.up.weight"].dtype == torch.float32 and ".lora." not in "".join(final)
    base = dequantize(packed["blocks.0.mlp.up.weight"], 64, torch.float32)
    update = final["blocks.0.mlp.up.weight"] - base  # the adapters' B A, merged onto the dequantized base
    assert update.abs().max() > 1e-4 and torch.linalg.matrix_rank(update, atol=1e-6) <= 4
    assert torch.equal(final["blocks.0.ln_1.weight"], plain["blocks.0.ln_1.weight"])  # not adapted: as loaded
    # Merged from the last checkpoint onto the pretrained weights quantized again: the run's own model.
    assert main(["export", str(root / "single"), str(root / "merged.safetensors"), "--merged"]) == 0
    merged = load_file(str(root / "merged.safetensors"))
    assert merged.keys() == final.keys() and all(merged[k].equal(final[k]) for k in final)


def test_fsdp_holds_half_the_4_bit_base_on_each_rank(qlora_runs):
    root, _, packed = qlora_runs
    single = read_records(root / "single")[-1]["memory"]["params"]
    # gpt-tiny's fp32 parameters, less its adapted weights (in 64 features, but mlp.down's 256), plus
    # their NF4 bytes (64 features a row: 32 bytes of indices, 12 of scale and factors) and the adapters
    plain = sum(t.numel() * 4 for t in load_file(str(root / "pretrained.safetensors")).values())
    adapted = {f"{m}": (rows, 256 if m == "mlp.down" else 64) for m, rows in
               (("attn.qkv", 192), ("attn.proj", 64), ("mlp.up", 256), ("mlp.down", 64))}
    floats = 2 * sum(4 * rows * features for rows, features in adapted.values())
    adapters = 2 * sum(4 * 4 * (rows + features) for rows, features in adapted.values())
    nf4 = sum(t.numel() for t in packed.values())
    assert nf4 == 2 * sum(rows * row_bytes(features) for rows, features in adapted.values())
    assert single == plain - floats + nf4 + adapters
    for run in ("fsdp", "fsdp-init"):
        ranks = [m["params"] for m in read_records(root / run)[-1]["memory_by_rank"]]
        assert all(held <= 0.55 * single for held in ranks), (run, ranks, single)


def test_fsdp_from_initial_values_quantizes_each_block_as_it_is_made(qlora_runs):
    root, _, _ = qlora_runs
    records = read_records(root / "fsdp-init")
    assert len(records) == STEPS and records[-1]["loss"] < records[0]["loss"]


@pytest.mark.parametrize(("overrides", "expected"), [
    (("parallel.strategy=tensor", "launch.nproc=2"), "lora.quantize = 'nf4': the 4-bit base is held under single, "
                                                     "ddp, zero1, zero2, fsdp, hsdp"),
    (("lora.rank=0",), "lora.quantize = 'nf4': a quantized base trains through adapters; set lora.rank > 0"),
    (("model.d_model=96", "model.n_head=2"), "lora.quantize = 'nf4': blocks.0.attn.qkv has 96 input features"),
    (("lora.quantize=int4",), "lora.quantize = 'int4'"),
], ids=["tensor", "no-adapters", "narrow", "unknown"])
def test_bad_qlora_settings_stop_the_cli_before_any_worker_starts(tmp_path, capsys, overrides, expected):
    sets = [arg for each in ("lora.rank=4", "lora.quantize=nf4", *overrides) for arg in ("--set", each)]
    assert main(["train", str(CONFIGS / "gpt-tiny.toml"), "--out", str(tmp_path / "run"), *sets]) == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_nf4_layer_keeps_no_dequantized_weight_for_backward_and_passes_the_input_its_gradient():
    torch.manual_seed(0)
    layer = torch.nn.Linear(128, 96, bias=True)
    plain = torch.nn.Linear(128, 96, bias=True)
    quantize_layers(torch.nn.ModuleDict({"layer": layer}), ["layer"], torch.float32)
    plain.weight.data, plain.bias.data = dequantize(layer.weight, 128, torch.float32), layer.bias.data.clone()
    plain.requires_grad_(False)
    saved = []
    x = torch.randn(5, 128, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = layer(x)
    assert [t.dtype for t in saved] == [torch.uint8]  # the packed weight alone: no float copy of it
    (grad,) = torch.autograd.grad(out.square().sum(), x)
    x2 = x.detach().clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(plain(x2).square().sum(), x2)
    torch.testing.assert_close(grad, expected)


def _nf4_held(ctx: DistContext, root: Path) -> tuple[int, int]:
    """fsdp QLoRA on this world, gpt-tiny 256 wide: the bytes of this rank's NF4 shards, and the
    weights they quantize (the whole model's)."""
    trainer = Trainer(cfg_for(root, "fsdp", ctx.world_size, "model.d_model=256", "model.n_head=4", "train.steps=2",
                              "train.micro_batch=2"), ctx)
    trainer.fit()
    held = sum(unit.shard_buffer.nbytes for unit in trainer.strategy.sharding.units if unit.full_dtype == torch.uint8)
    layers = [m for m in trainer.strategy.module.modules() if isinstance(m, NF4Linear)]
    quantized = sum(m.in_features * m.out_features for m in layers)
    return held, quantized


def test_fsdp_on_4_ranks_holds_a_quarter_of_at_most_0_6_bytes_per_quantized_weight(tmp_path):
    ranks = run_ranks(_nf4_held, 4, tmp_path)
    quantized = ranks[0][1]
    total = sum(held for held, _ in ranks)
    assert total <= 0.6 * quantized  # 4 bits, the int8 scales and each row's fp32 factors (256 and 1024 wide)
    assert all(held <= total / 4 + 4 * 1100 for held, _ in ranks)  # a quarter each, and a padded row per tensor


def _qlora_and_lora(ctx: DistContext, root: Path) -> dict[str, float]:
    """200 steps of configs/gpt-tiny.toml in bf16-mixed with rank-8 adapters, over its weights in
    fp32 and in NF4: each run's validation loss."""
    losses = {}
    for name, stored in (("lora", "none"), ("qlora", "nf4")):
        cfg = gpt_tiny(root / name, "single", 1, "parallel.precision=bf16-mixed", "lora.rank=8", "lora.alpha=16",
                       f"lora.quantize={stored}", steps=200)
        losses[name] = Trainer(cfg, ctx).fit()["val_loss"]
    return losses


@pytest.mark.slow
def test_qlora_ends_within_3_percent_of_lora_after_200_steps(tmp_path):
    losses = in_process(_qlora_and_lora, tmp_path)
    assert abs(losses["qlora"] - losses["lora"]) <= 0.03 * losses["lora"], losses
