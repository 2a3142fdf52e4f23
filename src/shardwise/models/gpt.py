"""A decoder-only transformer (GPT-2 shape): token + position embeddings, pre-LayerNorm blocks of
causal self-attention and a GELU MLP, a weight-tied head. With `moe` set (`gpt-moe`), each block's
MLP is a Mixture-of-Experts layer (moe.py). No parallelism code lives here."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.models.moe import Experts, MoE, MoEConfig, active_parameters


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_head: int
    d_model: int
    seq_len: int
    vocab_size: int
    # Off by default: a bias whose exact gradient is zero (attention's key bias) makes parameter
    # comparisons between summation orders meaningless under Adam (see FACTS-torch-cpu.md).
    bias: bool = False
    d_ff: int | None = None  # the MLP's hidden width; None: 4 x d_model, GPT-2's
    moe: MoEConfig | None = None  # each block's MLP a Mixture-of-Experts layer of these experts


class LayerNorm(nn.LayerNorm):
    """LayerNorm computed in fp32 whatever the input and parameter dtypes: the variance of a
    width-long vector loses its small terms in 16 bits. Returns the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            bias = self.bias.float() if self.bias is not None else None
            return F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), bias, self.eps).to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # Heads are counted from qkv's output, not n_head: a tensor-parallel rank's qkv computes its share.
        q, k, v = self.qkv(x).chunk(3, dim=2)
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        # The fused kernels keep the softmax and its running sums in fp32 even for 16-bit inputs.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        hidden = cfg.d_ff or 4 * cfg.d_model
        self.up = nn.Linear(cfg.d_model, hidden, bias=cfg.bias)
        self.down = nn.Linear(hidden, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """One transformer block; the unit that sharding, pipelining and recomputation work on."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = LayerNorm(cfg.d_model)
        self.mlp = MoE(cfg.d_model, cfg.moe, cfg.bias) if cfg.moe else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        for name, module in self.named_modules():
            self.init_module(module, name)

    def init_module(self, module: nn.Module, name: str) -> None:
        """Initialise `module`'s own parameters (module `name` of this GPT): matrices and embeddings
        normal(0, 0.02), the residual projections' scaled down by depth so the residual stream's
        variance stays put (GPT-2), biases zero, norms one; experts as the MLPs they are, and the
        choice biases of bias balancing zero. The head is the token embedding (tied),
        initialised once, as the embedding. Called for every module when the GPT is built, and by
        shardwise.materialise for each module of a meta-built GPT, under its own generator."""
        if isinstance(module, nn.Linear) and name != "head":
            residual = name.endswith(("attn.proj", "mlp.down", "shared.down"))
            nn.init.normal_(module.weight, mean=0.0, std=self._residual_std if residual else 0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, Experts):
            nn.init.normal_(module.w_up, mean=0.0, std=0.02)
            nn.init.normal_(module.w_down, mean=0.0, std=self._residual_std)
        elif isinstance(module, MoE):
            nn.init.zeros_(module.balance_bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    @property
    def _residual_std(self) -> float:
        return 0.02 / math.sqrt(2 * self.cfg.n_layer)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids [batch, seq] -> logits [batch, seq, vocab]."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters counted once (the tied head is the token embedding); position embeddings
        excluded by default, as they do no matmul work."""
        total = sum(p.numel() for p in self.parameters())
        return total - self.pos_emb.weight.numel() if non_embedding else total

    def active_params(self) -> int:
        """`num_params()` less the experts a token does not go through: those a token computes with."""
        if self.cfg.moe is None:
            return self.num_params()
        idle = sum(p.numel() for p in self.parameters()) - active_parameters(self, self.cfg.moe.top_k)
        return self.num_params() - idle

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6 per active parameter (forward 2, backward 4) plus attention's
        score and value matmuls, 12 * layers * width * sequence (PaLM appendix B)."""
        c = self.cfg
        return 6 * self.active_params() + 12 * c.n_layer * c.d_model * c.seq_len
