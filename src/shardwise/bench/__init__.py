"""Benchmarks of ours against PyTorch's native counterpart, measured in one run (A B A B).

Each is a module run on every rank under torchrun (or, with 0 ranks, a driver run as one plain
process that starts whole `shardwise train` jobs itself); `shardwise bench NAME` starts it and
writes its JSON to bench/results/NAME.json.
"""

BENCHES = {  # name -> (module, ranks)
    "ddp": ("shardwise.bench.ddp", 2),
    "fsdp": ("shardwise.bench.fsdp", 2),
    "recompute": ("shardwise.bench.recompute", 1),
    "precision": ("shardwise.bench.precision", 1),
    "pipeline": ("shardwise.bench.pipeline", 0),  # a driver: one world of 2 ranks, one of 4
    "tensor": ("shardwise.bench.tensor", 2),
    "mesh": ("shardwise.bench.mesh", 4),  # fsdp x tp against FSDP2 x DTensor on a 2 x 2 mesh
    "collectives": ("shardwise.bench.collectives", 2),
    "checkpoint": ("shardwise.bench.checkpoint", 2),
    "context": ("shardwise.bench.context", 4),  # context parallel: cp 1, 2, 4 in both modes against sequence length
    "hardware": ("shardwise.bench.hardware", 2),  # a device profile for `shardwise plan --device FILE`
    "planner": ("shardwise.bench.planner", 0),  # the planner's predictions against real runs (namespaces as root)
    "ps": ("shardwise.bench.ps", 0),  # parameter server (sync, async), dp and ddp as whole jobs
    "scale": ("shardwise.bench.scale", 0),  # the largest GPT each strategy trains in a memory budget, as whole jobs
    "data": ("shardwise.bench.data", 0),  # your own corpus: preparation, reads against a step, RSS at 1 MiB and 1 GiB
    "moe": ("shardwise.bench.moe", 0),  # gpt-moe under ep 1, 2, 4 as whole jobs; one layer against DeepSpeed's
    "multinode": ("shardwise.bench.multinode", 0),  # makes its own nodes (namespaces, as root) and ranks
    # one GPU (needs CUDA): gpt-2-124m's MFU and every data-parallel strategy's host cost on fake worlds
    "gpu": ("shardwise.bench.gpu", 0),
    # Llama-3-8B sharded 8, 16, 64 ways on one GPU through the fake process group (needs CUDA)
    "gpu-scale": ("shardwise.bench.gpu_scale", 0),
}
