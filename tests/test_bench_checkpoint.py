"""The checkpoint bench's measuring functions, on gpt tiny under fsdp on 2 ranks: the bytes they
count are the bytes on disk, and the async save they time writes the state it was given."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from distributed import run_ranks
from helpers import CONFIGS

from bench.checkpoint import (
    async_save_timings,
    files_bytes,
    phases_timed,
    plain_write,
    rank_share,
    timed_together,
)
from shardwise import checkpoint
from shardwise.checkpoint import checkpoint_dir, save_checkpoint, training_state
from shardwise.checkpoint_async import AsyncCheckpointer, HostStager
from shardwise.config.load import load_config
from shardwise.dist import DistContext
from shardwise.memory import local_tensor
from shardwise.trainer import Trainer


def measure_tiny(ctx: DistContext, root: Path) -> dict:
    cfg = load_config(CONFIGS / "gpt-tiny.toml", [f"run.out={root / 'run'}", "parallel.strategy=fsdp",
                                                  "launch.nproc=2", "train.global_batch=8", "train.micro_batch=4",
                                                  "data.name=synthetic-tokens"])
    trainer = Trainer(cfg, ctx)
    step = trainer.run_step
    step(0)  # the optimizer's state exists from the first step on
    phases: dict[str, float] = {}
    with phases_timed(phases, dcp=(dcp, "save"), checksums=(checkpoint, "_checksums")):
        seconds, saved = timed_together(ctx, lambda: save_checkpoint(trainer, 1, keep=1))
    plain = root / f"plain-{ctx.rank}.bin"
    plain_write(plain, 2 * (8 << 20) + 123)  # more than one block, and a partial one

    live = training_state(trainer, 2)["model"]
    stager = HostStager()
    staged = stager.stage({"model": live}).result()["model"]
    shares_storage = any(local_tensor(staged[k]).untyped_storage().data_ptr()
                         == local_tensor(t).untyped_storage().data_ptr() for k, t in live.items())
    checkpointer = AsyncCheckpointer(keep=1, is_main=ctx.is_main)
    trainer.checkpointer = checkpointer  # as the bench does: the step's optimizer waits for the copy
    before = {key: local_tensor(t).clone() for key, t in live.items()}
    run = copy.copy(trainer)
    run.out = root / "async"
    timings = async_save_timings(ctx, run, checkpointer, 1, lambda: step(1))
    # The step changed the live weights; the checkpoint must hold those from before it.
    state = stager.stage(training_state(trainer, 2)).result()
    stager.thread.shutdown()
    dcp.load(state, checkpoint_id=checkpoint_dir(run.out) / "step-00000001")
    dist.destroy_process_group(checkpointer.group)
    return {"seconds": seconds, "saved": saved, "share": rank_share(saved, ctx.rank, 2), "phases": phases,
            "shares_storage": shares_storage,
            "patched_away": dcp.save.__name__ == "save" and checkpoint._checksums.__name__ == "_checksums",
            "plain": plain.stat().st_size, "timings": timings,
            "async_matches": all(torch.equal(local_tensor(state["model"][k]), v) for k, v in before.items()),
            "step_changed": any(not torch.equal(local_tensor(t), before[k])
                                for k, t in training_state(trainer, 2)["model"].items())}


def test_checkpoint_bench_counts_the_bytes_on_disk_and_async_saves_the_state_it_was_given(tmp_path):
    ranks = run_ranks(measure_tiny, 2, tmp_path)
    saved = ranks[0]["saved"]
    assert all(r["share"] > 0 for r in ranks)
    assert sum(r["share"] for r in ranks) == files_bytes(saved) == sum(
        f.stat().st_size for f in saved.iterdir())  # a flat directory: every file counted once
    assert all(r["plain"] == 2 * (8 << 20) + 123 for r in ranks)
    assert ranks[0]["seconds"] > ranks[0]["phases"]["dcp"] > 0 and ranks[0]["phases"]["checksums"] > 0
    assert "checksums" not in ranks[1]["phases"]  # rank 0 alone hashes the files
    assert all(r["patched_away"] for r in ranks)  # the originals are back after the timing
    for r in ranks:
        t = r["timings"]
        assert 0 < t["stall_s"] <= t["done_s"] and t["step_during_write_s"] > 0
        assert not r["shares_storage"]  # staged: a copy, which training can no longer change
        assert r["step_changed"] and r["async_matches"]
