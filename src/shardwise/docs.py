"""Writes docs/config.md, the config reference, from the config schema itself: every section's
dataclass in `config.SECTIONS`, every key's type, default, allowed values and description (the
`option(...)` beside each field), and the `shardwise train` flag that sets it; and the pictures
of the pipeline schedules in docs/strategies/pipeline.md, drawn by their simulator.

    python -m shardwise.docs      # from the repository root, after changing config.py or a schedule

tests/test_docs.py fails when docs/config.md or the pictures differ from what this writes, or when
a key has no description.
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
from shardwise.pipeline_schedules import SCHEDULES, Costs, build, draw, simulate

OUT = Path("docs/config.md")
SCHEDULE_PAGE = Path("docs/strategies/pipeline.md")
PICTURES = ("<!-- Schedule pictures: written by `python -m shardwise.docs` from pipeline_schedules.py -->\n",
            "<!-- End of the schedule pictures -->\n")
PICTURED = (4, 8)  # ranks, micro-batches

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


def render_schedules() -> str:
    """Every schedule on 4 ranks and 8 micro-batches, F = B = W: its simulated timeline, bubble and
    the activations each rank holds at most."""
    ranks, micro_batches = PICTURED
    parts = [PICTURES[0]]
    for name in SCHEDULES:
        schedule = build(name, ranks, micro_batches)
        timeline = simulate(schedule, Costs.uniform(schedule.layout.stages))
        held = " ".join(f"{n / schedule.layout.virtual:g}" for n in timeline.peak_in_flight)
        stages = f", {schedule.layout.virtual} stages per rank" if schedule.layout.virtual > 1 else ""
        parts.append(f"`{name}`{stages}: bubble {timeline.bubble:.3f}; activations held at most, in micro-batches "
                     f"of a rank's layers: {held}\n\n```text\n{draw(timeline)}\n```\n")
    parts.append(PICTURES[1])
    return "\n".join(parts)


def with_schedules(page: str) -> str:
    """`page` with its schedule pictures replaced by the ones drawn now."""
    start, end = page.index(PICTURES[0]), page.index(PICTURES[1]) + len(PICTURES[1])
    return page[:start] + render_schedules() + page[end:]


def main() -> int:
    if not OUT.parent.is_dir():
        print(f"python -m shardwise.docs: no {OUT.parent}/ here; run it from the repository root", file=sys.stderr)
        return 2
    OUT.write_text(render())
    SCHEDULE_PAGE.write_text(with_schedules(SCHEDULE_PAGE.read_text()))
    print(f"wrote {OUT} and the schedule pictures in {SCHEDULE_PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
