"""Tensor parallel, ours (`tensor`): every block of each model replica split over its tp ranks
(parallel/tensor.py, as the model family's plan lays it out), the replicas averaging their
gradients over dp."""

from __future__ import annotations

import functools

from torch import nn

from shardwise.config.schema import Config, ConfigError
from shardwise.parallel.tensor import parallelize_blocks
from shardwise.parallel.tensor_group import TensorParallelGroup
from shardwise.strategies.mesh import MeshStrategy


class TensorParallel(MeshStrategy):
    """`tensor`: each replica's blocks split over its tp group; replicas average gradients over dp."""

    @classmethod
    def check_split(cls, cfg: Config, dp: int, pp: int, tp: int) -> None:
        if pp != 1:
            raise ConfigError(f"parallel.pp = {pp}: tensor does not pipeline; use --strategy pipeline "
                              "with --tp, which splits each stage's blocks tensor-parallel")
        if tp < 2:
            raise ConfigError(f"parallel.tp = {tp}: tensor parallel needs at least 2 ranks per model")

    def _split(self, model: nn.Module) -> None:
        """Every block split over tp as the plan lays it out; a meta-built model made real block by
        block, each split as soon as it is real."""
        located = self.locate(model)
        self.view.record_layout(model, [{id(t) for t in model.state_dict(keep_vars=True).values()}])
        self.materialise_outside_blocks(model)
        self.tensor_shards, self.tp_partial = parallelize_blocks(
            located.blocks, located.plan, TensorParallelGroup(self.tp_group), self.cfg.sequence_parallel,
            functools.partial(self.materialised, model), model)
        self.view.record_local_state(model)
