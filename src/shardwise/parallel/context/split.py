"""Context parallelism applied to a model as its authors wrote it.

A model computes attention with `torch.nn.functional.scaled_dot_product_attention(q, k, v,
is_causal=True)` (shardwise's GPT does, and so does transformers' `sdpa` attention). While
`ContextParallel.attending` is open, that function is replaced (as PyTorch's own context parallel
does it) by one that computes causal attention over the group (ring or all-to-all), within the
documents of the batch if it is packed; every other operation of the model runs unchanged on this
rank's tokens. Replacing the function, not intercepting it with a torch function mode, is what
reaches recomputation too: checkpointed blocks run their forward again inside backward, where
the autograd engine leaves torch function modes off. So the model needs only
two things from outside: its inputs and targets split by the layout (`shard`), and its position
embedding (or RoPE) fed the tokens' global positions instead of 0 .. local_len - 1 (`feed_positions`).

Without a group (one rank, no context parallelism) the same replacement applies document masks
alone. One attending context at a time per process (the strategies that compose run one model
per process).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from shardwise.parallel.context.all_to_all import all_to_all_attention
from shardwise.parallel.context.layout import SequenceLayout
from shardwise.parallel.context.ring import SDPA, Ring, RingStats, causal_attention, ring_attention

MODES = ("ring", "all-to-all")


class ContextParallel:
    """One model's context parallelism: `mode` ("ring" or "all-to-all") over `group` (None: one
    rank, document masks only). Sequences of any length the layout splits are taken as they come."""

    def __init__(self, mode: str, group: dist.ProcessGroup | None) -> None:
        if mode not in MODES:
            raise ValueError(f"context-parallel mode {mode!r}: unknown; allowed: {', '.join(MODES)}")
        self.mode = mode
        self.group = group
        self.size = 1 if group is None else group.size()
        self.rank = 0 if group is None else group.rank()
        self.stats = RingStats()  # ring attention's work on this rank, over every call
        self.documents: torch.Tensor | None = None  # of the batch under way, while `attending`

    def layout(self, seq_len: int) -> SequenceLayout:
        """How a sequence of `seq_len` tokens is split: head-tail for ring attention (balanced causal
        work), contiguous for all-to-all (its all-to-all puts the sequence back in order)."""
        split = SequenceLayout.head_tail if self.mode == "ring" else SequenceLayout.contiguous
        return split(seq_len, self.size)

    def shard(self, full: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of `full` (inputs, targets: the whole sequence along `dim`)."""
        return self.layout(full.shape[dim]).shard(full, self.rank, dim)

    def positions(self, local_len: int) -> torch.Tensor:
        """The global positions of this rank's `local_len` tokens, in local order."""
        return self.layout(local_len * self.size).positions(self.rank)

    def feed_positions(self, module: nn.Module, argument: int | str) -> RemovableHandle:
        """Give `module` (a position embedding, a rotary embedding) this rank's global positions in
        place of its argument `argument` (an index for a positional argument, a name for a keyword
        one), which the model fills with 0 .. local_len - 1 (shaped `[local_len]`, or with leading
        dimensions of 1 or of the batch)."""

        def global_positions(local: torch.Tensor) -> torch.Tensor:
            positions = self.positions(local.shape[-1]).to(local.device)
            return positions.view(*[1] * (local.dim() - 1), -1).expand_as(local)

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if isinstance(argument, str):
                return args, {**kwargs, argument: global_positions(kwargs[argument])}
            return (*args[:argument], global_positions(args[argument]), *args[argument + 1:]), kwargs

        return module.register_forward_pre_hook(hook, with_kwargs=True)

    @contextmanager
    def split(self, batch: tuple[torch.Tensor, ...]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's inputs and targets of `batch` ((inputs, targets), or with each input token's
        document for packed documents): its tokens over a group, the whole batch otherwise.
        Inside, the model's attention runs over the group and within the batch's documents; keep it
        open for backward too (recomputation runs the forward again there). The loss over this
        rank's tokens is their mean: every rank of the group holds as many, so the mean over the
        group is the sequence's."""
        inputs, targets, *documents = batch
        documents = documents[0] if documents else None
        if self.group is None and documents is None:
            yield inputs, targets
            return
        with self.attending(documents):
            yield self.shard(inputs), self.shard(targets)

    @contextmanager
    def attending(self, documents: torch.Tensor | None = None) -> Iterator[None]:
        """Inside, the model's causal attention calls run over the group, within `documents` (each
        token's document over the whole sequence, `[batch, seq_len]`) where given. Keep it open for
        backward too where blocks are recomputed there (activation checkpointing)."""
        if F.scaled_dot_product_attention is not SDPA:
            raise RuntimeError("scaled_dot_product_attention is already replaced: one attending context at a time")
        self.documents = documents
        F.scaled_dot_product_attention = self._scaled_dot_product_attention
        try:
            yield
        finally:
            F.scaled_dot_product_attention = SDPA
            self.documents = None

    def _scaled_dot_product_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                      attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                      is_causal: bool = False, scale: float | None = None,
                                      enable_gqa: bool = False) -> torch.Tensor:
        """`scaled_dot_product_attention`'s signature; the causal calls it can compute go to
        `attention` (grouped-query heads whatever `enable_gqa` says), the rest are refused."""
        if attn_mask is not None or not is_causal or dropout_p:
            raise ValueError("context parallelism and document masks compute causal attention "
                             "(scaled_dot_product_attention with is_causal=True, no attn_mask, no dropout); the model "
                             f"called it with attn_mask={None if attn_mask is None else 'a tensor'}, "
                             f"is_causal={is_causal}, dropout_p={dropout_p}")
        return self.attention(query, key, value, scale)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
        """Causal attention of this rank's queries on the whole sequence, as the mode computes it."""
        if self.group is None:
            return causal_attention(q, k, v, self.documents, scale)
        if self.mode == "ring":
            ring = Ring(self.group, self.layout(q.shape[2] * self.size), self.stats)
            return ring_attention(q, k, v, ring, self.documents, scale)
        return all_to_all_attention(q, k, v, self.group, self.documents, scale)
