"""The config's schema: its sections (model, data, train, parallel, launch, run), every key's
type, default and meaning (`option`: docs/config.md is written from these), and the facts about
the families and strategies a key's values name. A value here is checked by validate.py."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from shardwise.atomic_file import write_whole
from shardwise.config.registry import NAMES as STRATEGIES
from shardwise.config.registry import spec

# parallel/pipeline/schedules.py's, by name (the config imports no parallelism; tests/test_config.py holds them equal)
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev")
PS_MODES = ("sync", "async")
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-true")
REDUCE_DTYPES = ("fp32", "bf16")
OFFLOADS = ("none", "optimizer")
FLOAT8_RECIPES = ("none", "tensorwise", "rowwise")  # parallel/float8.py
ALL_REDUCES = ("backend", "ring")
GRAD_COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
# transformers models (models/hf.py): `hf`, any causal-LM family, of model.hf_config's architecture; and
# families shardwise sizes by the GPT presets (or model.hf_config)
HF_MODELS = ("hf", "hf-llama", "hf-qwen2", "hf-gpt2", "hf-mixtral", "hf-qwen3-moe", "hf-deepseek-v3")
# families whose key/value heads may be fewer than their heads
GROUPED_QUERY_MODELS = ("hf", "hf-llama", "hf-qwen2", "hf-mixtral", "hf-qwen3-moe", "hf-deepseek-v3")
# A transformers config.json's `model_type` -> the family of shardwise's that builds it (Mistral has
# Llama's modules); every other causal-LM model_type builds as `hf`.
HF_MODEL_TYPES = {"llama": "hf-llama", "mistral": "hf-llama", "qwen2": "hf-qwen2", "gpt2": "hf-gpt2",
                  "mixtral": "hf-mixtral", "qwen3_moe": "hf-qwen3-moe", "deepseek_v3": "hf-deepseek-v3"}
# A size a ModelConfig names -> transformers' standard attribute for it, which every config class
# answers to (its attribute_map points the standard name at the family's own: GPT-2's n_embd for
# hidden_size), then the names families without the standard one use.
HF_SIZE_NAMES: dict[str, tuple[str, ...]] = {
    "n_layer": ("num_hidden_layers",),
    "n_head": ("num_attention_heads",),
    "n_kv_head": ("num_key_value_heads",),
    "d_model": ("hidden_size",),
    "d_ff": ("intermediate_size", "n_inner", "ffn_dim"),
    "vocab_size": ("vocab_size",),
    "seq_len": ("max_position_embeddings",),
    "head_dim": ("head_dim",),
    "n_experts": ("num_local_experts", "num_experts", "n_routed_experts"),
    "top_k": ("num_experts_per_tok",),
    "d_expert": ("moe_intermediate_size",),
}
# The sizes each family of shardwise's own takes from model.hf_config where the file sets them (the
# others are the preset's); `hf` takes every size its config class has, the class's default where the
# file is silent.
_DENSE_SIZES = ("n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "vocab_size", "seq_len")
HF_FAMILY_SIZES: dict[str, tuple[str, ...]] = {
    "hf-llama": _DENSE_SIZES,
    "hf-qwen2": _DENSE_SIZES,
    "hf-gpt2": ("n_layer", "n_head", "d_model", "d_ff", "vocab_size", "seq_len"),
    "hf-mixtral": (*_DENSE_SIZES, "n_experts", "top_k"),  # its experts are its MLPs (intermediate_size)
    "hf-qwen3-moe": (*_DENSE_SIZES, "n_experts", "top_k", "d_expert", "head_dim"),
    # its attention's other sizes (MLA's ranks and head widths) and its dense first blocks: the file's
    "hf-deepseek-v3": (*_DENSE_SIZES, "n_experts", "top_k", "d_expert"),
    "hf": tuple(HF_SIZE_NAMES),
}
# Models of token sequences: sized by a GPT preset, trained on text.
LANGUAGE_MODELS = ("gpt", "gpt-moe", *HF_MODELS)
# Models whose blocks have Mixture-of-Experts layers: ours (models/moe.py), transformers' (their own).
MOE_MODELS = ("gpt-moe", "hf-mixtral", "hf-qwen3-moe", "hf-deepseek-v3")
ROUTER_SCORES = ("softmax", "sigmoid")
BALANCES = ("aux-loss", "bias", "none")
# The strategies that split experts over parallel.ep ranks (parallel/experts.py).
EP_STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "hsdp", "tensor", "pipeline")
MODELS = (*LANGUAGE_MODELS, "cnn", "mlp")
GPT_PRESETS = ("tiny", "small", "gpt2-124m")
OPTIMIZERS = ("adamw", "sgd", "muon")
CORPORA = ("shakespeare", "stdlib")  # the built-in text corpora (data/corpus.py)
TEXT_DATASETS = (*CORPORA, "synthetic-tokens")
IMAGE_DATASETS = ("digits", "synthetic-images")
FORMATS = ("text", "chat", "completion", "preference")  # what data.path's JSON lines are (data/samples.py, pairs.py)
OBJECTIVES = ("sft", "dpo", "ipo", "simpo")  # train.objective (preference.py)
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
                       "layer for each MLP, docs/strategies/moe.md), `hf` (a transformers causal LM of any family, "
                       "model.hf_config's), `hf-llama` / `hf-qwen2` / `hf-gpt2` / `hf-mixtral` / `hf-qwen3-moe` / "
                       "`hf-deepseek-v3` (a randomly initialised transformers Llama, Qwen2, GPT-2, Mixtral, "
                       "Qwen3-MoE or DeepSeek-V3 of the preset's sizes, or of model.hf_config's), `cnn` (with "
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
                                   "deepseek_v3; every other causal LM transformers builds: hf, which needs it). "
                                   "`--hf-config FILE` sets this and model.name")
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
    format: str = option("text", "with data.path: `text` (a corpus to continue), or fine-tuning samples from JSON "
                         "Lines, the loss counting the answers' tokens only (docs/finetuning.md): `chat` (each line's "
                         "`messages`, rendered by data.tokenizer's chat template; the assistant turns count) or "
                         "`completion` (each line's `prompt` and `completion`; the completion counts). Samples are "
                         "packed, each its own document (data.documents = `files`). `preference`: each line's "
                         "`prompt`, `chosen` and `rejected` (strings, or lists of chat turns), whole pairs packed "
                         "in windows, for train.objective = `dpo`, `ipo` or `simpo` (docs/preference.md)", FORMATS)
    documents: str = option("none", "`shakespeare`, `stdlib`, `data.path`: pack documents with a document mask (no "
                            "token attends to another document's): `files` (each play or module; each text file, "
                            "JSON line or table row of data.path), `paragraphs` (each block after a blank line; "
                            "built-ins only); `none`: one stream, attention across everything in a window "
                            "(docs/strategies/context.md)", DOCUMENTS)
    path: str | None = option(None, "your own corpus instead of data.name (docs/data.md): a .txt or .jsonl file "
                              "(either may be .gz- or .zst-compressed), a .parquet, .arrow or .feather file, a "
                              "directory of them or a glob, or a Hugging Face dataset saved to disk; tokenized once "
                              "into the cache (`shardwise prepare-data`)")
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
    pack_pairs: bool = option(False, "data.format = `preference`: each window holds as many whole pairs as fit "
                              "(train.global_batch and micro_batch then count windows); false: one pair a window, "
                              "and they count pairs")
    truncate_prompt: bool = option(False, "data.format = `preference`: a pair too long for a window (its prompt twice "
                                   "and both answers in model.seq_len + 1 tokens) has its prompt cut from the left to "
                                   "fit; false: it is refused, naming its line")


@dataclass
class MuonConfig:
    """`train.optimizer = "muon"`: Muon for the hidden weight matrices, AdamW (`train.beta1`,
    `train.beta2`) for the rest (docs/muon.md)."""

    params: list[str] | None = option(None, "name patterns (fnmatch, the plain model's names) of the matrices Muon "
                                      "steps; unset: every matrix of the model's blocks (embeddings, head, norms and "
                                      "biases take AdamW)")
    adjust_lr: str = option("original", "torch.optim.Muon's `adjust_lr_fn` for a matrix of `rows` output and `cols` "
                            "input features: `original` scales train.lr by sqrt(max(1, rows / cols)), "
                            "`match_rms_adamw` by 0.2 sqrt(max(rows, cols)) (one lr for both halves)",
                            ("original", "match_rms_adamw"))
    momentum: float = option(0.95, "Muon's Nesterov momentum, in [0, 1)")
    ns_steps: int = option(5, "Newton-Schulz iterations that orthogonalize each matrix's update")
    ns_dtype: str = option("bf16", "the Newton-Schulz iterations' dtype: `bf16` as torch.optim.Muon, or `fp32`",
                           ("bf16", "fp32"))
    whole_fused: bool = option(False, "a fused projection (qkv, gate_up) orthogonalized whole, not part by part")


@dataclass
class TrainConfig:
    """The loop: steps, batch, optimizer, schedule, evaluation, checkpoints."""

    steps: int = option(100, "optimizer steps")
    optimizer: str = option("adamw", "`adamw`, `sgd` with `train.momentum`, or `muon` (`[train.muon]`; AdamW for "
                            "what it does not step)", OPTIMIZERS)
    global_batch: int = option(16, "samples per optimizer step, over all ranks")
    micro_batch: int = option(8, "samples per forward on one model replica (`pipeline`: per pipeline run, split "
                              "into `parallel.pipeline.micro_batches`); global_batch / (replicas x micro_batch) "
                              "micro-steps are accumulated, replicas being the world size, `parallel.dp` or "
                              "param-server's workers")
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
    memory_checkpoint_every: int = option(0, "an elastic job (launch.min_nnodes): every N steps, each rank's state "
                                          "also kept in its node's shared memory and in the next node's, two "
                                          "generations, so the survivors of a lost node, and a node that comes "
                                          "back, go on from it without reading a disk (peer_checkpoints.py); 0: off")
    bad_step: str = option("stop", "a step whose loss or gradients are not finite on some rank, or whose loss "
                           "spikes (`spike_factor`), is re-run once from the same state; if it fails again the run "
                           "stops (`stop`) or goes on without that step's update (`skip`); each logged with the "
                           "step, the ranks and the verdict (health.py). `off`: no check (the same one collective a "
                           "step: the loss's all-reduce instead of the check's all-gather)", ("stop", "skip", "off"))
    spike_factor: float = option(0.0, "a loss above this many times the median of the last 20 steps' is a bad step; "
                                 "0: losses are only checked for being finite")
    straggler_factor: float = option(2.0, "a rank whose step took more than this many times the other ranks' median "
                                     "CPU seconds, 3 steps in a row, is named in the log and metrics.jsonl; 0: off")
    checkpoint_async: bool = option(True, "write checkpoints in a background thread: a save holds the step only "
                                    "while it copies this rank's state to host memory, and at most one is in "
                                    "flight (checkpoint_async.py); false: every rank waits for its files")
    compile: bool = option(False, "compile each block's forward with torch.compile (inductor), regionally: identical "
                           "blocks share one graph; compile time and graph count go in the summary (docs/compile.md)")
    objective: str = option("sft", "`sft`: the answers' (or the corpus's) cross-entropy; `dpo`, `ipo` or `simpo` on "
                            "data.format = `preference` pairs (docs/preference.md; DPO and IPO against the initial "
                            "model's log-probabilities, computed before the first step)", OBJECTIVES)
    beta: float = option(0.1, "`dpo`, `ipo`, `simpo`: beta, the strength of the preference (IPO's 1 / (2 beta) margin)")
    gamma: float = option(0.5, "`simpo`: its target reward margin gamma")
    reference: str = option("pass", "`dpo`, `ipo`: the reference log-probabilities: `pass`, one pass of the initial "
                            "model over every window before the first step, kept in the run directory (no model "
                            "beside the policy); `copy`, a frozen copy of the initial model held as the policy is "
                            "(fsdp: 1/N of it) computing each step's windows' as they come (no pass over the whole "
                            "data first)", ("pass", "copy"))
    muon: MuonConfig = field(default_factory=MuonConfig)


@dataclass
class LoraConfig:
    """Low-rank adapters (LoRA, docs/finetuning.md): the model's weights frozen, and beside each target linear
    layer two trainable matrices whose product, scaled by alpha / rank, adds to its output."""

    rank: int = option(0, "the adapters' rank r; 0: no adapters, every parameter trains")
    alpha: float = option(16.0, "the update's scale is alpha / rank")
    dropout: float = option(0.0, "dropout on the adapters' input, in [0, 1)")
    targets: list[str] | None = option(None, "the linear layers that get adapters, by name or its last components "
                                       "(`attn.qkv`, `q_proj`; `*` matches within a component); unset: the "
                                       "attention and MLP projections of the model family's parallel plan")
    train: list[str] | None = option(None, "modules that train whole beside the adapters, named as targets are "
                                     "(a new head: peft's modules_to_save); unset: none")
    quantize: str = option("none", "how the target layers' frozen weights are stored: `none` (as the model's "
                           "parameters) or `nf4`, 4-bit NormalFloat with double-quantized scales (QLoRA, nf4.py); "
                           "their input features must be a multiple of 64", ("none", "nf4"))


@dataclass
class PipelineConfig:
    """How micro-batches run through the stages (`pipeline`, `model-parallel`, and the
    sharded strategies with pp > 1)."""

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


@dataclass
class DDPConfig:
    """How data parallel averages gradients (`ddp`; `ddp-native` takes the bucket size and
    `find_unused_parameters`)."""

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


@dataclass
class ShardingConfig:
    """How the sharded strategies (`zero1`, `zero2`, `fsdp`, `hsdp`, `fsdp-native`) gather,
    reduce and keep their shards."""

    reshard_after_forward: bool = option(True, "`fsdp`, `fsdp-native`: free a unit's full parameters after its "
                                         "forward")
    prefetch: int = option(1, "`fsdp`: units whose all-gather is issued ahead")
    blocks_per_unit: int = option(1, "`zero1`, `zero2`, `fsdp`, `hsdp` (without pipeline stages): consecutive "
                                  "blocks sharded as one unit, gathered and reduced by one collective (fewer "
                                  "collectives and hooks a step, as many blocks gathered at once); divides the blocks")
    reduce_dtype: str = option("fp32", "sharded strategies: the dtype gradients are reduce-scattered in",
                               REDUCE_DTYPES)
    offload: str = option("none", "`zero1`, `zero2`, `fsdp`: `optimizer` keeps the fp32 master shards, their "
                          "gradients and the optimizer state in host memory and steps there (ZeRO-Offload)", OFFLOADS)


@dataclass
class ParamServerConfig:
    """The servers of `param-server` and how they apply pushes."""

    servers: int = option(1, "the last `servers` ranks hold the parameters and their optimizer; the others are "
                          "workers")
    mode: str = option("sync", "`sync` averages every worker's gradients each step, `async` applies each push on "
                       "arrival", PS_MODES)
    max_staleness: int = option(4, "`async`: drop a push computed on parameters more than this many updates old")


@dataclass
class ParallelConfig:
    """How training is spread over ranks: the strategy (docs/strategies/), precision, recomputation, the
    mesh's sizes, and each kind of strategy's own settings in a table of its own."""

    strategy: str = option("single", "how training is spread over ranks; one page each in docs/strategies/",
                           STRATEGIES)
    precision: str = option("fp32", "what computes and what is stored in which dtype (docs/precision.md)",
                            PRECISIONS)
    float8: str = option("none", "the blocks' linear layers compute in float8 (with bf16-mixed or bf16-true): "
                         "`tensorwise` one scale a tensor, `rowwise` one a row (docs/precision.md)", FLOAT8_RECIPES)
    loss_scale: float = option(65536.0, "`fp16-mixed`: the dynamic loss scaler's starting scale")
    loss_scale_growth_interval: int = option(2000, "`fp16-mixed`: clean steps before the loss scale doubles")
    recompute: str = option("none", "activation checkpointing of the blocks, every:K with K >= 1 "
                            "(docs/recompute.md)", ("none", "blocks", "every:K", "selective"))
    sync_batchnorm: bool = option(False, "data parallel: BatchNorm statistics over the global batch")
    block: str = option(DEFAULT_BLOCK, "class name of the model's repeated block: the unit sharded as one (zero1/2, "
                        "fsdp, fsdp-native), recomputed, cut into stages (pipeline) or split (tensor); left at the "
                        "default, a model without a `Block` (a transformers model) has the layer class its "
                        "`_no_split_modules` declares used")
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
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    param_server: ParamServerConfig = field(default_factory=ParamServerConfig)

    def mesh_shape(self, world_size: int) -> tuple[int, int, int]:
        """(dp, pp, tp): the device mesh's sizes, unset ones filled in as described above (each of
        the dp replicas spans cp x pp x tp ranks). A parameter-server job's replicas are its workers."""
        chosen = spec(self.strategy)
        if chosen.parameter_servers:
            return world_size - self.param_server.servers, 1, 1
        # A list and a loop, not a dict and generators: validating each of a plan's hundreds of
        # thousands of candidates asks this several times.
        sizes = [self.dp, self.pp, self.tp]
        own = ("dp", "pp", "tp").index(chosen.mesh_dim)
        if sizes[own] is None:
            others = 1
            for size in sizes:
                if size is not None:
                    others *= size
            sizes[own] = max(1, world_size // max(1, self.cp * others))
        dp, pp, tp = sizes
        return 1 if dp is None else dp, 1 if pp is None else pp, 1 if tp is None else tp


@dataclass
class LaunchConfig:
    """How the workers are started (through torch.distributed.run), and how failures are handled."""

    nproc: int = option(1, "worker processes on this node")
    nnodes: int = option(1, "nodes in the job (an elastic job's most)")
    min_nnodes: int | None = option(None, "elastic: the fewest nodes the job goes on with (--nnodes MIN:MAX); when "
                                    "a node is lost the others re-form the world in their processes and go on "
                                    "from the newest checkpoint; a node that comes back is taken in by a restart "
                                    "of the workers (elastic.py); unset: a fixed size")
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
    replica_groups: int = option(1, "N > 1: N replica groups of `nproc` ranks each on this node, every rank forked "
                                 "from one server and a failed group restarted by the launcher; their gradients "
                                 "averaged every step by torchft, which commits or rolls back each step and heals "
                                 "a group restarted after a failure (`max_restarts`) from a live one, the others "
                                 "going on (replicas.py; ddp, or zero1, zero2, fsdp sharding each group's model "
                                 "over its ranks; needs torchft)")
    debug_collectives: bool = option(False, "check before every collective that it is the same call on every rank, "
                                     "failing at the first mismatch (slow; not with ddp-native)")


@dataclass
class MlflowConfig:
    """MLflow: the main rank logs the resolved config as parameters, every step's and evaluation's
    metrics at their step, and summary.json and metrics.jsonl as artifacts, to one MLflow run named
    after the run directory (docs/report.md). Needs `pip install 'shardwise[mlflow]'`."""

    tracking_uri: str | None = option(None, "where MLflow keeps its runs: a database (`sqlite:///mlflow.db`, a "
                                      "file in the directory shardwise starts in, MLflow putting the artifacts in "
                                      "./mlruns there) or a tracking server (`http://host:5000`); unset: off")
    experiment: str = option("shardwise", "the MLflow experiment the run is logged under (made if missing)")


@dataclass
class WandbConfig:
    """Weights & Biases: the main rank logs the resolved config, every step's and evaluation's
    metrics at their step, and summary.json and metrics.jsonl as run files, to one W&B run named after
    the run directory, kept in `out`/wandb. Its mode is WANDB_MODE where set, else `online` where an
    API key is found (WANDB_API_KEY or `wandb login`), else `offline` (docs/report.md). Needs
    `pip install 'shardwise[wandb]'`."""

    project: str | None = option(None, "the W&B project the run is logged to; unset: off")
    entity: str | None = option(None, "the W&B team or user the project belongs to (unset: the API key's "
                                "default entity)")


@dataclass
class RunConfig:
    """Where the run is written, and how it is reported."""

    out: str = option("runs/latest", "the run directory: config.toml, metrics.jsonl, model.safetensors, "
                      "checkpoints/")
    log_every: int = option(10, "steps between progress lines when not on a terminal")
    resume: bool = option(False, "continue from the newest good checkpoint in `out`")
    tensorboard: bool = option(False, "the main rank also writes its metrics as TensorBoard scalars to "
                               "`out`/tensorboard (needs the tensorboard package)")
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def world_size(self) -> int:
        """The ranks of one job's world: every node's; under replica groups one group's (a group a
        node, across nodes), each group a world of its own that torchft averages with the others."""
        nodes = self.launch.nnodes if self.launch.replica_groups == 1 else 1
        return self.launch.nproc * nodes

    def grad_accum(self, world_size: int | None = None) -> int:
        """Micro-steps per optimizer step on each model replica; validate() guarantees it divides."""
        dp = self.parallel.mesh_shape(world_size or self.world_size)[0]
        return self.train.global_batch // (dp * self.train.micro_batch)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The config as TOML tables (unset keys left out: TOML has no null)."""

        def set_only(table: dict[str, Any]) -> dict[str, Any]:
            return {k: set_only(v) if isinstance(v, dict) else v for k, v in table.items() if v is not None}

        return {section: set_only(dataclasses.asdict(getattr(self, section))) for section in SECTIONS}

    def save(self, path: Path) -> None:
        """Write the config to `path` as TOML, whole or not at all: each rank that saves a run's
        resolved config (a job's first rank, each replica group's) replaces the file while others may
        be reading it, and a rank that read it half written trained with defaults for the rest."""
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, tomli_w.dumps(self.to_dict()).encode())


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "lora": LoraConfig,
    "parallel": ParallelConfig,
    "launch": LaunchConfig,
    "run": RunConfig,
}

def tables() -> dict[str, type]:
    """Every table of the config by its dotted name, a section's own tables (`parallel.pipeline`)
    right after it: what the docs and the loader walk."""
    found: dict[str, type] = {}

    def visit(name: str, cls: type) -> None:
        found[name] = cls
        for f in dataclasses.fields(cls):
            if f.default_factory is not dataclasses.MISSING:
                visit(f"{name}.{f.name}", f.default_factory)

    for section, cls in SECTIONS.items():
        visit(section, cls)
    return found


# Keys that moved into a table of their own (issue 41): the old name -> the new one, for the error
# that names it.
MOVED_KEYS: dict[str, str] = {
    **{f"parallel.{key}": f"parallel.pipeline.{key}"
       for key in ("micro_batches", "schedule", "virtual_stages", "split_points")},
    **{f"parallel.{key}": f"parallel.ddp.{key}"
       for key in ("bucket_mb", "all_reduce", "grad_compression", "powersgd_rank", "powersgd_start_step",
                   "find_unused_parameters")},
    **{f"parallel.{key}": f"parallel.sharding.{key}"
       for key in ("reshard_after_forward", "prefetch", "reduce_dtype", "offload")},
    **{f"parallel.ps_{key}": f"parallel.param_server.{key}" for key in ("servers", "mode", "max_staleness")},
}

GPT_PRESET_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(n_layer=2, n_head=2, d_model=64, seq_len=64, vocab_size=256),
    "small": dict(n_layer=6, n_head=6, d_model=384, seq_len=256, vocab_size=256),
    "gpt2-124m": dict(n_layer=12, n_head=12, d_model=768, seq_len=1024, vocab_size=50304),
}
