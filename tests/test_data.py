"""The corpus loader and the global-batch sampler."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardwise.data import GlobalBatchSampler
from shardwise.data.corpus import TokenWindows, load_corpus, source_files, split_tokens
from shardwise.data.documents import DocumentWindows, document_starts, split_starts
from shardwise.data.images import load_digits_split


@pytest.fixture(scope="module")
def shakespeare() -> np.ndarray:
    return load_corpus("shakespeare")


def test_shakespeare_is_the_complete_works_as_bytes(shakespeare):
    assert 4_000_000 < len(shakespeare) < 6_000_000
    text = bytes(shakespeare).decode("latin-1")
    for phrase in ("To be, or not to be", "HAMLET", "ROMEO"):
        assert phrase in text
    assert shakespeare.dtype == np.uint8 and int(shakespeare.max()) <= 255


def test_loading_twice_gives_identical_bytes(shakespeare):
    again = load_corpus("shakespeare")
    assert np.array_equal(np.asarray(again), np.asarray(shakespeare))


def test_stdlib_corpus_is_python_source():
    tokens = load_corpus("stdlib")
    assert len(tokens) > 1_000_000 and b"def " in bytes(tokens[:100_000])


def test_split_sizes_are_exact_and_disjoint(shakespeare):
    train, val = split_tokens(shakespeare, 0.05)
    assert len(train) + len(val) == len(shakespeare)
    assert len(val) == len(shakespeare) - int(len(shakespeare) * 0.95)
    assert np.array_equal(np.asarray(val[:100]), np.asarray(shakespeare[len(train): len(train) + 100]))


def test_windows_shift_targets_by_one_and_stay_in_byte_range(shakespeare):
    windows = TokenWindows(shakespeare, seq_len=32)
    assert len(windows) == (len(shakespeare) - 1) // 32
    inputs, targets = windows.batch(torch.tensor([0, 5, len(windows) - 1]))
    assert inputs.shape == targets.shape == (3, 32) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert torch.equal(inputs[1], torch.from_numpy(np.asarray(shakespeare[160:192], dtype=np.int64)))
    assert 0 <= int(inputs.min()) and int(inputs.max()) <= 255


def test_digits_split_is_fixed():
    train, val = load_digits_split(0.1)
    assert len(train) + len(val) == 1797 and train.images.shape[1:] == (1, 8, 8)
    assert 0.0 <= float(train.images.min()) and float(train.images.max()) <= 1.0


@pytest.mark.parametrize("micro_batch", [1, 2])
def test_each_global_step_has_the_same_samples_whatever_the_world_size(micro_batch):
    reference = GlobalBatchSampler(num_samples=103, global_batch=8, seed=3)
    for world in (1, 2, 4):
        sampler = GlobalBatchSampler(num_samples=103, global_batch=8, seed=3)
        for step in range(40):  # crosses three epoch boundaries
            gathered = torch.cat([
                torch.cat(sampler.micro_batches(step, rank, world, micro_batch)) for rank in range(world)
            ])
            assert torch.equal(gathered, reference.global_indices(step)), (world, step)


def test_ranks_read_disjoint_slices():
    sampler = GlobalBatchSampler(num_samples=1000, global_batch=16, seed=0)
    slices = [set(sampler.rank_indices(5, rank, 4).tolist()) for rank in range(4)]
    assert all(len(s) == 4 for s in slices)
    assert len(set.union(*slices)) == 16


def test_an_epoch_visits_every_sample_once_and_the_seed_changes_the_order():
    sampler = GlobalBatchSampler(num_samples=64, global_batch=8, seed=1)
    epoch = torch.cat([sampler.global_indices(step) for step in range(8)])
    assert sorted(epoch.tolist()) == list(range(64))
    other = GlobalBatchSampler(num_samples=64, global_batch=8, seed=2)
    assert not torch.equal(other.global_indices(0), sampler.global_indices(0))
    assert not torch.equal(sampler.global_indices(8), sampler.global_indices(0))  # next epoch reshuffles


def test_a_fresh_sampler_resumes_at_any_step():
    first = GlobalBatchSampler(num_samples=50, global_batch=4, seed=9)
    expected = [first.global_indices(step) for step in range(30)]
    resumed = GlobalBatchSampler(num_samples=50, global_batch=4, seed=9)
    assert torch.equal(resumed.global_indices(17), expected[17])


def test_files_as_documents_begin_where_each_play_begins(shakespeare):
    starts = document_starts("shakespeare", "files", shakespeare)
    assert len(starts) == 42 and starts[0] == 0
    text = bytes(shakespeare)
    # each document is one file and the newline after it
    assert all(text[start - 1] == ord("\n") for start in starts[1:])
    assert text[starts[-1]:].rstrip(b"\n") == source_files("shakespeare")[-1].read_bytes().rstrip(b"\n")


def test_paragraphs_as_documents_begin_after_every_blank_line():
    tokens = np.frombuffer(b"one\n\ntwo\nlines\n\n\nthree", dtype=np.uint8)
    starts = document_starts("shakespeare", "paragraphs", tokens)
    assert [bytes(tokens[a:b]) for a, b in zip(starts, [*starts[1:], len(tokens)], strict=True)] == [
        b"one\n\n", b"two\nlines\n\n\n", b"three"]


def test_packed_windows_give_each_token_its_document_and_split_with_the_bytes(shakespeare):
    starts = document_starts("shakespeare", "paragraphs", shakespeare)
    cut = int(len(shakespeare) * 0.95)
    train_starts, val_starts = split_starts(starts, cut)
    train, val = split_tokens(shakespeare, 0.05)
    windows = DocumentWindows(train, 64, train_starts)
    indices = torch.tensor([0, 7, 1000])
    inputs, _ = windows.batch(indices)
    documents = windows.documents(indices)
    assert documents.shape == inputs.shape and documents.dtype == torch.int64
    # a new document begins exactly after a blank line: where the previous two inputs are newlines
    # and this one is not
    rows = inputs.numpy()
    begins = (documents[:, 1:] != documents[:, :-1]).numpy()
    blank = np.zeros_like(begins)
    blank[:, 1:] = (rows[:, :-2] == 10) & (rows[:, 1:-1] == 10) & (rows[:, 2:] != 10)
    assert np.array_equal(begins, blank) and begins.sum() >= 3
    assert val_starts[0] == 0 and np.array_equal(val_starts[1:] + cut, starts[starts > cut])
    assert len(val) == len(shakespeare) - cut
