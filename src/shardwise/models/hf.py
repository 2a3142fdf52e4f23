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

import json
from collections import Counter
from pathlib import Path

import torch
from torch import nn

from shardwise.config.schema import HF_MODELS, HF_SIZE_ALIASES, HF_SIZE_KEYS, ModelConfig


def decoder_layer_class(model: nn.Module) -> str | None:
    """The class name of the model's repeated layer: of the classes any of its modules declares in
    `_no_split_modules`, the one with the most instances (BERT declares its embeddings and its
    layer; the layer repeats). None if no module declares any."""
    declared = {name for module in model.modules() for name in getattr(module, "_no_split_modules", None) or ()}
    counts = Counter(type(m).__name__ for m in model.modules() if type(m).__name__ in declared)
    if not counts:
        return None
    return max(sorted(counts), key=counts.__getitem__)


class CausalLM(nn.Module):
    """A transformers causal LM called as the trainer calls a model: token ids in, logits out."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # No key/value cache: training never generates.
        return self.lm(input_ids=idx, use_cache=False).logits


def build_causal_lm(cfg: ModelConfig) -> CausalLM:
    """A randomly initialised Llama (`hf-llama`), Qwen2 (`hf-qwen2`), GPT-2 (`hf-gpt2`), Mixtral
    (`hf-mixtral`) or Qwen3-MoE (`hf-qwen3-moe`) of the config's (resolved) sizes, from the current
    torch seed: the family's defaults, or with `model.hf_config` that file's architecture. Dropout
    is off, as in shardwise's GPT: ranks would draw different masks than one device does."""
    try:
        import transformers
    except ImportError:
        raise ImportError(f"model.name = {cfg.name!r} needs transformers: pip install 'shardwise[hf]'") from None
    families = {"hf-llama": transformers.LlamaConfig, "hf-qwen2": transformers.Qwen2Config,
                "hf-gpt2": transformers.GPT2Config, "hf-mixtral": transformers.MixtralConfig,
                "hf-qwen3-moe": transformers.Qwen3MoeConfig, "hf-deepseek-v3": transformers.DeepseekV3Config}
    if cfg.name not in families:
        raise ValueError(f"model.name = {cfg.name!r}: not a Hugging Face model; allowed: {', '.join(HF_MODELS)}")
    values = json.loads(Path(cfg.hf_config).read_text()) if cfg.hf_config else {}
    # The dtype the file was saved in is not the one training stores: the precision decides that.
    values = {k: v for k, v in values.items() if k not in ("torch_dtype", "dtype", "model_type")}
    sizes = {theirs: getattr(cfg, ours) for ours, theirs in HF_SIZE_KEYS[cfg.name].items()}
    context = HF_SIZE_KEYS[cfg.name]["seq_len"]
    if values.get(context) is not None:  # the model's context is the file's; model.seq_len, the window, at most it
        del sizes[context]
    aliases = {alias for size in sizes for alias in HF_SIZE_ALIASES.get(size, ())}  # the sizes set here win
    values = {k: v for k, v in values.items() if k not in aliases}
    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0) if cfg.name == "hf-gpt2" else \
        dict(attention_dropout=0.0)
    config = families[cfg.name](**{**values, **sizes, **no_dropout, "bos_token_id": None, "eos_token_id": None})
    return CausalLM(transformers.AutoModelForCausalLM.from_config(config))
