"""Any transformers causal LM trains through `shardwise train --hf-config`, with no family table of
shardwise's: Qwen3, Gemma 3 and Phi-3, each saved by `save_pretrained` as a user would bring it,
split as its own transformers plans say (fsdp x tp 2 on 4 processes; 2 pipeline stages) as under
single, each run's directory a model `from_pretrained` loads with no key missing or left over and
the run's own logits; and what cannot work yet is refused before launch, in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO, assert_states_close, read_records, train_in_process
from safetensors.torch import load_file

from shardwise import cli
from shardwise.checkpoint import consolidate
from shardwise.config.load import load_config
from shardwise.models import build_model

os.environ["HF_HUB_OFFLINE"] = "1"

STEPS = 4
TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0)


def tiny_config(model_type: str):
    """`model_type`'s config class with TINY's sizes (its own defaults for everything else)."""
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **TINY)
    if model_type == "phi3":  # one head width: Phi-3 computes it from the hidden size
        del config.head_dim
    return config


FAMILIES = ("qwen3", "gemma3_text", "phi3")
# Each family split over tp as its own base_model_tp_plan says, under fsdp x tp 2 on 4 processes
# (Qwen3's and Gemma 3's per-head q and k norms whole on each rank, their gradients summed over tp;
# Phi-3's fused projections split on their own, their outputs gathered and attention computed whole
# between them), and cut into 2 pipeline stages as its base_model_pp_plan says: Qwen3's sharded by
# fsdp, Gemma 3's on 1F1B, Phi-3's on ZB-H1 (its backward split in two).
RUNS = ("fsdp-tp2", "pp2")
FLAGS = {"fsdp-tp2": ("--strategy", "fsdp", "--nproc", "4", "--tp", "2"),
         ("qwen3", "pp2"): ("--strategy", "fsdp", "--nproc", "2", "--pp", "2"),
         ("gemma3_text", "pp2"): ("--strategy", "pipeline", "--nproc", "2"),
         ("phi3", "pp2"): ("--strategy", "pipeline", "--nproc", "2", "--set", "parallel.pipeline.schedule=zb-h1")}


def flags(family: str, run: str) -> tuple[str, ...]:
    return (*FLAGS.get(run, ()), *FLAGS.get((family, run), ()), *(("--set", "parallel.pipeline.micro_batches=2")
                                                                   if run == "pp2" else ()))


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> dict[str, Path]:
    """Each family as `save_pretrained` writes it, randomly initialised."""
    import transformers

    root = tmp_path_factory.mktemp("pretrained")
    torch.manual_seed(1)
    for family in FAMILIES:
        transformers.AutoModelForCausalLM.from_config(tiny_config(family)).save_pretrained(root / family)
    return {family: root / family for family in FAMILIES}


def train_args(directory: Path, out: Path, *more: str) -> list[str]:
    return ["train", "--hf-config", str(directory), "--weights", str(directory), "--set", "data.name=synthetic-tokens",
            "--set", "model.seq_len=32", "--set", "train.global_batch=4", "--set", "train.micro_batch=2",
            "--set", "train.optimizer=sgd", "--set", "train.lr=0.1", "--set", "train.eval_every=0",
            "--set", "train.eval_batches=1", "--steps", str(STEPS), "--checkpoint-every", str(STEPS),
            "--out", str(out), *more]


@pytest.fixture(scope="module")
def runs(pretrained, tmp_path_factory) -> dict[tuple[str, str], Path]:
    """Each family's RUNS through the command (all at once: most of each is starting up), and under
    single in this process from the config the command builds."""
    root = tmp_path_factory.mktemp("runs")
    out = {(family, run): root / family / run for family in FAMILIES for run in (*RUNS, "single")}
    commands = [subprocess.Popen([sys.executable, "-m", "shardwise.cli", *train_args(
        pretrained[family], out[family, run], *flags(family, run))], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for family in FAMILIES for run in RUNS]
    for command in commands:
        _, err = command.communicate(timeout=300)
        assert command.returncode == 0, err
    for family in FAMILIES:
        args = cli.parser().parse_args(train_args(pretrained[family], out[family, "single"], "--strategy", "single"))
        train_in_process(cli._train_config(args))
    return out


@pytest.mark.parametrize("family, run", [(family, run) for family in FAMILIES for run in RUNS])
def test_a_family_of_no_table_of_ours_trains_split_by_its_own_plans_as_under_single(runs, family, run):
    ours_records, single = (read_records(runs[family, name]) for name in (run, "single"))
    assert [r["step"] for r in ours_records] == list(range(1, STEPS + 1))
    for ours, theirs in zip(ours_records, single, strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
    assert load_config(runs[family, run] / "config.toml").model.name == "hf"  # no family of ours
    got, want = (load_file(str(runs[family, name] / "model.safetensors")) for name in (run, "single"))
    assert got.keys() == want.keys()
    assert_states_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family, run", [(family, run) for family in FAMILIES for run in RUNS])
def test_the_run_directory_loads_in_transformers_with_no_key_missing_and_the_runs_logits(runs, pretrained, tmp_path,
                                                                                         family, run):
    from transformers import AutoModelForCausalLM

    directory = runs[family, run]
    loaded, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    consolidate(directory, tmp_path / "state.safetensors")  # what the run trained, as shardwise holds it
    ours = build_model(load_config(directory / "config.toml").model)
    ours.load_state_dict(load_file(str(tmp_path / "state.safetensors")))
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours.eval()(tokens)
        torch.testing.assert_close(loaded.eval()(tokens).logits, expected, rtol=1e-5, atol=1e-5)
        before = AutoModelForCausalLM.from_pretrained(pretrained[family]).eval()(tokens).logits
    assert not torch.allclose(before, expected, atol=1e-4)  # it trained


@pytest.mark.parametrize("family, flags, words", [
    # Phi-3's plan gathers its fused projections' outputs, which take the whole sequence
    ("phi3", ["--strategy", "tensor", "--nproc", "2", "--tp", "2", "--set", "parallel.sequence_parallel=true"],
     "phi3's plan splits 'self_attn.qkv_proj' on its own, which takes its whole input; sequence parallel does not"),
    ("phi3", ["--strategy", "tensor", "--nproc", "2", "--tp", "2", "--set", "lora.rank=4"],
     "lora.targets: lm.model.layers.0.self_attn.o_proj is split over tp on its own (its family's plan)"),
    ("qwen3", ["--strategy", "fsdp", "--nproc", "2", "--set", "parallel.cp=2"], "model.name = 'hf' has no plan yet"),
])
def test_what_needs_a_plan_is_refused_before_launch_in_one_line(pretrained, tmp_path, capsys, family, flags, words):
    out = tmp_path / "run"
    assert cli.main(train_args(pretrained[family], out, *flags)) == 2
    error = capsys.readouterr().err
    assert error.startswith("shardwise train: config error: ") and words in error and error.count("\n") == 1
    assert not out.exists()


def test_a_family_transformers_does_not_build_as_a_causal_lm_or_cannot_build_is_refused(tmp_path, capsys):
    vit = tmp_path / "vit" / "config.json"
    vit.parent.mkdir()
    vit.write_text(json.dumps({"model_type": "vit"}))
    assert cli.main(["train", "--hf-config", str(vit), "--out", str(tmp_path / "a")]) == 2
    assert "model_type 'vit' is not a family transformers 5." in capsys.readouterr().err
    bert = tmp_path / "bert.json"  # 64 wide, 12 heads (the class's default): transformers refuses it
    bert.write_text(json.dumps({"model_type": "bert", "hidden_size": 64, "is_decoder": True}))
    assert cli.main(["train", "--hf-config", str(bert), "--out", str(tmp_path / "b"),
                     "--set", "data.name=synthetic-tokens"]) == 2
    error = capsys.readouterr().err
    assert "transformers cannot build it" in error and "not a multiple of the number of attention heads" in error
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("model_type, targets", [
    ("olmoe", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")),  # its tp plan's
    ("gpt_oss", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")),  # its blocks'
])
def test_lora_on_a_family_without_a_plan_of_ours_targets_its_own_projections(model_type, targets):
    """OLMoE's base_model_tp_plan names its attention's projections (its experts are no nn.Linear);
    GPT-OSS's names only its embedding, so its blocks' linear layers are taken."""
    import transformers

    from shardwise.lora import apply_lora, default_targets
    from shardwise.materialise import init_context

    with init_context():
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
            model_type, **{**TINY, "eos_token_id": None, "bos_token_id": None}))
    assert default_targets(model) == targets
    adapted = apply_lora(model, 4, 8.0, 0.0, None, seed=0)
    assert len(adapted) == 2 * len(targets)  # 2 blocks


@pytest.mark.parametrize("model_type, sizes", [
    ("sarvam_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)),  # q, k, v by their rows
    ("hrm_text", {}),  # gate and up, and attention's gate, q, k and v: equal chunks
])
def test_a_family_whose_hub_checkpoints_fuse_projections_reads_and_writes_them(tmp_path, model_type, sizes):
    """Sarvam-MoE's checkpoints hold q, k and v as one `query_key_value`, HRM's gate and up as one
    `gate_up_proj` (transformers' Split and Chunk as it loads them): each model tensor is read from
    its rows there, and the run's weights file holds them fused again, as `save_pretrained` does."""
    import transformers

    from shardwise.dist import init_distributed
    from shardwise.trainer import Trainer
    from shardwise.weights import load_weights

    torch.manual_seed(0)
    pretrained = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(
        model_type, **TINY, **sizes))
    pretrained.save_pretrained(tmp_path / "pretrained")
    args = cli.parser().parse_args(train_args(tmp_path / "pretrained", tmp_path / "run", "--strategy", "single"))
    cfg = cli._train_config(args)
    cli._check_before_launch(cfg)
    threads = torch.get_num_threads()
    try:
        trainer = Trainer(cfg, init_distributed(threads_per_rank=1))
        load_weights(trainer.strategy, cfg.model.weights, trainer.names)
        state = trainer.strategy.view.full_state_dict()
        assert_states_close(state, pretrained.state_dict(), rtol=0, atol=0, prefix="lm.")
        trainer.fit()
    finally:
        torch.set_num_threads(threads)
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run", output_loading_info=True)
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    loaded.save_pretrained(tmp_path / "again")
    written, again = (tmp_path / name / "model.safetensors" for name in ("run", "again"))
    assert written.read_bytes() == again.read_bytes()
    assert not torch.equal(loaded.lm_head.weight, pretrained.lm_head.weight)  # it trained
