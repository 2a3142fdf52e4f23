"""Every strategy, one line each: its name, where it lives, and the facts config validation, the
CLI, the worker, the Python API and the planner need to know of it.

This module imports nothing of shardwise, so the config's schema can read it (config/ imports no
strategy); a strategy's class (and the config checks only it makes, `Strategy.check_config`) is
strategies/classes.py's to import, from `module`, when asked for.
Adding a strategy: its module, its test, its docs page and one line in `SPECS`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StrategySpec:
    name: str
    module: str  # "fsdp": the class is shardwise.strategies.fsdp.<cls>
    cls: str
    # The dimension of the dp x pp x tp mesh it takes the ranks the others leave on: "dp" replicates
    # (or shards) the whole model; "pp" cuts it into pipeline stages; "tp" splits its matrices.
    mesh_dim: str = "dp"
    # Data parallel: which model state it shards over the replicas, as ZeRO's stages count (0: none,
    # 1: optimizer state, 2: + gradients, 3: + parameters); None where it is not data parallel.
    zero_stage: int | None = 0
    pipelined: bool = False  # runs micro-batches through a schedule (parallel.pipeline.micro_batches, .schedule)
    one_process: bool = False  # one process, however many devices
    parameter_servers: bool = False  # the last parallel.param_server.servers ranks serve; the others are its replicas
    own_launcher: bool = False  # started by our launcher (launch.launch_local), which can outlive a rank, not torchrun
    across_nodes: bool = False  # replicates across nodes what it shards within one (worth it only on several)
    # parallel.sharding.offload = "optimizer" keeps its master shards and optimizer state on the host
    offloads: bool = False
    checkpoints: bool = True  # saves and resumes checkpoints
    api: bool = True  # runs under the Python API (not only under `shardwise train`'s own launcher)
    # Splits each sequence over parallel.cp ranks and masks documents (data.documents): it runs the model
    # through the Strategy's own micro-batch loop on the whole model, each rank's gradients averaged with
    # its cp peers' as with its replicas' (docs/strategies/context.md).
    context_parallel: bool = False
    native: bool = False  # PyTorch's own implementation behind our interface: the anchor of a bench
    planned: bool = False  # among `shardwise plan`'s candidates

    @property
    def splits_model(self) -> bool:
        """Whether it cuts one model over several ranks (pipeline stages, tensor shards)."""
        return self.mesh_dim != "dp"

    @property
    def shards_split_model(self) -> bool:
        """Whether it shards a model that tensor parallel splits (parallel.tp > 1): ours that shard."""
        return bool(self.zero_stage) and not self.native


SPECS: dict[str, StrategySpec] = {spec.name: spec for spec in (
    StrategySpec("single", "single", "Single", one_process=True, context_parallel=True),
    StrategySpec("dp", "dp", "DataParallel", one_process=True),
    StrategySpec("ddp", "ddp", "DDP", planned=True, context_parallel=True),
    StrategySpec("ddp-native", "native", "NativeDDP", native=True, context_parallel=True),
    StrategySpec("zero1", "fsdp", "ShardedDataParallel", zero_stage=1, planned=True, offloads=True,
                 context_parallel=True),
    StrategySpec("zero2", "fsdp", "ShardedDataParallel", zero_stage=2, planned=True, offloads=True,
                 context_parallel=True),
    StrategySpec("fsdp", "fsdp", "ShardedDataParallel", zero_stage=3, planned=True, offloads=True,
                 context_parallel=True),
    StrategySpec("fsdp-native", "native", "NativeFSDP", zero_stage=3, native=True, context_parallel=True),
    StrategySpec("hsdp", "fsdp", "ShardedDataParallel", zero_stage=3, across_nodes=True, planned=True),
    StrategySpec("pipeline", "pipeline", "Pipeline", mesh_dim="pp", zero_stage=None, pipelined=True, planned=True,
                 context_parallel=True),
    StrategySpec("model-parallel", "pipeline", "ModelParallel", mesh_dim="pp", zero_stage=None, planned=True),
    StrategySpec("tensor", "tensor_parallel", "TensorParallel", mesh_dim="tp", zero_stage=None, planned=True,
                 context_parallel=True),
    StrategySpec("param-server", "param_server", "ParamServer", parameter_servers=True, own_launcher=True,
                 checkpoints=False, api=False),
)}

NAMES = tuple(SPECS)


def spec(name: str) -> StrategySpec:
    """The strategy called `name` (config validation has already refused unknown names)."""
    return SPECS[name]


def own_launcher_setting(strategy: str, replica_groups: int) -> str | None:
    """What starts a job's ranks with a launcher of shardwise's own instead of torchrun's (replica
    groups, or a strategy whose spec says so), named as a refusal names it; None where torchrun does."""
    if replica_groups > 1:
        return f"launch.replica_groups = {replica_groups}"
    return f"parallel.strategy = {strategy!r}" if spec(strategy).own_launcher else None
