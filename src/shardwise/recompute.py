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
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from shardwise.memory import record_saved, saved_until_gradient

# What `selective` keeps: the expensive ops' outputs.
_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
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


def apply_recompute(model: nn.Module, policy: str, block_class: str) -> list[nn.Module]:
    """Checkpoint the blocks `policy` chooses (modules of class `block_class`); return them."""
    kind, every = parse_policy(policy)
    if kind == "none":
        return []
    blocks = [m for m in model.modules() if type(m).__name__ == block_class]
    if not blocks:
        raise ValueError(f"parallel.recompute = {policy!r}: the model has no {block_class!r} modules to recompute")
    chosen = blocks[::every]
    for block in chosen:
        block.forward = _checkpointed(block.forward, selective=kind == "selective")
    return chosen


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
