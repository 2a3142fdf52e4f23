"""Which samples make up each global step, the same for every strategy and world size.

Global step k is the k-th run of `global_batch` indices through a stream of seeded epoch
permutations. Rank r of W takes the r-th contiguous slice of it and splits that into
micro-batches. So a run on 1 process with 4 accumulation steps and a run on 4 ranks with 1 see
exactly the same samples in step k, and resuming at step k needs nothing but k.
"""

from __future__ import annotations

import torch


class GlobalBatchSampler:
    def __init__(self, num_samples: int, global_batch: int, seed: int) -> None:
        if num_samples < 1:
            raise ValueError("the dataset has no samples")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.seed = seed
        self._epoch = -1
        self._order = torch.empty(0, dtype=torch.int64)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            # int32 where it holds every index: half the memory of a large corpus's order, the same values.
            dtype = torch.int32 if self.num_samples < 2**31 else torch.int64
            self._order = torch.randperm(self.num_samples, generator=generator, dtype=dtype)
            self._epoch = epoch
        return self._order

    def global_indices(self, step: int) -> torch.Tensor:
        """The sample indices of global step `step`, in order."""
        positions = torch.arange(step * self.global_batch, (step + 1) * self.global_batch)
        out = torch.empty(self.global_batch, dtype=torch.int64)
        for epoch in positions.div(self.num_samples, rounding_mode="floor").unique().tolist():
            mask = positions // self.num_samples == epoch
            out[mask] = self._permutation(epoch)[positions[mask] % self.num_samples].long()
        return out

    def rank_indices(self, step: int, rank: int, world_size: int) -> torch.Tensor:
        """This rank's contiguous slice of global step `step`."""
        per_rank = self.global_batch // world_size
        return self.global_indices(step)[rank * per_rank : (rank + 1) * per_rank]

    def micro_batches(self, step: int, rank: int, world_size: int, micro_batch: int) -> list[torch.Tensor]:
        return list(self.rank_indices(step, rank, world_size).split(micro_batch))
