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

A micro-batch's loss is the mean over its pairs. The rewards logged are beta (pi - r) (SimPO:
beta pi / |a|), their accuracy the share of pairs whose chosen answer's reward is higher, their
margin chosen's less rejected's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

OBJECTIVES = ("sft", "dpo", "ipo", "simpo")
NO_ANSWER = -1  # in `answers`: a target token no answer counts


@dataclass
class PairLogps:
    """Each pair's answers' log-probabilities (sums over their tokens) and their token counts."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


def pair_logps(logits: torch.Tensor, targets: torch.Tensor, answers: torch.Tensor) -> PairLogps:
    """The log-probability of every answer of a micro-batch ([rows, seq, vocab] logits, [rows, seq]
    targets and their `answers`), in fp32, pair after pair in row order."""
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
                     counts[:, 1::2][present])


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
    """The mean of `objective`'s loss over the pairs, and their metrics' sums."""
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
    return losses.sum() / max(pairs, 1), metrics
