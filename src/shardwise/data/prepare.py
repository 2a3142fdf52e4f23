"""The user's own corpus (`data.path`): text files and JSON Lines, tokenized once into a file of
token ids, then read a window at a time like a built-in corpus.

`data.path` names a file, a directory (every `.txt` and `.jsonl` file under it, in sorted order)
or a glob. A `.txt` file is one document; each line of a `.jsonl` file is one, its
`data.text_field`. `data.tokenizer` is `bytes` (every UTF-8 byte a token, as the built-in corpora)
or a Hugging Face tokenizer read offline: a `tokenizer.json`, or a directory holding one (a
model's from_pretrained directory).

`prepare` tokenizes every document in order (a Hugging Face tokenizer 1024 documents at a time,
on all cores through its own threads; the files are read and parsed in this process) into one
flat file of token ids (`tokens.bin`: the smallest unsigned integers that hold the vocabulary),
with where each document starts (`starts.npy`: for
`data.documents = "files"` masks) and a manifest (`manifest.json`: each input's size, modification
time and SHA-256, the tokenizer's hash, the counts). It lives in a directory of the cache named by
a hash of the inputs' paths, sizes and times and of the tokenizer, so preparing again is a no-op
until an input changes; it is written under a temporary name and renamed, so a failure (a missing
field, a line that is not JSON) leaves nothing behind, and ranks never see half of it.

Training reads the token file as it goes (`TokenFile`: positioned reads, so a rank holds what it
reads, not the pages around it): each rank's windows are read as its micro-batches need them, and
the sampler (sampler.py) decides which windows a step takes from the step alone, so a resumed or
resharded run continues at exactly the next sample.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardwise.config import Config, ConfigError, DataConfig
from shardwise.data.corpus import cache_dir

SUFFIXES = (".txt", ".jsonl")
BYTES = "bytes"
BATCH = 1024  # documents a tokenizer encodes at once


@dataclass(frozen=True)
class Prepared:
    """A prepared corpus: its token ids (read as they are asked for) and where each document starts."""

    tokens: TokenFile
    starts: np.ndarray


def input_files(path: str) -> list[Path]:
    """The files `data.path` names, in the order their documents are read."""
    given = Path(path).expanduser()
    if given.is_file():
        files = [given]
    elif given.is_dir():
        files = sorted(p for p in given.rglob("*") if p.suffix in SUFFIXES and p.is_file())
    else:
        files = sorted(Path(p) for p in glob.glob(str(given), recursive=True) if Path(p).is_file())
        if not files:
            raise ConfigError(f"data.path = {path!r}: no such file, directory or glob match")
    unknown = [p for p in files if p.suffix not in SUFFIXES]
    if unknown:
        raise ConfigError(f"data.path = {path!r}: {unknown[0]} is neither .txt nor .jsonl")
    if not files:
        raise ConfigError(f"data.path = {path!r}: no .txt or .jsonl files in it")
    return files


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


def documents(files: list[Path], text_field: str) -> Iterator[str]:
    """Every document's text, in order: a .txt file whole, a .jsonl file's lines' `text_field`."""
    for path in files:
        if path.suffix == ".txt":
            yield path.read_text(errors="replace")
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ConfigError(f"data.path: {path}, line {number}: not JSON ({error.msg})") from None
                text = record.get(text_field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise ConfigError(f"data.text_field = {text_field!r}: {path}, line {number} has no such "
                                      "text field")
                yield text


def _batches(texts: Iterable[str], size: int) -> Iterator[list[str]]:
    batch = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def corpus_dir(d: DataConfig, path: str, files: list[Path], tokenizer: Tokenizer) -> Path:
    """Where the corpus `path` names is prepared, in the cache: named by what it is made from."""
    stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    key = json.dumps([stats, tokenizer.name, tokenizer.fingerprint, d.text_field])
    return cache_dir() / "corpora" / hashlib.sha256(key.encode()).hexdigest()[:16]


def prepare(d: DataConfig, path: str, progress: bool = False) -> Path:
    """Tokenize the corpus `path` names into the cache, unless it is there already; return its
    directory. Bad input (no files, a line without the text field, nothing to train on) raises
    ConfigError and leaves nothing behind."""
    files = input_files(path)
    tokenizer = Tokenizer(d.tokenizer)
    out = corpus_dir(d, path, files, tokenizer)
    if (out / "manifest.json").is_file():
        return out
    from tqdm import tqdm

    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        starts, count = [], 0
        total = sum(p.stat().st_size for p in files) / 2**20
        texts = tqdm(documents(files, d.text_field), unit=" documents", disable=not progress,
                     desc=f"tokenizing {len(files)} file(s), {total:.1f} MiB")
        with open(tmp / "tokens.bin", "wb") as sink:
            for batch in _batches(texts, BATCH):
                for ids in tokenizer.batch_ids(batch):
                    if ids.size:
                        starts.append(count)
                        sink.write(ids.astype(tokenizer.dtype, copy=False).tobytes())
                        count += ids.size
        if count == 0:
            raise ConfigError(f"data.path = {path!r}: the corpus has no text ({len(files)} file(s), 0 tokens)")
        np.save(tmp / "starts.npy", np.asarray(starts, dtype=np.int64))
        manifest = {
            "path": path, "text_field": d.text_field, "tokenizer": tokenizer.name,
            "tokenizer_sha256": tokenizer.fingerprint, "vocab_size": tokenizer.vocab_size,
            "dtype": tokenizer.dtype.name, "tokens": count, "documents": len(starts),
            "inputs": [{"path": str(p), "bytes": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns,
                        "sha256": _sha256(p)} for p in files],
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


def load(d: DataConfig, path: str, model_vocab: int) -> Prepared:
    """The prepared corpus `path` names (prepared now if it is not yet), opened for reading; its
    vocabulary checked against the model's."""
    out = prepare(d, path)
    manifest = json.loads((out / "manifest.json").read_text())
    _check_vocabulary(d, manifest["vocab_size"], model_vocab)
    return Prepared(TokenFile(out / "tokens.bin", np.dtype(manifest["dtype"])), np.load(out / "starts.npy"))


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
