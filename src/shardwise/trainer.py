"""The training loop: data -> forward -> backward -> step, with accumulation, clipping, evaluation,
logging. It knows nothing about any particular strategy; it speaks only to the Strategy interface."""

from __future__ import annotations

import math
import signal
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from shardwise.checkpoint_async import AsyncCheckpointer
from shardwise.config.registry import spec
from shardwise.config.schema import HF_MODELS, LANGUAGE_MODELS, Config, TrainConfig
from shardwise.data import Dataset, DocumentWindows, GlobalBatchSampler, make_datasets
from shardwise.data.pairs import PairWindows
from shardwise.dist import DistContext, seed_everything
from shardwise.gradients import local_grads
from shardwise.health import StepHealth, watched_step
from shardwise.hf_files import config_json, write_model_files
from shardwise.materialise import init_context
from shardwise.memory import (
    ActivationCounter,
    MemoryBreakdown,
    PhasePeaks,
    reset_peak_resident,
    resident_bytes,
    return_free_memory,
)
from shardwise.metrics import MetricsWriter, Progress, device_peak_flops, mfu
from shardwise.models import build_model, flops_per_sample, loss_fn
from shardwise.muon import Muon, muon_groups, split_for_muon
from shardwise.peer_checkpoints import PeerCheckpoints
from shardwise.preference import PairMetrics, PreferenceObjective, ReferenceCopy, run_reference
from shardwise.replicas import (
    ReplicaGroups,
    load_replica_state,
    replica_dir,
    replica_group,
    replica_state,
    replicated_step,
)
from shardwise.strategies.base import OptimizerFactory, Strategy
from shardwise.strategies.classes import make_strategy
from shardwise.trackers import Trackers
from shardwise.weights import ModelNames, load_weights
from shardwise.weights_file import final_layout, save_weights


def optimizer_factory(cfg: TrainConfig, strategy: Strategy | None = None) -> OptimizerFactory:
    """AdamW or SGD with momentum; weight decay on matrices and embeddings, not on biases or
    norm scales (dim < 2). Muon (its model's split found now, in `strategy`'s wrapped model):
    for the parameters muon.py's `split_for_muon` chooses, each matrix as its layout says, whole
    where `strategy.view.whole_matrices()` assembles it, AdamW for the rest."""
    if cfg.optimizer == "muon":
        matrices = strategy.view.whole_matrices()
        named = [(name, matrices.whole_of(p)) for name, p in strategy.view.named_parameters()]
        takes, layouts = split_for_muon(strategy.module, named, strategy.cfg.block, cfg.muon.params,
                                        cfg.muon.whole_fused)

    def decayed(params: list[nn.Parameter]) -> list[dict]:
        return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]

    def make(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        params = [p for p in params if p.requires_grad]
        if cfg.optimizer == "muon":  # AdamW's groups as adamw's, for what Muon does not step
            rest = decayed([p for p in params if id(matrices.whole_of(p)) not in takes])
            return Muon([*muon_groups(params, takes, layouts, cfg.weight_decay, matrices), *rest], lr=cfg.lr,
                        betas=(cfg.beta1, cfg.beta2), momentum=cfg.muon.momentum, ns_steps=cfg.muon.ns_steps,
                        ns_dtype=cfg.muon.ns_dtype, adjust_lr=cfg.muon.adjust_lr, matrices=matrices)
        groups = decayed(params)
        if cfg.optimizer == "sgd":
            return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))

    return make


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def optimizer_step(strategy: Strategy, optimizer: torch.optim.Optimizer, grad_clip: float) -> bool:
    """Clip (if grad_clip > 0) and step on the synchronised gradients; return whether it stepped.
    Under fp16 the gradients are unscaled first, and if any rank found an inf or NaN every rank
    skips the step. Then MoE routers balance on the step's counts (`Strategy.update_routers`). The
    trainer and the Python API (api.py) both step through this."""
    stepped = True
    if strategy.scaler:
        found_inf = strategy.scaler.unscale_(local_grads(strategy.local_parameters()), strategy.ctx.device)
        strategy.scaler.update(found_inf)
        stepped = not found_inf
    if stepped:
        if grad_clip > 0:
            strategy.clip_grad_norm_(grad_clip)
        optimizer.step()
    strategy.update_routers()
    return stepped


class Trainer:
    def __init__(self, cfg: Config, ctx: DistContext, peer_checkpoints: PeerCheckpoints | None = None) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.out = Path(cfg.run.out)
        seed_everything(cfg.train.seed)
        self.train_set, self.val_set = make_datasets(cfg)
        return_free_memory()  # memory freed earlier in this process is not the model's to reuse unseen
        reset_peak_resident()
        self.baseline_rss = resident_bytes()[0]  # the runtime's, before the model exists
        # Built on the meta device: the strategy materialises what this rank keeps (materialise.py).
        with init_context():
            model = build_model(cfg.model)
        self.flops_per_sample = flops_per_sample(model)
        self.seq_len = cfg.model.seq_len if cfg.model.name in LANGUAGE_MODELS else None
        self.names = ModelNames.of(model)  # what a weights file may call its tensors
        self.weights_layout = final_layout(model, self.names.layout)  # what the final weights file holds
        # An hf-* model's run directory is a transformers model directory: its config.json, as built.
        self.model_config = config_json(model, cfg.model.hf_config) if cfg.model.name in HF_MODELS else None
        self.strategy: Strategy = make_strategy(cfg.parallel, ctx, cfg.train.seed, cfg.train.compile, cfg.lora)
        group = replica_group()
        if group is not None:  # one of launch.replica_groups (replicas.py): its own directory, share and Manager
            self.out = replica_dir(cfg.run.out, group)
            self.strategy.data_rank += group * self.strategy.data_size
            self.strategy.data_size *= cfg.launch.replica_groups
        # Each phase's peak resident set (setup, load, steps, eval, checkpoint, final_weights): the summary's.
        self.peaks = PhasePeaks(ctx.device)
        with self.peaks("setup"):
            self.model = self.strategy.wrap(model)
        self.setup_rss = self.peaks.rss["setup"] - self.baseline_rss  # wrap's peak above the runtime's
        self.optimizer = self.strategy.optimizer(optimizer_factory(cfg.train, self.strategy))
        t = cfg.train  # a preference objective's loss, reference and metrics (preference.py), else cross-entropy
        self.objective = PreferenceObjective(t.objective, t.beta, t.gamma) if t.objective != "sft" else None
        self.loss_fn = self.objective or loss_fn
        copied = self.objective is not None and self.objective.needs_reference and t.reference == "copy"
        self.reference_copy = ReferenceCopy(cfg, ctx, self.names) if copied else None
        self.scaler = self.strategy.scaler
        self.skipped_steps = 0
        self.step = 0  # the step under way (0-based), for errors that happen inside it
        self.longest_step_s = 0.0  # a live rank reaches a collective within it (elastic.reform waits as long)
        self.sampler = GlobalBatchSampler(len(self.train_set), cfg.train.global_batch, cfg.train.seed)
        self.accum = cfg.train.global_batch // (self.strategy.data_size * cfg.train.micro_batch)
        self.activation_bytes = 0
        self.peak_flops = device_peak_flops(ctx.device)
        self.replicas = ReplicaGroups(ctx, group, cfg.launch.timeout_s, lambda: replica_state(self),
                                      lambda state: load_replica_state(self, state)) if group is not None else None
        self.committed = True  # whether the last step was applied (replica groups may roll one back)
        # The steps watched for bad ones and stragglers (health.py), where the ranks train together
        # (not under param-server, whose workers keep no step together); in a replica group, within
        # the group (replicated_step tells the others of a bad step).
        watched = cfg.train.bad_step != "off" and not spec(cfg.parallel.strategy).parameter_servers
        self.health = StepHealth(ctx, cfg.train.spike_factor, cfg.train.straggler_factor, replica_group=group) \
            if watched else None
        self.health_events: list[dict[str, Any]] = []  # what it found, for metrics.jsonl
        # Checkpoints written in the background (train.checkpoint_async), where a run saves any
        self.checkpointer = AsyncCheckpointer(cfg.train.keep_checkpoints, ctx.is_main) \
            if cfg.train.checkpoint_async and cfg.train.checkpoint_every else None
        # An elastic job's memory checkpoints (train.memory_checkpoint_every), kept by the worker across the
        # worlds it re-forms: their copies travel on a group of this world's
        self.peer_checkpoints = peer_checkpoints
        if peer_checkpoints is not None:
            peer_checkpoints.join()

    def micro_batches(self, dataset: Dataset, indices: list[torch.Tensor]) -> Iterable[tuple[torch.Tensor, ...]]:
        """(inputs, targets) of each micro-batch, and each input token's document where the data are
        packed documents."""
        for idx in indices:
            batch = dataset.batch(idx)
            if isinstance(dataset, DocumentWindows | PairWindows):
                batch = (*batch, dataset.documents(idx))
            yield tuple(t.to(self.ctx.device, non_blocking=True) for t in batch)

    def train_step(self, step: int) -> torch.Tensor:
        """One optimizer step over this rank's share of global batch `step`; returns the mean loss
        over the whole global batch (every rank gets the same value). A bad step (health.py) is
        re-run once from the same state; if it is bad again it stops the run or is skipped."""
        lr = learning_rate(step, self.cfg.train)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.replicas is not None:
            return replicated_step(self, step)
        if self.health is None:
            loss_sum = self.forward_backward(step)
            self.last_step_skipped = not self.optimizer_step()
            self.skipped_steps += self.last_step_skipped
            return self.ctx.all_reduce_mean(loss_sum / self.accum)
        return watched_step(self, step)

    def run_step(self, step: int) -> float:
        """Optimizer step `step`, waited for, gradients dropped after: what a bench times and the
        planner's measured mode runs. Returns the global batch's mean loss."""
        loss = self.train_step(step).item()  # .item() waits for the step to finish
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def memory(self) -> MemoryBreakdown:
        """This rank's counted bytes now, as metrics.jsonl records them."""
        memory = self.strategy.memory(self.activation_bytes)
        staged = self.checkpointer.staged_bytes if self.checkpointer is not None else 0
        held = self.peer_checkpoints.held_bytes if self.peer_checkpoints is not None else 0
        if staged or held:  # host copies of the state: an asynchronous save's, the memory checkpoints'
            memory.staging = staged + held
        if self.reference_copy is not None:  # the frozen copy's parameters (or shards) beside the policy's
            memory.params += self.reference_copy.held_bytes()
        return memory

    def forward_backward(self, step: int) -> torch.Tensor:
        """Forward and backward over this rank's micro-batches of step `step`, gradients
        synchronised after the last one; returns the sum of their losses."""
        indices = self.sampler.micro_batches(step, self.strategy.data_rank, self.strategy.data_size,
                                             self.cfg.train.micro_batch)
        if self.objective is not None:  # this step's pairs alone (health.py may run a step again)
            self.objective.metrics = PairMetrics()
        if self.reference_copy is not None:  # the step's windows' reference, from the frozen copy
            self.reference_copy.record(self, self.train_set, indices)
        # Count what is saved for backward once: shapes are fixed, so it never changes.
        counter = ActivationCounter(self.model) if not self.activation_bytes else nullcontext()
        with counter:
            loss_sum = self.strategy.forward_backward(self.model, self.micro_batches(self.train_set, indices),
                                                      self.loss_fn, self.accum)
        if isinstance(counter, ActivationCounter):
            self.activation_bytes = counter.bytes
        return loss_sum

    def optimizer_step(self) -> bool:
        self.staged()
        return optimizer_step(self.strategy, self.optimizer, self.cfg.train.grad_clip)

    def staged(self) -> None:
        """Before the parameters or the optimizer state change: the save in flight has copied them."""
        if self.checkpointer is not None:
            self.checkpointer.staged()

    def evaluate(self) -> float:
        """Mean loss over the same fixed validation batches every time, whatever the world size."""
        with self.between_steps("eval"), torch.no_grad():
            return validation_loss(self)

    def val_metrics(self) -> dict[str, float]:
        """A preference objective's metrics over the validation pairs evaluate just saw."""
        return self.objective.take_metrics(prefix="val_") if self.objective is not None else {}

    def step_record(self, step: int, loss: float, seconds: float, memory: MemoryBreakdown,
                    memory_by_rank: list[dict[str, int | None]]) -> dict[str, Any]:
        samples_per_s = self.cfg.train.global_batch / seconds
        return {
            "event": "step",
            "step": step + 1,
            "loss": loss,
            "lr": self.optimizer.param_groups[0]["lr"],
            "step_time_s": seconds,
            "samples_per_s": samples_per_s,
            "tokens_per_s": samples_per_s * self.seq_len if self.seq_len else None,
            "mfu": mfu(self.flops_per_sample, samples_per_s, self.ctx.world_size, self.peak_flops),
            "memory": memory.as_dict(),
            "memory_by_rank": memory_by_rank,
            **({"loss_scale": self.scaler.scale, "skipped": self.last_step_skipped} if self.scaler else {}),
            **({"router": self.strategy.router_stats} if self.strategy.router_stats else {}),
            **({"committed": self.committed, "replica_groups": self.replicas.participants,
                "healed_at": self.replicas.healed_at} if self.replicas is not None else {}),
        }

    def fit(self) -> dict[str, Any]:
        """Train up to train.steps steps (from the newest checkpoint with run.resume); checkpoint
        every train.checkpoint_every steps and on SIGTERM; write metrics and the final weights;
        return the summary."""
        t = self.cfg.train
        with self.peaks("load"):
            restored = self.peer_checkpoints.restore(self) if self.peer_checkpoints is not None else None
            first = restored if restored is not None else load_checkpoint(self) if self.cfg.run.resume else 0
            if self.replicas is not None and first:  # groups that resumed further along heal the others
                self.replicas.resume_at(first)
            # A LoRA checkpoint holds no frozen weights: they are the pretrained ones again.
            if self.cfg.model.weights and (first == 0 or self.strategy.lora is not None):
                load_weights(self.strategy, self.cfg.model.weights, self.names)
            if self.objective is not None and self.objective.needs_reference:
                self.objective.reference = run_reference(self, resumed=first > 0)
        if first >= t.steps:
            raise CheckpointError(f"{self.out}: its checkpoint is at step {first} of train.steps = {t.steps}; "
                                  "nothing left to resume (raise train.steps to train further)")
        # A replica group restarted after a failure keeps the records of what it did before it.
        kept = t.steps if self.replicas is not None and self.replicas.restarted else first
        trackers = Trackers(self.cfg, self.out, resumed_at=kept) if self.ctx.is_main else None
        writer = MetricsWriter(self.out / "metrics.jsonl", self.ctx.is_main, resumed_at=kept, trackers=trackers)
        progress = Progress(t.steps, self.ctx.is_main, self.cfg.run.log_every, first=first)
        records: list[dict[str, Any]] = []
        val_loss = None
        terminate = TerminationFlag()
        failed = True  # until the summary is written: the trackers mark their runs failed
        try:
            step = first
            while step < t.steps:
                if self.replicas is not None:  # the steps the quorum committed: a healed group jumps ahead
                    step = self.replicas.begin()
                    if step >= t.steps:
                        break
                self.step = step
                started = time.perf_counter()
                with self.peaks("steps"):
                    loss = self.train_step(step).item()  # .item() waits for the step to finish
                    seconds = time.perf_counter() - started
                    self.longest_step_s = max(self.longest_step_s, seconds)
                    memory = self.memory()
                    memory_by_rank, stopping = gather_step_end(self.ctx, memory, terminate.raised)
                    record = self.step_record(step, loss, seconds, memory, memory_by_rank)
                    record |= self.objective.take_metrics() if self.objective is not None else {}
                    self.optimizer.zero_grad(set_to_none=True)
                writer.write(record)
                for event in self.health_events:
                    writer.write(event)
                self.health_events.clear()
                records.append(record)
                progress.update(step, loss, record["tokens_per_s"], record["samples_per_s"])
                if self.checkpointer is not None:
                    self.checkpointer.poll()  # the save in flight, if rank 0 finished it: its failure raised here
                done = step + 1 if self.committed else step  # a step replica groups rolled back left no trace
                if stopping:
                    if self.peer_checkpoints is not None:  # what the restarted workers restore, the state kept
                        self.save_in_memory(done, wait=True)
                    self.save_checkpoint(done, now=True)
                    raise SystemExit(f"rank {self.ctx.rank}: SIGTERM: saved a checkpoint after step {done}")
                if t.checkpoint_every and self.committed and done % t.checkpoint_every == 0:
                    self.save_checkpoint(done)
                if self.peer_checkpoints is not None:
                    self.peer_checkpoints.poll()  # the last copy to the peer: its failure raised here
                    if done % t.memory_checkpoint_every == 0:
                        self.save_in_memory(done)
                if t.eval_every and (step + 1) % t.eval_every == 0 and step + 1 < t.steps:
                    val_loss = self.evaluate()
                    writer.write({"event": "eval", "step": step + 1, "val_loss": val_loss, **self.val_metrics()})
                step += 1  # under replica groups, `begin` says which step is next (this one again if rolled back)
            if self.checkpointer is not None:
                with self.between_steps("checkpoint"):
                    self.checkpointer.wait()  # the last save in flight is on disk before the run ends
            val_loss = self.evaluate()
            with self.between_steps("final_weights"):
                self._save_weights()
            summary = run_summary(self, records, val_loss) | self.val_metrics()
            writer.write(summary)
            failed = False
        finally:
            if self.checkpointer is not None:
                self.checkpointer.close()  # after an error: the save in flight ends, on this rank alone
            if self.replicas is not None:
                self.replicas.close()
            terminate.restore()
            progress.close()
            writer.close(failed)
        return summary

    def save_checkpoint(self, step: int, now: bool = False) -> None:
        """Save the state after `step` steps: in the background where train.checkpoint_async, unless
        `now` (a SIGTERM's save: the process is about to end), which waits for the save in flight
        and writes this one before returning."""
        with self.between_steps("checkpoint"):
            if self.checkpointer is not None and not now:
                self.checkpointer.save(self, step)
                return
            if self.checkpointer is not None:
                self.checkpointer.wait()
            save_checkpoint(self, step, self.cfg.train.keep_checkpoints)

    def save_in_memory(self, step: int, wait: bool = False) -> None:
        """A memory checkpoint of the state after `step` (peer_checkpoints.py); with `wait`, copied to the
        peer before it returns."""
        with self.between_steps("checkpoint"):
            self.peer_checkpoints.save(self, step, wait)

    @contextmanager
    def between_steps(self, phase: str) -> Iterator[None]:
        """Evaluation, a checkpoint, the final weights: measured as `phase`, and started by handing
        the allocator's free memory back (`return_free_memory`): a step's activations, freed, would
        otherwise stay resident in its heaps through them."""
        return_free_memory()
        with self.peaks(phase):
            yield

    def _save_weights(self) -> None:
        """The plain model's weights as OUT/model.safetensors, readable without shardwise (what
        safetensors' save_model writes; for an hf-* model what save_pretrained writes, beside its
        config.json and the tokenizer's files: a directory from_pretrained loads), streamed tensor
        by tensor from what the ranks hold."""
        save_weights(self.strategy, self.weights_layout, self.out / "model.safetensors")
        if self.model_config is not None and self.ctx.is_main:
            write_model_files(self.out, self.model_config, self.cfg.data.tokenizer)


def run_summary(run: Trainer, records: list[dict[str, Any]], val_loss: float) -> dict[str, Any]:
    """The run's summary record: what it trained, how fast, in how much memory (metrics.jsonl's last)."""
    # The first steps include warm-up (allocation, thread pools); the median ignores them.
    times = sorted(r["step_time_s"] for r in records[1:] or records)
    median = times[len(times) // 2]
    samples_per_s = run.cfg.train.global_batch / median
    timeline = run.strategy.stage_timeline()
    return {
        "event": "summary",
        "strategy": run.cfg.parallel.strategy,
        "optimizer": run.cfg.train.optimizer,
        "world_size": run.ctx.world_size,
        "steps": records[-1]["step"],
        "resumed_at": records[0]["step"] - 1,
        "final_loss": records[-1]["loss"],
        "val_loss": val_loss,
        "median_step_time_s": median,
        "samples_per_s": samples_per_s,
        "tokens_per_s": samples_per_s * run.seq_len if run.seq_len else None,
        "mfu": mfu(run.flops_per_sample, samples_per_s, run.ctx.world_size, run.peak_flops),
        "memory": records[-1]["memory"],
        "precision": run.cfg.parallel.precision,
        "recompute": run.cfg.parallel.recompute,
        # parallel.float8: the recipe, the layers computing in float8 and those left out for their sizes
        **({"float8": run.strategy.float8} if run.strategy.float8 is not None else {}),
        "skipped_steps": run.skipped_steps,
        "stragglers": sorted(run.health.named) if run.health is not None else None,
        # Each rank's peak resident set over the run, and above the runtime's while the model
        # was made (and the strategy's own count of it, where it counts one).
        "peak_rss_by_rank": run.ctx.all_gather_object(resident_bytes()[1]),
        "setup_by_rank": run.ctx.all_gather_object({"rss_above_baseline": run.setup_rss,
                                                    "counted": run.strategy.setup_peak_bytes}),
        # Each phase's peak resident set by rank (and on CUDA its peak allocated bytes), with the
        # runtime's resident set before the model existed.
        "phases_by_rank": run.ctx.all_gather_object({"baseline_rss": run.baseline_rss, **run.peaks.as_dict()}),
        **({"stage_timeline": timeline} if timeline is not None else {}),
        # train.compile: graphs inductor compiled (one per distinct block, more if it recompiled) and its seconds
        **({"compile": run.strategy.compiler.as_dict()} if run.strategy.compiler else {}),
    }


def validation_loss(run: Trainer) -> float:
    """Trainer.evaluate's loss: the validation batches' mean, every rank its share."""
    run.model.eval()
    sampler = GlobalBatchSampler(len(run.val_set), run.cfg.train.global_batch, seed=0)
    # Without a group to average over (an asynchronous parameter-server worker), a rank
    # evaluates every batch itrun.
    share = (run.strategy.data_rank, run.strategy.data_size) if run.ctx.distributed else (0, 1)
    loss_sum = torch.zeros((), device=run.ctx.device)
    count = 0
    for batch in range(run.cfg.train.eval_batches):
        indices = sampler.micro_batches(batch, *share, run.cfg.train.micro_batch)
        if run.reference_copy is not None:
            run.reference_copy.record(run, run.val_set, indices)
        for batch in run.micro_batches(run.val_set, indices):
            with run.strategy.context.split(batch) as (inputs, targets):
                with run.strategy.precision.autocast(run.ctx.device):
                    loss_sum += run.loss_fn(run.model(inputs), targets)
            count += 1
    run.model.train()
    return run.ctx.all_reduce_mean(loss_sum / count).item()


class TerminationFlag:
    """Notes SIGTERM (what torchrun and schedulers send before killing a job) instead of dying
    at once, so the run can save a checkpoint at the end of the current step."""

    def __init__(self) -> None:
        self.raised = False
        self._previous = signal.signal(signal.SIGTERM, self._note)

    def _note(self, signum: int, frame: object) -> None:
        self.raised = True

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)


def gather_step_end(ctx: DistContext, memory: MemoryBreakdown, stop: bool) -> tuple[list[dict[str, int | None]], bool]:
    """Every rank's counted memory after a step, and whether any rank is to stop (SIGTERM: all must
    stop at the same step to save together): one collective a step (a pickled gather and an
    all-reduce took three)."""
    fields = memory.as_dict()
    mine = torch.tensor([-1 if v is None else v for v in fields.values()] + [stop], dtype=torch.int64,
                        device=ctx.device)
    rows = ctx.all_gather_rows(mine).cpu().tolist()
    return [{k: None if v == -1 else v for k, v in zip(fields, row[:-1], strict=True)} for row in rows], \
        any(row[-1] for row in rows)
