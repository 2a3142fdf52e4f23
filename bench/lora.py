"""`shardwise bench lora`: LoRA under our `fsdp` against peft's LoRA under PyTorch's FSDP2
(`fully_shard` on a peft model, each decoder layer then the root), on a transformers Llama with
grouped-query attention (gpt small's sizes, 2 key/value heads), in one 2-rank world, alternating
step by step (A B A B).

Both sides: the same initial model (the trainer's values, materialise.py), rank-8 adapters on the
seven projections of every layer with the same initial values (ours copied into peft's), AdamW
over the adapters alone, fp32, the same batches (each rank its share of the global batch), no
clipping. Reports the median step times and their ratio, the first losses of each (they agree:
the same model trains), and per rank the bytes of parameters (the frozen model's shards and the
adapters') and optimizer state after a step (gradients freed on both): ours as `Strategy.memory`
counts them, FSDP2's from its DTensors' local shards, each storage once. A third contestant is
ours with the projections' frozen weights in NF4 (QLoRA, `lora.quantize = "nf4"`): its step time
against our LoRA's, and its bytes.
"""

from __future__ import annotations

import os
import platform
import statistics
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from bench.common import BenchArgs, StepFn, alternate, bench_config, bench_main
from bench.tensor import initial_model, our_step
from shardwise.dist import DistContext
from shardwise.lora import is_adapter
from shardwise.memory import local_tensor, optimizer_state_tensors, storage_bytes
from shardwise.models import loss_fn
from shardwise.trainer import Trainer, optimizer_factory

RANK = 8
LLAMA = ("model.name=hf-llama", "model.n_kv_head=2", f"lora.rank={RANK}", "lora.alpha=16", "train.grad_clip=0")


def peft_fsdp2_model(trainer: Trainer, ctx: DistContext) -> nn.Module:
    """The trainer's model, whole, with peft's adapters where ours are (their values ours), then
    `fully_shard` on each decoder layer and on the root over the world."""
    from peft import LoraConfig, get_peft_model

    cfg = trainer.cfg
    wrapper = initial_model(cfg, ctx.device)  # shardwise's hf-* wrapper: the transformers model is `lm`
    view = trainer.strategy.view
    names = [name for name in view.names() if is_adapter(name)]  # gathered to rank 0 alone, not the whole model
    whole = {name.removeprefix("lm."): tensor for name, tensor in zip(names, view.full_tensors(names), strict=True)}
    adapters = ctx.all_gather_object(whole)[0]  # rank 0's, on every rank
    targets = sorted({name.rpartition(".lora.")[0] for name in adapters})
    model = get_peft_model(wrapper.lm, LoraConfig(r=RANK, lora_alpha=cfg.lora.alpha, lora_dropout=0.0,
                                                  target_modules=targets))
    with torch.no_grad():
        for name in targets:
            layer = model.base_model.model.get_submodule(name)
            layer.lora_A["default"].weight.copy_(adapters[f"{name}.lora.A"])
            layer.lora_B["default"].weight.copy_(adapters[f"{name}.lora.B"])
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def peft_step(like: Trainer, ctx: DistContext, model: nn.Module, losses: list[float]) -> tuple[StepFn, Any]:
    optimizer = optimizer_factory(like.cfg.train)([p for p in model.parameters() if p.requires_grad])

    def step(k: int) -> None:
        (indices,) = like.sampler.micro_batches(k, ctx.rank, ctx.world_size, like.cfg.train.micro_batch)
        inputs, targets = like.train_set.batch(indices)
        loss = loss_fn(model(input_ids=inputs).logits, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())

    return step, optimizer


def fsdp2_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of FSDP2's parameters (their local shards), gradients and optimizer state on this rank."""
    params = [local_tensor(p) for p in model.parameters()]
    grads = [local_tensor(p.grad) for p in model.parameters() if p.grad is not None]
    state = [local_tensor(t) for t in optimizer_state_tensors(optimizer)]
    return {"params": storage_bytes(params), "grads": storage_bytes(grads), "optimizer": storage_bytes(state)}


def run(ctx: DistContext, args: BenchArgs) -> dict[str, Any] | None:
    steps, rounds, micro_batch = args.steps, args.rounds, args.micro_batch
    load_before = os.getloadavg()
    cfg = bench_config("fsdp", ctx.world_size, micro_batch, steps * 2, *LLAMA, preset=args.preset)
    trainer = Trainer(cfg, ctx)
    qlora = Trainer(bench_config("fsdp", ctx.world_size, micro_batch, steps * 2, *LLAMA, "lora.quantize=nf4",
                                 preset=args.preset), ctx)
    native = peft_fsdp2_model(trainer, ctx)
    losses = {"ours": [], "native": [], "qlora": []}
    native_step, native_optimizer = peft_step(trainer, ctx, native, losses["native"])
    steps_of = {"ours": our_step(trainer, losses["ours"]), "native": native_step,
                "qlora": our_step(qlora, losses["qlora"])}
    times = alternate(steps_of, steps, rounds)
    median = {name: statistics.median(t) for name, t in times.items()}

    def ours_state(run: Trainer) -> dict[str, int]:
        return {k: v for k, v in run.strategy.memory(0).as_dict().items() if k in ("params", "grads", "optimizer")}

    every = ctx.all_gather_object((ours_state(trainer), fsdp2_state(native, native_optimizer), ours_state(qlora)))
    if not ctx.is_main:
        return None
    trained = sum(p.numel() for p in trainer.strategy.module.parameters() if p.requires_grad)
    return {
        "bench": "lora",
        "model": f"hf-llama, gpt small's sizes, {cfg.model.n_kv_head} key/value heads, seq {cfg.model.seq_len}; "
                 f"rank-{RANK} adapters on every projection (about {trained:,} adapter parameters)",
        "world": ctx.world_size,
        "batch_per_rank": micro_batch,
        "threads_per_rank": torch.get_num_threads(),
        "machine": f"{platform.machine()}, {ctx.backend}, torch {torch.__version__}",
        "load_average_before_after": [load_before[0], os.getloadavg()[0]],
        "ours": {"step_time_s": median["ours"], "step_times_s": times["ours"], "first_losses": losses["ours"][:3],
                 "state_per_rank": [ours for ours, _, _ in every]},
        "native": {"step_time_s": median["native"], "step_times_s": times["native"],
                   "first_losses": losses["native"][:3], "state_per_rank": [theirs for _, theirs, _ in every]},
        "qlora": {"step_time_s": median["qlora"], "step_times_s": times["qlora"], "first_losses": losses["qlora"][:3],
                  "state_per_rank": [q for _, _, q in every]},
        "ratio": median["ours"] / median["native"],
        "ratio_qlora_vs_lora": median["qlora"] / median["ours"],
    }


def format_result(result: dict[str, Any]) -> str:
    def row(label: str, entry: dict[str, Any]) -> str:
        first = ", ".join(f"{loss:.5f}" for loss in entry["first_losses"])
        state = entry["state_per_rank"][0]
        return (f"  {label:<22} median step {entry['step_time_s'] * 1000:8.1f} ms   rank 0: params "
                f"{state['params'] / 2**20:6.2f} MiB, grads {state['grads'] / 2**20:5.2f}, optimizer "
                f"{state['optimizer'] / 2**20:5.2f}   first losses {first}")

    return "\n".join([
        f"lora bench: {result['model']}; {result['world']} ranks, batch {result['batch_per_rank']} per rank; load "
        f"average {result['load_average_before_after'][0]:.1f} -> {result['load_average_before_after'][1]:.1f}",
        row("ours (fsdp + lora)", result["ours"]), row("peft + FSDP2", result["native"]),
        row("ours (fsdp + qlora)", result["qlora"]),
        f"  ratio ours/native {result['ratio']:.3f}; qlora/lora {result['ratio_qlora_vs_lora']:.3f}"])


if __name__ == "__main__":
    bench_main("lora", run, format_result, rounds=12)
