"""A plan as a terminal table and as JSON (the schema docs/planner.md documents; scripts read it, so
its names stay put)."""

from __future__ import annotations

from typing import Any

from shardwise.config.schema import Config
from shardwise.planner.candidates import Candidate
from shardwise.planner.search import CLOSEST, Evaluated, GiB, Plan
from shardwise.planner.timing import expert_exchange_bytes


def candidate_record(evaluated: Evaluated, rank: int | None, cfg: Config) -> dict[str, Any]:
    c = evaluated.candidate
    record: dict[str, Any] = {
        "rank": rank,
        **c.as_dict(),
        "fits": evaluated.fits,
        "over_by_bytes": evaluated.over_by,
        "memory": evaluated.memory.as_dict(),
        "step_time_s": evaluated.step.total,
        "step_time": evaluated.step.as_dict(),
        "same_as": list(evaluated.twins),
    }
    if c.ep > 1:
        record["all_to_all_bytes"] = expert_exchange_bytes(c, cfg)  # one rank's, per step
    if len(evaluated.memory_by_stage) > 1:
        record["memory_by_stage"] = [stage.as_dict() for stage in evaluated.memory_by_stage]
    return record


def plan_json(plan: Plan) -> dict[str, Any]:
    m = plan.cfg.model
    fitting = sum(e.fits for e in plan.ranked)
    records = [candidate_record(e, i + 1 if e.fits else None, plan.cfg) for i, e in enumerate(plan.ranked)]
    return {
        "model": {"name": m.name, "params_total": plan.params_total, "params_active": plan.params_active,
                  "n_layer": m.n_layer, "n_head": m.n_head,
                  "n_kv_head": m.n_kv_head, "d_model": m.d_model, "d_ff": m.d_ff, "seq_len": m.seq_len,
                  "vocab_size": m.vocab_size, "hf_config": m.hf_config},
        "world_size": plan.world_size,
        "nodes": plan.nodes,
        "gpus_per_node": plan.gpus_per_node,
        "device": plan.device.to_dict(),
        "memory_limit_bytes": plan.memory_limit,
        "margin": plan.margin,
        "global_batch": plan.cfg.train.global_batch,
        "considered": plan.candidates,
        "pruned": plan.pruned,
        "candidates": records,
        "fitting": fitting,
        "refused": plan.refused,
        "recommended": records[0] if plan.recommended is not None else None,
        "reason": plan.reason,
        "max_batch": plan.max_batch,
    }


def _mesh(e: Evaluated) -> str:
    c = e.candidate
    mesh = f"{c.dp}x{c.pp}x{c.tp}" + (f" cp{c.cp} {c.cp_mode}" if c.cp > 1 else "") + (f" ep{c.ep}" if c.ep > 1 else "")
    return mesh + (f" M{c.micro_batches} {c.schedule}" if c.schedule else "")


PRUNED = {  # why candidates were not costed, as the table says it
    "dominated": "gpipe no better than the same under 1f1b",
    "cannot_fit": "over the limit before their activations",
    "slower": "slower than the {top} fastest that fit",
}


def _precisions(e: Evaluated) -> str:
    """`bf16-mixed`, or twins predicted alike as one: `bf16/fp16-mixed`."""
    names = e.precisions
    suffixes = {name.partition("-")[2] for name in names}
    if len(names) > 1 and len(suffixes) == 1 and "" not in suffixes:
        return "/".join(name.partition("-")[0] for name in names) + "-" + suffixes.pop()
    return "/".join(names)


def _considered(plan: Plan, top: int) -> str:
    costed = len(plan.ranked)
    line = f"{plan.candidates} candidates: {costed} costed, {len(plan.fitting)} of them fit"
    reasons = [f"{count} {PRUNED[why].format(top=top)}" for why, count in plan.pruned.items() if count]
    if reasons:
        line += "; not costed: " + ", ".join(reasons)
    twins = plan.candidates - costed - sum(plan.pruned.values())
    if twins:
        line += f"; {twins} predicted alike with a costed one (one row names both)"
    return line


def _refused(plan: Plan) -> list[str]:
    """One line on the meshes the trainer refuses, if any (every reason is in the JSON)."""
    if not plan.refused:
        return []
    strategies = ", ".join(dict.fromkeys(mesh.split()[0] for mesh in plan.refused))
    first = next(iter(plan.refused.values()))
    meshes = f"{len(plan.refused)} mesh" + ("es" if len(plan.refused) > 1 else "")
    return [f"refused by the trainer: {meshes} of {strategies}; the first because {first}"]


def _active(plan: Plan) -> str:
    """For a Mixture-of-Experts model, the parameters a token computes with."""
    return f" ({plan.params_active:,} active per token)" if plan.params_active != plan.params_total else ""


def format_plan(plan: Plan, top: int = 15) -> str:
    """The ranked candidates that fit (the first `top`), those over the limit but faster than the
    pick (closest first), and the pick."""
    fitting = plan.fitting
    width = max([10, *(len(_precisions(e)) for e in plan.ranked)])
    mesh = max([18, *(len(_mesh(e)) + 1 for e in plan.ranked)])
    lines = [
        f"{plan.cfg.model.name}: {plan.params_total:,} parameters{_active(plan)}; {plan.world_size} ranks "
        f"({plan.nodes} node(s) x {plan.gpus_per_node}) of {plan.device.name}; "
        f"{plan.memory_limit / GiB:.2f} GiB per rank, margin {plan.margin:.0%}; global batch "
        f"{plan.cfg.train.global_batch}",
        _considered(plan, top),
        *_refused(plan),
        "",
        f"{'#':>4}  {'strategy':<14} {'dp x pp x tp':<{mesh}} {'precision':<{width}} {'recompute':<9} {'mb':>4}  "
        f"{'GiB/rank':>9} {'step s':>9}  {'fits'}",
    ]

    def row(rank: str, e: Evaluated) -> str:
        c = e.candidate
        fits = "yes" if e.fits else f"no, {e.over_by / GiB:.2f} GiB over"
        return (f"{rank:>4}  {c.strategy:<14} {_mesh(e):<{mesh}} {_precisions(e):<{width}} {c.recompute:<9} "
                f"{c.micro_batch:>4}  {e.memory.total / GiB:>9.3f} {e.step.total:>9.4g}  {fits}")

    lines += [row(str(i + 1), e) for i, e in enumerate(fitting[:top])]
    if len(fitting) > top:
        lines.append(f"{'':>4}  ... {len(fitting) - top} more that fit (--top N, or --json)")
    lines += [row("-", e) for e in plan.shown_over[:CLOSEST]]
    if plan.recommended is not None:
        best = plan.recommended
        twins = f" ({', '.join(best.twins)} predicted alike)" if best.twins else ""
        lines += ["", f"recommended: {best.candidate.label}{twins}", f"  because: {plan.reason}"]
    else:
        lines += ["", f"no recommendation: {plan.reason}"]
    if plan.max_batch:
        lines += ["", "largest micro-batch that fits, per strategy (best precision and recompute):"]
        best_batch: dict[tuple, dict[str, Any]] = {}
        for entry in plan.max_batch:
            cp = f" cp{entry['cp']} {entry['cp_mode']}" if entry["cp"] > 1 else ""
            cp += f" ep{entry['ep']}" if entry["ep"] > 1 else ""
            key = (entry["strategy"], f"{entry['dp']}x{entry['pp']}x{entry['tp']}{cp}")
            if key not in best_batch or entry["max_micro_batch"] > best_batch[key]["max_micro_batch"]:
                best_batch[key] = entry
        for (strategy, mesh), entry in sorted(best_batch.items()):
            lines.append(f"  {strategy:<14} {mesh:<20} {entry['max_micro_batch']:>8}  "
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
