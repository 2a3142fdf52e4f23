"""Preference pairs (`data.format = "preference"`): each JSON line's `prompt` with a `chosen` and a
`rejected` answer, for the preference objectives (preference.py).

A line holds plain text (three strings, tokenized one after the other, no special tokens added) or
a conversation: `prompt` a list of turns and each answer a list of turns (or one assistant turn's
string), rendered by the tokenizer's chat template, an answer's tokens being what the template
adds after the prompt with the prompt for a reply (samples.py's ChatTemplate, as `chat` counts a
turn). Prepared (prepare.py), a pair is its prompt's, chosen answer's and rejected answer's tokens
one after the other in the token file, their lengths in `pairs.npy`.

In windows (`PairWindows`): a window of model.seq_len + 1 tokens holds one pair, or with
`data.pack_pairs` as many whole pairs as fit in the file's order; each pair as two documents,
prompt + chosen and prompt + rejected (attention stops at each), then padding (a document of its
own). A pair therefore never leaves its window: its two
answers are in the same micro-batch on the same rank under every strategy, a pipeline's chunks
(rows) included. A window's targets carry each token's answer (`answers` of preference.pair_logps:
2 j and 2 j + 1 for its pair j's chosen and rejected answer, -1 elsewhere), so each answer's
log-probability sums its own tokens alone. A pair needs 2 prompt + chosen + rejected tokens <=
seq_len + 1; a longer one is refused naming its line, or with `data.truncate_prompt` its prompt is
cut from the left to fit (at least one token of it kept).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import IO, Any

import numpy as np
import torch

from shardwise.config.schema import ConfigError
from shardwise.data.samples import IGNORED, ChatTemplate
from shardwise.preference import NO_ANSWER

PAD = 0  # the token padding a window's end (its own document; no answer counts it)


def _rendered(template: ChatTemplate, record: dict, where: Callable[[], str]) -> tuple[list[int], list[list[int]]]:
    """A conversation's prompt tokens and each answer's, by the chat template."""
    prompt = record.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        raise ConfigError(f"data.format = 'preference': {where()}: a conversation's `prompt` must be a non-empty list "
                          'of {"role": ..., "content": ...} turns')
    asked = template.render(prompt, reply=True)
    answers = []
    for key in ("chosen", "rejected"):
        answer = record.get(key)
        turns = [{"role": "assistant", "content": answer}] if isinstance(answer, str) else answer
        if not answer or not isinstance(turns, list):
            raise ConfigError(f"data.format = 'preference': {where()}: `{key}` is missing or empty")
        whole = template.render(prompt + turns)
        if whole[: len(asked)] != asked:
            raise ConfigError(f"data.format = 'preference': {where()}: the chat template does not render the `{key}` "
                              "answer as a continuation of the prompt, so its tokens cannot be told apart")
        answers.append(whole[len(asked) :])
    return asked, answers


def tokenize_pairs(records: Iterator[tuple[dict, Callable[[], str]]], tokenizer: Any, seq_len: int,
                   truncate_prompt: bool, tokens: IO[bytes]) -> np.ndarray:
    """Write each pair's prompt, chosen and rejected tokens to `tokens`; return [pairs, 3] lengths.
    `tokenizer`: prepare.Tokenizer (a chat template is read from its directory for conversations)."""
    template = None
    lengths = []
    for record, where in records:
        if isinstance(record.get("prompt"), list):
            template = template or ChatTemplate(tokenizer.name)
            asked, (chosen, rejected) = _rendered(template, record, where)
        else:
            texts = [record.get(key) for key in ("prompt", "chosen", "rejected")]
            for key, text in zip(("prompt", "chosen", "rejected"), texts, strict=True):
                if not isinstance(text, str) or not text:
                    raise ConfigError(f"data.format = 'preference': {where()}: `{key}` is missing or empty (a string, "
                                      "or for a conversation a list of turns)")
            asked, chosen, rejected = (list(tokenizer.ids(text)) for text in texts)
        if chosen == rejected:
            raise ConfigError(f"data.format = 'preference': {where()}: `chosen` and `rejected` are the same answer")
        if not asked or not chosen or not rejected:
            raise ConfigError(f"data.format = 'preference': {where()}: its prompt or an answer has no tokens")
        room = seq_len + 1 - len(chosen) - len(rejected)  # for the prompt, twice
        if 2 * len(asked) > room:
            if not truncate_prompt or room < 2:
                needed = 2 * len(asked) + len(chosen) + len(rejected)
                hint = "" if room < 2 else "; data.truncate_prompt = true cuts its prompt from the left"
                raise ConfigError(f"data.format = 'preference': {where()}: the pair needs {needed} tokens (its prompt "
                                  f"twice, then each answer), more than a window's model.seq_len + 1 = {seq_len + 1}"
                                  f"{hint}")
            asked = asked[len(asked) - room // 2 :]
        for part in (asked, chosen, rejected):
            tokens.write(np.asarray(part).astype(tokenizer.dtype, copy=False).tobytes())
        lengths.append((len(asked), len(chosen), len(rejected)))
    return np.asarray(lengths, dtype=np.int64).reshape(-1, 3)


def pack(lengths: np.ndarray, seq_len: int, several: bool) -> np.ndarray:
    """[windows + 1] boundaries: window w holds pairs [bounds[w], bounds[w + 1]), as many as fit in
    seq_len + 1 tokens in order where `several`, else one."""
    if not several:
        return np.arange(len(lengths) + 1, dtype=np.int64)
    needed = 2 * lengths[:, 0] + lengths[:, 1] + lengths[:, 2]
    bounds, held = [0], 0
    for pair, size in enumerate(needed.tolist()):
        if held + size > seq_len + 1:
            bounds.append(pair)
            held = 0
        held += size
    if len(needed):
        bounds.append(len(needed))
    return np.asarray(bounds, dtype=np.int64)


class PairWindows:
    """Pairs `lengths` ([pairs, 3]) of the token file `tokens` (prepare.TokenFile: each pair's prompt,
    chosen and rejected tokens from `starts[i]`), packed into windows of seq_len + 1 tokens (`pack`).
    `batch(indices)`: the windows' inputs and their targets as [rows, seq_len, 3]: each target
    token (IGNORED where no answer counts it), its answer and its window's id (its index, plus
    `first_id`: a validation set's windows numbered after the training set's, for the reference
    log-probabilities of both in one table)."""

    def __init__(self, tokens: Any, seq_len: int, lengths: np.ndarray, pack_pairs: bool,
                 starts: np.ndarray | None = None, first_id: int = 0) -> None:
        self.tokens, self.seq_len, self.lengths, self.first_id = tokens, seq_len, lengths, first_id
        self.pack_pairs = pack_pairs
        sizes = lengths.sum(axis=1)
        self.starts = np.cumsum(sizes) - sizes if starts is None else starts
        self.bounds = pack(lengths, seq_len, pack_pairs)

    def __len__(self) -> int:
        return len(self.bounds) - 1

    @property
    def most_pairs(self) -> int:
        """The most pairs a window holds."""
        return int(np.diff(self.bounds).max(initial=0))

    def _sequences(self, index: int) -> list[tuple[int, int, int, int]]:
        """Window `index`'s sequences in order: (pair, slot (2 j chosen, 2 j + 1 rejected), offset of its
        answer in the pair's tokens, the answer's length)."""
        sequences = []
        for j, pair in enumerate(range(self.bounds[index], self.bounds[index + 1])):
            asked, chosen, rejected = (int(n) for n in self.lengths[pair])
            sequences += [(pair, 2 * j, asked, chosen), (pair, 2 * j + 1, asked + chosen, rejected)]
        return sequences

    def _layout(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Window `index`'s tokens' answers and documents, from the pairs' lengths alone."""
        width = self.seq_len + 1
        answer = np.full(width, NO_ANSWER, dtype=np.int64)
        document = np.zeros(width, dtype=np.int64)
        at = 0
        for pair, slot, _, count in self._sequences(index):
            asked = int(self.lengths[pair][0])
            answer[at + asked : at + asked + count] = slot
            document[at : at + asked + count] = slot
            at += asked + count
        document[at:] = 2 * (self.bounds[index + 1] - self.bounds[index])  # the padding: a document of its own
        return answer, document

    def _tokens(self, index: int) -> np.ndarray:
        """Window `index`'s tokens: each sequence its pair's prompt then its answer, then padding."""
        row = np.full(self.seq_len + 1, PAD, dtype=np.int64)
        at = 0
        for pair, _, offset, count in self._sequences(index):
            asked, start = int(self.lengths[pair][0]), int(self.starts[pair])
            row[at : at + asked] = self.tokens.read(start, asked)
            row[at + asked : at + asked + count] = self.tokens.read(start + offset, count)
            at += asked + count
        return row

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        window = torch.from_numpy(np.stack([self._tokens(int(i)) for i in indices]))
        answer = torch.from_numpy(np.stack([self._layout(int(i))[0] for i in indices]))
        targets = window[:, 1:].masked_fill(answer[:, 1:] == NO_ANSWER, IGNORED)
        ids = (indices.to(torch.int64) + self.first_id)[:, None].expand_as(targets)
        return window[:, :-1], torch.stack([targets, answer[:, 1:], ids], dim=-1)

    def documents(self, indices: torch.Tensor) -> torch.Tensor:
        """[len(indices), seq_len]: each input token's document (as DocumentWindows.documents), from the
        pairs' lengths (no token read)."""
        return torch.from_numpy(np.stack([self._layout(int(i))[1][:-1] for i in indices]))

    def split(self, fraction: float) -> tuple[PairWindows, PairWindows]:
        """The pairs before the last `fraction` of them, and those (whole pairs each; the second's
        windows numbered after the first's)."""
        cut = len(self.lengths) - max(1, int(len(self.lengths) * fraction))
        train = PairWindows(self.tokens, self.seq_len, self.lengths[:cut], self.pack_pairs, self.starts[:cut])
        return train, PairWindows(self.tokens, self.seq_len, self.lengths[cut:], self.pack_pairs, self.starts[cut:],
                                  len(train))
