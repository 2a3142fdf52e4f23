"""A Mixture-of-Experts feed-forward layer: a router sends each token to `top_k` of `n_experts`
GELU MLPs and adds their outputs, weighted by its scores. No parallelism code lives here: where the
experts are computed is the layer's `dispatch` (all of them here; parallel/experts.py sends tokens
to the ranks that hold theirs).

How a forward goes, for N tokens of width d:
1. Router: scores = softmax or sigmoid of x @ W_r (N x E, in fp32). Each token takes the k experts
   of highest score (plus, under bias balancing, a per-expert bias that only steers the choice);
   its weights are the chosen scores, renormalised to sum to one (Mixtral, Qwen3-MoE, DeepSeek-V3).
2. Dispatch: the N k (token, expert) pairs are sorted by expert, so each expert's tokens are one
   contiguous run of rows. Every pair is computed: no capacity, no token dropped ("dropless"), so
   the layer's result does not depend on how tokens are batched or spread over ranks.
3. Experts: each run of rows through its expert's MLP, as one grouped matmul where the device has
   one (`torch._grouped_mm`, CUDA on Hopper), else one matmul per expert.
4. Combine: each pair's output times its weight, added back to its token's row.

Load balancing (`balance`):
- `aux-loss` (Switch Transformer, Mixtral): coefficient x E x sum_e f_e P_e is added to the loss,
  f_e the fraction of the micro-batch's pairs routed to e, P_e the mean score of e. It is added
  through the layer's output (`AuxLoss`): its gradient flows into the router in backward without
  the training loop ever seeing it, scaled as the micro-batch's loss is (`loss_scale`).
- `bias` (DeepSeek-V3, auxiliary-loss-free): after each optimizer step, every expert's choice bias
  moves by `balance_rate` towards balance: up for an expert that got fewer than its share of the
  step's tokens, down for one that got more (`update_balance`, with the counts summed over the
  step's micro-batches and every data-parallel rank, so it agrees everywhere).
- `none`.

Every layer counts the pairs routed to each expert in training forwards (not in a recomputed
forward, not in evaluation) until `update_balance` takes the counts: the router statistics the
trainer logs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MoEConfig:
    n_experts: int
    top_k: int
    d_expert: int  # each expert's hidden width
    score: str = "softmax"
    balance: str = "aux-loss"
    aux_loss_coef: float = 0.01
    balance_rate: float = 0.001
    shared_expert: bool = False  # a dense MLP of width d_expert that every token also goes through (DeepSeek)


class Experts(nn.Module):
    """`n` GELU MLPs d -> h -> d, their weights stacked: w_up [n, d, h], w_down [n, h, d]. Called on
    rows sorted by expert, `counts[e]` rows for expert e in turn."""

    def __init__(self, n: int, d_model: int, d_hidden: int) -> None:
        super().__init__()
        self.w_up = nn.Parameter(torch.empty(n, d_model, d_hidden))
        self.w_down = nn.Parameter(torch.empty(n, d_hidden, d_model))

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if _grouped_mm_fits(rows, self.w_up, self.w_down):
            offsets = counts.cumsum(0).to(torch.int32)
            hidden = F.gelu(torch._grouped_mm(rows, self.w_up.to(rows.dtype), offs=offsets))
            return torch._grouped_mm(hidden, self.w_down.to(rows.dtype), offs=offsets)
        outputs = [F.gelu(chunk @ up) @ down
                   for chunk, up, down in zip(rows.split(counts.tolist()), self.w_up, self.w_down, strict=True)]
        return torch.cat(outputs)


def _grouped_mm_fits(rows: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether torch's grouped matmul runs here, forward and backward: CUDA on compute capability 9
    or above, with rows 16-byte aligned (its kernel's requirement). Elsewhere (the CPU, whose
    kernel has no backward in torch 2.13) the experts are computed one matmul each."""
    if not (rows.is_cuda and hasattr(torch, "_grouped_mm")):
        return False
    aligned = all(w.shape[-1] * rows.element_size() % 16 == 0 for w in (rows, *weights))
    return aligned and torch.cuda.get_device_capability(rows.device) >= (9, 0)


def compute_here(rows: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
    """Every expert is on this rank: compute them in place (the layer's default dispatch)."""
    return experts(rows, counts)


# What a layer's dispatch is: (rows sorted by expert, this micro-batch's rows per expert, the experts)
# -> each row's expert output, in the same order.
Dispatch = Callable[[torch.Tensor, torch.Tensor, Experts], torch.Tensor]

@contextmanager
def loss_scale(model: nn.Module, scale: float) -> Iterator[None]:
    """Inside, the auxiliary loss each MoE layer of `model` adds in forward is backpropagated as if
    the micro-batch's loss were multiplied by `scale` before its backward (1 / accumulation steps,
    times fp16's loss scale): what the strategies' forward-backward loops open around each
    micro-batch."""
    layers = moe_layers(model)
    before = [layer.loss_scale for layer in layers]
    for layer in layers:
        layer.loss_scale = scale
    try:
        yield
    finally:
        for layer, previous in zip(layers, before, strict=True):
            layer.loss_scale = previous


class AuxLoss(torch.autograd.Function):
    """Returns its input unchanged; in backward, gives `aux` (a scalar loss) the gradient it would
    get had it been added to the micro-batch's loss: that loss's scale."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, aux: torch.Tensor,
                scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
        return grad, torch.full((), ctx.scale, device=grad.device), None


def _recomputing() -> bool:
    """Whether this forward runs inside backward: a checkpointed block's forward run again."""
    return torch._C._current_graph_task_id() != -1


class MoE(nn.Module):
    def __init__(self, d_model: int, cfg: MoEConfig, bias: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(d_model, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, d_model, cfg.d_expert)
        self.shared = SharedExpert(d_model, cfg.d_expert, bias) if cfg.shared_expert else None
        # DeepSeek-V3's choice bias: part of the model's state (checkpointed), never trained by gradients.
        self.register_buffer("balance_bias", torch.zeros(cfg.n_experts))
        self.routed: torch.Tensor | None = None  # pairs per expert in this step's training forwards so far
        self.dispatch: Dispatch = compute_here
        self.loss_scale = 1.0  # what its micro-batch's loss is multiplied by before backward (`loss_scale`)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For tokens x [N, d]: the chosen experts [N, k], their weights [N, k] and every expert's
        score [N, E] (fp32)."""
        logits = self.router(x).float()
        scores = logits.softmax(-1) if self.cfg.score == "softmax" else logits.sigmoid()
        steered = scores + self.balance_bias if self.cfg.balance == "bias" else scores
        chosen = steered.topk(self.cfg.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        return chosen, weights / weights.sum(-1, keepdim=True), scores

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        chosen, weights, scores = self.route(x)
        counts = expert_counts(chosen, self.cfg.n_experts)
        if self.training and not _recomputing():
            self.routed = counts if self.routed is None else self.routed + counts
        y = combine_pairs(x, chosen, weights, counts, lambda rows, per_expert: self.dispatch(rows, per_expert,
                                                                                            self.experts))
        if self.shared is not None:
            y = y + self.shared(x)
        if self.cfg.balance == "aux-loss" and self.training:
            fraction = counts.float() / chosen.numel()
            aux = self.cfg.aux_loss_coef * self.cfg.n_experts * (fraction * scores.mean(0)).sum()
            y = AuxLoss.apply(y, aux, self.loss_scale)
        return y.view(shape)

    @torch.no_grad()
    def update_balance(self, routed: torch.Tensor) -> None:
        """After an optimizer step, given the step's pairs per expert over every rank (`routed`):
        under bias balancing, move each expert's choice bias towards balance. Every rank passes the
        same counts, so the biases stay equal."""
        if self.cfg.balance == "bias":
            self.balance_bias += self.cfg.balance_rate * torch.sign(routed.float().mean() - routed.float())
        self.routed = None


def expert_counts(chosen: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Pairs routed to each of `n_experts` experts by `chosen` [N, k]. (Data-dependent: the
    planner's trace on fake tensors replaces it by a balanced count.)"""
    return torch.bincount(chosen.flatten(), minlength=n_experts)


def combine_pairs(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor,
                  compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Tokens x [N, d] routed to `chosen` [N, k] experts with `weights` [N, k] (`counts` pairs per
    expert): the (token, expert) pairs sorted by expert, computed by `compute(rows, counts)`, and
    each pair's output, weighted, added back to its token's row."""
    order = chosen.flatten().argsort(stable=True)
    token = order // chosen.shape[1]  # the token of each pair, pairs sorted by expert
    out = compute(x[token], counts)
    weighted = out * weights.flatten()[order].unsqueeze(-1).to(out.dtype)
    return torch.zeros_like(x, dtype=weighted.dtype).index_add_(0, token, weighted).to(x.dtype)


class SharedExpert(nn.Module):
    """A GELU MLP every token goes through besides its routed experts."""

    def __init__(self, d_model: int, d_hidden: int, bias: bool) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, d_hidden, bias=bias)
        self.down = nn.Linear(d_hidden, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def moe_layers(model: nn.Module) -> list[MoE]:
    """The model's MoE layers, in model order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def their_experts(module: nn.Module) -> list[nn.Module]:
    """transformers' experts modules in `module` (Mixtral's, Qwen3-MoE's, DeepSeek-V3's): a class
    `*Experts` with `num_experts`, every parameter stacked by expert on dim 0, called with the
    tokens, their chosen experts and their weights."""
    return [m for m in module.modules() if type(m).__name__.endswith("Experts") and isinstance(
        getattr(m, "num_experts", None), int) and all(p.shape[0] == m.num_experts for p in m.parameters())]


def active_parameters(model: nn.Module, top_k: int) -> int:
    """The parameters a token computes with: all of them, less the experts it is not routed to
    (`n - top_k` of each layer's `n`), ours or transformers'."""
    experts = [(layer.experts, layer.cfg.n_experts) for layer in moe_layers(model)]
    experts += [(module, module.num_experts) for module in their_experts(model)]
    idle = sum(sum(p.numel() for p in module.parameters()) * (n - top_k) // n for module, n in experts)
    return sum(p.numel() for p in model.parameters()) - idle
