"""Activation checkpointing: trade compute for memory by recomputing parts of a block's forward
during backward instead of keeping what they saved.

Policies (`parallel.recompute`):
- `none`: keep everything the forward saves.
- `blocks`: every block keeps only its input; its forward runs again in backward.
- `every:K`: the same for every K-th block (blocks 0, K, 2K, ...).
- `selective`: every block keeps the outputs of its matmuls and attention and recomputes the rest
  (norms, activations, reshapes), which are cheap to redo but as large to keep.

A policy is applied to a built model from outside, by replacing the `forward` of each chosen
`parallel.block` module with a checkpointed call of the original. Hooks on the module itself
(those of the sharded strategies) still run once, around the whole checkpointed forward, and
non-reentrant checkpointing composes with them and with autocast.

A backward split in two (parallel/pipeline/split_backward.py: B now, W later) unpacks some saved tensors twice, in
two backward calls, where torch's checkpoint recomputes the forward for each call or refuses the
second unpack. `once=True` checkpoints with `RecomputedOnce` instead: the first unpack recomputes
the block, and what it recomputed stays until autograd lets go of the block's graph (after W).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    get_device_states,
    set_device_states,
)

from shardwise.memory import hold_while_alive, record_saved, saved_until_gradient

# What `selective` keeps: the expensive ops' outputs.
_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._grouped_mm.default,  # transformers' MoE experts (ours: one mm per expert, or this on CUDA)
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def parse_policy(policy: str) -> tuple[str, int]:
    """`none`, `blocks`, `selective` or `every:K` -> (kind, K); raises ValueError otherwise."""
    if policy in ("none", "blocks", "selective"):
        return policy, 1
    kind, _, every = policy.partition(":")
    if kind == "every" and every.isdigit() and int(every) >= 1:
        return kind, int(every)
    raise ValueError(f"{policy!r}: expected none, blocks, selective or every:K with K >= 1")


def _keep_matmuls(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    """Save the expensive ops' outputs, recompute the rest. What is saved is also reported to the
    activation counter: selective checkpointing stores it itself, out of sight of saved-tensor
    hooks."""
    if op not in _SAVED_OPS:
        return CheckpointPolicy.PREFER_RECOMPUTE
    outputs = ctx.op_output if isinstance(ctx.op_output, tuple) else (ctx.op_output,)
    for output in outputs:
        if isinstance(output, torch.Tensor):
            record_saved(output)
    return CheckpointPolicy.MUST_SAVE


def _checkpointed(forward: Callable, selective: bool) -> Callable:
    options = {}
    if selective:
        options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)

    @functools.wraps(forward)
    def run(*args: object, **kwargs: object) -> object:
        if not selective or not isinstance(args[0], torch.Tensor):
            return checkpoint(forward, *args, use_reentrant=False, **options, **kwargs)
        with saved_until_gradient(args[0]):  # what it keeps lives until the block's backward is done
            return checkpoint(forward, *args, use_reentrant=False, **options, **kwargs)

    return run


class RecomputedOnce:
    """One checkpointed call: the forward keeps only its arguments, each tensor it saves for
    backward becomes an index, and the first unpack (in whichever backward call) runs the forward
    again to fill them in. They are then kept for every later unpack, until autograd frees the
    graph that holds this object; while an activation counter is open, the arguments and the
    recomputed tensors count as held until then."""

    def __init__(self, forward: Callable, args: tuple, kwargs: dict[str, Any]) -> None:
        self.forward, self.args, self.kwargs = forward, args, kwargs
        self.device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        self.autocast = (torch.is_autocast_enabled(self.device.type), torch.get_autocast_dtype(self.device.type))
        self.rng = torch.get_rng_state()
        self.device_rng = get_device_states(*args)
        self.saved: list[torch.Tensor] = []
        self.count = 0  # tensors the forward saved
        for arg in args:
            if isinstance(arg, torch.Tensor):
                hold_while_alive(self, arg)

    def pack(self, tensor: torch.Tensor) -> int:
        self.count += 1
        return self.count - 1

    def unpack(self, index: int) -> torch.Tensor:
        if not self.saved:
            self._recompute()
        return self.saved[index]

    def _recompute(self) -> None:
        args = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in self.args]
        enabled, dtype = self.autocast
        with torch.random.fork_rng(self.device_rng[0], device_type=self.device.type), torch.enable_grad(), \
                torch.autocast(self.device.type, dtype=dtype, enabled=enabled), \
                torch.autograd.graph.saved_tensors_hooks(self._keep, lambda kept: kept):
            torch.set_rng_state(self.rng)
            set_device_states(*self.device_rng, device_type=self.device.type)
            self.forward(*args, **self.kwargs)
        if len(self.saved) != self.count:
            raise RuntimeError(f"recomputing a block saved {len(self.saved)} tensors where its forward saved "
                               f"{self.count}: its forward must not depend on state that changed since")

    def _keep(self, tensor: torch.Tensor) -> None:
        self.saved.append(tensor.detach())  # its data only: the recomputed graph goes
        hold_while_alive(self, tensor)

    @classmethod
    def call(cls, forward: Callable, *args: object, **kwargs: object) -> object:
        once = cls(forward, args, kwargs)
        with torch.autograd.graph.saved_tensors_hooks(once.pack, once.unpack):
            return forward(*args, **kwargs)


def apply_recompute(model: nn.Module, policy: str, block_class: str, once: bool = False) -> list[nn.Module]:
    """Checkpoint the blocks `policy` chooses (modules of class `block_class`); return them. With
    `once`, for a split backward (`blocks` and `every:K` only): each forward recomputed at most once."""
    chosen = recomputed_blocks(model, policy, block_class)
    checkpoint_blocks(chosen, policy, once)
    return chosen


def recomputed_blocks(model: nn.Module, policy: str, block_class: str) -> list[nn.Module]:
    """The blocks `policy` chooses of `model`'s modules of class `block_class` (every K-th of the
    whole model's, counted before a pipeline cuts it)."""
    kind, every = parse_policy(policy)
    if kind == "none":
        return []
    blocks = [m for m in model.modules() if type(m).__name__ == block_class]
    if not blocks:
        raise ValueError(f"parallel.recompute = {policy!r}: the model has no {block_class!r} modules to recompute")
    return blocks[::every]


def checkpoint_blocks(blocks: list[nn.Module], policy: str, once: bool = False) -> None:
    """Recompute each of `blocks`' forward in backward, as `policy` says (`blocks`, `every:K`: the
    whole block; `selective`: what lies between its matmuls, whose outputs are kept); with `once`, at
    most once per forward."""
    kind, _ = parse_policy(policy)
    if once and kind == "selective":
        raise ValueError("parallel.recompute = 'selective' does not compose with a split backward; use blocks")
    for block in blocks:
        if once:
            block.forward = functools.wraps(block.forward)(functools.partial(RecomputedOnce.call, block.forward))
        else:
            block.forward = _checkpointed(block.forward, selective=kind == "selective")


# Elements saved per position and unit of width (s*b*h) by one of our GPT's blocks, in fp32.
# Korthikanti et al. 2022 count s*b*h*(34 + 5*a*s/h) bytes per layer in 16 bits; our block has no
# dropout (no masks: -2 s*b*h, -a*s*s*b) and fused attention, which keeps no s x s scores or
# probabilities (-4 a*s*s*b): 32 s*b*h bytes in 16 bits, i.e. 16 elements. Of them the input
# (1) is the only one a checkpointed block keeps; selective keeps the input, qkv (3), attention
# output (1), the two projections' outputs (1 + 1) and the MLP's up-projection (4).
SAVED_PER_BLOCK = {"none": 16, "blocks": 1, "selective": 11}


def estimate_saved_bytes(n_layer: int, d_model: int, seq_len: int, vocab_size: int, batch: int,
                         policy: str) -> int:
    """Bytes our GPT saves for backward in one fp32 forward of `batch` sequences under `policy`,
    counted from SAVED_PER_BLOCK, plus what lies outside the blocks: the final norm's and the
    head's inputs and the loss's log-probabilities (batch x seq x vocab). Norm statistics and
    attention's log-sum-exp (a few values per position) are left out."""
    outside = 2 * d_model + vocab_size
    return 4 * batch * seq_len * (saved_in_blocks(n_layer, policy) * d_model + outside)


def saved_in_blocks(n_layer: int, policy: str) -> int:
    """SAVED_PER_BLOCK summed over the model's `n_layer` blocks under `policy`."""
    kind, every = parse_policy(policy)
    if kind != "every":
        return n_layer * SAVED_PER_BLOCK[kind]
    checkpointed = -(-n_layer // every)  # blocks 0, K, 2K, ...
    return checkpointed * SAVED_PER_BLOCK["blocks"] + (n_layer - checkpointed) * SAVED_PER_BLOCK["none"]
