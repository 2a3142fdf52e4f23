"""Fine-tuning samples (`data.format`): chat conversations and prompt/completion pairs, each
tokenized with a mask of the tokens the loss counts.

- `chat`: each JSON line's `messages`, a list of `{"role": ..., "content": ...}` turns, rendered
  by the tokenizer's own chat template (its `tokenizer_config.json`, read offline through
  transformers). The loss counts the assistant turns' tokens: for each assistant turn, the tokens
  the template adds for it after the conversation before it with the prompt for a reply
  (`add_generation_prompt`), which is its content and its end-of-turn marker. The template must
  render each conversation as a prefix of the next longer one (every common one does); a sample
  whose rendering breaks that, or that has no assistant turn, is refused naming its line.
- `completion`: each JSON line's `prompt` and `completion`, tokenized one after the other (no
  special tokens added); the loss counts the completion's tokens.

Samples are packed: one after another into the corpus's token file, each its own document
(`data.documents = "files"`, set for these formats), so a window may hold several and attention
stops at every boundary; nothing is spent on padding. Beside the token file, `mask.bin` holds one
byte per token, 1 where the loss counts it; a window's targets are -100 (cross-entropy's ignored
value) where it does not (`MaskedWindows`). A window whose targets are all ignored contributes
nothing (models.loss_fn). The windows, the sampler and so exact resume are those of any corpus.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from shardwise.config.schema import ConfigError
from shardwise.data.documents import DocumentWindows

IGNORED = -100  # cross-entropy's ignore_index: a target the loss does not count


class ChatTemplate:
    """The chat template of the transformers tokenizer in `directory`, read offline."""

    def __init__(self, directory: str) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ConfigError("data.format = 'chat': rendering conversations needs transformers "
                              "(pip install 'shardwise[hf]')") from None
        if not Path(directory).is_dir():
            raise ConfigError(f"data.format = 'chat': data.tokenizer = {directory!r} must be a tokenizer's directory "
                              "(its tokenizer_config.json holds the chat template)")
        self.tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ConfigError(f"data.format = 'chat': the tokenizer in {directory} has no chat template "
                              "(tokenizer_config.json's chat_template); use data.format = 'completion'")

    def render(self, messages: list[dict[str, str]], reply: bool = False) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=reply)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in transformers 5

    def ids_and_mask(self, messages: Any, where: Callable[[], str]) -> tuple[np.ndarray, np.ndarray]:
        """The conversation's tokens and their mask (1: an assistant turn's)."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                     and isinstance(m.get("content"), str) for m in messages):
            raise ConfigError(f"data.format = 'chat': {where()}: `messages` must be a list of "
                              '{"role": ..., "content": ...} turns')
        ids = self.render(messages)
        mask = np.zeros(len(ids), dtype=np.uint8)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not turns:
            raise ConfigError(f"data.format = 'chat': {where()}: the conversation has no assistant turn to learn from")
        for i in turns:
            before, through = self.render(messages[:i], reply=True), self.render(messages[: i + 1])
            if ids[: len(through)] != through or through[: len(before)] != before:
                raise ConfigError(f"data.format = 'chat': {where()}: the chat template does not render turn {i + 1} "
                                  "as a continuation of the turns before it, so its tokens cannot be told apart")
            mask[len(before) : len(through)] = 1
        return np.asarray(ids), mask


def tokenize_samples(records: Iterator[tuple[dict, Callable[[], str]]], fmt: str, tokenizer: Any,
                     tokens: IO[bytes], mask: IO[bytes]) -> np.ndarray:
    """Write each record's tokens to `tokens` and their mask to `mask`; return each sample's length.
    `records`: (JSON object, what names where it is, for errors: sources.records); `tokenizer`:
    prepare.Tokenizer (for `chat`, its directory holds the template)."""
    template = ChatTemplate(tokenizer.name) if fmt == "chat" else None
    lengths = []
    for record, where in records:
        if template is not None:
            ids, kept = template.ids_and_mask(record.get("messages"), where)
        else:
            prompt, completion = record.get("prompt"), record.get("completion")
            if not isinstance(prompt, str) or not isinstance(completion, str) or not completion:
                raise ConfigError(f"data.format = 'completion': {where()}: needs a `prompt` and a non-empty "
                                  "`completion` string")
            asked, answered = tokenizer.ids(prompt), tokenizer.ids(completion)
            ids = np.concatenate([asked, answered])
            kept = np.concatenate([np.zeros(len(asked), np.uint8), np.ones(len(answered), np.uint8)])
        tokens.write(ids.astype(tokenizer.dtype, copy=False).tobytes())
        mask.write(kept.tobytes())
        lengths.append(len(ids))
    return np.asarray(lengths, dtype=np.int64)


class MaskedWindows(DocumentWindows):
    """`DocumentWindows` whose targets are `IGNORED` where the loss does not count them (`mask`: one
    byte per token of `tokens`, read alike)."""

    def __init__(self, tokens: Any, seq_len: int, starts: np.ndarray, mask: Any) -> None:
        super().__init__(tokens, seq_len, starts)
        self.mask = mask

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = super().batch(indices)
        counted = torch.from_numpy(self.mask.windows(indices.numpy() * self.seq_len, self.seq_len + 1))[:, 1:]
        return inputs, targets.masked_fill(counted == 0, IGNORED)
