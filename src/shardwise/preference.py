"""Preference objectives (`train.objective`): DPO, IPO and SimPO on pairs of answers to one prompt,
from each answer's log-probability under the policy (and, but for SimPO, under a reference).

An answer's log-probability is the sum of its tokens' (`pair_logps`: a micro-batch's answers are
told apart by `answers`, each target token's answer in its row: 2 j for pair j's chosen answer,
2 j + 1 for its rejected one, -1 for a token no answer counts), so several pairs packed in one
window stay apart. With pi the policy's and r the reference's log-probabilities, c and r
subscripts the chosen and rejected answers, |a| an answer's tokens (the losses as TRL computes
them):

- `dpo` (Rafailov et al., 2023; DPOTrainer's `sigmoid`): -log sigmoid(beta ((pi_c - r_c) - (pi_r - r_r)));
- `ipo` (Azar et al., 2023; DPOTrainer's `ipo`, each log-ratio averaged over its answer's tokens):
  ((pi_c - r_c) / |c| - (pi_r - r_r) / |r| - 1 / (2 beta))^2;
- `simpo` (Meng et al., 2024; CPOTrainer's `simpo` with cpo_alpha 0), no reference, log-probabilities
  averaged over their tokens: -log sigmoid(beta (pi_c / |c| - pi_r / |r|) - gamma).

A micro-batch's loss is the mean over its windows of each window's mean over its pairs: every
window weighs alike (as every sequence does for `sft`), so a step's loss is the same whichever
micro-batches, ranks or pipeline chunks its windows are cut into. The rewards logged are beta (pi - r) (SimPO:
beta pi / |a|), their accuracy the share of pairs whose chosen answer's reward is higher, their
margin chosen's less rejected's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed
import torch.nn.functional as F

NO_ANSWER = -1  # in `answers`: a target token no answer counts


@dataclass
class PairLogps:
    """Each pair's answers' log-probabilities (sums over their tokens) and their token counts."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


def pair_logps(logits: torch.Tensor, targets: torch.Tensor, answers: torch.Tensor) -> tuple[PairLogps, torch.Tensor]:
    """The log-probability of every answer of a micro-batch ([rows, seq, vocab] logits, [rows, seq]
    targets and their `answers`), in fp32, pair after pair in row order; and where each pair is
    ([pairs, 2]: its row, its index in the row)."""
    counted = answers != NO_ANSWER
    token_logps = -F.cross_entropy(logits.float().flatten(0, 1), targets.clamp(min=0).flatten(),
                                   reduction="none").view_as(targets)
    slots = answers.clamp(min=0)
    sums = torch.zeros(targets.shape, dtype=torch.float32, device=logits.device)
    sums.scatter_add_(1, slots, token_logps * counted)
    counts = torch.zeros(targets.shape, dtype=torch.float32, device=logits.device)
    counts.scatter_add_(1, slots, counted.float())
    present = counts[:, 0::2] > 0  # a pair's chosen answer has tokens where the pair is in the row
    return PairLogps(sums[:, 0::2][present], sums[:, 1::2][present], counts[:, 0::2][present],
                     counts[:, 1::2][present]), present.nonzero()


@dataclass
class PairMetrics:
    """Sums over a micro-batch's pairs, added up over a step's micro-batches and ranks, then divided by
    `pairs` for metrics.jsonl."""

    pairs: float = 0.0
    reward_chosen: float = 0.0
    reward_rejected: float = 0.0
    accurate: float = 0.0

    def add(self, other: PairMetrics) -> None:
        self.pairs += other.pairs
        self.reward_chosen += other.reward_chosen
        self.reward_rejected += other.reward_rejected
        self.accurate += other.accurate

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([self.pairs, self.reward_chosen, self.reward_rejected, self.accurate], dtype=torch.float64)

    def record(self) -> dict[str, float]:
        """The means metrics.jsonl logs: rewards chosen and rejected, accuracy and margin."""
        n = max(self.pairs, 1.0)
        return {"reward_chosen": self.reward_chosen / n, "reward_rejected": self.reward_rejected / n,
                "reward_accuracy": self.accurate / n, "reward_margin": (self.reward_chosen - self.reward_rejected) / n}


def preference_loss(objective: str, beta: float, gamma: float, policy: PairLogps,
                    reference: PairLogps | None) -> tuple[torch.Tensor, PairMetrics]:
    """`objective`'s loss of each pair, and their metrics' sums."""
    if objective == "simpo":
        chosen, rejected = policy.chosen / policy.chosen_tokens, policy.rejected / policy.rejected_tokens
        losses = -F.logsigmoid(beta * (chosen - rejected - gamma / beta))
        reward_chosen, reward_rejected = beta * chosen.detach(), beta * rejected.detach()
    else:
        chosen, rejected = policy.chosen - reference.chosen, policy.rejected - reference.rejected
        if objective == "dpo":
            losses = -F.logsigmoid(beta * (chosen - rejected))
        else:  # ipo
            losses = (chosen / policy.chosen_tokens - rejected / policy.rejected_tokens - 1 / (2 * beta)) ** 2
        reward_chosen, reward_rejected = beta * chosen.detach(), beta * rejected.detach()
    pairs = losses.numel()
    metrics = PairMetrics(float(pairs), reward_chosen.sum().item(), reward_rejected.sum().item(),
                          (reward_chosen > reward_rejected).sum().item())
    return losses, metrics


class PreferenceObjective:
    """`train.objective`'s loss over a micro-batch of preference windows (data/pairs.py: targets
    [rows, seq_len, 3], each target token, its answer and its window), against the reference
    log-probabilities of every window's answers (`reference`: [windows, pairs, 2], none for SimPO);
    the metrics of the pairs it saw since they were last taken."""

    def __init__(self, objective: str, beta: float, gamma: float) -> None:
        self.objective, self.beta, self.gamma = objective, beta, gamma
        self.reference: torch.Tensor | None = None
        self.metrics = PairMetrics()

    @property
    def needs_reference(self) -> bool:
        return self.objective != "simpo"

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        tokens, answers, windows = targets.unbind(-1)
        policy, where = pair_logps(logits, tokens, answers)
        reference = None
        if self.needs_reference:
            table = self.reference[windows[where[:, 0], 0], where[:, 1]].to(logits.device)
            reference = PairLogps(table[:, 0], table[:, 1], policy.chosen_tokens, policy.rejected_tokens)
        losses, metrics = preference_loss(self.objective, self.beta, self.gamma, policy, reference)
        self.metrics.add(metrics)
        rows = where[:, 0]  # each window's mean over its pairs, then the mean over the windows
        pairs = torch.zeros(len(tokens), device=losses.device).index_add_(0, rows, torch.ones_like(losses))
        per_window = torch.zeros(len(tokens), device=losses.device).index_add_(0, rows, losses)
        held = pairs > 0
        return (per_window[held] / pairs[held]).sum() / held.sum().clamp(min=1)

    def take_metrics(self, group: torch.distributed.ProcessGroup | None = None, prefix: str = "") -> dict[str, float]:
        """The pairs' metrics since last taken, over every rank (each pair counted on each rank that
        computed its loss: a mean is unchanged), named with `prefix`; then started afresh."""
        sums = self.metrics.as_tensor()
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(sums, group=group)
        self.metrics = PairMetrics()
        return {prefix + key: value for key, value in PairMetrics(*sums.tolist()).record().items()}


def empty_reference(datasets: list[Any]) -> torch.Tensor:
    """[windows of `datasets` (PairWindows, numbered one after the other), the most pairs a window
    holds, 2]: the reference table, every entry still to compute (-inf)."""
    total = sum(len(dataset) for dataset in datasets)
    return torch.full((total, max(d.most_pairs for d in datasets), 2), float("-inf"))


def record_answers(run: Any, strategy: Any, model: torch.nn.Module, dataset: Any, indices: torch.Tensor,
                   table: torch.Tensor, real: torch.Tensor | None = None) -> None:
    """The answers' log-probabilities of `dataset`'s windows `indices` (one micro-batch of `run`'s)
    under `model` (held by `strategy`), without gradients, into `table` (the rows where `real`)."""
    with torch.no_grad():
        for batch in run.micro_batches(dataset, [indices]):
            with strategy.context.split(batch) as (inputs, targets), strategy.precision.autocast(run.ctx.device):
                logits = model(inputs)
            policy, where = pair_logps(logits, targets[..., 0], targets[..., 1])
            kept = torch.ones(len(where), dtype=torch.bool) if real is None else real[where[:, 0].cpu()]
            windows = targets[where[:, 0], 0, 2].cpu()[kept]
            table[windows, where[:, 1].cpu()[kept]] = torch.stack([policy.chosen, policy.rejected], 1).cpu()[kept]


def reference_logps(run: Any, datasets: list[Any]) -> torch.Tensor:
    """Every window's answers' log-probabilities under `run`'s model as it is (before the first step:
    the initial or pretrained model; under LoRA, the base model, its adapters' B being zero), in
    evaluation mode (`empty_reference`'s table). Each replica computes its share of the windows, every
    rank the same number of forwards (a short share's last micro-batch repeats window 0 and drops
    it: fsdp gathers over every rank), and the shares are put together on every rank."""
    strategy, micro_batch = run.strategy, run.cfg.train.micro_batch
    table = empty_reference(datasets)
    run.model.eval()
    for dataset in datasets:
        for first in range(0, len(dataset), strategy.data_size * micro_batch):
            mine = first + strategy.data_rank * micro_batch + torch.arange(micro_batch)
            real = mine < len(dataset)
            record_answers(run, strategy, run.model, dataset, torch.where(real, mine, 0), table, real)
    run.model.train()
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(table, op=torch.distributed.ReduceOp.MAX)
    return table


REFERENCE_FILE = "reference.safetensors"  # in the run directory: the reference a resumed run goes on with


def run_reference(run: Any, resumed: bool) -> torch.Tensor:
    """The reference log-probabilities of `run`'s training and validation windows (`train.reference`):
    `pass`, computed before the first step (`reference_logps`) and written to the run directory by
    rank 0, or read from it by a resumed run, whose model has trained since; `copy`, a table to fill
    as each step's and evaluation's windows come (`ReferenceCopy`)."""
    from safetensors.torch import load, save

    from shardwise.atomic_file import write_whole

    if run.cfg.train.reference == "copy":
        return empty_reference([run.train_set, run.val_set])
    path = run.out / REFERENCE_FILE
    if resumed:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: a resumed {run.cfg.train.objective} run needs the reference "
                                    "log-probabilities its first run computed before its first step")
        return load(path.read_bytes())["logps"]
    table = reference_logps(run, [run.train_set, run.val_set])
    if run.ctx.is_main:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, save({"logps": table}))
    return table


class ReferenceCopy:
    """`train.reference = "copy"`: a frozen copy of the initial model (its seed's values, or
    model.weights), built, materialised and split by a strategy of the run's own configuration, so
    held as the policy is (fsdp: 1/N of it on each rank, gathered a unit at a time); it computes the
    answers of the windows each step and each evaluation takes, as they come, in evaluation mode."""

    def __init__(self, cfg: Any, ctx: Any, names: Any) -> None:
        from shardwise.materialise import init_context
        from shardwise.models import build_model
        from shardwise.strategies.classes import make_strategy
        from shardwise.weights import load_weights

        with init_context():
            model = build_model(cfg.model)
        model.requires_grad_(False)
        parallel = cfg.parallel  # a replica of ddp's holds the whole model: the copy needs no gradient buckets
        if parallel.strategy in ("ddp", "ddp-native"):
            parallel = dataclasses.replace(parallel, strategy="single")
        self.strategy = make_strategy(parallel, ctx, cfg.train.seed)
        self.model = self.strategy.wrap(model)
        self.model.eval()
        if cfg.model.weights:
            load_weights(self.strategy, cfg.model.weights, names)

    def held_bytes(self) -> int:
        """The copy's parameters this rank holds: its parts of them, or (a sharded strategy's) its shards."""
        from shardwise.memory import storage_bytes

        tensors = [p for p in self.model.parameters() if p.untyped_storage().size()]
        sharded = getattr(self.strategy, "sharded", None)
        return storage_bytes(tensors + (sharded.shards() if sharded is not None else []))

    def record(self, run: Any, dataset: Any, micro_batches: list[torch.Tensor]) -> None:
        """Each micro-batch's windows' answers into the run's reference table."""
        for indices in micro_batches:
            record_answers(run, self.strategy, self.model, dataset, indices, run.objective.reference)
