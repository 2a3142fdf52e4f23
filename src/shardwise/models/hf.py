"""Hugging Face `transformers` models in shardwise.

Any model works through the Python API as it is: the strategies need nothing from it but its
modules. What they do need is the *unit*, the repeated block that the sharded strategies gather and
free together and that recomputation checkpoints: `decoder_layer_class` finds it from the
`_no_split_modules` that every transformers model declares (the classes that must not be split
across devices: its decoder layer, sometimes its embeddings too).

For the config (`model.name = "hf-llama"`, `"hf-qwen2"` or `"hf-gpt2"`), `build_causal_lm` builds a
Llama, a Qwen2 or a GPT-2 of the config's sizes, randomly initialised from the torch seed, nothing downloaded; its
`CausalLM` wrapper takes token ids and returns logits, as the trainer calls every model.
`transformers` is imported only here and only when such a model is built (`pip install
'shardwise[hf]'`).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from shardwise.config import HF_MODELS, ModelConfig


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
    """A randomly initialised Llama (`hf-llama`), Qwen2 (`hf-qwen2`) or GPT-2 (`hf-gpt2`) of the
    config's (resolved) sizes, from the current torch seed. Dropout is off, as in shardwise's GPT:
    ranks would draw different masks than one device does."""
    try:
        import transformers
    except ImportError:
        raise ImportError(f"model.name = {cfg.name!r} needs transformers: pip install 'shardwise[hf]'") from None
    no_special_tokens = dict(bos_token_id=None, eos_token_id=None)
    if cfg.name in ("hf-llama", "hf-qwen2"):
        family = transformers.LlamaConfig if cfg.name == "hf-llama" else transformers.Qwen2Config
        config = family(
            vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
            num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head,
            max_position_embeddings=cfg.seq_len, **no_special_tokens)
    elif cfg.name == "hf-gpt2":
        config = transformers.GPT2Config(
            vocab_size=cfg.vocab_size, n_positions=cfg.seq_len, n_embd=cfg.d_model, n_inner=cfg.d_ff,
            n_layer=cfg.n_layer, n_head=cfg.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            **no_special_tokens)
    else:
        raise ValueError(f"model.name = {cfg.name!r}: not a Hugging Face model; allowed: {', '.join(HF_MODELS)}")
    return CausalLM(transformers.AutoModelForCausalLM.from_config(config))
