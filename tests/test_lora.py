"""LoRA: adapters beside the frozen model's projections train as one device trains them, under
every strategy that takes them, and the final weights are the plain model with the updates merged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from helpers import (
    CONFIGS,
    SGD,
    Crash,
    assert_same_training,
    crash_at,
    gpt_tiny,
    in_process,
    losses,
    read_records,
    train_runs,
)
from safetensors.torch import load_file

from shardwise.cli import main
from shardwise.config.load import load_config
from shardwise.dist import DistContext
from shardwise.lora import LoraError, apply_lora
from shardwise.materialise import init_context
from shardwise.models import build_model
from shardwise.strategies.classes import make_strategy
from shardwise.trainer import Trainer

STEPS, SAVED_AT = 10, 5
LORA = ("lora.rank=4", "lora.alpha=8")
LLAMA = ("model.name=hf-llama", "model.n_head=4", "model.n_kv_head=2")  # grouped-query attention: 2 heads share k, v
LLAMA_RUNS = {"ddp": ("ddp",), "zero2": ("zero2",), "fsdp": ("fsdp",), "fsdp-tp2": ("fsdp", "parallel.tp=2"),
              "tensor": ("tensor",), "pipeline": ("pipeline", "parallel.pipeline.micro_batches=2")}


def cfg_for(out: Path, strategy: str, world: int, *overrides: str):
    """gpt-tiny with rank-4 adapters on its four projections, SGD at a rate the adapters move by."""
    return gpt_tiny(out, strategy, world, "train.micro_batch=4", *SGD, "train.lr=0.5", *LORA, *overrides, steps=STEPS)


def tiny_gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(load_config(None).model)


def test_adapters_start_as_the_model_add_their_low_rank_update_and_alone_get_gradients():
    model, tokens = tiny_gpt(), torch.randint(0, 256, (2, 16))
    before = model(tokens)
    adapted = apply_lora(model, 4, 8.0, 0.0, None, seed=0)
    layers = ("attn.qkv", "attn.proj", "mlp.up", "mlp.down")  # the GPT plan's regions' layers
    assert adapted == [f"blocks.{b}.{layer}" for b in (0, 1) for layer in layers]
    assert torch.equal(model(tokens), before)  # B starts at zero
    qkv = model.blocks[0].attn.qkv
    torch.nn.init.normal_(qkv.lora.B)
    x = torch.randn(3, 64)
    torch.testing.assert_close(qkv(x), x @ qkv.weight.T + 2.0 * (x @ qkv.lora.A.T @ qkv.lora.B.T))  # no bias
    model(tokens).sum().backward()
    trained = {name for name, p in model.named_parameters() if p.grad is not None}
    assert trained == {f"{name}.lora.{m}" for name in adapted for m in "AB"}


def test_a_meta_built_models_adapters_get_the_values_a_real_ones_do():
    real = tiny_gpt()
    apply_lora(real, 4, 8.0, 0.0, None, seed=3)
    with init_context():
        meta = build_model(load_config(None).model)
    made = dict(in_process(_wrap_single, meta).named_parameters())
    adapters = [name for name, _ in real.named_parameters() if ".lora." in name]
    assert len(adapters) == 16
    for name in adapters:
        assert torch.equal(made[name], dict(real.named_parameters())[name]), name


def _wrap_single(ctx: DistContext, model: torch.nn.Module) -> torch.nn.Module:
    cfg = load_config(None, ["train.seed=3", *LORA])
    return make_strategy(cfg.parallel, ctx, cfg.train.seed, lora=cfg.lora).wrap(model)


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory) -> Path:
    """single on one rank; ddp, zero2, fsdp, a 2-stage pipeline, tensor tp2, fsdp over tp2, PyTorch's
    DDP and FSDP2 and hsdp (one node: sharded over it) on two, all with adapters; a transformers
    Llama's under single and each of LLAMA_RUNS."""
    root = tmp_path_factory.mktemp("lora")
    base = in_process(_train_single, root)
    in_process(lambda ctx: Trainer(cfg_for(root / "single-llama", "single", 1, *LLAMA), ctx).fit())
    run_ranks(train_runs, 2, root, {"ddp": ("ddp",), "zero2": ("zero2",), "fsdp": ("fsdp",),
                                    "pipeline": ("pipeline", "parallel.pipeline.micro_batches=2"),
                                    "tensor": ("tensor",), "fsdp-tp2": ("fsdp", "parallel.tp=2"),
                                    "ddp-native": ("ddp-native",), "fsdp-native": ("fsdp-native",),
                                    "hsdp": ("hsdp",), "tensor-sp": ("tensor", "parallel.sequence_parallel=true"),
                                    **{f"{name}-llama": (*run, *LLAMA) for name, run in LLAMA_RUNS.items()}},
              cfg_for)
    run_ranks(_crash_then_resume, 2, root / "fsdp-resumed")
    return root, base


def _crash_then_resume(ctx: DistContext, out: Path) -> None:
    """fsdp with adapters, a checkpoint at step 5, killed at 6, resumed."""
    with pytest.raises(Crash):
        crash_at(Trainer(cfg_for(out, "fsdp", 2, f"train.checkpoint_every={SAVED_AT}"), ctx), SAVED_AT + 1).fit()
    Trainer(cfg_for(out, "fsdp", 2, f"train.checkpoint_every={SAVED_AT}", "run.resume=true"), ctx).fit()


def _train_single(ctx: DistContext, root: Path) -> tuple[dict, dict]:
    """single, and its model's frozen weights before and after training."""
    trainer = Trainer(cfg_for(root / "single", "single", 1), ctx)
    frozen = {n: p.detach().clone() for n, p in trainer.strategy.module.named_parameters() if not p.requires_grad}
    trainer.fit()
    after = {n: p.detach().clone() for n, p in trainer.strategy.module.named_parameters() if not p.requires_grad}
    return frozen, after


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "fsdp", "pipeline", "tensor", "fsdp-tp2", "ddp-native",
                                      "fsdp-native", "hsdp", "tensor-sp"])
def test_lora_trains_as_one_device_does_under_every_strategy(lora_runs, strategy):
    root, _ = lora_runs
    assert_same_training(root / strategy, root / "single", STEPS)


@pytest.mark.parametrize("strategy", list(LLAMA_RUNS))
def test_lora_on_a_transformers_llama_trains_as_one_device_does(lora_runs, strategy):
    """Adapters on its seven projections: under tensor tp2 q, k, v, gate and up column-split (k and v
    over fewer heads), o and down row-split; over pp2 its layers in two stages; sharded under the rest."""
    root, _ = lora_runs
    assert_same_training(root / f"{strategy}-llama", root / "single-llama", STEPS)


def test_fsdp_shards_the_frozen_model_and_resumes_a_lora_run_bit_for_bit(lora_runs):
    root, _ = lora_runs
    single = read_records(root / "single")[-1]["memory"]["params"]
    fsdp = [m["params"] for m in read_records(root / "fsdp")[-1]["memory_by_rank"]]
    zero2 = [m["params"] for m in read_records(root / "zero2")[-1]["memory_by_rank"]]
    assert all(held <= 0.55 * single for held in fsdp), (fsdp, single)  # half the frozen model each, and padding
    assert all(held >= single for held in zero2)  # zero1 and zero2 hold the whole model: nothing to shard of it
    assert losses(root / "fsdp-resumed") == losses(root / "fsdp")  # the same computation: exactly
    resumed, straight = (load_file(str(root / run / "model.safetensors")) for run in ("fsdp-resumed", "fsdp"))
    assert resumed.keys() == straight.keys() and all(torch.equal(resumed[k], straight[k]) for k in straight)


def test_a_lora_checkpoint_holds_what_trains_and_refuses_another_kind_of_run(lora_runs, capsys):
    root, _ = lora_runs
    run = root / "fsdp-resumed"
    manifest = json.loads((run / "checkpoints" / f"step-{SAVED_AT:08d}" / "manifest.json").read_text())
    adapters = {f"blocks.{b}.{layer}.lora.{m}" for b in (0, 1) for layer in ("attn.qkv", "attn.proj", "mlp.up",
                                                                              "mlp.down") for m in "AB"}
    assert set(manifest["shapes"]) == adapters
    assert manifest["lora"] == {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": None, "train": None,
                                "quantize": "none"}
    for sets, expected in ((("run.resume=true",), "holds LoRA adapters (rank 4); this run trains every parameter"),
                           (("run.resume=true", "lora.rank=8"), "holds adapters of rank 4 on the family's default "
                                                                "targets (training no module whole); this run asks "
                                                                "for rank 8")):
        args = [arg for each in sets for arg in ("--set", each)]
        assert main(["train", str(CONFIGS / "gpt-tiny.toml"), "--out", str(run), *args]) == 2
        assert expected in capsys.readouterr().err


def test_adapters_on_pretrained_weights_start_from_them_and_resume_onto_them(lora_runs, tmp_path):
    root, _ = lora_runs
    pretrained = root / "single" / "model.safetensors"  # a model to fine-tune: the first run's, merged
    straight, resumed = in_process(_pretrained_runs, tmp_path, pretrained)
    assert straight["blocks.1.mlp.down.weight"].equal(load_file(str(pretrained))["blocks.1.mlp.down.weight"])
    # The merged model written from the last checkpoint (step 4, the run's end) is the run's own.
    assert main(["export", str(tmp_path / "resumed"), str(tmp_path / "merged.safetensors"), "--merged"]) == 0
    merged, final = (load_file(str(p)) for p in (tmp_path / "merged.safetensors", tmp_path / "resumed" /
                                                                                   "model.safetensors"))
    assert merged.keys() == final.keys() and all(merged[k].equal(final[k]) for k in final)
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    assert resumed.keys() == straight.keys() and all(torch.equal(resumed[k], straight[k]) for k in straight)


def _pretrained_runs(ctx: DistContext, root: Path, weights: Path) -> tuple[dict, dict]:
    """4 steps of adapters on `weights` straight, and killed after a checkpoint at 2 and resumed;
    each run's frozen model at the end."""
    def cfg(out: Path, *overrides: str):
        return cfg_for(out, "single", 1, f"model.weights={weights}", "train.steps=4", *overrides)

    straight = Trainer(cfg(root / "straight"), ctx)
    straight.fit()
    cfg(root / "resumed").save(root / "resumed" / "config.toml")  # as `shardwise train` writes it
    with pytest.raises(Crash):
        crash_at(Trainer(cfg(root / "resumed", "train.checkpoint_every=2"), ctx), 3).fit()
    resumed = Trainer(cfg(root / "resumed", "train.checkpoint_every=2", "run.resume=true"), ctx)
    resumed.fit()
    return [{n: p.detach().clone() for n, p in run.strategy.module.named_parameters()} for run in (straight, resumed)]


def test_the_model_stays_frozen_and_the_final_weights_merge_the_updates(lora_runs):
    root, (before, after) = lora_runs
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    final = load_file(str(root / "single" / "model.safetensors"))
    assert not any(".lora." in name for name in final)  # the plain model's names: the updates merged in
    moved = final["blocks.0.attn.qkv.weight"] - before["blocks.0.attn.qkv.weight"]
    assert moved.abs().max() > 1e-4  # the adapters trained and their update is in the weight
    assert torch.equal(final["blocks.0.ln_1.weight"], before["blocks.0.ln_1.weight"])  # not adapted: as it was


@pytest.mark.parametrize(("overrides", "expected"), [
    (("lora.targets=[\"attn.qkv\", \"wq\"]",), "lora.targets: 'wq' matches no module of GPT; its linear layers are "
                                               "named down, head, proj, qkv, up"),
    (("lora.rank=65",), "lora.rank = 65: must be at least 1 and at most blocks.0.attn.qkv's smaller dimension"),
    (("lora.rank=-1",), "lora.rank = -1: must be >= 0"),
    (("lora.dropout=1.0",), "lora.dropout = 1.0: must be in [0, 1)"),
    (("parallel.strategy=param-server", "launch.nproc=3"), "not under parallel.strategy = 'param-server'"),
], ids=["target", "rank", "negative", "dropout", "param-server"])
def test_bad_lora_settings_stop_the_cli_before_any_worker_starts(tmp_path, capsys, overrides, expected):
    sets = [arg for override in ("lora.rank=4", *overrides) for arg in ("--set", override)]
    assert main(["train", str(CONFIGS / "gpt-tiny.toml"), "--out", str(tmp_path / "run"), *sets]) == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_target_that_is_not_a_linear_layer_is_named():
    with pytest.raises(LoraError, match="ln_1 is a LayerNorm; adapters go beside nn.Linear layers"):
        apply_lora(tiny_gpt(), 4, 8.0, 0.0, ["ln_1"], seed=0)
    with pytest.raises(LoraError, match="lora.train: 'classifier' matches no module of GPT"):
        apply_lora(tiny_gpt(), 4, 8.0, 0.0, None, seed=0, train=["classifier"])
    model = tiny_gpt()
    apply_lora(model, 4, 8.0, 0.0, ["attn.qkv"], seed=0, train=["ln_f"])  # trained whole beside the adapters
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        "ln_f.weight", "ln_f.bias", "blocks.0.attn.qkv.lora.A", "blocks.0.attn.qkv.lora.B",
        "blocks.1.attn.qkv.lora.A", "blocks.1.attn.qkv.lora.B"}


def tiny_llama():
    """A transformers Llama with grouped-query attention (2 query heads, 1 key/value head), byte-sized."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(1)
    return AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
        tie_word_embeddings=False))


def test_our_adapters_compute_and_differentiate_as_peft_does_on_a_transformers_llama():
    import copy

    from peft import LoraConfig, get_peft_model

    ours = tiny_llama()
    theirs = copy.deepcopy(ours)
    adapted = apply_lora(ours, 4, 8.0, 0.0, None, seed=0)
    assert len(adapted) == 14  # q, k, v, o, gate, up, down in each of the 2 layers
    theirs = get_peft_model(theirs, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=adapted))
    generator = torch.Generator().manual_seed(2)
    for name in adapted:  # the same adapters in both, B not zero so that the update counts
        adapter, layer = ours.get_submodule(f"{name}.lora"), theirs.base_model.model.get_submodule(name)
        with torch.no_grad():
            adapter.B.copy_(torch.randn(adapter.B.shape, generator=generator) * 0.1)
            layer.lora_A["default"].weight.copy_(adapter.A)
            layer.lora_B["default"].weight.copy_(adapter.B)
    tokens = torch.randint(0, 256, (2, 32), generator=generator)
    logits = [model(tokens).logits for model in (ours, theirs)]
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-6)
    for each in logits:
        each.float().logsumexp(-1).mean().backward()
    for name in adapted:
        adapter, layer = ours.get_submodule(f"{name}.lora"), theirs.base_model.model.get_submodule(name)
        torch.testing.assert_close(adapter.A.grad, layer.lora_A["default"].weight.grad, rtol=0, atol=1e-6)
        torch.testing.assert_close(adapter.B.grad, layer.lora_B["default"].weight.grad, rtol=0, atol=1e-6)


def test_the_peft_export_and_the_merged_exports_give_our_final_models_logits(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    tiny_llama().save_pretrained(base)
    logits, tokens = in_process(_llama_lora_run, tmp_path / "run", base)
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "peft")]) == 0
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "merged"), "--merged"]) == 0  # a directory
    with torch.no_grad():
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "peft")(tokens).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run")(tokens).logits
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(tokens).logits
    torch.testing.assert_close(peft, logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(merged, logits, rtol=0, atol=1e-5)
    assert torch.equal(exported, merged)  # from the checkpoint and the pretrained files: the run's own model
    assert main(["export", str(tmp_path / "base"), str(tmp_path / "none")]) == 1  # no checkpoint to export


def _llama_lora_run(ctx: DistContext, out: Path, base: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Adapters on the pretrained Llama at `base` for 4 steps, a checkpoint at the end; the final
    model's logits on some tokens."""
    cfg = cfg_for(out, "single", 1, "model.name=hf-llama", f"model.hf_config={base / 'config.json'}",
                  f"model.weights={base}", "train.steps=4", "train.checkpoint_every=4")
    cfg.save(out / "config.toml")  # as `shardwise train` writes it
    trainer = Trainer(cfg, ctx)
    trainer.fit()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return trainer.model(tokens), tokens
