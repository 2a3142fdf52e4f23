"""Builds this folder's files (already committed; rerun to rebuild them):

- `tokenizer/`: a tokenizer whose tokens are UTF-8 bytes, token id = byte value, the same ids as
  `data.tokenizer = "bytes"` and so as the model `make demo` trains on Shakespeare. Its
  `tokenizer_config.json` holds a chat template in the plays' own layout (a speaker's name in
  capitals and a full stop, then the speech), which the demo's model has already learnt.
- `shout.jsonl`: 600 conversations in which the assistant repeats the user's line of Shakespeare
  in capitals, shouted: a skill the pretrained model lacks, learnable by adapters in a few hundred
  steps (configs/lora-chat.toml).

    python examples/chat/build.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

from shardwise.data.corpus import load_corpus

HERE = Path(__file__).parent
TEMPLATE = ("{% for m in messages %}{{ m['role'] | upper }}.\n{{ m['content'] }}\n\n{% endfor %}"
            "{% if add_generation_prompt %}ASSISTANT.\n{% endif %}")


def byte_tokenizer() -> Tokenizer:
    """Byte-level pre-tokenization maps each byte to one printable character; the vocabulary gives
    that character the byte's value as its id, and no merges join any two."""
    alphabet = ByteLevel.alphabet()
    by_byte = {ch: b for b, ch in _bytes_to_unicode().items() if ch in alphabet}
    tokenizer = Tokenizer(models.BPE(vocab=by_byte, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character map, which byte-level pre-tokenization applies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def shakespeare_lines(count: int, seed: int = 0) -> list[str]:
    text = bytes(load_corpus("shakespeare")).decode("utf-8", errors="ignore")
    lines = sorted({line.strip() for line in text.splitlines() if 24 <= len(line.strip()) <= 60
                    and line.strip()[0].isupper() and not line.strip().isupper()})
    return random.Random(seed).sample(lines, count)


def main() -> None:
    tokenizer = byte_tokenizer()
    out = HERE / "tokenizer"
    out.mkdir(exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE},
        indent=2) + "\n")
    with open(HERE / "shout.jsonl", "w") as f:
        for line in shakespeare_lines(600):
            shout = line.rstrip(".,;:!?").upper() + "!"
            f.write(json.dumps({"messages": [{"role": "user", "content": line},
                                             {"role": "assistant", "content": shout}]}) + "\n")


if __name__ == "__main__":
    main()
