"""`shardwise plan --plot FILE.png`: predicted step time against per-rank memory, one point per
candidate, the device's memory as a line, the Pareto front (no other candidate both faster and
smaller) marked. matplotlib is imported only here, only when asked for (the `plot` extra)."""

from __future__ import annotations

from pathlib import Path

from shardwise.planner.model import PlanError
from shardwise.planner.search import Evaluated, GiB, Plan


def pareto_front(evaluated: list[Evaluated]) -> list[Evaluated]:
    """The candidates no other beats on both step time and memory, fastest first."""
    front: list[Evaluated] = []
    for e in sorted(evaluated, key=lambda e: (e.step.total, e.memory.total)):
        if not front or e.memory.total < front[-1].memory.total:
            front.append(e)
    return front


def write_plot(plan: Plan, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise PlanError("--plot needs matplotlib: pip install 'shardwise[plot]'") from None
    matplotlib.use("Agg")  # files only: no display needed
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(9, 6))
    strategies = sorted({e.candidate.strategy for e in plan.ranked})
    for strategy in strategies:
        points = [e for e in plan.ranked if e.candidate.strategy == strategy]
        axes.scatter([e.memory.total / GiB for e in points], [e.step.total for e in points], s=14, alpha=0.6,
                     label=strategy)
    front = pareto_front(plan.ranked)
    axes.plot([e.memory.total / GiB for e in front], [e.step.total for e in front], "k--", linewidth=1,
              label="Pareto front")
    axes.axvline(plan.memory_limit / GiB, color="red", linewidth=1.5, label="memory per rank")
    if plan.recommended is not None:
        axes.scatter([plan.recommended.memory.total / GiB], [plan.recommended.step.total], s=120,
                     facecolors="none", edgecolors="black", label="recommended")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("predicted memory per rank (GiB)")
    axes.set_ylabel("predicted step time (s)")
    axes.set_title(f"{plan.params_total / 1e9:.3g}B parameters on {plan.world_size} x {plan.device.name}")
    axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
