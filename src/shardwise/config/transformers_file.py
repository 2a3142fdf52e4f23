"""A transformers config.json, read as transformers reads it, with nothing of transformers imported."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_transformers_config(path: str | Path) -> Any:
    """A transformers config.json's values as transformers reads them: the floats JSON cannot hold
    (Infinity, NaN), which save_pretrained writes as {"__float__": "Infinity"}, decoded."""

    def decoded(value: Any) -> Any:
        if isinstance(value, dict):
            return float(value["__float__"]) if value.keys() == {"__float__"} else \
                {k: decoded(v) for k, v in value.items()}
        return [decoded(v) for v in value] if isinstance(value, list) else value

    return decoded(json.loads(Path(path).read_text()))
