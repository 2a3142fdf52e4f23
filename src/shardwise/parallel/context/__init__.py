"""Attention over a sequence split across the ranks of a context-parallel group.

`layout` says which tokens each rank holds; `ring` computes causal attention by passing keys and
values around the ranks (head-tail layout, balanced causal work); `all_to_all` by exchanging the
sequence split for a head split around attention (DeepSpeed's Ulysses). Both honour document
masks (packed sequences: no query sees another document's keys). `blocks` is the blockwise
attention math ring attention is made of.
"""

from shardwise.parallel.context.all_to_all import all_to_all_attention
from shardwise.parallel.context.layout import SequenceLayout
from shardwise.parallel.context.ring import Ring, RingStats, causal_attention, ring_attention

__all__ = ["Ring", "RingStats", "SequenceLayout", "all_to_all_attention", "causal_attention", "ring_attention"]
