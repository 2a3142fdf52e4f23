"""The user's own corpus (`data.path`): text, JSON Lines, Parquet and Arrow files and Hugging Face
datasets saved to disk (sources.py), tokenized once into a file of token ids, then read a window
at a time like a built-in corpus.

`data.tokenizer` is `bytes` (every UTF-8 byte a token, as the built-in corpora) or a Hugging Face
tokenizer read offline: a `tokenizer.json`, or a directory holding one (a model's from_pretrained
directory).

`prepare` cuts the corpus into parts (sources.pieces: lines of a JSON Lines file by byte offset,
row groups, record batches, whole text files) and tokenizes them on a pool of processes, one
per core (at most MAX_WORKERS; a Hugging Face tokenizer on one thread in each), each part into a
file of its own, appended to one flat file of token ids in the corpus's order as they finish
(`tokens.bin`: the smallest unsigned integers that hold the vocabulary), so the result is the
same byte for byte on any number of processes; a corpus of one part is tokenized in this process.
Beside it, where each document starts (`starts.npy`: for `data.documents = "files"` masks) and a
manifest (`manifest.json`: each input's size, modification time and SHA-256, the tokenizer's
hash, the counts). It lives in a directory of the cache named by a hash of the inputs' paths,
sizes and times and of the tokenizer, so preparing again is a no-op until an input changes; it is
written under a temporary name and renamed, so a failure (a missing field, a line that is not
JSON) leaves nothing behind, and ranks never see half of it.

Training reads the token file as it goes (`TokenFile`: positioned reads, so a rank holds what it
reads, not the pages around it): each rank's windows are read as its micro-batches need them, and
the sampler (sampler.py) decides which windows a step takes from the step alone, so a resumed or
resharded run continues at exactly the next sample.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import multiprocessing
import os
import shutil
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from shardwise.config.schema import Config, ConfigError, DataConfig
from shardwise.data.corpus import cache_dir
from shardwise.data.pairs import tokenize_pairs
from shardwise.data.samples import tokenize_samples
from shardwise.data.sources import Piece, Source, documents, input_sources, pieces, records

BYTES = "bytes"
BATCH = 1024  # documents a tokenizer encodes at once
MAX_WORKERS = 8  # processes that tokenize a corpus, at most (the default: one per core up to this)
# A corpus is cut into about 4 parts per process, of between these many bytes of text each (a JSON
# Lines file in pieces of the least, each piece the lines that begin in it).
MIN_PART_BYTES, MAX_PART_BYTES = 1 << 20, 64 << 20


@dataclass(frozen=True)
class Prepared:
    """A prepared corpus: its token ids (read as they are asked for) and where each document starts."""

    tokens: TokenFile
    starts: np.ndarray
    mask: TokenFile | None = None  # fine-tuning samples: one byte a token, 1 where the loss counts it
    pairs: np.ndarray | None = None  # preference pairs: [pairs, 3] prompt, chosen and rejected lengths


def default_workers() -> int:
    """The processes that tokenize a corpus: one per core this process may use, at most MAX_WORKERS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cores, MAX_WORKERS)


class Tokenizer:
    """`bytes`, or a Hugging Face tokenizer from a `tokenizer.json` (or a directory holding one)."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == BYTES:
            self.vocab_size, self.file, self._hf = 256, None, None
            return
        file = Path(name).expanduser()
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise ConfigError(f"data.tokenizer = {name!r}: no tokenizer.json there (a file, or a directory holding "
                              "one, as a model's from_pretrained directory does)")
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise ConfigError(f"data.tokenizer = {name!r}: needs the tokenizers package "
                              "(pip install 'shardwise[data]')") from None

        self.file, self._hf = file, HFTokenizer.from_file(str(file))
        # Whole documents: a tokenizer.json saved for classification may pad or cut every text to a length.
        self._hf.no_padding()
        self._hf.no_truncation()
        self.vocab_size = self._hf.get_vocab_size()

    def ids(self, text: str) -> np.ndarray:
        """The token ids of `text`, no special tokens added."""
        if self._hf is None:
            return np.frombuffer(text.encode(), dtype=np.uint8)
        return np.asarray(self._hf.encode(text, add_special_tokens=False).ids)

    def batch_ids(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's ids: a Hugging Face tokenizer encodes the batch on all cores (its own threads)."""
        if self._hf is None:
            return [self.ids(text) for text in texts]
        return [np.asarray(e.ids) for e in self._hf.encode_batch(texts, add_special_tokens=False)]

    @property
    def dtype(self) -> np.dtype:
        """The smallest unsigned integer that holds every id."""
        return np.dtype(next(t for t in (np.uint8, np.uint16, np.uint32) if self.vocab_size <= np.iinfo(t).max + 1))

    def decode(self, ids: list[int]) -> str:
        if self._hf is None:
            return bytes(ids).decode(errors="replace")
        return self._hf.decode(ids)

    @functools.cached_property
    def fingerprint(self) -> str:
        """`bytes`, or the tokenizer file's SHA-256 (read once: the cache key and the manifest both name it)."""
        return BYTES if self.file is None else _sha256(self.file)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _batches(texts: Iterable[str], size: int) -> Iterator[list[str]]:
    batch = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def sources_of(d: DataConfig, path: str, held_out: bool = False) -> list[Source]:
    """The files of `path`: data.path (a dataset dict's split data.split), or with `held_out`
    data.val_path (a dataset dict refused: its split is named by its directory)."""
    return input_sources(path, None, "data.val_path") if held_out else input_sources(path, d.split, "data.path")


def corpus_dir(d: DataConfig, files: list[Path], tokenizer: Tokenizer, seq_len: int | None = None) -> Path:
    """Where the corpus of `files` is prepared, in the cache: named by what it is made from (and for
    preference pairs, which must fit a window, by the window and the truncation)."""
    stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    fitted = [seq_len, d.truncate_prompt] if d.format == "preference" else []
    key = json.dumps([stats, tokenizer.name, tokenizer.fingerprint, d.text_field, d.format, *fitted])
    return cache_dir() / "corpora" / hashlib.sha256(key.encode()).hexdigest()[:16]


def prepare(d: DataConfig, path: str, progress: bool = False, workers: int | None = None, held_out: bool = False,
            seq_len: int | None = None) -> Path:
    """Tokenize the corpus `path` names (data.path, or with `held_out` data.val_path) into the
    cache, unless it is there already, on `workers` processes (default: default_workers()); return
    its directory (`seq_len`: model.seq_len, which preference pairs must fit: pairs.py). Bad input
    (no files, a table without the text column, a line without the text field, nothing to train on) raises
    ConfigError and leaves nothing behind; what can be checked without reading the text is checked
    before any process starts."""
    if d.format == "preference" and seq_len is None:
        raise ValueError("prepare: preference pairs are fitted to model.seq_len; pass seq_len")
    sources = sources_of(d, path, held_out)
    files = [source.path for source in sources]
    tokenizer = Tokenizer(d.tokenizer)
    out = corpus_dir(d, files, tokenizer, seq_len)
    if (out / "manifest.json").is_file():
        return out
    from tqdm import tqdm

    workers = default_workers() if workers is None else workers
    cut = pieces(sources, d.text_field, MIN_PART_BYTES)  # the tables checked here
    total = sum(piece.size for piece in cut)
    part_bytes = min(MAX_PART_BYTES, max(MIN_PART_BYTES, total // (4 * workers)))
    parts = _parts(cut, part_bytes)
    processes = min(workers, len(parts))
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress,
                   desc=f"tokenizing {len(files)} file(s) on {processes} process(es)")
        with bar, open(tmp / "tokens.bin", "wb") as sink:
            if d.format == "preference":  # pairs: each its prompt, chosen and rejected tokens (pairs.py)
                pairs = np.concatenate([tokenize_pairs((r for piece in part for r in records(piece)), tokenizer,
                                                       seq_len, d.truncate_prompt, sink) for part in parts])
                np.save(tmp / "pairs.npy", pairs)
                lengths = [pairs.sum(axis=1)]
                hashes = [_sha256(p) for p in files]
            elif d.format != "text":  # fine-tuning samples: rendered and masked here (samples.py)
                with open(tmp / "mask.bin", "wb") as mask:
                    lengths = [tokenize_samples((r for piece in part for r in records(piece)), d.format, tokenizer,
                                                sink, mask) for part in parts]
                hashes = [_sha256(p) for p in files]
            elif processes > 1:
                lengths, hashes = _tokenize_in_processes(parts, tokenizer, d.text_field, files, processes, tmp, sink,
                                                         bar)
            else:
                lengths = [_tokenize_part(part, tokenizer, d.text_field, sink, bar) for part in parts]
                hashes = [_sha256(p) for p in files]
        lengths = np.concatenate([np.zeros(0, np.int64), *lengths])
        count = int(lengths.sum())
        if count == 0:
            raise ConfigError(f"data.path = {path!r}: the corpus has no text ({len(files)} file(s), 0 tokens)")
        np.save(tmp / "starts.npy", np.cumsum(lengths) - lengths)
        manifest = {
            "path": path, "format": d.format, "text_field": d.text_field, "tokenizer": tokenizer.name,
            "tokenizer_sha256": tokenizer.fingerprint, "vocab_size": tokenizer.vocab_size,
            "dtype": tokenizer.dtype.name, "tokens": count, "documents": len(lengths),
            "inputs": [{"path": str(p), "bytes": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns,
                        "sha256": digest} for p, digest in zip(files, hashes, strict=True)],
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        try:
            os.replace(tmp, out)
        except OSError:  # another process prepared it meanwhile: theirs is the same
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _parts(cut: list[Piece], part_bytes: int) -> list[list[Piece]]:
    """Consecutive pieces gathered into parts of at least `part_bytes` (the last may be less)."""
    parts: list[list[Piece]] = []
    held = part_bytes
    for piece in cut:
        if held >= part_bytes:
            parts.append([])
            held = 0
        parts[-1].append(piece)
        held += piece.size
    return parts


def _tokenize_part(part: list[Piece], tokenizer: Tokenizer, text_field: str, sink: IO[bytes], bar: Any = None
                   ) -> np.ndarray:
    """Write the token ids of `part`'s documents to `sink`; each (non-empty) document's length."""
    lengths, dtype = [], tokenizer.dtype
    texts = (text for piece in part for text in documents(piece, text_field))
    for batch in _batches(texts, BATCH):
        kept = [ids for ids in tokenizer.batch_ids(batch) if ids.size]
        if kept:
            sink.write(np.concatenate(kept).astype(dtype, copy=False).tobytes())
            lengths += [ids.size for ids in kept]
    if bar is not None:
        bar.update(sum(piece.size for piece in part))
    return np.asarray(lengths, dtype=np.int64)


def _tokenize_in_processes(parts: list[list[Piece]], tokenizer: Tokenizer, text_field: str, files: list[Path],
                           processes: int, tmp: Path, sink: IO[bytes], bar: Any) -> tuple[list[np.ndarray], list[str]]:
    """Each part tokenized by one of `processes` into a file of its own under `tmp`, appended to
    `sink` in order as it finishes; the inputs hashed by the same processes meanwhile. Each part's
    document lengths, and the inputs' SHA-256. A Hugging Face tokenizer runs on one thread in each
    process (the processes are the parallelism): they start with TOKENIZERS_PARALLELISM=false."""
    jobs = [(part, tokenizer.name, text_field, tmp / f"part-{i:06d}.bin") for i, part in enumerate(parts)]
    lengths = []
    with _environment(TOKENIZERS_PARALLELISM="false"):
        pool = _start_processes(processes)
        try:
            hashes = [pool.submit(_sha256, p) for p in files]
            for (part, *_, written), each in zip(jobs, pool.map(_tokenize_part_to_file, jobs), strict=True):
                with open(written, "rb") as f:
                    shutil.copyfileobj(f, sink, 1 << 20)
                written.unlink()
                lengths.append(each)
                bar.update(sum(piece.size for piece in part))
            return lengths, [h.result() for h in hashes]
        finally:  # on an error, the parts not yet begun are dropped: the error is not kept waiting for them
            pool.shutdown(cancel_futures=True)


def _start_processes(processes: int) -> ProcessPoolExecutor:
    """A pool of `processes`, forked where the system can (nothing to import again), else spawned."""
    methods = multiprocessing.get_all_start_methods()
    return ProcessPoolExecutor(processes, multiprocessing.get_context("fork" if "fork" in methods else "spawn"))


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _tokenize_part_to_file(job: tuple[list[Piece], str, str, Path]) -> np.ndarray:
    """In a pool's process: `_tokenize_part` into a file of its own."""
    part, tokenizer_name, text_field, out = job
    with open(out, "wb") as sink:
        return _tokenize_part(part, _tokenizer(tokenizer_name), text_field, sink)


@functools.cache
def _tokenizer(name: str) -> Tokenizer:
    """A pool process's tokenizer: read once per process."""
    return Tokenizer(name)


def load(d: DataConfig, path: str, model_vocab: int, held_out: bool = False, seq_len: int | None = None) -> Prepared:
    """The prepared corpus `path` names (data.path, or with `held_out` data.val_path; prepared now
    if it is not yet), opened for reading; its vocabulary checked against the model's."""
    out = prepare(d, path, held_out=held_out, seq_len=seq_len)
    manifest = json.loads((out / "manifest.json").read_text())
    _check_vocabulary(d, manifest["vocab_size"], model_vocab)
    mask = TokenFile(out / "mask.bin", np.dtype(np.uint8)) if (out / "mask.bin").is_file() else None
    pairs = np.load(out / "pairs.npy") if (out / "pairs.npy").is_file() else None
    return Prepared(TokenFile(out / "tokens.bin", np.dtype(manifest["dtype"])), np.load(out / "starts.npy"), mask,
                    pairs)


class TokenFile:
    """The token ids of a prepared corpus, read from the file as they are asked for (positioned
    reads, not a memory map: a mapped window maps the cached pages around it too, so a rank's RSS
    would grow with the corpus rather than with what it reads). Sliced, a part of the same file."""

    def __init__(self, path: Path, dtype: np.dtype, start: int = 0, stop: int | None = None) -> None:
        self.path, self.dtype = path, dtype
        self.start = start
        self.stop = path.stat().st_size // dtype.itemsize if stop is None else stop
        self._fd = os.open(path, os.O_RDONLY)

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, part: slice) -> TokenFile:
        start, stop, step = part.indices(len(self))
        if step != 1:
            raise ValueError("a token file slices contiguously")
        return TokenFile(self.path, self.dtype, self.start + start, self.start + stop)

    def __del__(self) -> None:
        os.close(self._fd)

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count) of this part."""
        data = os.pread(self._fd, count * self.dtype.itemsize, (self.start + start) * self.dtype.itemsize)
        return np.frombuffer(data, dtype=self.dtype)

    def windows(self, starts: np.ndarray, width: int) -> np.ndarray:
        """[len(starts), width] int64: the `width` tokens from each of `starts`."""
        return np.stack([self.read(int(start), width) for start in starts]).astype(np.int64)


def check_vocabulary(cfg: Config) -> None:
    """Before any worker starts: the tokenizer's vocabulary fits the model's."""
    if cfg.data.path is not None:
        _check_vocabulary(cfg.data, Tokenizer(cfg.data.tokenizer).vocab_size, cfg.model.vocab_size)


def _check_vocabulary(d: DataConfig, size: int, model_vocab: int) -> None:
    if size > model_vocab:
        raise ConfigError(f"data.tokenizer = {d.tokenizer!r}: its vocabulary of {size} tokens exceeds "
                          f"model.vocab_size = {model_vocab}; set model.vocab_size = {size} or more")
