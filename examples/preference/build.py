"""Builds this folder's `shout-pairs.jsonl` (already committed; rerun to rebuild it):

800 preference pairs whose prompt is a line of Shakespeare, the chosen answer the line shouted back
in capitals, the rejected answer the line said back as it is: an answer style the model `make demo`
pretrains has no preference for, learnt by DPO in a few dozen steps (configs/dpo-shout.toml). Plain
text, the demo's byte tokens; lines short enough that a pair (its prompt twice, both answers) fits
the demo model's 129-token window.

    python examples/preference/build.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from shardwise.data.corpus import load_corpus

HERE = Path(__file__).parent


def short_lines(count: int, seed: int = 0) -> list[str]:
    """Distinct lines of the plays of 16 to 28 characters, starting with a capital, not all capitals."""
    text = bytes(load_corpus("shakespeare")).decode("utf-8", errors="ignore")
    lines = sorted({line.strip() for line in text.splitlines() if 16 <= len(line.strip()) <= 28
                    and line.strip()[0].isupper() and not line.strip().isupper()})
    return random.Random(seed).sample(lines, count)


def main() -> None:
    with open(HERE / "shout-pairs.jsonl", "w") as f:
        for line in short_lines(800):
            said = line.rstrip(".,;:!?")
            f.write(json.dumps({"prompt": f"{line}\n", "chosen": f"{said.upper()}!\n", "rejected": f"{said}.\n"})
                    + "\n")


if __name__ == "__main__":
    main()
