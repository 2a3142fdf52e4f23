"""Writes docs/config.md, the config reference, from the config schema itself: every table's
dataclass (`config.schema.tables()`), every key's type, default, allowed values and description (the
`option(...)` beside each field), and the `shardwise train` flag that sets it; and the pictures
of the pipeline schedules in docs/strategies/pipeline.md, drawn by their simulator, as text and
(where matplotlib is installed) as one PNG, docs/images/pipeline-schedules.png.

    python -m shardwise.docs      # from the repository root, after changing config/schema.py or a schedule

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
from shardwise.config.schema import tables
from shardwise.parallel.pipeline.schedules import SCHEDULES, build
from shardwise.parallel.pipeline.simulate import Costs, draw, simulate

OUT = Path("docs/config.md")
SCHEDULE_PAGE = Path("docs/strategies/pipeline.md")
PICTURES = ("<!-- Schedule pictures: written by `python -m shardwise.docs` from parallel/pipeline/schedules.py -->\n",
            "<!-- End of the schedule pictures -->\n")
PICTURED = (4, 8)  # ranks, micro-batches
IMAGE = Path("docs/images/pipeline-schedules.png")
COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868", "BW": "#c44e52"}

HEADER = """\
# Config reference

<!-- Written by `python -m shardwise.docs` from src/shardwise/config/schema.py: change the descriptions
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
    for table, cls in tables().items():
        parts.append(f"## [{table}]\n\n{section_doc(cls)}\n")
        rows = ["| key | type | default | allowed | flag | description |", "| --- | --- | --- | --- | --- | --- |"]
        for f in dataclasses.fields(cls):
            if f.default_factory is not dataclasses.MISSING:  # a table of its own, after this one
                continue
            dotted = f"{table}.{f.name}"
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


def draw_schedules_png(path: Path) -> None:
    """Every schedule's simulated timeline at PICTURED, one panel each, on one time axis: each rank
    does the same work under every schedule (a stage's F, B and W take 1/V, V stages per rank), so
    a shorter row is a smaller bubble. A rank's second stage is hatched."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    from matplotlib import pyplot
    from matplotlib.patches import Patch

    ranks, micro_batches = PICTURED
    figure, axes = pyplot.subplots(len(SCHEDULES), 1, figsize=(12, 1.1 * len(SCHEDULES) * ranks / 2.5), sharex=True)
    for ax, name in zip(axes, SCHEDULES, strict=True):
        schedule = build(name, ranks, micro_batches)
        share = 1 / schedule.layout.virtual
        timeline = simulate(schedule, Costs.uniform(schedule.layout.stages, share, share, share))
        for r, intervals in enumerate(timeline.intervals):
            stages = schedule.layout.stages_of(r)
            for x in intervals:
                second = stages.index(x.action.stage) % 2 == 1
                ax.broken_barh([(x.start, x.end - x.start)], (r - 0.4, 0.8), facecolors=COLOURS[x.action.kind],
                               edgecolor="white", linewidth=0.5, hatch="///" if second else None)
                ax.text((x.start + x.end) / 2, r, str(x.action.micro_batch), ha="center", va="center", fontsize=6,
                        color="white")
        ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{name}: bubble {timeline.bubble:.3f}", fontsize=9, loc="left")
    axes[-1].set_xlabel(f"time, in one micro-batch's forward through a rank's layers (P = {ranks}, "
                        f"M = {micro_batches})")
    figure.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()]
                  + [Patch(facecolor="white", edgecolor="grey", hatch="///", label="second stage")],
                  loc="upper right", ncol=5, fontsize=8)
    figure.tight_layout(rect=(0, 0, 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100, metadata={"Software": None})
    pyplot.close(figure)


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
    try:
        draw_schedules_png(IMAGE)
        print(f"wrote {IMAGE}")
    except ImportError:
        print(f"left {IMAGE} as it was: drawing it needs matplotlib (pip install 'shardwise[plot]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
