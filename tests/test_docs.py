"""The docs stay true to the code: the config reference is what the generator writes from the
schema, every key is described, every relative link and anchor resolves, every `shardwise` flag
the docs mention exists, and every strategy has a page."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
from pathlib import Path

import pytest

from shardwise import docs
from shardwise.cli import main
from shardwise.config.registry import NAMES as STRATEGIES
from shardwise.config.schema import tables

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])
COMMANDS = ("train", "plan", "sample", "bench", "consolidate", "export", "report", "prepare-data", "slurm")
# Flags of other programs that the docs show beside ours.
FOREIGN_FLAGS = {
    "--nproc-per-node": "torchrun",
    "--no-deps": "pip",
    "--logdir": "tensorboard",
    "--local-addr": "torchrun",  # what --node-addr derives
    "--rdzv-conf": "torchrun",
    "--rate": "scripts/netns-nodes.sh",
    "--ntasks-per-node": "srun",
    "--signal": "sbatch",
    "--requeue": "sbatch",
    "--kill-on-bad-exit": "srun",
    "--durations": "pytest",
    "--backend-store-uri": "mlflow ui",
    "--json": "wandb leet inspect",
}


def page_id(page: Path) -> str:
    return str(page.relative_to(REPO))


def test_config_reference_is_what_the_generator_writes():
    written = (REPO / "docs" / "config.md").read_text()
    assert written == docs.render(), "docs/config.md is out of date: run `python -m shardwise.docs` from the repo root"


def test_pipeline_schedule_pictures_are_what_the_simulator_draws():
    page = (REPO / docs.SCHEDULE_PAGE).read_text()
    assert docs.render_schedules() in page, (
        f"the schedule pictures in {docs.SCHEDULE_PAGE} are out of date: run `python -m shardwise.docs` from the "
        "repo root")


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_the_schedules_picture_is_drawn_by_the_generator_and_committed(tmp_path):
    """Pixels depend on matplotlib's version; the committed picture must at least be the
    generator's, of the size it draws now."""
    docs.draw_schedules_png(tmp_path / "schedules.png")
    drawn, committed = (tmp_path / "schedules.png").read_bytes(), (REPO / docs.IMAGE).read_bytes()
    assert png_size(drawn) == png_size(committed)
    assert f"../images/{docs.IMAGE.name}" in (REPO / docs.SCHEDULE_PAGE).read_text()


@pytest.mark.parametrize("section", tables())
def test_every_config_key_is_described(section):
    cls = tables()[section]
    assert docs.section_doc(cls), f"[{section}]: give {cls.__name__} a docstring; it introduces the section"
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING:  # a table: its own docstring, its own case
            continue
        assert f.metadata.get("doc", "").strip(), (
            f"{section}.{f.name}: no description; declare it with option(default, 'what it does') in config/schema.py")
        choices = f.metadata.get("choices", ())
        assert not choices or f.default in choices, f"{section}.{f.name}: default {f.default!r} not in {choices}"


def test_config_reference_lists_every_key_with_its_allowed_values():
    reference = docs.render()
    for section, cls in tables().items():
        for f in (f for f in dataclasses.fields(cls) if f.default_factory is dataclasses.MISSING):
            row = next(line for line in reference.splitlines() if line.startswith(f"| `{section}.{f.name}` |"))
            assert all(f"`{choice}`" in row for choice in f.metadata.get("choices", ()))
    assert "| `parallel.strategy` | str | `\"single\"` |" in reference
    assert "## [parallel.pipeline]" in reference and "| `parallel.pipeline.schedule` | str | `\"1f1b\"` |" in reference
    assert "`--strategy`" in reference and "`--nproc`" in reference


def without_code(text: str) -> str:
    """Markdown with fenced blocks and inline code blanked out: links there are not links."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but - and _ dropped, spaces to -, repeats numbered."""
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*$", re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S),
                              flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(page: Path) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", without_code(page.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading with anchor #{anchor} in {page_id(resolved)}")
    assert not broken, f"{page_id(page)}: " + "; ".join(broken)


@pytest.fixture(scope="module")
def flags_by_command() -> dict[str, set[str]]:
    """Every flag each `shardwise` command's --help lists."""
    flags = {}
    for command in COMMANDS:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            main([command, "--help"])
        flags[command] = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out.getvalue()))
    return flags


def example_flags() -> set[str]:
    """The flags the scripts in examples/ and the bench modules (`python -m bench.NAME`)
    define, which the docs show beside ours."""
    scripts = [*(REPO / "examples").glob("*.py"), *(REPO / "bench").glob("*.py")]
    return {flag for script in scripts
            for flag in re.findall(r"add_argument\(\"(--[a-z][a-z0-9-]*)\"", script.read_text())}


def command_lines(text: str) -> list[tuple[str, str]]:
    """(command, its text) for every `shardwise CMD ...` the page shows: in code blocks (after a
    `$ ` prompt or none) with their indented continuation lines, and in inline code."""
    found = []
    for block in re.findall(r"^```.*?\n(.*?)^```", text, flags=re.M | re.S):
        for usage in re.findall(r"^(?:\$ )?(shardwise \w+.*(?:\n[ \t]+\S.*)*)", block, flags=re.M):
            found.append((usage.split()[1], usage))
    for span in re.findall(r"`(shardwise \w+[^`\n]*)`", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)):
        found.append((span.split()[1], span))
    return found


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_shardwise_flag_the_docs_mention_exists(page, flags_by_command):
    text = page.read_text()
    wrong = []
    for command, usage in command_lines(text):
        if command not in flags_by_command:
            wrong.append(f"`shardwise {command}`: no such command")
            continue
        wrong += [f"shardwise {command} {flag}" for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", usage)
                  if flag not in flags_by_command[command]]
    known = set().union(*flags_by_command.values()) | set(FOREIGN_FLAGS) | example_flags()
    wrong += [flag for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text) if flag not in known]
    assert not wrong, f"{page_id(page)} mentions flags no --help lists: {sorted(set(wrong))}"


def test_every_strategy_has_a_page_linked_from_the_readme():
    readme = (REPO / "README.md").read_text()
    for strategy in STRATEGIES:
        link = re.search(rf"\[`{re.escape(strategy)}`\]\((docs/strategies/[\w.-]+\.md)", readme)
        assert link, f"README.md: the strategy table has no row linking `{strategy}` to its page in docs/strategies/"
        assert (REPO / link.group(1)).is_file()


def test_every_docs_page_is_linked_from_the_index():
    index = REPO / "docs" / "README.md"
    reachable = {(index.parent / target.partition("#")[0]).resolve() for target in links(index)}
    orphans = [page_id(p) for p in PAGES if p.parent != REPO and p != index and p.resolve() not in reachable]
    assert not orphans, f"docs/README.md links no page {orphans}: add each to the index"
