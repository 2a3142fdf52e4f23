"""Fine-tuning samples (`data.format`): chat conversations rendered by the tokenizer's own chat
template and prompt/completion pairs, packed, the loss counting the answers' tokens only; refused
with the reason where they cannot be read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from helpers import CONFIGS, SGD, assert_same_training, gpt_tiny, in_process, read_records, train_runs

from shardwise.config.load import load_config
from shardwise.config.schema import ConfigError
from shardwise.data import make_datasets
from shardwise.data.samples import IGNORED, MaskedWindows
from shardwise.trainer import Trainer

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
STEPS = 10


def save_tokenizer(out: Path, template: str | None = TEMPLATE) -> Path:
    """A byte-level BPE tokenizer trained on sums, its turn markers special tokens, with `template`."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([f"what is {a} plus {b}? {a + b}." for a in range(30) for b in range(30)], vocab_size=300,
                            special_tokens=["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)
    if template is not None:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(out)
    return out


def write_samples(path: Path, fmt: str, count: int = 240) -> Path:
    lines = []
    for i in range(count):
        a, b = i % 17, i % 13
        if fmt == "chat":
            lines.append({"messages": [{"role": "user", "content": f"what is {a} plus {b}?"},
                                       {"role": "assistant", "content": f"{a + b}."},
                                       {"role": "user", "content": "and twice that?"},
                                       {"role": "assistant", "content": f"{2 * (a + b)}."}]})
        else:
            lines.append({"prompt": f"what is {a} plus {b}? ", "completion": f"{a + b}."})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat")
    return {"root": root, "tokenizer": save_tokenizer(root / "tokenizer"),
            "chat": write_samples(root / "chat.jsonl", "chat"), "completion": write_samples(root / "pc.jsonl", "pc")}


def samples_config(out: Path, chat: dict[str, Path], fmt: str, strategy: str = "single", world: int = 1,
                   *overrides: str):
    return gpt_tiny(out, strategy, world, f"data.path={chat['chat' if fmt == 'chat' else 'completion']}",
                    f"data.tokenizer={chat['tokenizer']}", f"data.format={fmt}", "model.vocab_size=512",
                    "train.micro_batch=4", *SGD, *overrides, steps=STEPS)


def test_the_loss_counts_the_assistant_turns_and_the_completions_only(chat, tmp_path):
    from transformers import AutoTokenizer

    decode = AutoTokenizer.from_pretrained(chat["tokenizer"]).decode
    for fmt, answers in (("chat", "0.<|end|>0.<|end|>"), ("completion", "0.")):  # what is 0 plus 0? (twice that?)
        cfg = samples_config(tmp_path / fmt, chat, fmt)
        assert cfg.data.documents == "files"  # each sample its own document
        train, _ = make_datasets(cfg)
        assert isinstance(train, MaskedWindows)
        inputs, targets = train.batch(torch.arange(len(train)))
        counted = targets != IGNORED
        assert 0 < counted.float().mean() < 0.5  # the answers: a minority of the tokens
        # the first sample's counted targets (those whose input is in its document) are its answers
        documents = train.documents(torch.tensor([0]))[0]
        kept = targets[0][(documents == documents[0]) & counted[0]]
        assert decode(kept.tolist()) == answers


def test_fine_tuning_samples_train_under_ddp_as_under_single(chat):
    root = chat["root"] / "runs"
    in_process(lambda ctx: Trainer(samples_config(root / "single", chat, "chat"), ctx).fit())
    run_ranks(train_runs, 2, root, {"ddp": ("ddp",)}, ChatConfig(chat))
    assert_same_training(root / "ddp", root / "single", STEPS)


class ChatConfig:
    """cfg_for for train_runs: chat samples on `world` ranks (a class: the ranks import it by name)."""

    def __init__(self, chat: dict[str, Path]) -> None:
        self.chat = chat

    def __call__(self, out: Path, strategy: str, world: int, *overrides: str):
        return samples_config(out, self.chat, "chat", strategy, world, *overrides)


@pytest.mark.parametrize(("case", "expected"), [
    ("no-assistant", "line 2: the conversation has no assistant turn to learn from"),
    ("no-template", "has no chat template (tokenizer_config.json's chat_template); use data.format = 'completion'"),
    ("not-messages", "line 1: `messages` must be a list of"),
    ("bytes", "data.format = 'chat': data.tokenizer must be a tokenizer's directory"),
    ("no-completion", "line 1: needs a `prompt` and a non-empty `completion` string"),
])
def test_samples_that_cannot_be_read_are_refused_naming_the_line(chat, tmp_path, case, expected):
    data = tmp_path / "bad.jsonl"
    tokenizer, fmt = chat["tokenizer"], "chat"
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "3."}]}
    rows = {"no-assistant": [good, {"messages": [{"role": "user", "content": "hi"}]}],
            "no-template": [good], "not-messages": [{"messages": "hi"}], "bytes": [good],
            "no-completion": [{"prompt": "hi"}]}[case]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    if case == "no-template":
        tokenizer = save_tokenizer(tmp_path / "plain", template=None)
    if case == "bytes":
        tokenizer = "bytes"
    if case == "no-completion":
        fmt = "completion"
    with pytest.raises(ConfigError) as error:
        cfg = load_config(CONFIGS / "gpt-tiny.toml", [f"data.path={data}", f"data.tokenizer={tokenizer}",
                                                      f"data.format={fmt}", "model.vocab_size=512",
                                                      f"run.out={tmp_path / 'run'}"])
        make_datasets(cfg)
    assert expected in str(error.value)


def test_the_shipped_chat_config_fine_tunes_a_pretrained_gpt(tmp_path, monkeypatch):
    """configs/lora-chat.toml, as shipped (its paths from the checkout's root), over a stand-in for
    `make demo`'s model: its counted targets are the assistant's shout, and it trains its adapters."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from shardwise.models import build_model

    monkeypatch.chdir(CONFIGS.parent)
    pretrained = tmp_path / "demo.safetensors"
    shape = load_config(CONFIGS / "demo.toml")
    save_file({k: v.clone() for k, v in build_model(shape.model).state_dict().items()}, str(pretrained))
    cfg = load_config(CONFIGS / "lora-chat.toml", [f"model.weights={pretrained}", f"run.out={tmp_path / 'run'}",
                                                   "train.steps=3", "train.eval_every=0", "parallel.strategy=single",
                                                   "launch.nproc=1"])
    train, _ = make_datasets(cfg)
    _, targets = train.batch(torch.tensor([0]))
    documents = train.documents(torch.tensor([0]))[0]
    kept = targets[0][(documents == documents[0]) & (targets[0] != IGNORED)]
    first = json.loads((CONFIGS.parent / cfg.data.path).read_text().splitlines()[0])["messages"][1]["content"]
    assert AutoTokenizer.from_pretrained(cfg.data.tokenizer).decode(kept.tolist()) == first + "\n\n"
    in_process(lambda ctx: Trainer(cfg, ctx).fit())
    assert len(read_records(tmp_path / "run")) == 3
    memory = read_records(tmp_path / "run", "summary")[0]["memory"]
    assert 0 < memory["grads"] < 0.1 * memory["params"]  # gradients for the adapters alone
