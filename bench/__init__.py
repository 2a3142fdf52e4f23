"""Benchmarks of ours against PyTorch's native counterpart, measured in one run (A B A B).

Each is a module run on every rank under torchrun (or, with 0 ranks, a driver run as one plain
process that starts whole `shardwise train` jobs itself); `shardwise bench NAME` starts it and
writes its JSON to bench/results/NAME.json. They live beside src/, not in the package: they
measure shardwise from a checkout, and every process they start finds them there (`bench_env`).
"""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout


def bench_env(**settings: str) -> dict[str, str]:
    """This process's environment with the checkout on PYTHONPATH (and `settings`): what a process
    a bench starts runs with, so that `python -m bench.NAME` finds the benches wherever it runs."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **settings}


BENCHES = {  # name -> (module, ranks)
    "ddp": ("bench.ddp", 2),
    "fsdp": ("bench.fsdp", 2),
    "recompute": ("bench.recompute", 1),
    "precision": ("bench.precision", 1),
    "loss": ("bench.loss", 1),  # the chunked cross-entropy against F.cross_entropy on float32 logits
    "pipeline": ("bench.pipeline", 0),  # a driver: one world of 2 ranks, one of 4
    "tensor": ("bench.tensor", 2),
    "lora": ("bench.lora", 2),  # LoRA under our fsdp against peft's under FSDP2
    "mesh": ("bench.mesh", 4),  # fsdp x tp against FSDP2 x DTensor on a 2 x 2 mesh
    "collectives": ("bench.collectives", 2),
    "checkpoint": ("bench.checkpoint", 2),
    "checkpoint-scale": ("bench.checkpoint_scale", 4),  # the async save's stall on the 1.2B GPT under fsdp
    "context": ("bench.context", 4),  # context parallel: cp 1, 2, 4 in both modes against sequence length
    "hardware": ("bench.hardware", 2),  # a device profile for `shardwise plan --device FILE`
    "planner": ("bench.planner", 0),  # the planner's predictions against real runs (namespaces as root)
    "ps": ("bench.ps", 0),  # parameter server (sync, async), dp and ddp as whole jobs
    "faults": ("bench.faults", 0),  # one killed worker: restart from a checkpoint (sync, async) against healing
    "crash": ("bench.crash", 0),  # the whole job SIGKILLed 20 times in and between async saves: every resume exact
    "scale": ("bench.scale", 0),  # the largest GPT each strategy trains in a memory budget, as whole jobs
    "data": ("bench.data", 0),  # your own corpus: preparation, reads against a step, RSS at 1 MiB and 1 GiB
    "moe": ("bench.moe", 0),  # gpt-moe under ep 1, 2, 4 as whole jobs; one layer against DeepSpeed's
    "multinode": ("bench.multinode", 0),  # makes its own nodes (namespaces, as root) and ranks
    # one GPU (needs CUDA): gpt-2-124m's MFU and every data-parallel strategy's host cost on fake worlds
    "gpu": ("bench.gpu", 0),
    # Llama-3-8B sharded 8, 16, 64 ways on one GPU through the fake process group (needs CUDA)
    "gpu-scale": ("bench.gpu_scale", 0),
}
