"""`shardwise report RUN_DIR [RUN_DIR ...]`: one self-contained HTML page comparing runs.

Everything comes from each run's metrics.jsonl (and config.toml for the strategy of a run that
did not finish). The plots are PNGs drawn with matplotlib's Agg backend and embedded as base64
data URIs, so the page needs no network, no JavaScript and no files beside it. Every plot has a
stable id (the keys of PLOTS), and the summary table's cells a class per column, so tests and
scripts can find them.
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# id -> alt text of every plot the page can hold, in page order
PLOTS = {
    "loss-vs-step": "training and validation loss against step",
    "loss-vs-time": "training and validation loss against training time",
    "throughput": "throughput against step",
    "mfu": "model FLOPs utilisation against step",
    "memory": "memory per rank by category, stacked",
    "reward-accuracy": "a preference objective's reward accuracy against step",
    "pipeline-timeline": "pipeline stages busy and idle during the last step",
}
MEMORY_CATEGORIES = ("params", "grads", "optimizer", "activations")
# A pipeline's computes, by their schedule's kinds (parallel/pipeline/schedules.py): name and colour.
TIMELINE_KINDS = {"F": ("forward", "#4c72b0"), "BW": ("backward", "#dd8452"), "B": ("input gradients", "#c44e52"),
                  "W": ("weight gradients", "#8172b3")}
IDLE_COLOR = "#e5e5e5"


class ReportError(ValueError):
    """A run directory cannot be reported on; the message names it and says why."""


@dataclass
class Run:
    path: Path
    strategy: str
    world_size: int | None
    steps: list[dict[str, Any]]
    evals: list[tuple[int, float]]  # (step, validation loss), the summary's final one included
    summary: dict[str, Any] | None
    label: str = ""
    color: str = ""
    width: float = 1.2  # line width: wider for earlier runs, so a later run drawn on top of one leaves it visible
    seconds_at: dict[int, float] = field(default_factory=dict)  # step -> its and earlier steps' time, summed


def load_run(path: Path) -> Run:
    """Read RUN_DIR/metrics.jsonl; raise ReportError if it is missing, empty or not the trainer's."""
    metrics = path / "metrics.jsonl"
    if not path.is_dir():
        raise ReportError(f"{path}: no such run directory; pass a directory `shardwise train --out` wrote")
    if not metrics.is_file():
        raise ReportError(f"{path}: has no metrics.jsonl; is it a run directory written by `shardwise train`?")
    records = []
    for number, line in enumerate(metrics.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise ReportError(f"{metrics}:{number}: not a JSON record ({error})") from None
    steps = [r for r in records if r.get("event") == "step"]
    if not steps:
        raise ReportError(f"{metrics}: holds no step records (the run stopped before its first step finished); "
                          "train it again or leave it out")
    summary = next((r for r in records if r.get("event") == "summary"), None)
    evals = [(r["step"], r["val_loss"]) for r in records if r.get("event") == "eval"]
    if summary is not None:
        evals.append((summary["steps"], summary["val_loss"]))
        strategy, world_size = summary["strategy"], summary["world_size"]
    else:
        strategy, world_size = _configured(path)
    run = Run(path, strategy, world_size, steps, evals, summary)
    total = 0.0
    for step in steps:
        total += step["step_time_s"]
        run.seconds_at[step["step"]] = total
    return run


def _configured(path: Path) -> tuple[str, int | None]:
    """The strategy and world size config.toml asked for, for a run with no summary."""
    config = path / "config.toml"
    if not config.is_file():
        return "unknown strategy", None
    cfg = tomllib.loads(config.read_text())
    launch = cfg.get("launch", {})
    return cfg.get("parallel", {}).get("strategy", "single"), launch.get("nproc", 1) * launch.get("nnodes", 1)


def label_runs(runs: list[Run]) -> None:
    """`name (strategy on N ranks)`: the directory's name, or its path from the runs' common
    folder where two runs share a name."""
    names = [run.path.name for run in runs]
    if len(set(names)) < len(names):
        common = os.path.commonpath([run.path.resolve() for run in runs])
        names = [os.path.relpath(run.path.resolve(), common) for run in runs]
    for run, name in zip(runs, names, strict=True):
        ranks = f" on {run.world_size} rank{'s' if run.world_size != 1 else ''}" if run.world_size else ""
        run.label = f"{name} ({run.strategy}{ranks})"


# --- the summary table -------------------------------------------------------------------------


def summary_row(run: Run) -> dict[str, Any]:
    """The table's numbers for a run: the summary record's where the run finished; otherwise the
    same quantities from its step records (median over steps after the first, as the trainer)."""
    if run.summary is not None:
        s = run.summary
        final_loss, median = s["final_loss"], s["median_step_time_s"]
        val_step, val_loss = s["steps"], s["val_loss"]
        tokens, samples, mfu = s["tokens_per_s"], s["samples_per_s"], s["mfu"]
    else:
        timed = sorted(run.steps[1:] or run.steps, key=lambda r: r["step_time_s"])
        middle = timed[len(timed) // 2]
        final_loss, median = run.steps[-1]["loss"], middle["step_time_s"]
        val_step, val_loss = run.evals[-1] if run.evals else (None, None)
        tokens, samples, mfu = middle["tokens_per_s"], middle["samples_per_s"], middle["mfu"]
    peaks = [memory["peak"] for memory in run.steps[-1]["memory_by_rank"]]
    return {"run": run.label, "steps": run.steps[-1]["step"], "final_loss": final_loss, "val_loss": val_loss,
            "val_step": val_step, "median_step_time_ms": median * 1000, "tokens_per_s": tokens,
            "samples_per_s": samples, "mfu": mfu, "peak_mib_by_rank": [peak / 2**20 for peak in peaks],
            "finished": run.summary is not None}


def _number(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def summary_table(runs: list[Run]) -> str:
    head = ("run", "steps", "final train loss", "validation loss", "median step time (ms)", "throughput", "MFU",
            "peak memory per rank (MiB)")
    rows = []
    for run in runs:
        row = summary_row(run)
        throughput = (f"{_number(row['tokens_per_s'], 0)} tokens/s" if row["tokens_per_s"] is not None
                      else f"{_number(row['samples_per_s'], 0)} samples/s")
        mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "not known"
        peaks = ", ".join(f"r{rank}: {_number(peak, 1)}" for rank, peak in enumerate(row["peak_mib_by_rank"]))
        steps = f"{row['steps']}" + ("" if row["finished"] else " (unfinished: no summary)")
        val_loss = _number(row["val_loss"], 4)
        if row["val_step"] is not None and row["val_step"] != row["steps"]:  # an unfinished run's last evaluation
            val_loss += f" (step {row['val_step']})"
        cells = [("run", row["run"]), ("steps", steps), ("final_loss", _number(row["final_loss"], 4)),
                 ("val_loss", val_loss),
                 ("median_step_time_ms", _number(row["median_step_time_ms"], 1)), ("throughput", throughput),
                 ("mfu", mfu), ("peak_memory", peaks)]
        rows.append("<tr>" + "".join(f'<td class="{name}">{html.escape(text)}</td>' for name, text in cells) + "</tr>")
    header = "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"
    return f'<table id="summary">\n<thead>{header}</thead>\n<tbody>\n' + "\n".join(rows) + "\n</tbody>\n</table>"


# --- the plots -----------------------------------------------------------------------------------


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ReportError("shardwise report draws its plots with matplotlib, which is not installed: "
                          "pip install 'shardwise[plot]'") from None
    matplotlib.use("Agg")  # files only: no display needed
    from matplotlib import pyplot

    return pyplot


def _png(figure: Any) -> str:
    """The figure as a base64 PNG, closed."""
    buffer = io.BytesIO()
    figure.tight_layout()
    figure.savefig(buffer, format="png", dpi=100)
    _pyplot().close(figure)
    return base64.b64encode(buffer.getvalue()).decode()


def _loss_plot(runs: list[Run], x_of: Callable[[Run, int], float], xlabel: str, title: str) -> Any:
    """Training loss (line) and validation loss (dashed, circles) of every run against x_of(run, step)."""
    figure, axes = _pyplot().subplots(figsize=(8, 4.5))
    for run in runs:
        axes.plot([x_of(run, r["step"]) for r in run.steps], [r["loss"] for r in run.steps], color=run.color,
                  linewidth=run.width, label=f"{run.label}: train")
        if run.evals:
            axes.plot([x_of(run, step) for step, _ in run.evals], [loss for _, loss in run.evals], "o--",
                      color=run.color, linewidth=run.width, markersize=2 + 2 * run.width,
                      label=f"{run.label}: validation")
    axes.set_xlim(left=0)
    axes.set_xlabel(xlabel)
    axes.set_ylabel("loss (mean cross-entropy, nats)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    return figure


def _per_step_plot(runs: list[Run], key: str, scale: float, ylabel: str, title: str, ticks: str | None = None) -> Any:
    figure, axes = _pyplot().subplots(figsize=(8, 4.5))
    for run in runs:
        points = [(r["step"], r[key] * scale) for r in run.steps if r.get(key) is not None]
        axes.plot(*zip(*points, strict=True), color=run.color, linewidth=run.width, label=run.label)
    axes.set_xlabel("step")
    axes.set_ylabel(ylabel)
    axes.set_ylim(bottom=0)
    if ticks:
        axes.yaxis.set_major_formatter(ticks)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    return figure


def _unit(largest: float) -> tuple[str, float]:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if largest >= size:
            return unit, size
    return "KiB", 2**10


def _memory_plot(runs: list[Run]) -> Any:
    """One panel per run, one bar per rank: params, grads, optimizer state and activations stacked,
    as the last step record counted them."""
    memories = [run.steps[-1]["memory_by_rank"] for run in runs]
    largest = max(sum(m[c] or 0 for c in MEMORY_CATEGORIES) for ranks in memories for m in ranks)
    unit, size = _unit(largest)
    widths = [max(2, len(ranks)) for ranks in memories]
    pyplot = _pyplot()
    figure, panels = pyplot.subplots(1, len(runs), figsize=(max(8, 1.1 * sum(widths) + 1.5), 4.5), sharey=True,
                                     width_ratios=widths, squeeze=False)
    colors = pyplot.get_cmap("Set2").colors
    for axes, run, ranks in zip(panels[0], runs, memories, strict=True):
        bottom = [0.0] * len(ranks)
        for category, color in zip(MEMORY_CATEGORIES, colors, strict=False):
            heights = [(m[category] or 0) / size for m in ranks]
            axes.bar(range(len(ranks)), heights, bottom=bottom, color=color, width=0.6, label=category)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
        axes.set_xticks(range(len(ranks)), [f"rank {r}" for r in range(len(ranks))])
        axes.set_xlim(-0.75, max(1, len(ranks)) - 0.25)
        axes.set_title(run.label, fontsize=9)
        axes.grid(axis="y", alpha=0.3)
    panels[0][0].set_ylabel(f"bytes held at the last step ({unit})")
    panels[0][-1].legend(fontsize=8, loc="upper right")
    figure.suptitle("Memory per rank by category")
    return figure


def _timeline_plot(runs: list[Run]) -> Any:
    """One panel per pipeline run: each pp rank of replica 0 (tp rank 0) over the last step's
    forward_backward, its forwards and backwards (or input and weight gradients) drawn where they
    computed, labelled with their micro-batch (primed on a rank's second stage), the rest idle."""
    pyplot = _pyplot()
    figure, panels = pyplot.subplots(len(runs), 1, figsize=(8, 0.6 + sum(1.6 + 0.45 * _stages(r) for r in runs)),
                                     squeeze=False, height_ratios=[1 + _stages(r) for r in runs])
    for axes, run in zip(panels[:, 0], runs, strict=True):
        ranks = sorted((r for r in run.summary["stage_timeline"] if r["replica"] == 0 and r["tp_rank"] == 0),
                       key=lambda r: r["stage"])
        end = max(r["window"][1] for r in run.summary["stage_timeline"])
        for row, rank in enumerate(ranks):
            axes.broken_barh([(0, end * 1000)], (row - 0.4, 0.8), color=IDLE_COLOR)
            busy = 0.0
            for kind, (_, color) in TIMELINE_KINDS.items():
                spans = [(start * 1000, (stop - start) * 1000) for k, _, _, start, stop in rank["intervals"]
                         if k == kind]
                axes.broken_barh(spans, (row - 0.4, 0.8), facecolor=color, edgecolor="white", linewidth=0.5)
                busy += sum(width for _, width in spans)
            for kind, i, stage, start, stop in rank["intervals"]:
                if stop - start > 0.025 * end:  # name the micro-batch where the bar has room for it
                    second = "'" if rank["stages"].index(stage) else ""
                    axes.text((start + stop) * 500, row, f"{kind}{i}{second}", ha="center", va="center",
                              fontsize=7, color="white")
            axes.text(end * 1000 * 1.01, row, f"busy {busy / (end * 1000):.0%}", va="center", fontsize=8)
        axes.set_yticks(range(len(ranks)), [f"stage{'s' if len(r['stages']) > 1 else ''} "
                                            f"{', '.join(map(str, r['stages']))} (rank {r['rank']})" for r in ranks])
        axes.invert_yaxis()
        axes.set_xlim(0, end * 1000 * 1.12)
        axes.set_xlabel(f"time since the first stage began step {run.summary['steps']} (ms)")
        replicas = "" if len(ranks) == len(run.summary["stage_timeline"]) else ", replica 0"
        axes.set_title(f"{run.label}{replicas}", fontsize=9)
    shown = [kind for kind in TIMELINE_KINDS
             if any(iv[0] == kind for run in runs for r in run.summary["stage_timeline"] for iv in r["intervals"])]
    handles = [pyplot.Rectangle((0, 0), 1, 1, color=c) for c in (*(TIMELINE_KINDS[k][1] for k in shown), IDLE_COLOR)]
    panels[0, 0].legend(handles, [*(TIMELINE_KINDS[k][0] for k in shown), "idle (waiting)"], fontsize=8, ncols=3,
                        loc="lower right", bbox_to_anchor=(1.0, 1.12))
    figure.suptitle("Pipeline stages: computing and idle in the last step")
    return figure


def _stages(run: Run) -> int:
    return sum(1 for r in run.summary["stage_timeline"] if r["replica"] == 0 and r["tp_rank"] == 0)


# --- the page ------------------------------------------------------------------------------------


def _figure(plot_id: str, figure: Any, caption: str) -> str:
    return (f'<figure>\n<img id="{plot_id}" alt="{html.escape(PLOTS[plot_id])}" '
            f'src="data:image/png;base64,{_png(figure)}">\n<figcaption>{caption}</figcaption>\n</figure>')


def _sections(runs: list[Run]) -> list[str]:
    """Each plot's section: heading, image and caption (or a note where there is nothing to draw)."""
    sections = [
        ("Loss against step", _figure("loss-vs-step", _loss_plot(
            runs, lambda run, step: step, "step", "Loss against step"),
            "Training loss of each step's global batch; validation loss on the same fixed batches at every "
            "evaluation, the last one after the final step.")),
        ("Loss against training time", _figure("loss-vs-time", _loss_plot(
            runs, lambda run, step: run.seconds_at[step],
            "training time (s): the sum of step times, evaluation excluded", "Loss against training time"),
            "The same losses against the time spent in training steps, so a faster strategy's curve ends "
            "further left.")),
    ]
    tokens = all(r.get("tokens_per_s") is not None for run in runs for r in run.steps)
    key, unit = ("tokens_per_s", "tokens") if tokens else ("samples_per_s", "samples")
    sections.append(("Throughput", _figure("throughput", _per_step_plot(
        runs, key, 1.0, f"{unit}/s (global batch / step time)", "Throughput per step", ticks="{x:,.0f}"),
        f"{unit.capitalize()} per second of each step, over all ranks. The first step includes warm-up "
        "(allocation, thread pools); the table's throughput is the median over the steps after it.")))
    known = [run for run in runs if any(r.get("mfu") is not None for r in run.steps)]
    unknown = ", ".join(html.escape(run.label) for run in runs if run not in known)
    if known:
        note = f" Not known for {unknown}: its device's peak FLOP/s is not known." if unknown else ""
        sections.append(("Model FLOPs utilisation", _figure("mfu", _per_step_plot(
            known, "mfu", 100.0, "MFU (% of the devices' bf16 dense peak)", "Model FLOPs utilisation per step"),
            "Achieved model FLOP/s over the peak of all devices in the world." + note)))
    else:
        sections.append(("Model FLOPs utilisation", '<p class="not-known" id="mfu-not-known">MFU is not known '
                         "for these runs: not known on CPU (and on GPUs other than H100, H200, A100 and L4), "
                         "since it needs the device's peak FLOP/s.</p>"))
    sections.append(("Memory per rank", _figure("memory", _memory_plot(runs),
                     "Bytes each rank held at the last step, counted from the tensors themselves: parameters, "
                     "gradients and optimizer state (shards, where a strategy shards them), and the most "
                     "activations saved for backward at once. The process's peak (on CPU its resident set, "
                     "runtime included) is in the table.")))
    preferring = [run for run in runs if any(r.get("reward_accuracy") is not None for r in run.steps)]
    if preferring:
        sections.append(("Preference rewards", _figure("reward-accuracy", _per_step_plot(
            preferring, "reward_accuracy", 100.0, "reward accuracy (%)", "Reward accuracy per step"),
            "A preference objective's share of each step's pairs whose chosen answer's reward (beta times "
            "its log-ratio to the reference; SimPO: its mean log-probability) beats the rejected one's. "
            "Rewards and margins are in metrics.jsonl and the table's validation numbers in the summary.")))
    pipelines = [run for run in runs if run.summary is not None and "stage_timeline" in run.summary]
    if pipelines:
        sections.append(("Pipeline stages", _figure("pipeline-timeline", _timeline_plot(pipelines),
                         "Each stage's forward and backward computations during the last step's pipeline "
                         "schedule (all its runs, if it accumulates), on one clock; grey is time the stage "
                         "waited for its neighbours (the bubble) or for communication.")))
    return [f"<section>\n<h2>{html.escape(title)}</h2>\n{body}\n</section>" for title, body in sections]


STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; padding: 0 1em; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; }
th { background: #f3f3f3; }
th:first-child, td.run { text-align: left; }
td.run { font-weight: 600; }
figure { margin: 0.5em 0 1.5em; }
figure img { max-width: 100%; }
figcaption, .runs, .not-known { color: #555; font-size: 0.9em; }
"""


def render(runs: list[Run]) -> str:
    """The whole HTML page for `runs` (loaded with load_run)."""
    label_runs(runs)
    colors = _pyplot().get_cmap("tab10").colors
    for i, run in enumerate(runs):
        run.color = colors[i % len(colors)]
        run.width = 1.2 + 1.6 * (len(runs) - 1 - i) / max(1, len(runs) - 1)
    items = "".join(f"<li>{html.escape(run.label)}: <code>{html.escape(str(run.path))}</code></li>" for run in runs)
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        f"<title>shardwise report: {html.escape(', '.join(run.path.name for run in runs))}</title>",
        f"<style>{STYLE}</style>", "</head>", "<body>", "<h1>shardwise report</h1>",
        f'<ul class="runs">{items}</ul>', "<h2>Summary</h2>", summary_table(runs),
        '<p class="runs">Median step time and throughput: over the steps after the first. Peak memory: the '
        "process's peak (on CPU its resident set, including the Python and torch runtime).</p>",
        *_sections(runs), "</body>", "</html>", ""])


def default_out(run_dirs: list[Path]) -> Path:
    """report.html beside the first run directory (runs/a and runs/b -> runs/report.html)."""
    return run_dirs[0].resolve().parent / "report.html"


def write_report(run_dirs: list[Path], out: Path | None = None) -> Path:
    """Load every run, render the page and write it to `out` (default: default_out); return the path."""
    runs = [load_run(path) for path in run_dirs]
    out = out or default_out(run_dirs)
    page = render(runs)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    return out
