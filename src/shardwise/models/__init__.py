"""Built-in models. None of them knows anything about parallelism."""

from __future__ import annotations

import torch
from torch import nn

from shardwise.config.schema import ModelConfig
from shardwise.models.cnn import CNN
from shardwise.models.cross_entropy import IGNORE, cross_entropy_sum
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.models.hf import HF_MODELS, build_causal_lm
from shardwise.models.mlp import MLP
from shardwise.models.moe import MoEConfig

__all__ = ["CNN", "GPT", "GPTConfig", "MLP", "build_model", "flops_per_sample", "loss_fn"]


def build_model(cfg: ModelConfig, image_pixels: int = 64) -> nn.Module:
    """The model a config names, on the CPU, initialised from the current torch seed."""
    if cfg.name in ("gpt", "gpt-moe"):
        moe = None
        if cfg.name == "gpt-moe":
            moe = MoEConfig(cfg.n_experts, cfg.top_k, cfg.d_expert, cfg.router_score, cfg.balance, cfg.aux_loss_coef,
                            cfg.balance_rate, cfg.shared_expert)
        return GPT(GPTConfig(cfg.n_layer, cfg.n_head, cfg.d_model, cfg.seq_len, cfg.vocab_size, cfg.bias, cfg.d_ff,
                             moe))
    if cfg.name in HF_MODELS:
        return build_causal_lm(cfg)
    if cfg.name == "cnn":
        return CNN(cfg.width, cfg.num_classes)
    return MLP(image_pixels, cfg.width, cfg.num_classes)


def flops_per_sample(model: nn.Module) -> int | None:
    """Training FLOPs for one sample (a sequence for the GPT), or None where no estimate exists."""
    if isinstance(model, GPT):
        return model.flops_per_token() * model.cfg.seq_len
    return None


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the targets (tokens or images) that count, computed in fp32: a
    log-softmax over the vocabulary in 16 bits rounds away the small probabilities the gradient
    needs. A target of -100 does not count (a fine-tuning prompt's token: data/samples.py); where
    none counts the loss is 0, with a gradient of 0, not a mean over nothing (no host sync asks)."""
    flat = targets.reshape(-1)
    total = cross_entropy_sum(logits.reshape(-1, logits.shape[-1]), flat)  # float32 a chunk at a time
    return total / (flat != IGNORE).sum().clamp(min=1)
