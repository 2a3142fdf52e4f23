"""Preference objectives (issue 71): DPO, IPO and SimPO from the answers' log-probabilities, held to
TRL's own code on the same policy and reference log-probabilities; answers packed in one row kept
apart."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from shardwise.preference import NO_ANSWER, PairLogps, pair_logps, preference_loss

PAIRS, LENGTH, BETA, GAMMA = 6, 12, 0.1, 0.5


def answers_and_logps(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's layout: [chosen rows; rejected rows] of LENGTH + 1 tokens, a prompt then an answer of
    2 to 8 tokens then padding; each predicted token's log-probability (0 outside answers); and the
    reference's log-probability of each answer."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.zeros(2 * PAIRS, LENGTH + 1, dtype=torch.long)
    for row in range(2 * PAIRS):
        start = int(torch.randint(1, 4, (), generator=generator))
        mask[row, start : start + int(torch.randint(2, 9, (), generator=generator))] = 1
    logps = -torch.rand(2 * PAIRS, LENGTH, generator=generator, dtype=torch.float64).float() * 3 * mask[:, 1:]
    reference = logps.sum(1) + torch.randn(2 * PAIRS, generator=generator) * 0.5
    return mask, logps, reference[:PAIRS], reference[PAIRS:]


def ours(objective: str, mask: torch.Tensor, logps: torch.Tensor, ref_chosen: torch.Tensor,
         ref_rejected: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    sums, counts = logps.sum(1), mask.sum(1).float()
    policy = PairLogps(sums[:PAIRS], sums[PAIRS:], counts[:PAIRS], counts[PAIRS:])
    reference = PairLogps(ref_chosen, ref_rejected, counts[:PAIRS], counts[PAIRS:])
    loss, metrics = preference_loss(objective, BETA, GAMMA, policy, None if objective == "simpo" else reference)
    return loss, metrics.record()


def trl_dpo(loss_type: str, mask: torch.Tensor, logps: torch.Tensor, ref_chosen: torch.Tensor,
            ref_rejected: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """DPOTrainer._compute_loss itself, on a stand-in model returning `logps` as its per-token
    log-probabilities and the reference's precomputed (TRL's precompute_ref_log_probs)."""
    from trl import DPOTrainer

    class Model(torch.nn.Module):
        def forward(self, **kwargs: object) -> SimpleNamespace:
            zeros = torch.zeros_like(logps)
            return SimpleNamespace(log_probs=logps, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())

    model = Model()
    metrics: defaultdict = defaultdict(lambda: defaultdict(list))
    trainer = SimpleNamespace(
        model=model, accelerator=SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t,
                                                 gather_for_metrics=lambda t: t),
        ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type],
        loss_weights=[1.0], beta=BETA, aux_loss_enabled=False, _metrics=metrics, _total_train_tokens=0, _tp_size=1,
        use_weighting=False, label_smoothing=0.0)
    inputs = {"input_ids": torch.ones_like(mask), "attention_mask": torch.ones_like(mask), "completion_mask": mask,
              "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}
    loss = DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)
    return loss, {key: metrics["train"][f"rewards/{name}"][0] for key, name in (
        ("reward_chosen", "chosen"), ("reward_rejected", "rejected"), ("reward_accuracy", "accuracies"),
        ("reward_margin", "margins"))}


def trl_simpo(mask: torch.Tensor, logps: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """CPOTrainer.cpo_loss itself (loss_type "simpo", cpo_alpha 0: the loss is the mean of its
    losses), on the answers' mean log-probabilities (its get_batch_logps' average_log_prob), and the
    metrics as its get_batch_loss_metrics computes them."""
    from trl.experimental.cpo import CPOTrainer

    average = logps.sum(1) / mask.sum(1)
    trainer = SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=GAMMA, beta=BETA, label_smoothing=0.0,
                              accelerator=SimpleNamespace(device=torch.device("cpu")))
    losses, chosen, rejected = CPOTrainer.cpo_loss(trainer, average[:PAIRS], average[PAIRS:])
    return losses.mean(), {"reward_chosen": chosen.mean().item(), "reward_rejected": rejected.mean().item(),
                           "reward_accuracy": (chosen > rejected).float().mean().item(),
                           "reward_margin": (chosen - rejected).mean().item()}


@pytest.mark.parametrize("objective", ["dpo", "ipo", "simpo"])
def test_losses_and_reward_metrics_equal_trls(objective):
    for seed in range(3):
        data = answers_and_logps(seed)
        got, got_metrics = ours(objective, *data)
        want, want_metrics = trl_simpo(*data[:2]) if objective == "simpo" else \
            trl_dpo({"dpo": "sigmoid", "ipo": "ipo"}[objective], *data)
        assert got.item() == pytest.approx(want.item(), rel=1e-6, abs=1e-7)
        assert got_metrics == pytest.approx(want_metrics, rel=1e-6, abs=1e-7)
        assert 0 < got_metrics["reward_accuracy"] < 1 or objective == "simpo"  # the pairs disagree: a real check


def test_answers_packed_in_one_row_keep_their_own_log_probabilities():
    """Two pairs in one row and one in the next: each answer's sum is its own tokens' alone, as if
    computed one answer at a time; tokens no answer counts (prompts, padding) count nowhere."""
    torch.manual_seed(0)
    logits = torch.randn(2, 10, 7)
    targets = torch.randint(0, 7, (2, 10))
    answers = torch.full((2, 10), NO_ANSWER)
    spans = {(0, 0): (1, 3), (0, 1): (4, 5), (0, 2): (6, 8), (0, 3): (8, 10), (1, 0): (2, 6), (1, 1): (7, 9)}
    for (row, answer), (start, stop) in spans.items():
        answers[row, start:stop] = answer
    got = pair_logps(logits, targets, answers)
    token = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    want = {key: token[key[0], start:stop].sum() for key, (start, stop) in spans.items()}
    order = [(0, 0), (0, 2), (1, 0)]  # each pair's chosen answer, row by row
    torch.testing.assert_close(got.chosen, torch.stack([want[k] for k in order]))
    torch.testing.assert_close(got.rejected, torch.stack([want[(r, a + 1)] for r, a in order]))
    assert got.chosen_tokens.tolist() == [2, 2, 4] and got.rejected_tokens.tolist() == [1, 2, 2]
