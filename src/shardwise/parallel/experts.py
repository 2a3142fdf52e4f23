"""Expert parallel: every MoE layer's experts split over `parallel.ep` ranks, each token sent to
the rank that holds its expert and its output sent back.

The ep ranks are data-parallel ranks (dims.py splits dp into ep x edp): they read different data,
hold the same dense layers, and each holds E / ep of every layer's experts. A layer's forward, on
each of them (`ExpertDispatch`):
1. the router has chosen experts for this rank's tokens; the (token, expert) pairs are sorted by
   expert, so the pairs for each ep rank are one run of rows;
2. an all-to-all of the counts tells each rank how many rows it gets from every other, per expert;
3. an all-to-all of the rows (variable splits) sends each to its expert's rank;
4. there the rows are regrouped by expert and computed, then put back in arrival order;
5. an all-to-all with the splits reversed returns every output to the rank its token came from.
Backward runs the two row all-to-alls in reverse (`AllToAll`), so every rank takes part in every
layer's collectives even when none of its tokens chose a remote expert or none reached its own.

Gradients: a dense parameter's are averaged over dp as any replica's are (the strategy's own
reduction). An expert's gradient on its rank already sums what every ep rank's tokens contributed
(the all-to-all's backward brought them); it is summed over the edp ranks that hold the same
experts and divided by dp, the same mean over the global batch: under ddp here
(`average_gradients`), under zero1, zero2 and fsdp by their own reduce-scatter over edp (fsdp.py's
`ShardGroup`). Clipping counts each expert once: under ddp the squares of the expert gradients
are summed over ep.

Checkpoints hold each layer's expert weights as one tensor [E, ...], a DTensor sharded on dim 0
over ep: a checkpoint loads into any ep size, and into strategies without experts split.

The experts are ours (models/moe.py's MoE layers) or transformers' (`TheirExperts`: Mixtral's,
Qwen3-MoE's experts modules, their forward called as written on the rows that reach them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from shardwise.gradients import clip_coefficient, squared_norm
from shardwise.models.moe import combine_pairs, expert_counts, moe_layers, their_experts
from shardwise.parallel.comm import all_reduce_packed
from shardwise.parallel.dims import Mesh


class Exchange:
    """All-to-alls over the ep ranks' `group`, timed: `seconds` spent in them since the last
    `take_seconds` (forward and backward, the counts' and the rows'), their share of a step."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.seconds = 0.0

    def __call__(self, x: torch.Tensor, received: list[int] | None, sent: list[int] | None) -> torch.Tensor:
        """Rows of `x` sent in runs of `sent[r]` rows to rank r; the rows received, `received[r]`
        from rank r, in rank order (None: equal runs)."""
        started = time.perf_counter()
        out = x.new_empty((sum(received), *x.shape[1:])) if received is not None else torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), received, sent, group=self.group)
        self.seconds += time.perf_counter() - started
        return out

    def take_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


class AllToAll(torch.autograd.Function):
    """Rows of `x` sent by `exchange` in runs of `sent[r]` rows to rank r; returns the rows received,
    `received[r]` from rank r, in rank order. Backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, received: list[int], sent: list[int],
                exchange: Exchange) -> torch.Tensor:
        ctx.splits, ctx.exchange = (received, sent), exchange
        return exchange(x, received, sent)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
        received, sent = ctx.splits
        return ctx.exchange(grad, sent, received), None, None, None


class ExpertDispatch:
    """A MoE layer's dispatch when its experts are split over the `size` ranks `exchange` talks to
    (this rank holds experts [rank x E / ep, (rank + 1) x E / ep))."""

    def __init__(self, exchange: Exchange, size: int) -> None:
        self.exchange, self.size = exchange, size

    def __call__(self, rows: torch.Tensor, counts: torch.Tensor,
                 experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        local = counts.numel() // self.size
        # [sender, local expert]: the rows each rank sends each of ours
        arriving = self.exchange(counts, None, None).view(self.size, local)
        # The splits, on the host for the all-to-alls: one copy of both.
        splits = torch.stack([counts.view(self.size, local).sum(1), arriving.sum(1)]).tolist()
        sent, received = splits
        arrived = AllToAll.apply(rows, received, sent, self.exchange)
        # Arrived rows come sender by sender, each sender's by expert: regroup them by expert.
        expert = torch.arange(local, device=counts.device).repeat(self.size).repeat_interleave(
            arriving.flatten(), output_size=arrived.shape[0])
        by_expert = expert.argsort(stable=True)
        computed = experts(arrived[by_expert], arriving.sum(0))
        if arrived.requires_grad and not computed.requires_grad:  # no row for any expert here: still in the graph,
            computed = computed + arrived * 0  # so that this rank's backward runs both all-to-alls as the others do
        in_arrival_order = torch.empty_like(computed).index_copy(0, by_expert, computed)
        return AllToAll.apply(in_arrival_order, sent, received, self.exchange)


class TheirExperts:
    """A transformers experts module's forward under expert parallel (models/moe.py's
    `their_experts`), called with the tokens, their chosen experts [N, k] and weights [N, k]; it
    returns the tokens' weighted sums. Here the (token, expert) pairs are sorted and dispatched as ours are, and on the
    experts' rank the module's own forward computes each arrived row with its one expert at weight 1:
    their code, unchanged, on their weights."""

    def __init__(self, forward: Callable[..., torch.Tensor], dispatch: ExpertDispatch, n_experts: int) -> None:
        self.forward, self.dispatch, self.n_experts = forward, dispatch, n_experts

    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        counts = expert_counts(top_k_index, self.n_experts)
        return combine_pairs(hidden, top_k_index, top_k_weights, counts,
                             lambda rows, per_expert: self.dispatch(rows, per_expert, self._compute))

    def _compute(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        expert = torch.repeat_interleave(torch.arange(counts.numel(), device=rows.device), counts).unsqueeze(1)
        return self.forward(rows, expert, torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device))


class ExpertParallel:
    """The experts of a strategy's model split over the mesh's ep ranks: which parameters are
    experts, and what the strategy does differently for them."""

    def __init__(self, mesh: Mesh, model: nn.Module) -> None:
        self.mesh = mesh
        self.size, self.rank = mesh.size("ep"), mesh.rank("ep")
        self.readers = mesh.size("dp") * mesh.size("cp")  # the ranks reading different tokens
        # ep's ranks; and the ranks holding the same experts (the edp ranks, and their cp ranks)
        self.group, self.replicas = mesh.group("ep"), mesh.group("edp_cp")
        self.exchange = Exchange(self.group)  # every MoE layer's all-to-alls, timed together
        self.model = model  # what parameters are named by
        self.full_shapes: dict[str, torch.Size] = {}  # expert parameter name -> its shape with every expert
        self.params: list[nn.Parameter] = []  # this rank's experts, as split so far
        self._ids: set[int] = set()

    def split(self, module: nn.Module, prefix: str | None = None) -> None:
        """Keep this rank's share of the experts of every MoE layer in `module` (real now, the same
        on every rank: the model, or a block being made), ours or transformers', and route the
        layers through `ExpertDispatch`. Its parameters are named as in the model, or, given its
        `prefix` there, as `prefix.name` (a pipeline's block on a later stage of this rank, which the
        model no longer holds)."""
        if prefix is None:
            names = {id(p): name for name, p in self.model.named_parameters()}
        else:
            names = {id(p): f"{prefix}.{name}" for name, p in module.named_parameters()}
        for layer in moe_layers(module):
            self._keep_share(layer.experts, names)
            layer.dispatch = ExpertDispatch(self.exchange, self.size)
        for experts in their_experts(module):
            n_experts = experts.num_experts
            self._keep_share(experts, names)
            experts.num_experts = n_experts // self.size
            experts.forward = TheirExperts(experts.forward, ExpertDispatch(self.exchange, self.size), n_experts)

    def _keep_share(self, experts: nn.Module, names: dict[int, str]) -> None:
        """Replace each of `experts`' parameters (stacked by expert on dim 0) by this rank's rows."""
        for key, param in list(experts.named_parameters(recurse=False)):
            share = param.shape[0] // self.size
            self.full_shapes[names[id(param)]] = param.shape
            kept = param.detach()[self.rank * share : (self.rank + 1) * share].clone()
            setattr(experts, key, nn.Parameter(kept, requires_grad=param.requires_grad))
            self.params.append(getattr(experts, key))
            self._ids.add(id(self.params[-1]))

    def is_expert(self, param: torch.Tensor) -> bool:
        return id(param) in self._ids

    def holds(self, name: str) -> bool:
        """Whether parameter `name` is split over ep."""
        return name in self.full_shapes

    def broadcast(self) -> None:
        """Every expert as the first of its replicas holds it (what a replica's broadcast from rank 0
        is for the dense parameters)."""
        with torch.no_grad():
            for param in self.params:
                dist.broadcast(param, group=self.replicas, group_src=0)

    def average_gradients(self) -> None:
        """Each expert's gradient, summed over its replicas (edp, and cp's ranks, which hold other
        tokens of the same sequences), over the ranks reading different tokens (dp x cp): the mean
        over the global batch. An expert no token reached on any rank has a zero gradient, not none."""
        grads = []
        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            grads.append(param.grad)
        if self.readers > self.size:
            all_reduce_packed(grads, self.replicas, average=False)
        torch._foreach_div_(grads, float(self.readers))

    def clip_grad_norm_(self, grads: Sequence[torch.Tensor], max_norm: float, device: torch.device) -> torch.Tensor:
        """Scale `grads` (this rank's, experts among them) to a global norm of at most `max_norm`;
        the dense ones are the same on every ep rank and count once, the experts' are summed over ep."""
        held = {id(p.grad) for p in self.params}
        experts = [g for g in grads if id(g) in held]
        dense = [g for g in grads if id(g) not in held]
        expert_squares = squared_norm(experts, device).to(device)
        dist.all_reduce(expert_squares, group=self.group)
        norm = (squared_norm(dense, device).to(device) + expert_squares).sqrt()
        coefficient = clip_coefficient(norm, max_norm)
        for grad in grads:
            grad.mul_(coefficient.to(grad.device))
        return norm

    def as_global(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """`local`, this rank's experts of parameter `name` (or its optimizer state), as a DTensor
        of every expert, sharded on dim 0 over ep."""
        from torch.distributed.tensor import DTensor, Shard

        full = self.full_shapes[name]
        stride = torch.empty(full, device="meta").stride()
        return DTensor.from_local(local, self.mesh["ep"], [Shard(0)], run_check=False, shape=full, stride=stride)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """Every expert of a parameter, from each ep rank's share (collective over ep)."""
        shares = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(shares, local.contiguous(), group=self.group)
        return torch.cat(shares)


def balance_routers(model: nn.Module, groups: tuple[dist.ProcessGroup, ...], experts: ExpertParallel | None,
                    device: torch.device,
                    whole_model: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, list] | None:
    """After an optimizer step: each of `model`'s MoE layers' pairs per expert over the step, summed
    over `groups` in turn (the ranks that route different tokens: dp and cp, and under sequence
    parallel tp), balance its router (moe.py).
    Return the step's routing record: pairs per expert and their imbalance (max / mean) per layer,
    under expert parallel also the pairs each ep rank computed and the seconds this rank spent in
    all-to-alls; None for a model without MoE layers. `whole_model`: the whole model's counts, in
    model order, from this rank's (a pipeline's stages gather theirs, a collective; called even
    where this rank holds no MoE layer), None where this rank holds every layer."""
    layers = moe_layers(model)
    if not layers and whole_model is None:
        return None
    routed = torch.stack([torch.zeros(layer.cfg.n_experts, dtype=torch.int64, device=device)
                          if layer.routed is None else layer.routed for layer in layers]) if layers else \
        torch.zeros(0, 0, dtype=torch.int64, device=device)
    for group in groups if layers else ():
        dist.all_reduce(routed, group=group)
    for layer, counts in zip(layers, routed, strict=True):
        layer.update_balance(counts)
    if whole_model is not None:
        routed = whole_model(routed)
    load = routed.float()
    stats = {"tokens_per_expert": routed.tolist(),
             "imbalance": (load.max(1).values / load.mean(1).clamp(min=1)).tolist()}
    if experts is not None:
        by_rank = routed.view(routed.shape[0], experts.size, -1).sum(-1)
        rank_load = by_rank.float()
        stats.update(tokens_per_ep_rank=by_rank.tolist(),
                     ep_imbalance=(rank_load.max(1).values / rank_load.mean(1).clamp(min=1)).tolist(),
                     all_to_all_s=experts.exchange.take_seconds())
    return stats
