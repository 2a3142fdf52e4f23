"""A plan as a terminal table and as JSON (the schema docs/planner.md documents; scripts read it, so
its names stay put)."""

from __future__ import annotations

from typing import Any

from shardwise.planner.candidates import Candidate
from shardwise.planner.search import Evaluated, GiB, Plan


def candidate_record(evaluated: Evaluated, rank: int | None) -> dict[str, Any]:
    c = evaluated.candidate
    record: dict[str, Any] = {
        "rank": rank,
        **c.as_dict(),
        "fits": evaluated.fits,
        "over_by_bytes": evaluated.over_by,
        "memory": evaluated.memory.as_dict(),
        "step_time_s": evaluated.step.total,
        "step_time": evaluated.step.as_dict(),
    }
    if len(evaluated.memory_by_stage) > 1:
        record["memory_by_stage"] = [stage.as_dict() for stage in evaluated.memory_by_stage]
    return record


def plan_json(plan: Plan) -> dict[str, Any]:
    m = plan.cfg.model
    fitting = sum(e.fits for e in plan.ranked)
    records = [candidate_record(e, i + 1 if e.fits else None) for i, e in enumerate(plan.ranked)]
    return {
        "model": {"name": m.name, "params_total": plan.params_total, "n_layer": m.n_layer, "n_head": m.n_head,
                  "d_model": m.d_model, "seq_len": m.seq_len, "vocab_size": m.vocab_size},
        "world_size": plan.world_size,
        "nodes": plan.nodes,
        "gpus_per_node": plan.gpus_per_node,
        "device": plan.device.to_dict(),
        "memory_limit_bytes": plan.memory_limit,
        "margin": plan.margin,
        "global_batch": plan.cfg.train.global_batch,
        "candidates": records,
        "fitting": fitting,
        "refused": plan.refused,
        "recommended": records[0] if plan.recommended is not None else None,
        "reason": plan.reason,
        "max_batch": plan.max_batch,
    }


def _mesh(e: Evaluated) -> str:
    c = e.candidate
    mesh = f"{c.dp}x{c.pp}x{c.tp}"
    return mesh + (f" M{c.micro_batches} {c.schedule}" if c.spec.pipelined else "")


def format_plan(plan: Plan, top: int = 15) -> str:
    """The ranked candidates that fit (the first `top`), the closest that do not, and the pick."""
    fitting = [e for e in plan.ranked if e.fits]
    over = [e for e in plan.ranked if not e.fits]
    lines = [
        f"{plan.cfg.model.name}: {plan.params_total:,} parameters; {plan.world_size} ranks "
        f"({plan.nodes} node(s) x {plan.gpus_per_node}) of {plan.device.name}; "
        f"{plan.memory_limit / GiB:.2f} GiB per rank, margin {plan.margin:.0%}; global batch "
        f"{plan.cfg.train.global_batch}",
        f"{len(plan.ranked)} candidates: {len(fitting)} fit, {len(over)} do not",
        "",
        f"{'#':>4}  {'strategy':<14} {'dp x pp x tp':<18} {'precision':<10} {'recompute':<9} {'mb':>4}  "
        f"{'GiB/rank':>9} {'step s':>9}  {'fits'}",
    ]

    def row(rank: str, e: Evaluated) -> str:
        c = e.candidate
        fits = "yes" if e.fits else f"no, {e.over_by / GiB:.2f} GiB over"
        return (f"{rank:>4}  {c.strategy:<14} {_mesh(e):<18} {c.precision:<10} {c.recompute:<9} {c.micro_batch:>4}  "
                f"{e.memory.total / GiB:>9.3f} {e.step.total:>9.4g}  {fits}")

    lines += [row(str(i + 1), e) for i, e in enumerate(fitting[:top])]
    if len(fitting) > top:
        lines.append(f"{'':>4}  ... {len(fitting) - top} more that fit (--top N, or --json)")
    lines += [row("-", e) for e in over[:3]]
    if plan.recommended is not None:
        lines += ["", f"recommended: {plan.recommended.candidate.label}", f"  because: {plan.reason}"]
    else:
        lines += ["", f"no recommendation: {plan.reason}"]
    if plan.max_batch:
        lines += ["", "largest micro-batch that fits, per strategy (best precision and recompute):"]
        best: dict[tuple, dict[str, Any]] = {}
        for entry in plan.max_batch:
            key = (entry["strategy"], entry["dp"], entry["pp"], entry["tp"])
            if key not in best or entry["max_micro_batch"] > best[key]["max_micro_batch"]:
                best[key] = entry
        for (strategy, dp, pp, tp), entry in sorted(best.items()):
            lines.append(f"  {strategy:<14} {dp}x{pp}x{tp:<12} {entry['max_micro_batch']:>8}  "
                         f"({entry['precision']}, recompute {entry['recompute']})")
    return "\n".join(lines)


def format_measured(measured: list[dict[str, Any]]) -> str:
    """Predicted beside measured for the candidates `--measure` ran, fastest measured first."""
    lines = ["", f"measured on this machine ({len(measured)} candidates, median step):",
             f"  {'candidate':<48} {'predicted s':>11} {'measured s':>11}  {'GiB/rank pred.':>14} {'counted':>8}"]
    for entry in measured:
        label = Candidate(**entry["candidate"]).label
        counted = max(sum(rank[k] for k in ("params", "grads", "optimizer", "activations"))
                      for rank in entry["memory_by_rank"])
        lines.append(f"  {label:<48} {entry['predicted_step_s']:>11.4g} {entry['measured_step_s']:>11.4g}  "
                     f"{entry['predicted_memory']['total'] / GiB:>14.3f} {counted / GiB:>8.3f}")
    best = Candidate(**measured[0]["candidate"])
    lines.append(f"recommended from measurement: {best.label} ({measured[0]['measured_step_s']:.4g} s a step)")
    return "\n".join(lines)
