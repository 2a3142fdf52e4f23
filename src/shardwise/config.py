"""One typed, validated config: TOML file, then `--set section.key=value` overrides, then flags.

Every bad value raises `ConfigError` with one line naming the key, the value and what is
allowed, and all of it happens before any worker starts.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from shardwise.parallel.pipeline.schedules import SCHEDULES as PIPELINE_SCHEDULES
from shardwise.parallel.pipeline.schedules import ScheduleError, virtual_stages
from shardwise.recompute import parse_policy
from shardwise.strategies.registry import NAMES as STRATEGIES
from shardwise.strategies.registry import SPECS, spec

SCHEDULES = tuple(PIPELINE_SCHEDULES)
PS_MODES = ("sync", "async")
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true")
REDUCE_DTYPES = ("fp32", "bf16")
OFFLOADS = ("none", "optimizer")
ALL_REDUCES = ("backend", "ring")
GRAD_COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
# transformers models of the GPT presets' sizes (models/hf.py)
HF_MODELS = ("hf-llama", "hf-qwen2", "hf-gpt2", "hf-mixtral", "hf-qwen3-moe", "hf-deepseek-v3")
# families whose key/value heads may be fewer than their heads
GROUPED_QUERY_MODELS = ("hf-llama", "hf-qwen2", "hf-mixtral", "hf-qwen3-moe", "hf-deepseek-v3")
# A transformers config.json's `model_type` -> the family that builds it (Mistral has Llama's modules).
HF_MODEL_TYPES = {"llama": "hf-llama", "mistral": "hf-llama", "qwen2": "hf-qwen2", "gpt2": "hf-gpt2",
                  "mixtral": "hf-mixtral", "qwen3_moe": "hf-qwen3-moe", "deepseek_v3": "hf-deepseek-v3"}
# Where each family's transformers config keeps the sizes a ModelConfig names.
_LLAMA_SIZE_KEYS = dict(n_layer="num_hidden_layers", n_head="num_attention_heads", n_kv_head="num_key_value_heads",
                        d_model="hidden_size", d_ff="intermediate_size", vocab_size="vocab_size",
                        seq_len="max_position_embeddings")
HF_SIZE_KEYS: dict[str, dict[str, str]] = {
    "hf-llama": _LLAMA_SIZE_KEYS,
    "hf-qwen2": _LLAMA_SIZE_KEYS,
    "hf-gpt2": dict(n_layer="n_layer", n_head="n_head", d_model="n_embd", d_ff="n_inner", vocab_size="vocab_size",
                    seq_len="n_positions"),
    # Mixtral's experts are its MLPs (intermediate_size); Qwen3-MoE's have a width of their own.
    "hf-mixtral": {**_LLAMA_SIZE_KEYS, "n_experts": "num_local_experts", "top_k": "num_experts_per_tok"},
    "hf-qwen3-moe": {**_LLAMA_SIZE_KEYS, "n_experts": "num_experts", "top_k": "num_experts_per_tok",
                     "d_expert": "moe_intermediate_size", "head_dim": "head_dim"},
    # Its attention's other sizes (MLA's ranks and head widths) and its dense first blocks: model.hf_config's.
    "hf-deepseek-v3": {**_LLAMA_SIZE_KEYS, "n_experts": "n_routed_experts", "top_k": "num_experts_per_tok",
                       "d_expert": "moe_intermediate_size"},
}
# Other names a config.json may keep a size under: transformers 5 saves Qwen3-MoE's num_experts by its
# attribute's name, num_local_experts (published Qwen3-MoE configs say num_experts).
HF_SIZE_ALIASES = {"num_experts": ("num_local_experts",)}
# Models of token sequences: sized by a GPT preset, trained on text.
LANGUAGE_MODELS = ("gpt", "gpt-moe", *HF_MODELS)
# Models whose blocks have Mixture-of-Experts layers: ours (models/moe.py), transformers' (their own).
MOE_MODELS = ("gpt-moe", "hf-mixtral", "hf-qwen3-moe", "hf-deepseek-v3")
ROUTER_SCORES = ("softmax", "sigmoid")
BALANCES = ("aux-loss", "bias", "none")
# The strategies that split experts over parallel.ep ranks (parallel/experts.py).
EP_STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
MODELS = (*LANGUAGE_MODELS, "cnn", "mlp")
GPT_PRESETS = ("tiny", "small", "gpt2-124m")
OPTIMIZERS = ("adamw", "sgd")
CORPORA = ("shakespeare", "stdlib")  # the built-in text corpora (data/corpus.py)
TEXT_DATASETS = (*CORPORA, "synthetic-tokens")
IMAGE_DATASETS = ("digits", "synthetic-images")
DOCUMENTS = ("none", "files", "paragraphs")  # what a corpus's documents are, for document masks (data/documents.py)
CP_MODES = ("ring", "all-to-all")
BACKENDS = ("auto", "gloo", "nccl")
DEFAULT_BLOCK = "Block"  # the GPT's block class


class ConfigError(ValueError):
    """A config value is wrong; the message is one line naming key, value and what is allowed."""


def option(default: Any, doc: str, choices: tuple[str, ...] = ()) -> Any:
    """A config key: its default, what it does and, for a key with a fixed set of values, those.
    `python -m shardwise.docs` writes docs/config.md from these."""
    return field(default=default, metadata={"doc": doc, "choices": choices})


@dataclass
class ModelConfig:
    """The model to train. An hf-* model with `hf_config` takes its sizes from that config.json (a
    size set here must agree with it); otherwise sizes come from `preset`, and any size set here
    overrides the preset's."""

    name: str = option("gpt", "`gpt` (decoder-only transformer), `gpt-moe` (the GPT with a Mixture-of-Experts "
                       "layer for each MLP, docs/strategies/moe.md), `hf-llama` / `hf-qwen2` / `hf-gpt2` / "
                       "`hf-mixtral` / `hf-qwen3-moe` / `hf-deepseek-v3` (a randomly initialised transformers "
                       "Llama, Qwen2, GPT-2, Mixtral, Qwen3-MoE or DeepSeek-V3 of the preset's sizes), `cnn` (with "
                       "BatchNorm) or `mlp`", MODELS)
    preset: str = option("tiny", "GPT and hf-* size: `tiny` (2 blocks x width 64, 64-token context), `small` "
                         "(6 x 384, 256), `gpt2-124m` (12 x 768, 1024, vocabulary 50304); fills every size below "
                         "left unset", GPT_PRESETS)
    n_layer: int | None = option(None, "GPT, hf-*: blocks (unset: the preset's)")
    n_head: int | None = option(None, "GPT, hf-*: attention heads; must divide d_model (unset: the preset's)")
    d_model: int | None = option(None, "GPT, hf-*: width (unset: the preset's)")
    seq_len: int | None = option(None, "GPT, hf-*: context length in tokens (unset: the preset's)")
    vocab_size: int | None = option(None, "GPT, hf-*: vocabulary size, >= 256 for byte-level data (unset: the "
                                    "preset's)")
    n_kv_head: int | None = option(None, "hf-llama, hf-qwen2: key/value heads (grouped-query attention), dividing "
                                   "n_head; the GPT and GPT-2 have one per head (unset: n_head)")
    d_ff: int | None = option(None, "GPT, hf-*: the MLP's hidden width (unset: 4 x d_model)")
    hf_config: str | None = option(None, "hf-*: a transformers config.json (a published model's) whose "
                                   "architecture the model follows, read offline: it gives the model its sizes (a "
                                   "size set here must agree; seq_len may be shorter than its context) and its other "
                                   "settings (tied embeddings, biases, RoPE); its model_type must be model.name's "
                                   "family (llama and mistral: hf-llama; qwen2; gpt2; mixtral; qwen3_moe; "
                                   "deepseek_v3). `--hf-config FILE` sets this and model.name")
    bias: bool = option(False, "biases in the GPT's linear layers")
    weights: str | None = option(None, "start from these weights instead of initialising: a .safetensors file, or a "
                                 "directory of them (what from_pretrained reads), matched to the model by name "
                                 "(`lm.` and the like found by itself), each rank reading only its part "
                                 "(docs/huggingface.md); unset: initialised from train.seed")
    head_dim: int | None = option(None, "hf-qwen3-moe: each attention head's width (Qwen3's 128 is not d_model / "
                                  "n_head; unset: model.hf_config's, else d_model / n_head)")
    n_experts: int | None = option(None, "gpt-moe and the hf-* MoE families: experts in each MoE layer (unset: "
                                   "model.hf_config's, else 8)")
    top_k: int | None = option(None, "gpt-moe and the hf-* MoE families: experts each token is routed to, at most "
                               "n_experts (unset: model.hf_config's, else 2)")
    d_expert: int | None = option(None, "gpt-moe, hf-qwen3-moe, hf-deepseek-v3: each expert's hidden width (unset: "
                                  "model.hf_config's, else d_ff); hf-mixtral's experts are its MLPs, of width d_ff")
    router_score: str = option("softmax", "gpt-moe: the router's scores, `softmax` over the experts (Mixtral, "
                               "Qwen3-MoE) or each expert's `sigmoid` (DeepSeek-V3)", ROUTER_SCORES)
    balance: str = option("aux-loss", "gpt-moe: load balancing: `aux-loss` (aux_loss_coef x E x sum of each "
                          "expert's token fraction times its mean score, added to the loss), `bias` "
                          "(DeepSeek-V3's auxiliary-loss-free choice bias, moved by balance_rate each step), "
                          "`none`", BALANCES)
    aux_loss_coef: float = option(0.01, "gpt-moe, balance = aux-loss: the auxiliary loss's coefficient")
    balance_rate: float = option(0.001, "gpt-moe, balance = bias: how far each step moves an expert's bias")
    shared_expert: bool = option(False, "gpt-moe: an MLP of width d_expert every token also goes through "
                                 "(DeepSeek)")
    width: int = option(32, "CNN / MLP: hidden width")
    num_classes: int = option(10, "CNN / MLP: output classes")


@dataclass
class DataConfig:
    """The training data (see the Data section of docs/training.md)."""

    name: str = option("shakespeare", "GPT, hf-*: `shakespeare`, `stdlib` (Python's own sources), `synthetic-tokens`; "
                       "CNN / MLP: `digits` (scikit-learn), `synthetic-images`", TEXT_DATASETS + IMAGE_DATASETS)
    val_fraction: float = option(0.05, "the last fraction of the corpus validates; between 0 and 1")
    synthetic_size: int = option(1 << 20, "bytes (or images) of synthetic data")
    documents: str = option("none", "`shakespeare`, `stdlib`, `data.path`: pack documents with a document mask (no "
                            "token attends to another document's): `files` (each play or module; each text file, "
                            "JSON line or table row of data.path), `paragraphs` (each block after a blank line; "
                            "built-ins only); `none`: one stream, attention across everything in a window "
                            "(docs/strategies/context.md)", DOCUMENTS)
    path: str | None = option(None, "your own corpus instead of data.name (docs/data.md): a .txt, .jsonl, .parquet, "
                              ".arrow or .feather file, a directory of them or a glob, or a Hugging Face dataset saved "
                              "to disk; tokenized once into the cache (`shardwise prepare-data`)")
    val_path: str | None = option(None, "with data.path: a corpus of its own to validate on (as data.path; a dataset "
                                  "dict's split by its directory), instead of the last data.val_fraction of "
                                  "data.path's")
    text_field: str = option("text", "with data.path: the field of each JSON line, or the column of a Parquet or Arrow "
                             "file or saved dataset, that holds its text")
    split: str = option("train", "with data.path naming a Hugging Face dataset dict saved to disk (dataset_dict.json): "
                        "the split to train on")
    tokenizer: str = option("bytes", "with data.path: `bytes` (each UTF-8 byte a token), or a Hugging Face "
                            "tokenizer read offline: a tokenizer.json or a directory holding one; its vocabulary "
                            "must fit model.vocab_size")


@dataclass
class TrainConfig:
    """The loop: steps, batch, optimizer, schedule, evaluation, checkpoints."""

    steps: int = option(100, "optimizer steps")
    optimizer: str = option("adamw", "`adamw`, or `sgd` with `train.momentum`", OPTIMIZERS)
    global_batch: int = option(16, "samples per optimizer step, over all ranks")
    micro_batch: int = option(8, "samples per forward on one model replica (`pipeline`: per pipeline run, split "
                              "into `parallel.micro_batches`); global_batch / (replicas x micro_batch) micro-steps "
                              "are accumulated, replicas being the world size, `parallel.dp` or param-server's "
                              "workers")
    lr: float = option(1e-3, "peak learning rate: linear warm-up over `warmup_steps`, then cosine to `min_lr`")
    min_lr: float = option(1e-4, "learning rate at the end of the cosine; at most `lr`")
    warmup_steps: int = option(10, "steps of linear learning-rate warm-up")
    weight_decay: float = option(0.1, "decoupled weight decay on matrices and embeddings (none on biases and norms)")
    beta1: float = option(0.9, "AdamW's first-moment decay, in [0, 1)")
    beta2: float = option(0.95, "AdamW's second-moment decay, in [0, 1)")
    momentum: float = option(0.9, "SGD's momentum, in [0, 1)")
    grad_clip: float = option(1.0, "clip the global gradient norm (over all ranks and shards) to this; 0 turns "
                              "clipping off")
    eval_every: int = option(50, "validate every k steps (0: only at the end)")
    eval_batches: int = option(2, "global batches each validation averages over")
    seed: int = option(0, "model init and data order")
    checkpoint_every: int = option(0, "save a checkpoint every N steps; 0: none (SIGTERM still saves one)")
    keep_checkpoints: int = option(3, "keep the newest K checkpoints")


@dataclass
class ParallelConfig:
    """How training is spread over ranks: the strategy (docs/strategies/), precision, recomputation and
    each strategy's own settings."""

    strategy: str = option("single", "how training is spread over ranks; one page each in docs/strategies/",
                           STRATEGIES)
    precision: str = option("fp32", "what computes and what is stored in which dtype (docs/precision.md)",
                            PRECISIONS)
    loss_scale: float = option(65536.0, "`fp16-mixed`: the dynamic loss scaler's starting scale")
    loss_scale_growth_interval: int = option(2000, "`fp16-mixed`: clean steps before the loss scale doubles")
    recompute: str = option("none", "activation checkpointing of the blocks, every:K with K >= 1 "
                            "(docs/recompute.md)", ("none", "blocks", "every:K", "selective"))
    bucket_mb: float = option(25.0, "`ddp`, `ddp-native`: gradient bucket size in MiB")
    all_reduce: str = option("backend", "`ddp`: average buckets with the backend's all-reduce or our `ring` "
                             "(parallel/comm.py)", ALL_REDUCES)
    grad_compression: str = option("none", "`ddp`: send buckets as they are, cast to `fp16` or `bf16`, or "
                                   "`powersgd`-compressed (parallel/compression.py; PowerSGD needs fp32 or bf16-mixed)",
                                   GRAD_COMPRESSIONS)
    powersgd_rank: int = option(4, "`powersgd`: rank r of the factors")
    powersgd_start_step: int = option(10, "`powersgd`: plain averaged steps before compressing")
    find_unused_parameters: bool = option(False, "data parallel: allow parameters that get no gradient (reduced "
                                          "as zero) instead of failing")
    sync_batchnorm: bool = option(False, "data parallel: BatchNorm statistics over the global batch")
    block: str = option(DEFAULT_BLOCK, "class name of the model's repeated block: the unit sharded as one (zero1/2, "
                        "fsdp, fsdp-native), recomputed, cut into stages (pipeline) or split (tensor); left at the "
                        "default, a model without a `Block` (a transformers model) has the layer class its "
                        "`_no_split_modules` declares used")
    reshard_after_forward: bool = option(True, "`fsdp`, `fsdp-native`: free a unit's full parameters after its "
                                         "forward")
    prefetch: int = option(1, "`fsdp`: units whose all-gather is issued ahead")
    reduce_dtype: str = option("fp32", "sharded strategies: the dtype gradients are reduce-scattered in",
                               REDUCE_DTYPES)
    offload: str = option("none", "`zero1`, `zero2`, `fsdp`: `optimizer` keeps the fp32 master shards, their "
                          "gradients and the optimizer state in host memory and steps there (ZeRO-Offload)", OFFLOADS)
    dp: int | None = option(None, "data-parallel ranks on the device mesh (docs/strategies/mesh.md): dp x cp x pp x "
                            "tp = world size. Left unset, the strategy's own dimension (pp for the pipelines, tp "
                            "for tensor, dp for the others) takes the ranks the others leave; the others are 1")
    pp: int | None = option(None, "`pipeline`, `model-parallel`, and `zero1`, `zero2`, `fsdp` sharding each stage "
                            "over its dp ranks: pipeline stages per replica (as for dp)")
    tp: int | None = option(None, "`tensor`, `pipeline` / `model-parallel` with tensor-parallel stages, and `zero1`, "
                            "`zero2`, `fsdp`, `hsdp` sharding a tensor-parallel model: tensor-parallel ranks per "
                            "stage; divides model.n_head, n_kv_head and d_ff (as for dp)")
    sequence_parallel: bool = option(False, "with tp > 1 (`tensor`, the pipelines, the sharded strategies): split the "
                                     "norms and the residual stream along the sequence over the tp ranks too "
                                     "(Megatron's sequence parallelism), so each block saves 1/tp of its activations; "
                                     "tp must divide model.seq_len")
    micro_batches: int = option(4, "`pipeline` (and the sharded strategies with pp > 1): micro-batches per "
                                "pipeline run (M); must divide `train.micro_batch`")
    schedule: str = option("1f1b", "`pipeline` (and the sharded strategies with pp > 1): the schedule "
                           "micro-batches run by (docs/strategies/pipeline.md): `gpipe`, `1f1b`, `interleaved-1f1b` "
                           "(`virtual_stages` stages per rank), `zb-h1` (1F1B "
                           "with the weight gradients deferred into the drain), `zbv` and `dualpipev` (2 stages per "
                           "rank on a V)", SCHEDULES)
    virtual_stages: int | None = option(None, "`pipeline`, `interleaved-1f1b`: stages per rank, at least 2 (unset: "
                                        "2); `zbv` and `dualpipev` always have 2, the others 1. The model is cut "
                                        "into pp x virtual_stages stages of at least one block each")
    split_points: list[int] | None = option(None, "`pipeline`: the first block of stages 2..P, e.g. [3]; unset, "
                                            "stages are balanced by parameter count")
    ep: int = option(1, "expert parallel: ranks each MoE layer's experts are split over (`gpt-moe`; "
                     "docs/strategies/moe.md), taken from the data-parallel ranks: they read different data and "
                     "send each token to the rank of its experts; must divide model.n_experts and dp")
    cp: int = option(1, "context parallel: ranks each sequence is split over (docs/strategies/context.md), with "
                     "the strategies whose page says so; the data-parallel replicas are then world / (cp x pp x tp)")
    cp_mode: str = option("ring", "context parallel's attention: `ring` passes keys and values around the cp ranks "
                          "(model.seq_len divisible by 2 x cp), `all-to-all` splits heads instead of the sequence "
                          "around it (model.n_head divisible by cp)", CP_MODES)
    replicas: int = option(2, "`dp`: replicas the one process runs, each on its own device (all on the CPU "
                           "without GPUs)")
    ps_servers: int = option(1, "`param-server`: the last ps_servers ranks hold the parameters and their "
                             "optimizer; the others are workers")
    ps_mode: str = option("sync", "`param-server`: `sync` averages every worker's gradients each step, `async` "
                          "applies each push on arrival", PS_MODES)
    ps_max_staleness: int = option(4, "`param-server`, `async`: drop a push computed on parameters more than this "
                                   "many updates old")

    def mesh(self, world_size: int, node_size: int | None = None) -> MeshShape:
        """The run's device mesh (parallel/dims.py): `mesh_shape`'s dp split into the replicas that average
        their gradients and the ranks the sharded strategies split a replica's state over: all of
        dp under zero1, zero2, fsdp and fsdp-native; hsdp's dp ranks within a node of `node_size`
        ranks (default: the whole world); none under the strategies that replicate."""
        dp, pp, tp = self.mesh_shape(world_size)
        chosen = spec(self.strategy)
        shard = 1
        if chosen.zero_stage:
            shard = dp
            if chosen.across_nodes:
                shard = max(1, min(dp, (node_size or world_size) // (self.cp * pp * tp)))
        return MeshShape(dp // shard, shard, self.cp, pp, tp, ep=self.ep)

    def mesh_shape(self, world_size: int) -> tuple[int, int, int]:
        """(dp, pp, tp): the device mesh's sizes, unset ones filled in as described above (each of
        the dp replicas spans cp x pp x tp ranks). A parameter-server job's replicas are its workers."""
        if spec(self.strategy).parameter_servers:
            return world_size - self.ps_servers, 1, 1
        own = spec(self.strategy).mesh_dim
        sizes = {"dp": self.dp, "pp": self.pp, "tp": self.tp}
        others = self.cp * math.prod(size for dim, size in sizes.items() if dim != own and size is not None)
        if sizes[own] is None:
            sizes[own] = max(1, world_size // max(1, others))
        dp, pp, tp = (1 if size is None else size for size in sizes.values())
        return dp, pp, tp


MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "pp", "tp")  # outermost first (parallel/dims.py)


@dataclass(frozen=True)
class MeshShape:
    """The sizes of a run's device mesh, by dimension (parallel/dims.py says what each holds)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    pp: int = 1
    tp: int = 1
    # Expert parallel: not a dimension of its own but a split of dp (parallel/dims.py); the mesh's sizes leave it out.
    ep: int = 1

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, dim) for dim in MESH_DIMS)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: those that read different shares of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def world(self) -> int:
        return math.prod(self.sizes)

    def __str__(self) -> str:
        dims = [f"{dim} {size}" for dim, size in zip(MESH_DIMS, self.sizes, strict=True) if size > 1]
        return " x ".join(dims) + (f" (ep {self.ep} of dp)" if self.ep > 1 else "") if dims else "one rank"


@dataclass
class LaunchConfig:
    """How the workers are started (through torch.distributed.run), and how failures are handled."""

    nproc: int = option(1, "worker processes on this node")
    nnodes: int = option(1, "nodes in the job")
    node_rank: int = option(0, "this node's rank, in [0, nnodes)")
    rdzv_endpoint: str = option("127.0.0.1:29500", "HOST:PORT of node 0's rendezvous (multi-node)")
    node_addr: str | None = option(None, "this node's address on the network the nodes share (multi-node): the "
                                   "launcher derives its --local-addr, whether it hosts the rendezvous, and Gloo's "
                                   "interface from it")
    backend: str = option("auto", "`auto`: `nccl` with CUDA, else `gloo`", BACKENDS)
    timeout_s: float = option(300.0, "collective timeout: a collective waiting longer fails, naming itself and the "
                              "missing rank")
    threads_per_rank: int = option(1, "CPU threads each rank may use")
    max_restarts: int = option(0, "restart the whole group this often after a worker dies; it resumes from the "
                               "newest checkpoint")
    shutdown_timeout_s: int = option(25, "after SIGTERM, workers get this long (to save a checkpoint) before "
                                     "SIGKILL; a stalled rank also lives this long after the job has failed")
    debug_collectives: bool = option(False, "check before every collective that it is the same call on every rank, "
                                     "failing at the first mismatch (slow; not with ddp-native)")


@dataclass
class RunConfig:
    """Where the run is written, and how it is reported."""

    out: str = option("runs/latest", "the run directory: config.toml, metrics.jsonl, model.safetensors, "
                      "checkpoints/")
    log_every: int = option(10, "steps between progress lines when not on a terminal")
    resume: bool = option(False, "continue from the newest good checkpoint in `out`")
    tensorboard: bool = option(False, "the main rank also writes its metrics as TensorBoard scalars to "
                               "`out`/tensorboard (needs the tensorboard package)")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def world_size(self) -> int:
        return self.launch.nproc * self.launch.nnodes

    def grad_accum(self, world_size: int | None = None) -> int:
        """Micro-steps per optimizer step on each model replica; validate() guarantees it divides."""
        dp = self.parallel.mesh_shape(world_size or self.world_size)[0]
        return self.train.global_batch // (dp * self.train.micro_batch)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {
            section: {k: v for k, v in dataclasses.asdict(getattr(self, section)).items() if v is not None}
            for section in SECTIONS
        }

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(tomli_w.dumps(self.to_dict()))


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "parallel": ParallelConfig,
    "launch": LaunchConfig,
    "run": RunConfig,
}

GPT_PRESET_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(n_layer=2, n_head=2, d_model=64, seq_len=64, vocab_size=256),
    "small": dict(n_layer=6, n_head=6, d_model=384, seq_len=256, vocab_size=256),
    "gpt2-124m": dict(n_layer=12, n_head=12, d_model=768, seq_len=1024, vocab_size=50304),
}


def _allowed_types(annotation: Any) -> tuple[type, ...]:
    hints = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    return tuple(h for h in hints if h is not type(None))


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    if value is None:
        return None
    allowed = _allowed_types(annotation)
    kind = type(value)
    if kind in allowed:
        return value
    if list[int] in allowed:
        if kind is list and all(type(item) is int for item in value):
            return value
        raise ConfigError(f"{key} = {value!r}: expected a list of integers, e.g. [3]")
    if float in allowed and kind is int:
        return float(value)
    names = " or ".join(t.__name__ for t in allowed)
    raise ConfigError(f"{key} = {value!r}: expected {names}, got {kind.__name__}")


def apply_section(cfg: Config, section: str, values: dict[str, Any], origin: str) -> None:
    """Set `values` (by key) in `cfg`'s [section], each checked for its key and type."""
    if section not in SECTIONS:
        raise ConfigError(f"[{section}] in {origin}: unknown section; allowed: {', '.join(SECTIONS)}")
    if not isinstance(values, dict):
        raise ConfigError(f"{section} in {origin}: expected a [{section}] table, got {values!r}")
    target = getattr(cfg, section)
    fields = {f.name: f for f in dataclasses.fields(target)}
    hints = typing.get_type_hints(type(target))
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(
                f"{section}.{key} in {origin}: unknown key; allowed in [{section}]: {', '.join(fields)}"
            )
        setattr(target, key, _coerce(f"{section}.{key}", value, hints[key]))


def parse_override(text: str) -> tuple[str, str, Any]:
    """`section.key=value`, the value read as a TOML literal (bare words are strings)."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. --set train.lr=3e-4")
    dotted, raw = text.split("=", 1)
    section, key = dotted.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return section, key, value


def load_config(
    path: str | Path | None = None,
    overrides: list[str] = (),
    flags: dict[str, Any] | None = None,
) -> Config:
    """Build a config from a TOML file, `--set` overrides and flags (dotted keys), in that order,
    then validate it. Raises ConfigError on the first bad value."""
    cfg = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r}: not found")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {str(path)!r}: not valid TOML ({exc})") from None
        for section, values in data.items():
            apply_section(cfg, section, values, str(path))
    for text in overrides:
        section, key, value = parse_override(text)
        apply_section(cfg, section, {key: value}, "--set")
    for dotted, value in (flags or {}).items():
        if value is not None:
            section, key = dotted.split(".", 1)
            apply_section(cfg, section, {key: value}, f"--{key.replace('_', '-')}")
    resolve_presets(cfg)
    validate(cfg)
    return cfg


def read_hf_config(path: str) -> tuple[str, dict[str, tuple[str, int]]]:
    """The family (model.name) a transformers config.json builds and the sizes it sets, by
    ModelConfig key, each with the file's name for it; ConfigError if the file is missing, not JSON
    or of another family."""
    key = f"model.hf_config = {path!r}"
    try:
        values = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{key}: no such file; give the path of a transformers config.json") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}: not a JSON transformers config ({exc})") from None
    model_type = values.get("model_type") if isinstance(values, dict) else None
    if model_type not in HF_MODEL_TYPES:
        raise ConfigError(f"{key}: model_type {model_type!r} is not a family shardwise builds; allowed: "
                          f"{', '.join(HF_MODEL_TYPES)}")
    name = HF_MODEL_TYPES[model_type]
    sizes = {}
    for ours, theirs in HF_SIZE_KEYS[name].items():
        found = next((k for k in (theirs, *HF_SIZE_ALIASES.get(theirs, ())) if values.get(k) is not None), None)
        if found is not None:
            sizes[ours] = (found, values[found])
    return name, sizes


def hf_config_overrides(path: str | None) -> list[str]:
    """`--set` overrides that make the model the one a transformers config.json describes (the
    flag `--hf-config` of `shardwise train` and `plan`): its family and the file, whose sizes the
    model then takes (`resolve_presets`). `path` may name the file or the model's directory."""
    if path is None:
        return []
    if Path(path).is_dir():
        path = str(Path(path) / "config.json")
    name, _ = read_hf_config(path)
    return [f"model.name={name}", f"model.hf_config={json.dumps(path)}"]


def resolve_presets(cfg: Config) -> None:
    m = cfg.model
    if m.hf_config is not None:
        _take_hf_sizes(m)
    if m.name in LANGUAGE_MODELS:
        if m.preset not in GPT_PRESET_SIZES:
            raise ConfigError(f"model.preset = {m.preset!r}: unknown; allowed: {', '.join(GPT_PRESETS)}")
        for key, value in GPT_PRESET_SIZES[m.preset].items():
            if getattr(m, key) is None:
                setattr(m, key, value)
        if m.n_kv_head is None:
            m.n_kv_head = m.n_head
        if m.d_ff is None:
            m.d_ff = 4 * m.d_model
    if m.name == "hf-qwen3-moe" and m.head_dim is None:
        m.head_dim = m.d_model // m.n_head
    if m.name in MOE_MODELS:
        m.n_experts = 8 if m.n_experts is None else m.n_experts
        m.top_k = 2 if m.top_k is None else m.top_k
        if m.d_expert is None or m.name == "hf-mixtral":
            m.d_expert = m.d_ff


def _take_hf_sizes(m: ModelConfig) -> None:
    """The one rule of precedence: model.hf_config gives the model its sizes. A size set beside it
    must agree; model.seq_len, the training window, may be shorter than the file's context."""
    family, sizes = read_hf_config(m.hf_config)
    if m.name != family:
        raise ConfigError(f"model.hf_config = {m.hf_config!r}: builds {family}, but model.name = {m.name!r}; "
                          f"set model.name = {family!r}")
    for key, (theirs, value) in sizes.items():
        mine = getattr(m, key)
        if mine is None:
            setattr(m, key, value)
        elif key == "seq_len" and mine > value:
            raise ConfigError(f"model.seq_len = {mine}: longer than the context of model.hf_config = "
                              f"{m.hf_config!r} ({theirs} = {value}); train on windows of at most {value}")
        elif key != "seq_len" and mine != value:
            raise ConfigError(f"model.{key} = {mine}: model.hf_config = {m.hf_config!r} says {theirs} = {value}, "
                              f"and a model's config.json gives its sizes; leave model.{key} unset")


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key} = {value!r}: unknown; allowed: {', '.join(allowed)}")


def _positive(key: str, value: float, zero_ok: bool = False) -> None:
    if value < 0 or (value == 0 and not zero_ok):
        bound = ">= 0" if zero_ok else "> 0"
        raise ConfigError(f"{key} = {value!r}: must be {bound}")


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Check every value and every relation between values; `world_size` defaults to the launch's."""
    m, d, t, p, launch = cfg.model, cfg.data, cfg.train, cfg.parallel, cfg.launch
    _choice("model.name", m.name, MODELS)
    validate_parallel(p)
    _choice("launch.backend", launch.backend, BACKENDS)
    _choice("train.optimizer", t.optimizer, OPTIMIZERS)
    datasets = TEXT_DATASETS if m.name in LANGUAGE_MODELS else IMAGE_DATASETS
    _validate_own_data(cfg)
    if d.name not in datasets:
        raise ConfigError(
            f"data.name = {d.name!r}: not usable with model.name = {m.name!r}; allowed: {', '.join(datasets)}"
        )
    if m.name in LANGUAGE_MODELS:
        for key in ("n_layer", "n_head", "d_model", "seq_len", "vocab_size", "n_kv_head", "d_ff"):
            _positive(f"model.{key}", getattr(m, key))
        if m.d_model % m.n_head:
            raise ConfigError(f"model.d_model = {m.d_model}: must be divisible by model.n_head = {m.n_head}")
        if m.n_kv_head != m.n_head and m.name not in GROUPED_QUERY_MODELS:
            raise ConfigError(f"model.n_kv_head = {m.n_kv_head}: model.name = {m.name!r} has one key/value head per "
                              f"head (n_head = {m.n_head}); grouped-query attention: {', '.join(GROUPED_QUERY_MODELS)}")
        if m.n_head % m.n_kv_head:
            raise ConfigError(f"model.n_kv_head = {m.n_kv_head}: must divide model.n_head = {m.n_head}")
        if m.vocab_size < 256:
            raise ConfigError(f"model.vocab_size = {m.vocab_size}: must be >= 256 for byte-level data")
    if p.recompute != "none" and m.name not in LANGUAGE_MODELS:
        raise ConfigError(f"parallel.recompute = {p.recompute!r}: model.name = {m.name!r} has no blocks to recompute")
    _positive("model.width", m.width)
    _positive("model.num_classes", m.num_classes)
    if not 0 < d.val_fraction < 1:
        raise ConfigError(f"data.val_fraction = {d.val_fraction!r}: must be between 0 and 1 (exclusive)")
    _positive("data.synthetic_size", d.synthetic_size)
    for key in ("steps", "global_batch", "micro_batch", "lr", "eval_batches"):
        _positive(f"train.{key}", getattr(t, key))
    _positive("train.keep_checkpoints", t.keep_checkpoints)
    for key in ("min_lr", "warmup_steps", "weight_decay", "grad_clip", "eval_every", "seed", "checkpoint_every"):
        _positive(f"train.{key}", getattr(t, key), zero_ok=True)
    for key in ("beta1", "beta2", "momentum"):
        if not 0 <= getattr(t, key) < 1:
            raise ConfigError(f"train.{key} = {getattr(t, key)!r}: must be in [0, 1)")
    if t.min_lr > t.lr:
        raise ConfigError(f"train.min_lr = {t.min_lr!r}: must be <= train.lr = {t.lr!r}")
    _positive("launch.max_restarts", launch.max_restarts, zero_ok=True)
    _positive("launch.shutdown_timeout_s", launch.shutdown_timeout_s, zero_ok=True)
    for key in ("nproc", "nnodes", "threads_per_rank", "timeout_s"):
        _positive(f"launch.{key}", getattr(launch, key))
    if not 0 <= launch.node_rank < launch.nnodes:
        raise ConfigError(f"launch.node_rank = {launch.node_rank}: must be in [0, launch.nnodes = {launch.nnodes})")
    if launch.node_addr and launch.nnodes == 1:
        raise ConfigError(f"launch.node_addr = {launch.node_addr!r}: only for several nodes (launch.nnodes > 1); "
                          "one node rendezvous on loopback")
    _positive("run.log_every", cfg.run.log_every)
    if cfg.run.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("run.tensorboard = true: the tensorboard package is not installed; "
                          "pip install 'shardwise[tensorboard]' (or pip install tensorboard), or leave it off")
    world = world_size or cfg.world_size
    _positive("parallel.replicas", p.replicas)
    _choice("parallel.ps_mode", p.ps_mode, PS_MODES)
    _positive("parallel.ps_servers", p.ps_servers)
    _positive("parallel.ps_max_staleness", p.ps_max_staleness, zero_ok=True)
    strategy = spec(p.strategy)
    _validate_context(cfg, world)
    strategy.strategy_class(cfg.parallel.mesh_shape(world)[1]).check_config(cfg, world)
    if strategy.one_process and world != 1:
        raise ConfigError(
            f"parallel.strategy = {p.strategy!r}: runs on one process, but the world size is {world}; "
            "use --nproc 1 or a multi-rank strategy such as ddp"
        )
    if not strategy.checkpoints and (launch.max_restarts or t.checkpoint_every or cfg.run.resume):
        raise ConfigError(f"{p.strategy} keeps no checkpoints: set launch.max_restarts = 0, "
                          "train.checkpoint_every = 0 and run.resume = false")
    if m.weights is not None:
        _validate_weights(m.weights, p.strategy)
    _validate_mesh(cfg, world)
    _validate_experts(cfg, world)
    dp = p.mesh_shape(world)[0]
    per_step = dp * t.micro_batch
    if t.global_batch % per_step:
        if dp == world:
            replicas = f"world size {world}"
        else:
            replicas = f"the {dp} workers" if strategy.parameter_servers else f"parallel.dp {dp}"
        raise ConfigError(
            f"train.global_batch = {t.global_batch}: must be divisible by {replicas} x "
            f"train.micro_batch {t.micro_batch} = {per_step} (the rest is gradient accumulation)"
        )


def _validate_experts(cfg: Config, world: int) -> None:
    """A gpt-moe's experts and routing, and how parallel.ep splits them over the world."""
    m, p = cfg.model, cfg.parallel
    _positive("parallel.ep", p.ep)
    if m.head_dim is not None and m.name != "hf-qwen3-moe":
        raise ConfigError(f"model.head_dim = {m.head_dim}: only hf-qwen3-moe's heads have a width of their own; "
                          f"model.name = {m.name!r} has heads of d_model / n_head")
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
        if p.sequence_parallel:
            raise ConfigError(f"parallel.sequence_parallel = true with model.name = {m.name!r}: each tp rank would "
                              "route only its part of the sequence (the router's counts and auxiliary loss over "
                              "part of the tokens); leave sequence_parallel off, the MoE layers whole on every tp "
                              "rank")
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
    for key, size in (("cp", p.cp), ("pp", pp)):
        if size > 1:
            raise ConfigError(f"parallel.ep = {p.ep} with parallel.{key} = {size}: expert parallel does not compose "
                              f"with {key} yet; it splits the experts over data-parallel ranks only")
    if tp > 1 and (not spec(p.strategy).zero_stage or p.sequence_parallel):
        raise ConfigError(f"parallel.ep = {p.ep} with parallel.tp = {tp}: expert parallel composes with tensor "
                          "parallel under zero1, zero2 and fsdp, without sequence_parallel (every tp rank then "
                          "routes the same tokens, its MoE layers whole)")
    if dp % p.ep:
        raise ConfigError(f"parallel.ep = {p.ep}: the expert-parallel ranks are data-parallel ranks, so ep must "
                          f"divide dp = {dp} (world size {world}); e.g. --nproc {p.ep}")
    if spec(p.strategy).zero_stage and m.n_experts // p.ep % (dp // p.ep):
        raise ConfigError(f"parallel.ep = {p.ep}: {p.strategy} shards each ep rank's {m.n_experts // p.ep} experts "
                          f"over the dp / ep = {dp // p.ep} ranks that hold the same ones; they must divide evenly "
                          "(raise model.n_experts or parallel.ep)")


def _validate_weights(weights: str, strategy: str) -> None:
    path = Path(weights)
    if not (path.is_file() and path.suffix == ".safetensors" or path.is_dir() and any(path.glob("*.safetensors"))):
        raise ConfigError(f"model.weights = {weights!r}: expected a .safetensors file, or a directory holding them "
                          "(as from_pretrained reads); not found")
    if not spec(strategy).checkpoints:  # the state a checkpoint loads into is what weights load into
        raise ConfigError(f"model.weights = {weights!r}: {strategy} keeps the parameters on its servers, which "
                          "start from initial values; use another strategy to start from weights")


def validate_parallel(p: ParallelConfig) -> None:
    """The [parallel] values that need no model, batch or world size to check: all the Python API
    (api.py) can check before it sees a model."""
    _choice("parallel.strategy", p.strategy, STRATEGIES)
    _choice("parallel.precision", p.precision, PRECISIONS)
    _choice("parallel.reduce_dtype", p.reduce_dtype, REDUCE_DTYPES)
    _choice("parallel.schedule", p.schedule, SCHEDULES)
    _positive("parallel.micro_batches", p.micro_batches)
    try:
        virtual_stages(p.schedule, p.virtual_stages)
    except ScheduleError as exc:
        raise ConfigError(f"parallel.{exc}") from None
    sharded = [name for name, each in SPECS.items() if each.zero_stage]
    if p.reduce_dtype != "fp32" and p.strategy not in sharded:
        raise ConfigError(
            f"parallel.reduce_dtype = {p.reduce_dtype!r}: only the sharded strategies ({', '.join(sharded)}) "
            f"reduce in another dtype; parallel.strategy is {p.strategy!r}"
        )
    _choice("parallel.offload", p.offload, OFFLOADS)
    offloading = [name for name, each in SPECS.items() if each.offloads]
    if p.offload != "none" and p.strategy not in offloading:
        raise ConfigError(f"parallel.offload = {p.offload!r}: only {', '.join(offloading)} offload their optimizer "
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
    _positive("parallel.bucket_mb", p.bucket_mb)
    _positive("parallel.prefetch", p.prefetch, zero_ok=True)
    _positive("parallel.cp", p.cp)
    _choice("parallel.cp_mode", p.cp_mode, CP_MODES)
    _positive("parallel.loss_scale", p.loss_scale)
    _positive("parallel.loss_scale_growth_interval", p.loss_scale_growth_interval)


def _validate_gradient_reduction(p: ParallelConfig) -> None:
    """The ring and gradient compression are our ddp's, and PowerSGD needs steady fp32 gradients."""
    _choice("parallel.all_reduce", p.all_reduce, ALL_REDUCES)
    _choice("parallel.grad_compression", p.grad_compression, GRAD_COMPRESSIONS)
    _positive("parallel.powersgd_rank", p.powersgd_rank)
    _positive("parallel.powersgd_start_step", p.powersgd_start_step, zero_ok=True)
    for key, value, plain in (("parallel.all_reduce", p.all_reduce, "backend"),
                              ("parallel.grad_compression", p.grad_compression, "none")):
        if value != plain and p.strategy != "ddp":
            raise ConfigError(f"{key} = {value!r}: only parallel.strategy = 'ddp' (ours) has it; "
                              f"parallel.strategy is {p.strategy!r}")
    if p.grad_compression == "powersgd" and p.precision in ("fp16-mixed", "bf16-true"):
        raise ConfigError(
            f"parallel.grad_compression = 'powersgd': needs fp32 gradients on a steady scale (its error feedback "
            f"carries them from step to step), not parallel.precision = {p.precision!r}; use fp32 or bf16-mixed"
        )


def _validate_own_data(cfg: Config) -> None:
    """data.path and what goes with it (the files themselves are read by data/prepare.py)."""
    d = cfg.data
    if d.path is None:
        defaults = DataConfig()
        for key in ("val_path", "tokenizer", "text_field", "split"):
            if getattr(d, key) != getattr(defaults, key):
                raise ConfigError(f"data.{key} = {getattr(d, key)!r}: only with data.path (your own corpus)")
        return
    if cfg.model.name not in LANGUAGE_MODELS:
        raise ConfigError(f"data.path = {d.path!r}: a text corpus; model.name = {cfg.model.name!r} takes images")
    if d.documents == "paragraphs":
        raise ConfigError("data.documents = 'paragraphs': only for the built-in corpora; with data.path, `files` "
                          "makes each text file or JSON line a document")


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
    if m.name not in LANGUAGE_MODELS:
        raise ConfigError(f"{what}: model.name = {m.name!r} has no token sequences; use one of "
                          f"{', '.join(LANGUAGE_MODELS)}")
    if d.documents != "none" and d.name not in CORPORA and d.path is None:
        raise ConfigError(f"data.documents = {d.documents!r}: data.name = {d.name!r} has no documents; use one of "
                          f"{', '.join(CORPORA)}")
    if p.cp == 1:
        return
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
