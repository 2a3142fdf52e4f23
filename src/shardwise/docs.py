"""Writes docs/config.md, the config reference, from the config schema itself: every section's
dataclass in `config.SECTIONS`, every key's type, default, allowed values and description (the
`option(...)` beside each field), and the `shardwise train` flag that sets it.

    python -m shardwise.docs      # from the repository root, after changing config.py

tests/test_docs.py fails when docs/config.md differs from what this writes, or when a key has no
description.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from pathlib import Path
from typing import Any

import tomli_w

from shardwise.cli import _add_train_parser
from shardwise.config import SECTIONS

OUT = Path("docs/config.md")

HEADER = """\
# Config reference

<!-- Written by `python -m shardwise.docs` from src/shardwise/config.py: change the descriptions
there, then rerun it (tests/test_docs.py fails while this file is out of date). -->

A run is configured by one TOML file with the sections below. Every key has a default, so a file
names only what it changes. `--set section.key=value` overrides any key (the value is read as
TOML; a bare word is a string), and the flags of `shardwise train` override both; the flag column
says which key each flag sets. `config.toml` in a run directory is the resolved config (presets
filled in). Every value and every relation between values is checked before any worker starts:
a bad one stops `shardwise train` with one line naming the key, the value and what is allowed
(exit code 2).

Examples: [configs/gpt-tiny.toml](../configs/gpt-tiny.toml) (for trying things),
[configs/demo.toml](../configs/demo.toml) (what `make demo` trains),
[configs/gpt-70b.toml](../configs/gpt-70b.toml) (for `shardwise plan` only).
"""


def train_flags() -> dict[str, str]:
    """`section.key` -> the `shardwise train` flag that sets it; each flag's help starts with its key."""
    commands = argparse.ArgumentParser().add_subparsers()
    _add_train_parser(commands)
    flags = {}
    for action in commands.choices["train"]._actions:
        key = re.match(r"(\w+\.\w+)\b", action.help or "")
        if key and action.option_strings:
            flags[key.group(1)] = action.option_strings[0]
    return flags


def type_name(annotation: str) -> str:
    """`int | None` -> `int` (an unset default says the rest), `list[int]` -> `list of int`."""
    base = annotation.replace(" | None", "")
    return re.sub(r"list\[(\w+)\]", r"list of \1", base)


def default(value: Any) -> str:
    """As it would be written in the TOML file; `None` is a key left unset."""
    if value is None:
        return "unset"
    return "`" + tomli_w.dumps({"v": value}).strip().removeprefix("v = ") + "`"


def section_doc(cls: type) -> str:
    """The section class's own docstring ('' for the one dataclasses makes up)."""
    doc = cls.__dict__.get("__doc__") or ""
    return "" if doc.startswith(f"{cls.__name__}(") else inspect.cleandoc(doc)


def render() -> str:
    flags = train_flags()
    parts = [HEADER]
    for section, cls in SECTIONS.items():
        parts.append(f"## [{section}]\n\n{section_doc(cls)}\n")
        rows = ["| key | type | default | allowed | flag | description |", "| --- | --- | --- | --- | --- | --- |"]
        for f in dataclasses.fields(cls):
            dotted = f"{section}.{f.name}"
            choices = ", ".join(f"`{choice}`" for choice in f.metadata.get("choices", ()))
            flag = f"`{flags[dotted]}`" if dotted in flags else ""
            doc = f.metadata.get("doc", "").replace("|", "\\|")
            rows.append(f"| `{dotted}` | {type_name(str(f.type))} | {default(f.default)} | {choices} | {flag} "
                        f"| {doc} |")
        parts.append("\n".join(rows) + "\n")
    return "\n".join(parts)


def main() -> int:
    if not OUT.parent.is_dir():
        print(f"python -m shardwise.docs: no {OUT.parent}/ here; run it from the repository root", file=sys.stderr)
        return 2
    OUT.write_text(render())
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
