"""Packed documents: a corpus as a stream of documents, cut into windows that may hold several,
with each token's document known, so attention can stop at every boundary (a document mask).

A corpus's bytes are its documents one after another (corpus.py), so packing is the same windows
as without documents; what packing adds is where each document begins:

- `files`: each source file (a play or poem of Shakespeare's, a module of the standard library),
  tens of kilobytes: a boundary in a few windows of long sequences;
- `paragraphs`: each block of text after a blank line (a speech, a function), a hundred to a few
  hundred bytes: several boundaries in most windows of short sequences too.

The document ids of a window count the documents begun before each token, so two tokens share a
document exactly where their ids are equal; ids are only compared, never embedded.
"""

from __future__ import annotations

import numpy as np
import torch

from shardwise.data.corpus import TokenWindows, source_files

NEWLINE = ord("\n")


def document_starts(corpus: str, unit: str, tokens: np.ndarray) -> np.ndarray:
    """Where each document of `tokens` (all the bytes of built-in corpus `corpus`) begins, ascending,
    starting with 0 (int64). `unit`: "files" or "paragraphs"."""
    if unit == "files":
        # load_corpus writes each file followed by one newline
        sizes = np.array([path.stat().st_size + 1 for path in source_files(corpus)], dtype=np.int64)
        return np.concatenate([[0], np.cumsum(sizes)[:-1]])
    if unit == "paragraphs":
        t = np.asarray(tokens)
        # the first byte that is not a newline after two: a blank line's trailing newlines stay with the text before it
        after_blank = np.flatnonzero((t[:-2] == NEWLINE) & (t[1:-1] == NEWLINE) & (t[2:] != NEWLINE)) + 2
        return np.concatenate([[0], after_blank]).astype(np.int64)
    raise ValueError(f"documents {unit!r}: unknown; allowed: files, paragraphs")


def split_starts(starts: np.ndarray, cut: int) -> tuple[np.ndarray, np.ndarray]:
    """The document starts of the bytes before `cut` and of those from it (as `split_tokens` cuts
    the bytes), each counted from its own first byte; the part from `cut` begins mid-document."""
    return starts[starts < cut], np.concatenate([[0], starts[starts > cut] - cut])


class DocumentWindows(TokenWindows):
    """`TokenWindows` over packed documents: the same windows, and each input token's document."""

    def __init__(self, tokens: np.ndarray, seq_len: int, starts: np.ndarray) -> None:
        super().__init__(tokens, seq_len)
        self.starts = starts

    def documents(self, indices: torch.Tensor) -> torch.Tensor:
        """`[len(indices), seq_len]` int64: the document of each input token of the windows `indices`
        (`batch(indices)`'s inputs), as the number of documents begun up to it."""
        positions = indices.numpy()[:, None] * self.seq_len + np.arange(self.seq_len)
        return torch.from_numpy(np.searchsorted(self.starts, positions, side="right").astype(np.int64))
