"""Compile per block (`train.compile`): each of the model's `parallel.block` modules runs its forward
through `torch.compile`, regionally, as torchtitan does: one small graph that every identical block
reuses, where compiling the whole model would trace every block and break at each collective.

What is compiled is the block's own forward, in place (`block.forward`), so that:
- the parameters keep their names (checkpoints, weights files and `from_pretrained` see no
  `_orig_mod.` prefix);
- the hooks on the block itself, the sharded strategies' all-gather before and free after, stay
  outside the graph and run eagerly around it, as fsdp needs;
- recomputation (recompute.py), applied after, checkpoints the compiled forward: backward runs the
  compiled forward again, whose saved tensors the checkpoint's hooks keep as they keep eager ones.
Tensor parallel's split, applied later by the strategy, is traced into the graph at the first call
(compiling is lazy), its collectives included.

Blocks share one compiled graph when they hold the same structure: `torch.compile` treats a module's
parameters as inputs, not constants. `BlockCompiler` counts the graphs its backend is handed and the
seconds they take, so the metrics can say that each distinct block compiled once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class BlockCompiler:
    """Compiles blocks' forwards with inductor and counts what it compiles."""

    def __init__(self) -> None:
        self.graphs = 0  # graphs handed to inductor: a block's forward, and again at each recompile or graph break
        self.seconds = 0.0  # inductor's code generation, forward and backward graphs (not dynamo's tracing)

    def _inductor(self, graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        return compile_fx(graph, example_inputs, inner_compile=self._timed)

    def _timed(self, graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor], **kwargs: Any) -> Any:
        """Inductor's code generation for one forward or (at the first backward) backward graph, timed."""
        from torch._inductor.compile_fx import compile_fx_inner

        started = time.perf_counter()
        try:
            return compile_fx_inner(graph, example_inputs, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started

    def compile_blocks(self, model: nn.Module, block_class: str) -> list[nn.Module]:
        """Replace the forward of every `block_class` module of `model` with its compiled version;
        return the blocks. Raises ValueError when the model has none."""
        blocks = [m for m in model.modules() if type(m).__name__ == block_class]
        if not blocks:
            raise ValueError(f"train.compile: the model has no {block_class!r} modules to compile "
                             "(parallel.block names the repeated block)")
        for block in blocks:
            block.forward = torch.compile(block.forward, backend=self._inductor)
        return blocks

    def as_dict(self) -> dict[str, float | int]:
        return {"graphs": self.graphs, "seconds": self.seconds}
