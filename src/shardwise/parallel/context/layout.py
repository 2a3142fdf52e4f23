"""Which tokens of a sequence each rank of a context-parallel group holds.

The sequence is cut into equal chunks and each rank holds some of them, in order, as one local
sequence. Two layouts:

- `contiguous`: `cp` chunks, rank r holds chunk r. All-to-all attention uses it: after its
  all-to-all every rank has the whole sequence back in order.
- `head_tail`: `2 cp` chunks, rank r holds chunk r and chunk 2 cp - 1 - r. Under a causal mask a
  query attends to the keys before it, so with contiguous chunks the last rank has `2 cp - 1` times
  the first rank's work; with one early and one late chunk every rank has the same. Ring attention
  uses it.

A layout also says where each local token stands in the whole sequence (`positions`): position
embeddings, RoPE and the causal mask need the global positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class SequenceLayout:
    seq_len: int  # the whole sequence
    size: int  # ranks in the context-parallel group
    chunks_per_rank: int  # 1: contiguous, 2: head-tail

    @classmethod
    def contiguous(cls, seq_len: int, size: int) -> SequenceLayout:
        return cls(seq_len, size, 1)

    @classmethod
    def head_tail(cls, seq_len: int, size: int) -> SequenceLayout:
        return cls(seq_len, size, 2)

    def __post_init__(self) -> None:
        if self.seq_len % self.num_chunks:
            raise ValueError(f"a sequence of {self.seq_len} tokens does not split into {self.num_chunks} equal "
                             f"chunks ({self.chunks_per_rank} on each of {self.size} ranks)")

    @property
    def num_chunks(self) -> int:
        return self.size * self.chunks_per_rank

    @property
    def chunk_len(self) -> int:
        return self.seq_len // self.num_chunks

    @property
    def local_len(self) -> int:
        return self.seq_len // self.size

    def chunks(self, rank: int) -> list[int]:
        """The chunks rank `rank` holds, in the order its local sequence has them."""
        if self.chunks_per_rank == 1:
            return [rank]
        return [rank, self.num_chunks - 1 - rank]

    def chunk_positions(self, chunk: int) -> torch.Tensor:
        """The global positions of chunk `chunk`'s tokens (int64)."""
        return torch.arange(chunk * self.chunk_len, (chunk + 1) * self.chunk_len)

    def positions(self, rank: int) -> torch.Tensor:
        """The global positions of rank `rank`'s local tokens, in local order (int64)."""
        return self._positions[rank]

    @cached_property
    def _positions(self) -> list[torch.Tensor]:
        return [torch.cat([self.chunk_positions(c) for c in self.chunks(rank)]) for rank in range(self.size)]

    def shard(self, full: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """Rank `rank`'s part of `full`, whose dimension `dim` is the whole sequence (a batch of
        tokens, its targets, its document ids): a copy."""
        return full.index_select(dim, self.positions(rank).to(full.device))

    def unshard(self, parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """The whole sequence from every rank's part (in rank order): `shard`'s inverse."""
        order = torch.cat([self.positions(rank) for rank in range(self.size)])
        return torch.cat(parts, dim).index_select(dim, torch.argsort(order).to(parts[0].device))
