"""What a forward on fake tensors needs to run the real model code (planner/traces.py's trace): the
decisions a model takes by looking at data, which fake tensors do not have, taken as a real run
on shardwise's batches takes them; and which traces are small enough for real tensors."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from unittest import mock

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily

from shardwise.config.schema import HF_MODELS, ModelConfig
from shardwise.materialise import init_context
from shardwise.models import build_model, cross_entropy, moe
from shardwise.models.moe import their_experts

REAL_TRACE_ELEMENTS = 1 << 22  # the most elements a trace on real tensors may hold (16 MiB of float32)


def fits_real_trace(vocab: int, width: int, hidden: int, tokens: int) -> bool:
    """Whether a two-block model (`hidden`: its widest layer's, or its experts', width) and its widest
    activation over `tokens` are small enough to trace on real tensors: they save the same storages
    as fake ones, at a tenth of the dispatch cost (a tiny Llama's forward: 2.4 ms against 25). Fake
    tensors, which hold no memory, trace the rest; their mode allows the balanced counts' real ones."""
    weights = vocab * width + 2 * (4 * width ** 2 + 3 * width * hidden)
    return weights + tokens * max(vocab, hidden, width) <= REAL_TRACE_ELEMENTS


def one_sequence_per_row(model_name: str) -> contextlib.AbstractContextManager:
    """transformers looks at the position ids for several sequences packed into a row, which it
    cannot do on fake tensors, and builds an explicit attention mask instead. A real run on
    shardwise's batches (one window per row) finds none and uses SDPA's causal kernel; so does the
    trace."""
    if model_name not in HF_MODELS:
        return contextlib.nullcontext()
    from transformers import masking_utils

    return mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)


def _balanced_counts(chosen: torch.Tensor, n_experts: int) -> torch.Tensor:
    """`models.moe.expert_counts` for the trace: the pairs of `chosen` [N, k] spread evenly over
    the experts, as real numbers (fake tensors have none to give)."""
    pairs = chosen.numel()
    with unset_fake_temporarily():
        return torch.tensor([pairs // n_experts + (e < pairs % n_experts) for e in range(n_experts)])


def _one_group_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """transformers' grouped matmul (its experts' `grouped_mm` implementation) for the trace: the
    same output and saved input from one matmul, its weight any expert's (the kernel's meta
    function takes bfloat16 only; the output's rows do not depend on which expert computes them),
    outside autocast as the kernel is."""
    with torch.autocast(input.device.type, enabled=False):
        return input @ weight[0]


@contextlib.contextmanager
def balanced_routing(model: nn.Module) -> Iterator[None]:
    """Every MoE layer of `model` computes its (token, expert) pairs without asking the data where
    they go: ours routes them evenly over its experts (`expert_counts`), transformers' grouped
    experts (which ask only for offsets) through one matmul per projection. What a forward saves
    does not depend on the routing (dropless: every pair's rows are computed, by one expert or
    another), so this is what any routing saves; the balance only makes the trace possible."""
    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch.object(moe, "expert_counts", _balanced_counts))
        if their_experts(model):
            from transformers.integrations import moe as their_moe

            patches.enter_context(mock.patch.object(their_moe, "_grouped_mm", _one_group_mm))
        yield


def one_loss_chunk() -> contextlib.AbstractContextManager:
    """The loss over a micro-batch's rows in one chunk: what it saves (the logits and each row's
    log-sum-exp) does not depend on the chunks, and a long sequence's trace would otherwise run
    the chunk loop dozens of times on fake tensors (93 chunks at Qwen3's 40,960 tokens)."""
    return mock.patch.object(cross_entropy, "CHUNK_ELEMENTS", 1 << 62)


@contextlib.contextmanager
def fake_model(cfg: ModelConfig, n_layer: int) -> Iterator[nn.Module]:
    """`cfg`'s model with `n_layer` blocks on fake tensors, for the `with`: its forward runs on real
    token ids, its decisions taken as above, without memory or initialisation. Built on the meta
    device, then each tensor made a fake one on the CPU (what a fake tensor holds is a meta tensor):
    a module that casts itself in its constructor (Inkling's convolutions) cannot swap fake
    parameters there."""
    with init_context():
        model = build_model(dataclasses.replace(cfg, n_layer=n_layer))
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    made: dict[int, torch.Tensor] = {}  # a tied tensor stays one

    def faked(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in made:
            made[id(tensor)] = FakeTensor(fake, tensor, torch.device("cpu"))
            if isinstance(tensor, nn.Parameter):
                made[id(tensor)] = nn.Parameter(made[id(tensor)], requires_grad=tensor.requires_grad)
        return made[id(tensor)]

    for module in model.modules():
        for tensors in (module._parameters, module._buffers):
            for key, tensor in tensors.items():
                if tensor is not None:
                    tensors[key] = faked(tensor)
    with fake, one_sequence_per_row(cfg.name), balanced_routing(model):
        yield model
