"""Hugging Face `transformers` models in shardwise.

Any model works through the Python API as it is: the strategies need nothing from it but its
modules. What they do need is the *unit*, the repeated block that the sharded strategies gather and
free together and that recomputation checkpoints: `decoder_layer_class` finds it from the
`_no_split_modules` that every transformers model declares (the classes that must not be split
across devices: its decoder layer, sometimes its embeddings too).

For the config (`model.name = "hf-llama"`, `"hf-qwen2"`, `"hf-gpt2"`, `"hf-mixtral"` or
`"hf-qwen3-moe"`), `build_causal_lm` builds a Llama, a Qwen2, a GPT-2, a Mixtral or a Qwen3-MoE of
the config's sizes (and, with `model.hf_config`, of a published model's
architecture: tied embeddings, biases, RoPE), randomly initialised from the torch seed, nothing downloaded; its
`CausalLM` wrapper takes token ids and returns logits, as the trainer calls every model.
`transformers` is imported only here and only when such a model is built (`pip install
'shardwise[hf]'`).
"""

from __future__ import annotations

import functools
from collections import Counter

import torch
from torch import nn

from shardwise.config.schema import HF_FAMILY_SIZES, HF_MODELS, HF_SIZE_NAMES, ModelConfig
from shardwise.config.transformers_file import read_transformers_config
from shardwise.models.plans import largest_layer_list, text_config


def decoder_layer_class(model: nn.Module) -> str | None:
    """The class name of the model's repeated layer: of the classes any of its modules declares in
    `_no_split_modules`, the one with the most instances (BERT declares its embeddings and its
    layer; the layer repeats). A family that declares none (CTRL, Marian, RoFormer): the class of the
    entries of its ModuleList of one class that holds the most parameters (its layers). None if
    neither finds one."""
    declared = {name for module in model.modules() for name in getattr(module, "_no_split_modules", None) or ()}
    counts = Counter(type(m).__name__ for m in model.modules() if type(m).__name__ in declared)
    if counts:
        return max(sorted(counts), key=counts.__getitem__)
    found = largest_layer_list(model)
    return type(found[1][0]).__name__ if found else None


class CausalLM(nn.Module):
    """A transformers causal LM called as the trainer calls a model: token ids in, logits out."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # No key/value cache: training never generates.
        return self.lm(input_ids=idx, use_cache=False).logits


def build_causal_lm(cfg: ModelConfig) -> CausalLM:
    """A randomly initialised transformers causal LM, from the current torch seed: for `hf` the
    family and architecture model.hf_config gives; for shardwise's own families (`hf-llama`, ...) of
    the config's (resolved) sizes, with model.hf_config that file's architecture otherwise. Dropout (and a
    router's jitter) is off, as in shardwise's GPT: ranks would draw different masks than one device does."""
    try:
        import transformers
    except ImportError:
        raise ImportError(f"model.name = {cfg.name!r} needs transformers: pip install 'shardwise[hf]'") from None
    if cfg.name not in HF_MODELS:
        raise ValueError(f"model.name = {cfg.name!r}: not a Hugging Face model; allowed: {', '.join(HF_MODELS)}")
    config = transformers_config(cfg)
    _without_noise(config)
    return CausalLM(transformers.AutoModelForCausalLM.from_config(config))


def transformers_config(cfg: ModelConfig) -> object:
    """The transformers config `build_causal_lm` builds from: for `hf` model.hf_config's, for
    shardwise's own families their config class of the resolved sizes."""
    import transformers

    values = read_transformers_config(cfg.hf_config) if cfg.hf_config else {}
    # The dtype the file was saved in is not the one training stores: the precision decides that.
    values = {k: v for k, v in values.items() if k not in ("torch_dtype", "dtype")}
    if cfg.name == "hf":
        return transformers.AutoConfig.for_model(**values)
    return _sized_config(transformers.CONFIG_MAPPING[FAMILY_TYPES[cfg.name]], values, cfg)


def tp_plan_of(cfg: ModelConfig) -> tuple[str, dict[str, str]]:
    """The family of a transformers model and the tensor parallel plan its config declares (empty
    where it declares none), read without building the model: once per file, for the planner
    checks it for each of thousands of candidates."""
    family, plan, *_ = _plans_of(cfg.name, cfg.hf_config)
    return family, dict(plan)


def pp_plan_of(cfg: ModelConfig) -> tuple[str, ...]:
    """The modules a transformers model's pipeline plan names, in order (embeddings, the layers'
    list, the final norm): empty where its config declares none."""
    return _plans_of(cfg.name, cfg.hf_config)[2]


def unsplit_classes_of(cfg: ModelConfig) -> tuple[str, ...]:
    """The classes a transformers model's causal-LM class declares must not be split
    (`_no_split_modules`: its decoder layers among them), read without building the model."""
    return _plans_of(cfg.name, cfg.hf_config)[3]


@functools.cache
def _plans_of(name: str, hf_config: str | None) -> tuple[str, tuple[tuple[str, str], ...], tuple[str, ...],
                                                        tuple[str, ...]]:
    import transformers

    # a family of shardwise's: its plan does not depend on its sizes
    config = transformers.AutoConfig.for_model(**read_transformers_config(hf_config)) if name == "hf" \
        else transformers.CONFIG_MAPPING[FAMILY_TYPES[name]]()
    text = text_config(config)
    model_class = transformers.MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return (text.model_type, tuple((getattr(text, "base_model_tp_plan", None) or {}).items()),
            tuple(getattr(text, "base_model_pp_plan", None) or ()),
            tuple(getattr(model_class, "_no_split_modules", None) or ()))


def _without_noise(config: object) -> None:
    """Dropout, and the noise some routers add while training, off in `config` and in the configs
    it holds (a multimodal model's text model's)."""
    for key, value in vars(config).items():
        if isinstance(value, float) and ("dropout" in key or key.endswith("_pdrop") or "jitter" in key):
            setattr(config, key, 0.0)
        elif hasattr(value, "attribute_map") and hasattr(value, "to_dict"):  # a sub-config
            _without_noise(value)


# shardwise's own transformers families -> transformers' model_type
FAMILY_TYPES = {"hf-llama": "llama", "hf-qwen2": "qwen2", "hf-gpt2": "gpt2", "hf-mixtral": "mixtral",
                "hf-qwen3-moe": "qwen3_moe", "hf-deepseek-v3": "deepseek_v3"}


def _sized_config(config_class: type, values: dict, cfg: ModelConfig) -> object:
    """`config_class` of the file's `values` and of `cfg`'s sizes, each given to the class under its
    own name for it (its attribute_map's target of the standard name, or a synonym the class has:
    GPT-2's n_inner), so that what the class derives from them (head widths, layer lists) follows.
    The model's context stays the file's where it sets one: model.seq_len is the window within it."""
    renamed, default = config_class.attribute_map, config_class()
    sizes = {}
    for ours in HF_FAMILY_SIZES[cfg.name]:
        names = [renamed.get(n, n) for n in HF_SIZE_NAMES[ours]]
        # the first the class has; else the standard name, which a model reads as an extra (Qwen3-MoE's head_dim)
        attribute = next((n for n in names if hasattr(default, n)), names[0])
        keys = {k for k in values if renamed.get(k, k) == attribute}  # the file's names for it
        if ours == "seq_len" and any(values[k] is not None for k in keys):
            continue
        values = {k: v for k, v in values.items() if k not in keys}
        sizes[attribute] = getattr(cfg, ours)
    values = {k: v for k, v in values.items() if k not in ("model_type", "bos_token_id", "eos_token_id")}
    for key in ("layer_types", "mlp_layer_types"):  # per-layer kinds: the first n_layer of them
        if isinstance(values.get(key), list) and len(values[key]) > cfg.n_layer:
            values[key] = values[key][:cfg.n_layer]
    # generation's tokens, which a preset's vocabulary of 256 may not hold
    return config_class(**values, **sizes, bos_token_id=None, eos_token_id=None)
