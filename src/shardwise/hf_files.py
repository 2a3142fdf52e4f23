"""The files beside a transformers model's weights that make a directory `from_pretrained` loads:
`config.json` (the model as trained: its family, sizes and architecture) and the tokenizer's
files when the run was given a Hugging Face tokenizer.

A run of an hf-* model writes them beside its `model.safetensors` (weights_file.py writes that
under transformers' names), so the run directory is itself the model:
`AutoModelForCausalLM.from_pretrained(RUN)` and `AutoTokenizer.from_pretrained(RUN)`.
`shardwise consolidate RUN DIR` writes the same directory from a checkpoint.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from torch import nn

from shardwise.atomic_file import write_whole

CONFIG = "config.json"
# A Hugging Face tokenizer's files, as `save_pretrained` writes them for the tokenizers transformers knows.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.txt", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja",
                   "chat_template.json")
# Set to None where shardwise builds the model (models/hf.py), given back from the published file.
SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")


def config_json(model: nn.Module, hf_config: str | None) -> str:
    """The config.json of shardwise's hf-* `model` (built on the meta device will do): transformers'
    own config of the model as built, its class named (`architectures`), its weights' dtype fp32
    (final weights are written in fp32), and the special token ids of `hf_config`, the published
    config.json it follows, where it gave them."""
    config = copy.deepcopy(model.lm.config)
    published = json.loads(Path(hf_config).read_text()) if hf_config else {}
    for key in SPECIAL_TOKENS:
        if key in published:
            setattr(config, key, published[key])
    config.architectures = [type(model.lm).__name__]
    config.dtype = "float32"
    return config.to_json_string()


def tokenizer_files(tokenizer: str) -> dict[str, Path]:
    """The files of `data.tokenizer` (a tokenizer.json, or a directory holding one) that a
    transformers tokenizer is loaded from, by the name each takes in a model's directory; none for
    the byte tokenizer."""
    if tokenizer == "bytes":
        return {}
    path = Path(tokenizer).expanduser()
    if path.is_file():
        return {"tokenizer.json": path}
    return {name: path / name for name in TOKENIZER_FILES if (path / name).is_file()}


def write_model_files(out: Path, config: str, tokenizer: str) -> None:
    """`config` as out/config.json and the tokenizer's files into `out`, each written whole under a
    temporary name and renamed into place."""
    out.mkdir(parents=True, exist_ok=True)
    write_whole(out / CONFIG, config.encode())
    for name, file in tokenizer_files(tokenizer).items():
        write_whole(out / name, file.read_bytes())
