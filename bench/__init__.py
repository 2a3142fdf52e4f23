"""Benchmarks of ours against PyTorch's native counterpart, measured in one run (A B A B).

Each is a module run on every rank under torchrun (or, with 0 ranks, a driver run as one plain
process that starts whole `shardwise train` jobs itself); `shardwise bench NAME` starts it and
writes its JSON to bench/results/NAME.json. They live beside src/, not in the package: they
measure shardwise from a checkout, and every process they start finds them there (`bench_env`).
"""

import os
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]  # the checkout


def bench_env(**settings: str) -> dict[str, str]:
    """This process's environment with the checkout on PYTHONPATH (and `settings`): what a process
    a bench starts runs with, so that `python -m bench.NAME` finds the benches wherever it runs."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **settings}


class Bench(NamedTuple):
    module: str
    ranks: int  # the world it runs on under torchrun; 0: a driver, one plain process that starts its own jobs
    # `shardwise bench NAME --quick`: its own flags for its shortest run, every part of it once, in seconds
    # (a check that it runs, not a measurement); None where it has no short form
    quick: tuple[str, ...] | None


# A bench whose entry is bench_main: one measured step in one round, on a micro-batch of 1 of gpt tiny.
ONE_STEP = ("--steps", "1", "--rounds", "1", "--micro-batch", "1", "--preset", "tiny")

BENCHES = {
    "ddp": Bench("bench.ddp", 2, ONE_STEP),
    "fsdp": Bench("bench.fsdp", 2, ONE_STEP),
    "recompute": Bench("bench.recompute", 1, ONE_STEP),
    "precision": Bench("bench.precision", 1, ONE_STEP),
    # the host's work in a step (operators, Python calls, collectives): single and fsdp's unit sizes
    "host": Bench("bench.host", 1, ("--steps", "4", "--rounds", "1")),
    # gpt small on Shakespeare, 300 steps: bf16-mixed against float8 (tensorwise, rowwise), validation losses
    "float8": Bench("bench.float8", 1, ONE_STEP),
    # the chunked cross-entropy against F.cross_entropy on float32 logits (of fixed, large sizes)
    "loss": Bench("bench.loss", 1, None),
    "pipeline": Bench("bench.pipeline", 0, None),  # a driver: one world of 2 ranks, one of 4
    "tensor": Bench("bench.tensor", 2, ONE_STEP),
    "lora": Bench("bench.lora", 2, ONE_STEP),
    # Muon under fsdp (an owner a matrix) against ddp's, AdamW's, every rank gathering all, DeepSpeed's
    "muon": Bench("bench.muon", 2, ONE_STEP),  # LoRA under our fsdp against peft's under FSDP2
    "mesh": Bench("bench.mesh", 4, ONE_STEP),  # fsdp x tp against FSDP2 x DTensor on a 2 x 2 mesh
    "collectives": Bench("bench.collectives", 2, None),  # 1 KiB to 256 MiB, and 200 steps of each compression
    "checkpoint": Bench("bench.checkpoint", 2, ONE_STEP),
    "checkpoint-scale": Bench("bench.checkpoint_scale", 4, None),  # the async save's stall on the 1.2B GPT, fsdp
    "context": Bench("bench.context", 4, None),  # context parallel: cp 1, 2, 4 in both modes against sequence length
    "hardware": Bench("bench.hardware", 2, ()),  # a device profile for `shardwise plan --device FILE`
    # the planner's predictions against real runs (namespaces as root)
    "planner": Bench("bench.planner", 0, ("--steps", "2", "--scenarios", "1", "--quick-profile")),
    "ps": Bench("bench.ps", 0, None),  # parameter server (sync, async), dp and ddp as whole jobs
    # one killed worker: restart from a checkpoint (sync, async) against healing
    "faults": Bench("bench.faults", 0, None),
    # the whole job SIGKILLed 20 times in and between async saves: every resume exact
    # (30 steps: a kill aimed at a millisecond's phase that misses it, on a loaded machine, has two saves left)
    "crash": Bench("bench.crash", 0, ("--steps", "30", "--kills", "1")),
    # the largest GPT each strategy trains in a memory budget, as whole jobs
    "scale": Bench("bench.scale", 0, None),
    # your own corpus: preparation, reads against a step, RSS at 1 MiB and 1 GiB
    "data": Bench("bench.data", 0, ("--steps", "1", "--reads", "10", "--sizes-mib", "1")),
    # gpt-moe under ep 1, 2, 4 as whole jobs; one layer against DeepSpeed's
    "moe": Bench("bench.moe", 0, None),
    # a node lost, recovered by a restart from disk and elastically from memory (namespaces, as root)
    "recovery": Bench("bench.recovery", 0, ("--preset", "tiny", "--steps", "8")),
    # makes its own nodes (namespaces, as root) and ranks
    "multinode": Bench("bench.multinode", 0, ("--steps", "1", "--strategies", "ddp", "--rates", "unlimited",
                                               "--preset", "tiny", "--micro-batch", "1", "--quick-profile")),
    # one GPU (needs CUDA): gpt-2-124m's MFU and every data-parallel strategy's host cost on fake worlds
    "gpu": Bench("bench.gpu", 0, None),
    # Llama-3-8B sharded 8, 16, 64 ways on one GPU through the fake process group (needs CUDA)
    "gpu-scale": Bench("bench.gpu_scale", 0, None),
}
