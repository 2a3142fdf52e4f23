"""Asynchronous checkpoints (checkpoint_async.py): training goes on while a save is written,
`latest` moves only once it is whole, the copy is counted, and a save that fails in the background
stops every rank at the same step with its cause. (Every resume test of test_checkpoint.py saves
asynchronously too: train.checkpoint_async is on by default.)"""

from __future__ import annotations

import threading
from pathlib import Path
from unittest.mock import patch

import pytest
from distributed import run_ranks
from helpers import CONFIGS, gpt_tiny, in_process, losses, read_records
from safetensors.torch import load_file

from shardwise import checkpoint_async
from shardwise.checkpoint import CheckpointError, checkpoint_dir
from shardwise.cli import main
from shardwise.dist import DistContext
from shardwise.planner.candidates import Candidate
from shardwise.planner.memory_model import predict_memory
from shardwise.trainer import Trainer


def cfg_for(out: Path, world: int = 1, *overrides: str):
    return gpt_tiny(out, "single" if world == 1 else "ddp", world, "train.micro_batch=4", "train.checkpoint_every=2",
                    "train.keep_checkpoints=1", *overrides, steps=6)


def _held_save(ctx: DistContext, out: Path) -> dict:
    """6 steps saving every 2, the save after step 4 held back until step 6 has run: what `latest`
    named, what was in flight and what step 5 recorded meanwhile."""
    release, seen = threading.Event(), {}
    real_seal = checkpoint_async.seal

    def held_seal(tmp: Path, final: Path, manifest: dict, keep: int) -> None:
        if final.name == "step-00000004":
            release.wait(60)
        real_seal(tmp, final, manifest, keep)

    trainer = Trainer(cfg_for(out), ctx)
    train_step = trainer.train_step

    def observed(step: int):
        if step == 5:  # the sixth step: the save after the fourth is still being written
            seen["latest"] = (checkpoint_dir(out) / "latest").read_text()
            seen["in_flight"] = trainer.checkpointer.in_flight.step
            release.set()
        return train_step(step)

    trainer.train_step = observed
    with patch.object(checkpoint_async, "seal", held_seal):
        trainer.fit()
    seen["params"] = sum(p.nbytes for p in trainer.model.parameters())
    seen["tensors"] = len(list(trainer.model.parameters()))
    return seen


def test_latest_moves_only_once_a_save_is_whole_while_training_goes_on(tmp_path):
    seen = in_process(_held_save, tmp_path)
    assert seen["latest"] == "step-00000002" and seen["in_flight"] == 4
    root = checkpoint_dir(tmp_path)
    assert (root / "latest").read_text() == "step-00000006"  # the run's end waited for its last save
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000006"]  # keep_checkpoints = 1
    staging = [r["memory"]["staging"] for r in read_records(tmp_path)]
    assert staging[:2] == [None, None] and len(set(staging[2:])) == 1  # held from the first save on, reused
    # The copy: the model and AdamW's state (two moments and a float32 step count a tensor), as the
    # planner predicts it, and the run's step and this rank's RNG state (5,056 bytes), which it leaves out.
    predicted = predict_memory(Candidate("single", 1, 1, 1, "fp32", "none", 4), cfg_for(tmp_path))[0].staging
    assert predicted == 3 * seen["params"] + 4 * seen["tensors"]
    assert predicted < staging[2] <= predicted + 5_056 + 8


def _held_copy(ctx: DistContext, out: Path) -> tuple[list, dict, dict]:
    """6 steps saving every 2, the staging thread's copy for the save after step 2 held until the
    third step's forward and backward have run: the order of what happened, the parameters when
    the save was asked for, and the checkpoint's."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from shardwise import trainer as trainer_module

    events, release, at_save = [], threading.Event(), {}
    real_copy, real_step = checkpoint_async.HostStager._copy, trainer_module.optimizer_step

    def held_copy(*args: object) -> dict:
        if not at_save.get("copied"):
            release.wait(60)
            at_save["copied"] = True
        staged = real_copy(*args)
        events.append("copied")
        return staged

    def logged_step(*args: object) -> bool:
        events.append(("optimizer step", trainer.step))
        return real_step(*args)

    trainer = Trainer(cfg_for(out, 1, "train.keep_checkpoints=3"), ctx)
    forward_backward, save = trainer.forward_backward, trainer.save_checkpoint

    def logged_forward_backward(step: int):
        loss = forward_backward(step)
        events.append(("forward and backward", step))
        if step == 2:
            release.set()
        return loss

    def saved(step: int, now: bool = False) -> None:
        if step == 2:
            at_save.update({name: p.detach().clone() for name, p in trainer.strategy.view.named_parameters()})
        save(step, now)

    trainer.forward_backward, trainer.save_checkpoint = logged_forward_backward, saved
    with patch.object(checkpoint_async.HostStager, "_copy", staticmethod(held_copy)), \
            patch.object(trainer_module, "optimizer_step", logged_step):
        trainer.fit()
    dcp_to_torch_save(checkpoint_dir(out) / "step-00000002", out / "step-2.pt")
    return events, at_save, torch.load(out / "step-2.pt")["model"]


def test_the_copy_runs_beside_the_next_forward_and_backward_and_the_optimizer_step_waits_for_it(tmp_path):
    events, at_save, saved = in_process(_held_copy, tmp_path)
    # the save after step 2 returned, the third step's forward and backward ran, then the copy ended,
    # and only then did that step's optimizer change what was being copied
    assert events[4:8] == [("forward and backward", 2), "copied", ("optimizer step", 2), ("forward and backward", 3)]
    names = [name for name in at_save if name != "copied"]
    assert names and all(saved[name].equal(at_save[name]) for name in names)  # the state at the save, exactly
    # and saving changed nothing of the training: the losses and final weights of a run without checkpoints
    in_process(lambda ctx: Trainer(cfg_for(tmp_path / "unsaved", 1, "train.checkpoint_every=0"), ctx).fit())
    assert losses(tmp_path) == losses(tmp_path / "unsaved")
    weights, unsaved = (load_file(str(run / "model.safetensors")) for run in (tmp_path, tmp_path / "unsaved"))
    assert weights.keys() == unsaved.keys() and all(weights[k].equal(unsaved[k]) for k in weights)


def _failing_save(ctx: DistContext, out: Path) -> tuple[str, int]:
    """ddp saving every 2 steps, rank 0's disk full as it seals: the error each rank raised, and at
    which step."""
    def full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    trainer = Trainer(cfg_for(out, ctx.world_size), ctx)
    with patch.object(checkpoint_async, "seal", full), pytest.raises(CheckpointError) as raised:
        trainer.fit()
    return str(raised.value), trainer.step


def test_a_save_that_fails_in_the_background_stops_every_rank_at_one_step_with_its_cause(tmp_path):
    (message, step), other = run_ranks(_failing_save, 2, tmp_path)
    assert other == (message, step) and step in (2, 3)  # at the next step's poll, or the next save's wait
    assert message.startswith("in the background after step 2: could not save checkpoint step-00000002 in ")
    assert message.endswith("[Errno 28] No space left on device; there is no earlier one")
    root = checkpoint_dir(tmp_path)
    assert not (root / "latest").exists() and not list(root.glob("*step-*"))  # the unfinished save removed


def test_a_run_or_checkpoint_directory_that_cannot_be_written_is_refused_before_launch(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["train", str(CONFIGS / "gpt-tiny.toml"), "--out", str(blocker / "run")]) == 2
    assert f"run.out '{blocker / 'run'}' cannot be made: {blocker} is a file" in capsys.readouterr().err
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("")
    assert main(["train", str(CONFIGS / "gpt-tiny.toml"), "--out", str(tmp_path / "run"),
                 "--checkpoint-every", "5"]) == 2
    assert (f"train.checkpoint_every = 5: its directory '{tmp_path / 'run' / 'checkpoints'}' cannot be made: "
            f"{tmp_path / 'run' / 'checkpoints'} is a file") in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["checkpoints"]  # nothing written


def test_a_metrics_line_torn_by_a_kill_leaves_the_records_before_it_to_a_resumed_run(tmp_path):
    from shardwise.metrics import MetricsWriter

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"event": "step", "step": 1}\n{"event": "step", "step": 2}\n{"event": "st')
    MetricsWriter(path, enabled=True, resumed_at=5).close()
    assert path.read_text() == '{"event": "step", "step": 1}\n{"event": "step", "step": 2}\n'


def test_sealing_never_removes_a_complete_checkpoint_in_place(tmp_path):
    """What bench crash found a kill could hit: a complete checkpoint saved again (renamed into place
    by a run killed before `latest` moved, then re-saved by its resumed run) was deleted before the
    new copy replaced it, and rotation deleted old ones under their own names. Now the complete one
    is kept, and whatever is deleted is first renamed out of the step-* names."""
    from shardwise.checkpoint import LATEST, REMOVING, problem_with, seal

    root = tmp_path / "checkpoints"
    root.mkdir()

    def save(step: int, payload: str) -> Path:
        tmp = root / f".tmp-step-{step:08d}"
        tmp.mkdir()
        (tmp / "shard.bin").write_text(payload)
        seal(tmp, root / f"step-{step:08d}", {"step": step}, keep=2)
        return root / f"step-{step:08d}"

    first = save(5, "first")
    (root / LATEST).write_text("step-00000000")  # as if killed after the rename, before `latest` moved
    again = save(5, "again")
    assert again == first and (first / "shard.bin").read_text() == "first" and problem_with(first) is None
    assert (root / LATEST).read_text() == first.name
    (first / "manifest.json").unlink()  # incomplete now: a save of step 5 replaces it
    assert (save(5, "third") / "shard.bin").read_text() == "third"
    (root / f"{REMOVING}step-00000001").mkdir()  # a deletion a kill cut short
    save(10, "ten")
    save(15, "fifteen")
    assert sorted(p.name for p in root.iterdir()) == [LATEST, "step-00000010", "step-00000015"]
