"""Datasets and the global-batch sampler. A dataset has `len()` and `batch(indices) -> (inputs, targets)`;
packed documents (`DocumentWindows`) also `documents(indices)`, each input token's document."""

from __future__ import annotations

from typing import Protocol

import torch

from shardwise.config.schema import Config, ConfigError
from shardwise.data import prepare
from shardwise.data.corpus import TokenWindows, load_corpus, split_tokens, synthetic_tokens
from shardwise.data.documents import DocumentWindows, document_starts, split_starts
from shardwise.data.images import load_digits_split, synthetic_images
from shardwise.data.pairs import PairWindows
from shardwise.data.sampler import GlobalBatchSampler
from shardwise.data.samples import MaskedWindows

__all__ = ["Dataset", "DocumentWindows", "GlobalBatchSampler", "make_datasets"]


class Dataset(Protocol):
    def __len__(self) -> int: ...
    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


def make_datasets(cfg: Config) -> tuple[Dataset, Dataset]:
    """(train, validation) for the config's data and model."""
    d = cfg.data
    if d.name == "digits":
        return load_digits_split(d.val_fraction)
    if d.name == "synthetic-images":
        train = synthetic_images(d.synthetic_size, cfg.train.seed, cfg.model.num_classes)
        return train, synthetic_images(max(64, int(d.synthetic_size * d.val_fraction)), cfg.train.seed + 1,
                                       cfg.model.num_classes)
    if d.path is not None:
        return _own_datasets(cfg)
    if d.name == "synthetic-tokens":
        tokens = synthetic_tokens(d.synthetic_size, cfg.train.seed, cfg.model.vocab_size)
    else:
        tokens = load_corpus(d.name)
    train, val = split_tokens(tokens, d.val_fraction)
    if d.documents == "none":
        return TokenWindows(train, cfg.model.seq_len), TokenWindows(val, cfg.model.seq_len)
    train_starts, val_starts = split_starts(document_starts(d.name, d.documents, tokens), len(train))
    return DocumentWindows(train, cfg.model.seq_len, train_starts), DocumentWindows(val, cfg.model.seq_len, val_starts)


def _own_datasets(cfg: Config) -> tuple[Dataset, Dataset]:
    """data.path's corpus (prepare.py), split as a built-in one, or validated on data.val_path's."""
    d, seq_len = cfg.data, cfg.model.seq_len
    corpus = prepare.load(d, d.path, cfg.model.vocab_size, seq_len=seq_len)
    if d.format == "preference":  # whole pairs in windows, split by pairs
        train = PairWindows(corpus.tokens, seq_len, corpus.pairs, d.pack_pairs)
        if d.val_path is None:
            train, val = train.split(d.val_fraction)
        else:
            held_out = prepare.load(d, d.val_path, cfg.model.vocab_size, held_out=True, seq_len=seq_len)
            val = PairWindows(held_out.tokens, seq_len, held_out.pairs, d.pack_pairs, first_id=len(train))
        if not len(train) or not len(val):
            raise ConfigError(f"data.path = {d.path!r}: {train.lengths.shape[0]} pair(s) to train on and "
                              f"{val.lengths.shape[0]} to validate on; each needs one at least")
        return train, val
    if d.val_path is not None:
        held_out = prepare.load(d, d.val_path, cfg.model.vocab_size, held_out=True, seq_len=seq_len)
        parts = [(corpus.tokens, corpus.starts), (held_out.tokens, held_out.starts)]
        masks = [corpus.mask, held_out.mask]
    else:
        train, val = split_tokens(corpus.tokens, d.val_fraction)
        parts = list(zip((train, val), split_starts(corpus.starts, len(train)), strict=True))
        masks = list(split_tokens(corpus.mask, d.val_fraction)) if corpus.mask is not None else [None, None]
    for (tokens, _), what in zip(parts, ("train on", "validate on"), strict=True):
        if len(tokens) < seq_len + 1:
            raise ConfigError(f"data.path = {d.path!r}: {len(tokens)} tokens to {what}, fewer than one sequence of "
                              f"model.seq_len + 1 = {seq_len + 1}")
    if d.format != "text":  # fine-tuning samples: the loss counts what their masks keep
        return tuple(MaskedWindows(tokens, seq_len, starts, mask) for (tokens, starts), mask in zip(parts, masks,
                                                                                                   strict=True))
    if d.documents == "none":
        return tuple(TokenWindows(tokens, seq_len) for tokens, _ in parts)
    return tuple(DocumentWindows(tokens, seq_len, starts) for tokens, starts in parts)
