"""Checking a config: every value and every relation between values, against the world size the
run will have, before any worker starts; each problem a `ConfigError` of one line naming the key,
the value and what is allowed. What only one strategy refuses is its class's `check_config`,
beside the code it protects, called from here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from shardwise.config.registry import SPECS, spec
from shardwise.config.schema import (
    ALL_REDUCES,
    BACKENDS,
    BALANCES,
    CORPORA,
    CP_MODES,
    DOCUMENTS,
    EP_STRATEGIES,
    FLOAT8_RECIPES,
    FORMATS,
    GRAD_COMPRESSIONS,
    GROUPED_QUERY_MODELS,
    IMAGE_DATASETS,
    LANGUAGE_MODELS,
    MODELS,
    MOE_MODELS,
    OBJECTIVES,
    OFFLOADS,
    OPTIMIZERS,
    PRECISIONS,
    PS_MODES,
    REDUCE_DTYPES,
    ROUTER_SCORES,
    SCHEDULES,
    STRATEGIES,
    TEXT_DATASETS,
    Config,
    ConfigError,
    DataConfig,
    ParallelConfig,
)
from shardwise.elastic import check_range
from shardwise.parallel.pipeline.schedules import ScheduleError, virtual_stages
from shardwise.recompute import parse_policy
from shardwise.strategies.base import mesh_of
from shardwise.strategies.classes import strategy_class
from shardwise.trackers import check_trackers


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key} = {value!r}: unknown; allowed: {', '.join(allowed)}")


def _positive(key: str, value: float, zero_ok: bool = False) -> None:
    if value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise ConfigError(f"{key} = {value!r}: must be {bound}")


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Check every value and every relation between values; `world_size` defaults to the launch's.
    An elastic range's smaller sizes too (elastic.py)."""
    _validate(cfg, world_size or cfg.world_size, fixed=True, varied=True)
    check_range(cfg, validate_varied)


def check_fixed(cfg: Config) -> None:
    """validate's checks of what no planner candidate sets, in its order: the planner makes them
    once for its base config instead of once for each of (up to) hundreds of thousands of candidates."""
    _validate(cfg, cfg.world_size, fixed=True, varied=False)


def validate_varied(cfg: Config, world: int) -> None:
    """validate(cfg, world) less `check_fixed`'s checks: the same first ConfigError wherever those
    pass, as they do for every candidate of a base config that passes them."""
    _validate(cfg, world, fixed=False, varied=True)


def _validate(cfg: Config, world: int, fixed: bool, varied: bool) -> None:
    """validate's checks, in the order that decides which error a config with several gets.
    `fixed`: those that read nothing a planner candidate sets (the parallel table's strategy,
    precision, recompute, mesh sizes, pipeline, cp and ep; train.micro_batch and global_batch;
    launch.nproc) nor the world size; `varied`: the others."""
    m, d, t, p, launch = cfg.model, cfg.data, cfg.train, cfg.parallel, cfg.launch
    if fixed:
        _choice("model.name", m.name, MODELS)
    if varied:
        validate_parallel(p)
    if fixed:
        _choice("launch.backend", launch.backend, BACKENDS)
        _choice("train.optimizer", t.optimizer, OPTIMIZERS)
        _choice("train.bad_step", t.bad_step, ("stop", "skip", "off"))
        _validate_own_data(cfg)
    if varied:
        _validate_lora(cfg, world)
        _validate_float8(cfg, world)
    if fixed:
        _validate_model(cfg)
    if varied and p.recompute != "none" and m.name not in LANGUAGE_MODELS:
        raise ConfigError(f"parallel.recompute = {p.recompute!r}: model.name = {m.name!r} has no blocks to recompute")
    if fixed and t.compile and m.name not in LANGUAGE_MODELS:
        raise ConfigError(f"train.compile: model.name = {m.name!r} has no blocks to compile")
    if varied and t.compile and p.recompute == "selective":
        raise ConfigError("train.compile with parallel.recompute = 'selective': its policy cannot see the operations "
                          "inside a compiled block and would recompute nearly all of it; use 'blocks' or 'every:K'")
    if fixed:
        _positive("model.width", m.width)
        _positive("model.num_classes", m.num_classes)
        if not 0 < d.val_fraction < 1:
            raise ConfigError(f"data.val_fraction = {d.val_fraction!r}: must be between 0 and 1 (exclusive)")
        _positive("data.synthetic_size", d.synthetic_size)
        _positive("train.steps", t.steps)
    if varied:
        _positive("train.global_batch", t.global_batch)
        _positive("train.micro_batch", t.micro_batch)
    if fixed:
        _validate_optimization(cfg)
    if varied:
        _positive("launch.nproc", launch.nproc)
    if fixed:
        _validate_launch(cfg)
        _positive("parallel.replicas", p.replicas)
        _choice("parallel.param_server.mode", p.param_server.mode, PS_MODES)
        _positive("parallel.param_server.servers", p.param_server.servers)
        _positive("parallel.param_server.max_staleness", p.param_server.max_staleness, zero_ok=True)
    if varied:
        if t.optimizer == "muon":
            _muon_composes(cfg, world)
        if t.objective != "sft" and p.cp > 1:  # an answer's log-probability would be split over the cp ranks
            raise ConfigError(f"train.objective = {t.objective!r}: not with context parallel (parallel.cp = {p.cp}); "
                              "a pair's window is one rank's")
        _validate_strategy(cfg, world)


def _validate_model(cfg: Config) -> None:
    """The dataset suits the model, and a language model's sizes fit together."""
    m, d = cfg.model, cfg.data
    datasets = TEXT_DATASETS if m.name in LANGUAGE_MODELS else IMAGE_DATASETS
    if d.name not in datasets:
        raise ConfigError(
            f"data.name = {d.name!r}: not usable with model.name = {m.name!r}; allowed: {', '.join(datasets)}"
        )
    if m.name == "hf" and m.hf_config is None:
        raise ConfigError("model.name = 'hf': a transformers causal LM of the family and architecture model.hf_config "
                          "gives; set it (--hf-config MODEL/config.json)")
    if m.name in LANGUAGE_MODELS:
        for key in ("n_layer", "n_head", "d_model", "seq_len", "vocab_size", "n_kv_head", "d_ff"):
            _positive(f"model.{key}", getattr(m, key))
        if m.d_model % m.n_head and m.name != "hf":  # `hf`: the family's sizes are its own to check
            raise ConfigError(f"model.d_model = {m.d_model}: must be divisible by model.n_head = {m.n_head}")
        if m.n_kv_head != m.n_head and m.name not in GROUPED_QUERY_MODELS:
            raise ConfigError(f"model.n_kv_head = {m.n_kv_head}: model.name = {m.name!r} has one key/value head per "
                              f"head (n_head = {m.n_head}); grouped-query attention: {', '.join(GROUPED_QUERY_MODELS)}")
        if m.n_head % m.n_kv_head and m.name != "hf":
            raise ConfigError(f"model.n_kv_head = {m.n_kv_head}: must divide model.n_head = {m.n_head}")
        if m.vocab_size < 256:
            raise ConfigError(f"model.vocab_size = {m.vocab_size}: must be >= 256 for byte-level data")


def _validate_optimization(cfg: Config) -> None:
    """The [train] values after the batch sizes, and the launch's restarts and shutdown."""
    t, launch = cfg.train, cfg.launch
    for key in ("lr", "eval_batches"):
        _positive(f"train.{key}", getattr(t, key))
    _positive("train.keep_checkpoints", t.keep_checkpoints)
    for key in ("min_lr", "warmup_steps", "weight_decay", "grad_clip", "eval_every", "seed", "checkpoint_every",
                "memory_checkpoint_every", "spike_factor", "straggler_factor"):
        _positive(f"train.{key}", getattr(t, key), zero_ok=True)
    for key in ("beta1", "beta2", "momentum"):
        if not 0 <= getattr(t, key) < 1:
            raise ConfigError(f"train.{key} = {getattr(t, key)!r}: must be in [0, 1)")
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr = {t.min_lr!r}: must be <= train.lr = {t.lr!r}")
    if t.optimizer == "muon":
        _validate_muon(cfg)
    _validate_objective(cfg)
    _positive("launch.max_restarts", launch.max_restarts, zero_ok=True)
    _positive("launch.shutdown_timeout_s", launch.shutdown_timeout_s, zero_ok=True)


# Every matrix whole on a rank, or ZeRO's or tensor parallel's shards of it (put together by an owner rank);
# not fsdp-native (FSDP2's DTensor shards) nor param-server (its servers step)
MUON_STRATEGIES = ("single", "dp", "ddp", "ddp-native", "zero1", "zero2", "fsdp", "hsdp", "tensor", "pipeline",
                   "model-parallel")


def _validate_muon(cfg: Config) -> None:
    """Muon's keys, and a language model's blocks for it to step (or named parameters)."""
    muon = cfg.train.muon
    _positive("train.muon.ns_steps", muon.ns_steps)
    if not 0 <= muon.momentum < 1:
        raise ConfigError(f"train.muon.momentum = {muon.momentum!r}: must be in [0, 1)")
    if cfg.model.name not in LANGUAGE_MODELS and muon.params is None:
        raise ConfigError(f"train.optimizer = 'muon': steps the matrices of a language model's blocks; model.name = "
                          f"{cfg.model.name!r} has none: name them in train.muon.params")


def _validate_objective(cfg: Config) -> None:
    """train.objective and the data it trains on: a preference objective on preference pairs, and
    those pairs for a preference objective."""
    t, d = cfg.train, cfg.data
    _choice("train.objective", t.objective, OBJECTIVES)
    if (t.objective != "sft") != (d.format == "preference"):
        want = "data.format = 'preference' (and data.path, its pairs)" if t.objective != "sft" else \
            "train.objective = 'dpo', 'ipo' or 'simpo'"
        raise ConfigError(f"train.objective = {t.objective!r} with data.format = {d.format!r}: needs {want}")
    _positive("train.beta", t.beta)
    _positive("train.gamma", t.gamma, zero_ok=True)
    _choice("train.reference", t.reference, ("pass", "copy"))
    if t.reference == "copy" and cfg.lora.rank > 0:
        raise ConfigError("train.reference = 'copy' with LoRA adapters: the reference is the base model the adapters "
                          "leave untouched, which train.reference = 'pass' computes once at no memory cost")


def _muon_composes(cfg: Config, world: int) -> None:
    """What Muon composes with (checked for each of a planner's candidates): MUON_STRATEGIES, with
    ZeRO's shards on the device; no adapters, no fp16 loss scale yet."""
    p = cfg.parallel
    if p.strategy not in MUON_STRATEGIES:
        raise ConfigError(f"train.optimizer = 'muon': not under parallel.strategy = {p.strategy!r}; use one of "
                          f"{', '.join(MUON_STRATEGIES)}, or adamw")
    if p.sharding.offload != "none":
        raise ConfigError(f"train.optimizer = 'muon': not with parallel.sharding.offload = {p.sharding.offload!r} "
                          "(its matrices would be assembled from the host)")
    if cfg.lora.rank > 0:
        raise ConfigError("train.optimizer = 'muon': not with LoRA adapters yet (lora.rank > 0); use adamw")
    if p.precision == "fp16-mixed":
        raise ConfigError("train.optimizer = 'muon': not with fp16's loss scaler yet; use bf16-mixed or fp32")


def _validate_launch(cfg: Config) -> None:
    """The launch's nodes, threads and timeout, and the [run] table."""
    launch = cfg.launch
    for key in ("nnodes", "threads_per_rank", "timeout_s"):
        _positive(f"launch.{key}", getattr(launch, key))
    if not 0 <= launch.node_rank < launch.nnodes:
        raise ConfigError(f"launch.node_rank = {launch.node_rank}: must be in [0, launch.nnodes = {launch.nnodes})")
    if launch.node_addr and launch.nnodes == 1:
        raise ConfigError(f"launch.node_addr = {launch.node_addr!r}: only for several nodes (launch.nnodes > 1); "
                          "one node rendezvous on loopback")
    _positive("run.log_every", cfg.run.log_every)
    check_trackers(cfg.run)


def _validate_strategy(cfg: Config, world: int) -> None:
    """The strategy on this world: its own checks, the mesh, the experts, replica groups, and the
    global batch split over the data-parallel replicas."""
    t, p, launch = cfg.train, cfg.parallel, cfg.launch
    strategy = spec(p.strategy)
    _validate_context(cfg, world)
    dp, pp, _ = p.mesh_shape(world)
    strategy_class(p.strategy, pp).check_config(cfg, world)
    if strategy.one_process and world != 1:
        raise ConfigError(
            f"parallel.strategy = {p.strategy!r}: runs on one process, but the world size is {world}; "
            "use --nproc 1 or a multi-rank strategy such as ddp"
        )
    if not strategy.checkpoints and (launch.max_restarts or t.checkpoint_every or cfg.run.resume):
        raise ConfigError(f"{p.strategy} keeps no checkpoints: set launch.max_restarts = 0, "
                          "train.checkpoint_every = 0 and run.resume = false")
    if cfg.model.weights is not None:
        _validate_weights(cfg.model.weights, p.strategy)
    _validate_mesh(cfg, world)
    _validate_experts(cfg, world)
    _validate_replica_groups(cfg)
    dp *= launch.replica_groups
    per_step = dp * t.micro_batch
    if t.global_batch % per_step:
        if launch.replica_groups > 1:
            replicas = f"launch.replica_groups {launch.replica_groups} x world size {world}"
        elif dp == world:
            replicas = f"world size {world}"
        else:
            replicas = f"the {dp} workers" if strategy.parameter_servers else f"parallel.dp {dp}"
        raise ConfigError(
            f"train.global_batch = {t.global_batch}: must be divisible by {replicas} x "
            f"train.micro_batch {t.micro_batch} = {per_step} (the rest is gradient accumulation)"
        )


# What a replica group may run (replicas.py): the whole model on each rank, or sharded over the
# group's ranks alike in every group (torchft's HSDP), so that the same rank of each group holds the same part.
REPLICA_GROUP_STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")


def _validate_replica_groups(cfg: Config) -> None:
    """launch.replica_groups: torchft's groups (replicas.py), all on one node or one a node, healing
    from a peer rather than a checkpoint."""
    launch, p = cfg.launch, cfg.parallel
    _positive("launch.replica_groups", launch.replica_groups)
    if launch.replica_groups == 1:
        return
    n = launch.replica_groups
    if p.strategy not in REPLICA_GROUP_STRATEGIES or any((size or 1) > 1 for size in (p.pp, p.tp, p.cp, p.ep)):
        raise ConfigError(f"launch.replica_groups = {n}: torchft averages and heals replicas that each hold the "
                          f"model whole or sharded over their ranks ({', '.join(REPLICA_GROUP_STRATEGIES)}), so far "
                          f"without a mesh; not parallel.strategy = {p.strategy!r}"
                          + (" over a mesh" if p.strategy in REPLICA_GROUP_STRATEGIES else ""))
    if launch.nnodes > 1 and launch.nnodes != n:
        raise ConfigError(f"launch.replica_groups = {n} on launch.nnodes = {launch.nnodes} nodes: across nodes, "
                          f"each node runs one group of its launch.nproc ranks; give as many groups as nodes")
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError(f"launch.replica_groups = {n}: needs torchft; pip install 'shardwise[ft]' "
                          "(or pip install torchft)")


def _validate_experts(cfg: Config, world: int) -> None:
    """A gpt-moe's experts and routing, and how parallel.ep splits them over the world."""
    m, p = cfg.model, cfg.parallel
    _positive("parallel.ep", p.ep)
    if m.head_dim is not None and m.name not in ("hf", "hf-qwen3-moe"):
        raise ConfigError(f"model.head_dim = {m.head_dim}: only hf's and hf-qwen3-moe's heads have a width of their "
                          f"own; model.name = {m.name!r} has heads of d_model / n_head")
    if m.head_dim is not None:
        _positive("model.head_dim", m.head_dim)
    if m.name in MOE_MODELS:
        for key in ("n_experts", "top_k", "d_expert"):
            _positive(f"model.{key}", getattr(m, key))
        if m.top_k > m.n_experts:
            raise ConfigError(f"model.top_k = {m.top_k}: each token is routed to top_k of the model.n_experts = "
                              f"{m.n_experts} experts; must be at most n_experts")
        _choice("model.router_score", m.router_score, ROUTER_SCORES)
        _choice("model.balance", m.balance, BALANCES)
        _positive("model.aux_loss_coef", m.aux_loss_coef, zero_ok=True)
        _positive("model.balance_rate", m.balance_rate, zero_ok=True)
        if p.sequence_parallel and m.balance == "aux-loss":
            raise ConfigError("parallel.sequence_parallel = true with model.balance = 'aux-loss': each tp rank "
                              "routes its part of the sequence, and the auxiliary loss over part of the tokens is "
                              "not the whole sequence's; use model.balance = 'bias' (its counts are summed over "
                              "every rank) or leave sequence_parallel off")
        if m.balance == "aux-loss" and p.cp > 1:
            raise ConfigError(f"model.balance = 'aux-loss' with parallel.cp = {p.cp}: the auxiliary loss is computed "
                              "over a rank's tokens, under context parallel only part of each sequence; use "
                              "model.balance = 'bias' (its counts are summed over every rank)")
    if p.ep == 1:
        return
    if m.name not in MOE_MODELS:
        raise ConfigError(f"parallel.ep = {p.ep}: splits the experts of Mixture-of-Experts layers; model.name = "
                          f"{m.name!r} has none (models with experts: {', '.join(MOE_MODELS)})")
    if p.strategy not in EP_STRATEGIES:
        raise ConfigError(f"parallel.ep = {p.ep}: parallel.strategy = {p.strategy!r} does not split experts yet; "
                          f"expert parallel runs under {', '.join(EP_STRATEGIES)}")
    if m.n_experts % p.ep:
        raise ConfigError(f"parallel.ep = {p.ep}: must divide model.n_experts = {m.n_experts}; each ep rank holds "
                          "an equal share of every layer's experts")
    dp, pp, tp = p.mesh_shape(world)
    if dp % p.ep:
        raise ConfigError(f"parallel.ep = {p.ep}: the expert-parallel ranks are data-parallel ranks, so ep must "
                          f"divide dp = {dp} (world size {world}); e.g. --nproc {p.ep}")
    over, among = dp // p.ep, f"dp / ep = {dp // p.ep}"
    if spec(p.strategy).across_nodes:  # hsdp: an expert's shards stay within a node, as the rest's do
        shard = mesh_of(p, world, cfg.launch.nproc).dp_shard
        if shard % p.ep:
            raise ConfigError(f"parallel.ep = {p.ep}: {p.strategy} shards within a node, over its {shard} "
                              "data-parallel ranks, and an expert group must lie within them too; ep must divide "
                              f"{shard}")
        over, among = shard // p.ep, f"a node's {shard} / ep = {shard // p.ep}"
    held = m.n_experts // p.ep
    # Fewer experts than the ranks sharing them are split within each expert (parallel/shard.py's
    # sharded_shape); more must divide evenly, or some ranks would hold a whole expert of padding.
    if spec(p.strategy).zero_stage and held >= over and held % over:
        raise ConfigError(f"parallel.ep = {p.ep}: {p.strategy} shards each ep rank's {held} experts over the "
                          f"{among} ranks that hold the same ones; they must divide evenly, or be fewer "
                          "than those ranks (raise model.n_experts or parallel.ep)")


def _validate_weights(weights: str, strategy: str) -> None:
    path = Path(weights)
    if not (path.is_file() and path.suffix == ".safetensors" or path.is_dir() and any(path.glob("*.safetensors"))):
        raise ConfigError(f"model.weights = {weights!r}: expected a .safetensors file, or a directory holding them "
                          "(as from_pretrained reads); not found")
    if not spec(strategy).checkpoints:  # the state a checkpoint loads into is what weights load into
        raise ConfigError(f"model.weights = {weights!r}: {strategy} keeps the parameters on its servers, which "
                          "start from initial values; use another strategy to start from weights")


# The strategies LoRA is tested under (tests/test_lora.py); the others refuse it until they are.
LORA_STRATEGIES = ("single", "ddp", "ddp-native", "zero1", "zero2", "fsdp", "fsdp-native", "hsdp", "pipeline", "tensor")
# Those that hold a 4-bit base (QLoRA): every parameter whole, or split by rows (ZeRO's units). Not
# tensor parallel, which would split a row-parallel layer's packed rows, nor PyTorch's own wrappers.
QLORA_STRATEGIES = ("single", "ddp", "zero1", "zero2", "fsdp", "hsdp")


def _validate_lora(cfg: Config, world: int) -> None:
    lora, p = cfg.lora, cfg.parallel
    _positive("lora.rank", lora.rank, zero_ok=True)
    if lora.rank == 0:
        if lora.quantize != "none":
            raise ConfigError(f"lora.quantize = {lora.quantize!r}: a quantized base trains through adapters; set "
                              "lora.rank > 0")
        return
    _positive("lora.alpha", lora.alpha)
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"lora.dropout = {lora.dropout!r}: must be in [0, 1)")
    if cfg.model.name not in LANGUAGE_MODELS and lora.targets is None:
        raise ConfigError(f"lora.targets: model.name = {cfg.model.name!r} has no family default; name the layers")
    _choice("lora.quantize", lora.quantize, ("none", "nf4"))
    dp, pp, tp = p.mesh_shape(world)
    if lora.quantize == "nf4" and (p.strategy not in QLORA_STRATEGIES or pp > 1 or tp > 1):
        raise ConfigError(f"lora.quantize = 'nf4': the 4-bit base is held under {', '.join(QLORA_STRATEGIES)}, "
                          f"without pipeline or tensor parallel, so far; not under parallel.strategy = "
                          f"{p.strategy!r} with pp = {pp}, tp = {tp}")
    if p.strategy not in LORA_STRATEGIES:
        raise ConfigError(f"lora.rank = {lora.rank}: adapters train under {', '.join(LORA_STRATEGIES)} (each over "
                          f"pipeline stages and tensor parallel too); not under parallel.strategy = {p.strategy!r}")


# Those float8 is tested under (tests/test_float8.py), over tensor parallel too (tensor, and the
# sharded ones with parallel.tp: each split operand's scale spans its split), not over pipeline stages.
FLOAT8_STRATEGIES = ("single", "ddp", "zero1", "zero2", "fsdp", "hsdp", "tensor")


def _validate_float8(cfg: Config, world: int) -> None:
    p = cfg.parallel
    _choice("parallel.float8", p.float8, FLOAT8_RECIPES)
    if p.float8 == "none":
        return
    what = f"parallel.float8 = {p.float8!r}"
    if p.precision not in ("bf16-mixed", "bf16-true"):
        raise ConfigError(f"{what}: computes with bf16 beside float8; needs parallel.precision = 'bf16-mixed' or "
                          f"'bf16-true', not {p.precision!r}")
    if cfg.model.name not in LANGUAGE_MODELS:
        raise ConfigError(f"{what}: converts the linear layers of a language model's blocks; model.name = "
                          f"{cfg.model.name!r} has none")
    _, pp, tp = p.mesh_shape(world)
    if p.strategy not in FLOAT8_STRATEGIES or pp > 1:
        raise ConfigError(f"{what}: runs under {', '.join(FLOAT8_STRATEGIES)} so far, without pipeline stages; "
                          f"not parallel.strategy = {p.strategy!r} with pp = {pp}")
    if p.sequence_parallel:
        raise ConfigError(f"{what}: not with parallel.sequence_parallel yet (its column layers gather their input "
                          "along the sequence in a matmul of their own)")
    if cfg.lora.quantize != "none":
        raise ConfigError(f"{what}: not with lora.quantize = {cfg.lora.quantize!r} (an NF4 base is dequantized "
                          "to bf16 to compute; float8 would cast it again)")


def validate_parallel(p: ParallelConfig) -> None:
    """The [parallel] values that need no model, batch or world size to check: all the Python API
    (api.py) can check before it sees a model."""
    _choice("parallel.strategy", p.strategy, STRATEGIES)
    _choice("parallel.precision", p.precision, PRECISIONS)
    _choice("parallel.sharding.reduce_dtype", p.sharding.reduce_dtype, REDUCE_DTYPES)
    _choice("parallel.pipeline.schedule", p.pipeline.schedule, SCHEDULES)
    _positive("parallel.pipeline.micro_batches", p.pipeline.micro_batches)
    try:
        virtual_stages(p.pipeline.schedule, p.pipeline.virtual_stages)
    except ScheduleError as exc:
        raise ConfigError(f"parallel.pipeline.{exc}") from None
    # The lists of strategies only for the error: this runs for every candidate the planner weighs.
    if p.sharding.reduce_dtype != "fp32" and not spec(p.strategy).zero_stage:
        sharded = [name for name, each in SPECS.items() if each.zero_stage]
        raise ConfigError(
            f"parallel.sharding.reduce_dtype = {p.sharding.reduce_dtype!r}: only the sharded strategies "
            f"({', '.join(sharded)}) "
            f"reduce in another dtype; parallel.strategy is {p.strategy!r}"
        )
    _choice("parallel.sharding.offload", p.sharding.offload, OFFLOADS)
    if p.sharding.offload != "none" and not spec(p.strategy).offloads:
        offloading = [name for name, each in SPECS.items() if each.offloads]
        raise ConfigError(f"parallel.sharding.offload = {p.sharding.offload!r}: only {', '.join(offloading)} offload "
                          "their optimizer "
                          f"state to the host; parallel.strategy is {p.strategy!r}")
    _validate_gradient_reduction(p)
    if p.sequence_parallel and not (spec(p.strategy).splits_model or spec(p.strategy).shards_split_model):
        splitting = ", ".join(name for name, each in SPECS.items() if each.splits_model or each.shards_split_model)
        raise ConfigError(f"parallel.sequence_parallel = true: splits the sequence over tensor-parallel ranks; only "
                          f"{splitting} (with tp > 1) have them, not parallel.strategy = {p.strategy!r}")
    try:
        parse_policy(p.recompute)
    except ValueError as exc:
        raise ConfigError(f"parallel.recompute = {exc}") from None
    _positive("parallel.ddp.bucket_mb", p.ddp.bucket_mb)
    _positive("parallel.sharding.prefetch", p.sharding.prefetch, zero_ok=True)
    _positive("parallel.sharding.blocks_per_unit", p.sharding.blocks_per_unit)
    _positive("parallel.cp", p.cp)
    _choice("parallel.cp_mode", p.cp_mode, CP_MODES)
    _positive("parallel.loss_scale", p.loss_scale)
    _positive("parallel.loss_scale_growth_interval", p.loss_scale_growth_interval)


def _validate_gradient_reduction(p: ParallelConfig) -> None:
    """The ring and gradient compression are our ddp's, and PowerSGD needs steady fp32 gradients."""
    _choice("parallel.ddp.all_reduce", p.ddp.all_reduce, ALL_REDUCES)
    _choice("parallel.ddp.grad_compression", p.ddp.grad_compression, GRAD_COMPRESSIONS)
    _positive("parallel.ddp.powersgd_rank", p.ddp.powersgd_rank)
    _positive("parallel.ddp.powersgd_start_step", p.ddp.powersgd_start_step, zero_ok=True)
    for key, value, plain in (("parallel.ddp.all_reduce", p.ddp.all_reduce, "backend"),
                              ("parallel.ddp.grad_compression", p.ddp.grad_compression, "none")):
        if value != plain and p.strategy != "ddp":
            raise ConfigError(f"{key} = {value!r}: only parallel.strategy = 'ddp' (ours) has it; "
                              f"parallel.strategy is {p.strategy!r}")
    if p.ddp.grad_compression == "powersgd" and p.precision in ("fp16-mixed", "bf16-true"):
        raise ConfigError(
            f"parallel.ddp.grad_compression = 'powersgd': needs fp32 gradients on a steady scale (its error feedback "
            f"carries them from step to step), not parallel.precision = {p.precision!r}; use fp32 or bf16-mixed"
        )


def _validate_own_data(cfg: Config) -> None:
    """data.path and what goes with it (the files themselves are read by data/prepare.py)."""
    d = cfg.data
    _choice("data.format", d.format, FORMATS)
    if d.path is None:
        defaults = DataConfig()
        for key in ("val_path", "tokenizer", "text_field", "split", "format"):
            if getattr(d, key) != getattr(defaults, key):
                raise ConfigError(f"data.{key} = {getattr(d, key)!r}: only with data.path (your own corpus)")
        return
    if cfg.model.name not in LANGUAGE_MODELS:
        raise ConfigError(f"data.path = {d.path!r}: a text corpus; model.name = {cfg.model.name!r} takes images")
    if d.documents == "paragraphs":
        raise ConfigError("data.documents = 'paragraphs': only for the built-in corpora; with data.path, `files` "
                          "makes each text file or JSON line a document")
    if d.format != "text" and d.documents != "files":
        raise ConfigError(f"data.documents = {d.documents!r}: data.format = {d.format!r} packs its samples, each its "
                          "own document: leave data.documents unset (files)")
    if d.format == "chat" and d.tokenizer == "bytes":
        raise ConfigError("data.format = 'chat': data.tokenizer must be a tokenizer's directory with a chat template "
                          "(a model's from_pretrained directory), not bytes")


def _validate_context(cfg: Config, world: int) -> None:
    """Context parallelism and document masks: what they ask of the strategy, the model and the data."""
    m, d, p = cfg.model, cfg.data, cfg.parallel
    _choice("data.documents", d.documents, DOCUMENTS)
    if p.cp == 1 and d.documents == "none":
        return
    what = f"parallel.cp = {p.cp}" if p.cp > 1 else f"data.documents = {d.documents!r}"
    if not spec(p.strategy).context_parallel:
        splitting = ", ".join(name for name, each in SPECS.items() if each.context_parallel)
        raise ConfigError(f"{what}: parallel.strategy = {p.strategy!r} neither splits sequences nor masks documents; "
                          f"strategies that do: {splitting}")
    if d.documents != "none" and spec(p.strategy).pipelined and p.cp > 1:
        raise ConfigError(f"data.documents = {d.documents!r}: parallel.strategy = {p.strategy!r} masks documents, "
                          f"and splits sequences over parallel.cp = {p.cp}, not both yet")
    if m.name not in LANGUAGE_MODELS:
        raise ConfigError(f"{what}: model.name = {m.name!r} has no token sequences; use one of "
                          f"{', '.join(LANGUAGE_MODELS)}")
    if d.documents != "none" and d.name not in CORPORA and d.path is None:
        raise ConfigError(f"data.documents = {d.documents!r}: data.name = {d.name!r} has no documents; use one of "
                          f"{', '.join(CORPORA)}")
    if p.cp == 1:
        return
    if m.name == "hf":
        raise ConfigError(f"parallel.cp = {p.cp}: context parallel feeds each rank's positions to the module its "
                          "family's parallel plan names; model.name = 'hf' has no plan yet (docs/huggingface.md)")
    if world % p.cp:
        raise ConfigError(f"parallel.cp = {p.cp}: must divide the world size {world} (launch.nproc x launch.nnodes)")
    if p.cp_mode == "ring" and m.seq_len % (2 * p.cp):
        raise ConfigError(
            f"model.seq_len = {m.seq_len}: parallel.cp_mode = 'ring' cuts each sequence into 2 x parallel.cp = "
            f"{2 * p.cp} equal chunks (each rank one early and one late, for even causal work); make it divisible by "
            f"{2 * p.cp}"
        )
    tp = p.mesh_shape(world)[2]
    if p.cp_mode == "all-to-all" and (m.n_head % (p.cp * tp) or m.seq_len % p.cp):
        heads = "n_head / cp" if tp == 1 else f"n_head / (cp x tp) = n_head / {p.cp * tp}"
        raise ConfigError(
            f"model.n_head = {m.n_head}, model.seq_len = {m.seq_len}: parallel.cp_mode = 'all-to-all' gives each of "
            f"the parallel.cp = {p.cp} ranks {heads} heads over the whole sequence, gathered from seq_len / cp "
            f"tokens on each; make them divisible (or use cp_mode = 'ring')"
        )


def _validate_mesh(cfg: Config, world: int) -> None:
    """The dp x pp x tp values are sizes, and only a strategy that splits the model sets pp or tp
    (the rest of the mesh is MeshStrategy.check_config's)."""
    p = cfg.parallel
    for dim in ("dp", "pp", "tp"):
        if getattr(p, dim) is not None:
            _positive(f"parallel.{dim}", getattr(p, dim))
    strategy = spec(p.strategy)
    if strategy.splits_model or strategy.parameter_servers:
        return
    dp, pp, tp = p.mesh_shape(world)
    if strategy.shards_split_model:
        return  # the sharded strategies over tensor parallel or pipeline stages: their check_config checks the split
    if (dp, pp, tp) != (world // p.cp, 1, 1):
        splitting = ", ".join(name for name, each in SPECS.items() if each.splits_model)
        composing = ", ".join(name for name, each in SPECS.items() if each.shards_split_model)
        raise ConfigError(
            f"parallel.dp x pp x tp = {dp} x {pp} x {tp}: parallel.strategy = {p.strategy!r} is data parallel "
            f"over all {world} ranks; {splitting} split the model over a mesh, and {composing} shard a model "
            "tensor parallel splits (parallel.tp)"
        )
