"""`shardwise bench checkpoint-scale`: how long an asynchronous save stalls training at scale, on
the scale run's 1.2B GPT (bench/scale.py: width 1792, one 64-token sequence per rank, SGD) under
`fsdp` on 4 ranks, in bf16 (`parallel.precision = "bf16-true"`).

Each round, as bench/checkpoint.py measures them on gpt small: our synchronous save
(`save_checkpoint`: DCP write, checksums, fsync, rename, `latest`), then a training step alone, then
the trainer's asynchronous save (`train.checkpoint_async`) with the next step taken while it
writes. The stall is until the asynchronous save returned (buffers and the run's small state
copied to host memory) plus the next step's wait before its optimizer step for the copy of the
parameters and optimizer state, made during that step's forward and backward;
sealed, until its manifest was renamed into place and every rank knew. Beside them, the host
memory the staging took on each rank (its buffers, and the resident set's growth over the first
asynchronous save, which allocates them) against the planner's `staging`.

What fits this machine's 24 GiB: the scale run's SGD (momentum 0.9: the checkpoint holds the
weights and the momentum) in bf16, 4 bytes a parameter in all. In fp32 the run peaks at 4.65 GiB
a rank in a step (bench scale's end of run), and the staged copy, 2.3 GiB a rank, is held while
the next step runs beside the write: the kernel killed a rank (measured). The stall and the
synchronous save both grow with the bytes saved, so their ratio is what carries over.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

from bench.checkpoint import Measurements, shared_scratch
from bench.common import BenchArgs, bench_main
from bench.scale import END_SEQ_LEN, END_WIDTH, RANKS, scale_config
from shardwise.dist import DistContext
from shardwise.memory import resident_bytes
from shardwise.planner.candidates import Candidate
from shardwise.planner.memory_model import predict_memory
from shardwise.trainer import Trainer

PRECISION = "bf16-true"  # what fits beside the staged copy (the module's docstring)
GIB = 2**30


def run(ctx: DistContext, args: BenchArgs) -> dict[str, Any] | None:
    """`rounds` rounds (`steps` and `micro_batch` are unused: one sequence per rank, two steps a round).
    The first asynchronous save allocates the host buffers that later ones reuse: each round is kept."""
    rounds = args.rounds
    with shared_scratch(ctx) as scratch:
        cfg = scale_config("fsdp", "sgd", END_WIDTH, ctx.world_size, 2 * rounds + 2, f"model.seq_len={END_SEQ_LEN}",
                           f"parallel.precision={PRECISION}", f"run.out={scratch / 'run'}")
        trainer = Trainer(cfg, ctx)
        started = time.perf_counter()
        trainer.run_step(0)
        first_step_s = time.perf_counter() - started
        bench = Measurements(ctx, trainer, scratch)
        rows = []
        for round_ in range(rounds):
            record: dict[str, float] = {}
            bench.save(record, round_)
            before = resident_bytes()[0]
            timings = bench.async_save(record, 1 + 2 * round_)
            grown = resident_bytes()[0] - before
            rows.append({"save_s": record["save"], "step_alone_s": record["step_alone"], **timings,
                         "staged_bytes": ctx.all_gather_object(bench.checkpointer.staged_bytes),
                         "resident_growth_bytes": ctx.all_gather_object(grown)})
        bench.close()
    if not ctx.is_main:
        return None
    saving = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, checkpoint_every=1, checkpoint_async=True))
    predicted = predict_memory(Candidate("fsdp", ctx.world_size, 1, 1, PRECISION, "none", 1), saving)[0].staging
    return summarize(trainer, rows, predicted, first_step_s)


def summarize(trainer: Trainer, rows: list[dict[str, Any]], predicted: int, first_step_s: float) -> dict[str, Any]:
    med = {key: statistics.median(r[key] for r in rows) for key in ("save_s", "stall_s", "returned_s",
                                                                    "staging_wait_s", "done_s", "step_alone_s",
                                                                    "step_during_write_s")}
    n_params = sum(p.numel() for p in trainer.strategy.module.parameters())
    staged = rows[0]["staged_bytes"]
    return {
        "bench": "checkpoint-scale",
        "model": f"gpt, width {END_WIDTH}, {trainer.cfg.model.n_layer} layers, seq {trainer.cfg.model.seq_len}, "
                 f"{n_params:,} parameters, {PRECISION}, SGD with momentum",
        "strategy": "fsdp",
        "world_size": len(staged),
        "rounds": len(rows),
        "first_step_s": first_step_s,
        **{f"{key}_median": value for key, value in med.items()},
        "ratio_stall_vs_sync_save": med["stall_s"] / med["save_s"],
        "target": "a save blocks training for at most 10% of the synchronous save's time (issue 43)",
        "staging": {
            "staged_gib_per_rank": [round(b / GIB, 3) for b in staged],
            "resident_growth_gib_per_rank": [round(b / GIB, 3) for b in rows[0]["resident_growth_bytes"]],
            "planner_gib_per_rank": round(predicted / GIB, 3),
            "ratio_staged_vs_planner": max(staged) / predicted,
            "note": "staged: the host buffers of this rank's copy (checkpoint_async.py HostStager); resident "
                    "growth: its resident set after the first asynchronous save returned less before it "
                    "(the buffers are allocated then and kept); planner: predict_memory's staging",
        },
        "runs": rows,
    }


def format_result(result: dict[str, Any]) -> str:
    staging = result["staging"]
    return "\n".join([
        f"checkpoint-scale bench: {result['model']}, {result['strategy']} on {result['world_size']} ranks, "
        f"{result['rounds']} round(s), medians",
        f"  synchronous save   {result['save_s_median']:7.2f} s",
        f"  async save stall   {result['stall_s_median']:7.2f} s: {result['ratio_stall_vs_sync_save']:.3f} of the "
        f"synchronous save (target: at most 0.10): returned after {result['returned_s_median']:.2f} s, "
        f"the next step waited {result['staging_wait_s_median']:.2f} s; sealed after {result['done_s_median']:.2f} s",
        f"  a step meanwhile   {result['step_during_write_s_median']:7.2f} s vs {result['step_alone_s_median']:.2f} s "
        "alone",
        f"  staging per rank   {', '.join(f'{g:.3f}' for g in staging['staged_gib_per_rank'])} GiB staged, "
        f"resident set +{', '.join(f'{g:.3f}' for g in staging['resident_growth_gib_per_rank'])} GiB; "
        f"planner {staging['planner_gib_per_rank']:.3f} GiB ({staging['ratio_staged_vs_planner']:.3f}x)",
    ])


if __name__ == "__main__":
    bench_main("checkpoint-scale", run, format_result, ranks=RANKS, rounds=2)
