"""Naming the sick rank: which rank's step went wrong, whether it would again, and which rank is
holding the others back.

After each step's forward and backward, every rank reports four numbers in one all-gather:
- its own loss (the step's mean loss is summed from these: no all-reduce of its own);
- whether that loss is finite;
- whether its gradients are (their L1 norms, one fused kernel; fp16's scaler looks after its own);
- the CPU seconds its process spent on the step (computing, not waiting: a rank blocked in a
  collective sleeps).

**A bad step** is one where some rank's loss or gradients are not finite, or where the loss
spikes: more than `train.spike_factor` times the median of the last 20 steps. It is re-run once
from the same state: gradients dropped, the RNG put back as the step began, the same batch. If
the re-run is clean, the fault was transient (a flipped bit, a flaky device) and the re-run's
step is the one applied. If it fails again, the fault is deterministic (the data, the model, a
broken rank), and the run stops or skips the step (`train.bad_step`). Either way the event is
logged with the step, the ranks, what was wrong and the verdict.

**A straggler** is a rank whose CPU seconds exceed the other ranks' median by
`train.straggler_factor` for `STRAGGLER_STEPS` steps in a row. Synchronous training makes every
rank's wall time the slowest one's, so wall time cannot name it; time spent computing can. (On a
GPU a rank's CPU time is its launches, not its kernels: there, the kernels would have to be timed
with events.)
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from shardwise.checkpoint import TrainingRun
from shardwise.dist import DistContext
from shardwise.gradients import local_grads

SPIKE_HISTORY = 20  # steps the loss spike is judged against
STRAGGLER_STEPS = 3  # steps in a row a rank must be slow for to be named


class WatchedRun(TrainingRun, Protocol):
    """What a watched step needs of the trainer."""

    health: StepHealth
    accum: int
    last_step_skipped: bool
    skipped_steps: int
    health_events: list[dict[str, Any]]

    def forward_backward(self, step: int) -> torch.Tensor: ...

    def optimizer_step(self) -> bool: ...


class BadStepError(RuntimeError):
    """A step that failed again when re-run from the same state, under train.bad_step = "stop"."""


@dataclass(frozen=True)
class StepReport:
    """What each rank said of one attempt at a step: ranks whose loss or gradients were not
    finite, whether the loss spiked, and each rank's CPU seconds."""

    bad_loss: list[int]
    bad_grads: list[int]
    spike: bool
    cpu_s: list[float]

    @property
    def bad(self) -> bool:
        return bool(self.bad_loss or self.bad_grads or self.spike)

    def describe(self) -> str:
        parts = [f"non-finite loss on rank {', '.join(map(str, self.bad_loss))}" if self.bad_loss else "",
                 f"non-finite gradients on rank {', '.join(map(str, self.bad_grads))}" if self.bad_grads else "",
                 "a loss spike" if self.spike else ""]
        return "; ".join(p for p in parts if p)


@dataclass
class StepHealth:
    """One run's watch over its steps. `check` is collective: every rank calls it at each attempt."""

    ctx: DistContext
    spike_factor: float  # 0: no spike check
    straggler_factor: float  # 0: no straggler check
    losses: deque = field(default_factory=lambda: deque(maxlen=SPIKE_HISTORY))
    slow_in_a_row: dict[int, int] = field(default_factory=dict)
    named: set[int] = field(default_factory=set)  # stragglers named so far (once each)
    started_cpu: float = 0.0
    replica_group: int | None = None  # the run's group among launch.replica_groups, if it is one

    def start(self) -> None:
        """At the start of an attempt at a step."""
        self.started_cpu = time.process_time()

    def check(self, local_loss: torch.Tensor, grads: list[torch.Tensor]) -> tuple[torch.Tensor, StepReport]:
        """The step's mean loss over the ranks, and what every rank found in this attempt
        (collective). `local_loss`: this rank's mean loss; `grads`: the gradients it holds, [] where
        a loss scaler checks them."""
        cpu = time.process_time() - self.started_cpu
        device = self.ctx.device
        # Offloaded shards' gradients are on the host: their norm is brought to the device the loss is on.
        grad_norm = torch.stack(torch._foreach_norm(grads, 1)).sum().to(device) if grads else \
            torch.zeros((), device=device)
        # One row a rank, built where the step computed and gathered there (the loss with it: one
        # collective a step, not two), then read back once: one wait for the device.
        loss = local_loss.detach()
        mine = torch.stack([loss.to(torch.float64), ~torch.isfinite(loss), ~torch.isfinite(grad_norm),
                            torch.tensor(cpu, dtype=torch.float64, device=device)])
        every = self.ctx.all_gather_rows(mine)
        # The sum over the ranks in the loss's own dtype, over their number: what an all-reduce's mean gives.
        mean = every[:, 0].to(loss.dtype).sum() / self.ctx.world_size
        rows = every.cpu().tolist()
        history = list(self.losses)
        spike = bool(self.spike_factor and len(history) >= 5 and mean.item() > self.spike_factor
                     * statistics.median(history))
        bad_loss, bad_grads = ([r for r, row in enumerate(rows) if row[column]] for column in (1, 2))
        return mean, StepReport(bad_loss, bad_grads, spike, [row[3] for row in rows])

    def accept(self, loss: float) -> None:
        """A step applied: its loss joins the spike history."""
        if loss == loss and abs(loss) != float("inf"):
            self.losses.append(loss)

    def stragglers(self, report: StepReport, step: int) -> list[dict[str, Any]]:
        """The ranks named slow at `step` (1-based) by this report, each once: rank, ratio to the
        other ranks' median CPU seconds."""
        if not self.straggler_factor or len(report.cpu_s) < 2:
            return []
        events = []
        for rank, seconds in enumerate(report.cpu_s):
            # the other ranks' median: with two ranks, the median of all would be halfway to the slow one
            median = statistics.median(report.cpu_s[:rank] + report.cpu_s[rank + 1:])
            slow = median > 0 and seconds > self.straggler_factor * median
            self.slow_in_a_row[rank] = self.slow_in_a_row.get(rank, 0) + 1 if slow else 0
            if self.slow_in_a_row[rank] >= STRAGGLER_STEPS and rank not in self.named:
                self.named.add(rank)
                events.append({"event": "straggler", "step": step, "rank": rank,
                               "ratio": round(seconds / median, 2), "steps": STRAGGLER_STEPS})
                if self.ctx.is_main:
                    print(f"step {step}: rank {rank} is a straggler: {seconds / median:.1f}x the other ranks' "
                          f"median compute, {STRAGGLER_STEPS} steps in a row", file=sys.stderr)
        return events


def watched_step(trainer: WatchedRun, step: int) -> torch.Tensor:
    """The trainer's step `step` under the watch: a bad one re-run once from the same state, then
    applied (transient), or stopped or skipped (deterministic); stragglers named. Returns the
    step's mean loss."""
    loss, found = checked_step(trainer, step)
    if found is not None:
        give_up(trainer, step, found)
    else:
        trainer.last_step_skipped = not trainer.optimizer_step()
        trainer.health.accept(loss.item())
    trainer.skipped_steps += trainer.last_step_skipped
    return loss


def checked_step(trainer: WatchedRun, step: int) -> tuple[torch.Tensor, str | None]:
    """Forward and backward of step `step`, re-run once from the same state if it was bad (the
    event logged, stragglers named). Returns the step's mean loss over these ranks and, where it
    was bad again (deterministic: its gradients are not to be applied), what was wrong."""
    health = trainer.health
    rng = torch.get_rng_state(), torch.cuda.get_rng_state() if trainer.ctx.device.type == "cuda" else None
    loss, report = _checked_attempt(trainer, step)
    first = report
    if report.bad:
        torch.set_rng_state(rng[0])
        if rng[1] is not None:
            torch.cuda.set_rng_state(rng[1])
        trainer.optimizer.zero_grad(set_to_none=True)
        loss, report = _checked_attempt(trainer, step)
        _log_bad_step(trainer, step, first, again=report.bad)
    trainer.health_events += health.stragglers(report, step + 1)
    return loss, first.describe() if report.bad else None


def give_up(trainer: WatchedRun, step: int, found: str) -> None:
    """A step bad again when re-run (`found`: what was wrong): raise BadStepError under
    train.bad_step = "stop", else drop its gradients and count it skipped."""
    if trainer.cfg.train.bad_step == "stop":
        raise BadStepError(f"step {step + 1}: {found}, and again when re-run from the same state "
                           "(deterministic): stopping (train.bad_step = 'skip' would go on without it)")
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.last_step_skipped = True


def _checked_attempt(trainer: WatchedRun, step: int) -> tuple[torch.Tensor, StepReport]:
    """Forward and backward of step `step`, and what every rank found in it (collective)."""
    trainer.health.start()
    loss_sum = trainer.forward_backward(step)
    grads = [] if trainer.scaler else local_grads(trainer.strategy.local_parameters())
    return trainer.health.check(loss_sum / trainer.accum, grads)


def _log_bad_step(trainer: WatchedRun, step: int, first: StepReport, again: bool) -> None:
    """Log a bad step and the re-run's verdict (in a replica group, naming the group)."""
    verdict = "deterministic" if again else "transient"
    group = trainer.health.replica_group
    event = {"event": "bad_step", "step": step + 1, "found": first.describe(), "loss_ranks": first.bad_loss,
             "grad_ranks": first.bad_grads, "spike": first.spike, "verdict": verdict,
             "action": trainer.cfg.train.bad_step if again else "re-run applied",
             **({"replica_group": group} if group is not None else {})}
    trainer.health_events.append(event)
    if trainer.ctx.is_main:
        where = f"replica group {group}, " if group is not None else ""
        print(f"{where}step {step + 1}: {event['found']}; re-run from the same state: "
              f"{'the same again' if again else 'clean'} ({verdict}); {event['action']}", file=sys.stderr)
