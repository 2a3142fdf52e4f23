"""Checkpoints: resume bit-identically, reshard across strategies and world sizes, survive
corruption, refuse another model's state and crafted pickles."""

from __future__ import annotations

import json
import pickle
import signal
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from helpers import (
    Crash,
    assert_bit_identical,
    crash_at,
    gpt_tiny,
    in_process,
    losses,
    optimizer_tensors,
    read_records,
)
from safetensors.torch import load_file

from shardwise.checkpoint import CheckpointError, checkpoint_dir, safe_reader
from shardwise.dist import DistContext
from shardwise.trainer import Trainer

STEPS, SAVED_AT, CRASH_AT = 20, 10, 13


def cfg_for(out: Path, strategy: str, world: int, *overrides: str):
    return gpt_tiny(out, strategy, world, "train.micro_batch=4", f"train.checkpoint_every={SAVED_AT}", *overrides,
                    steps=STEPS)


def straight_and_resumed(ctx: DistContext, root: Path, strategy: str, *overrides: str) -> dict:
    """20 steps in one go, and 10 (saved) + a crash at 13 + resume to 20; this rank's optimizer
    state at the end of each."""
    straight = Trainer(cfg_for(root / "straight", strategy, ctx.world_size, *overrides), ctx)
    straight.fit()
    with pytest.raises(Crash):
        crash_at(Trainer(cfg_for(root / "resumed", strategy, ctx.world_size, *overrides), ctx), CRASH_AT).fit()
    resumed = Trainer(cfg_for(root / "resumed", strategy, ctx.world_size, "run.resume=true", *overrides), ctx)
    resumed.fit()
    return {"straight": optimizer_tensors(straight), "resumed": optimizer_tensors(resumed)}


FP32 = ("parallel.precision=fp32",)
BF16 = ("parallel.precision=bf16-mixed",)
# fp16 is slow on CPU: a smaller model; the scale grows every 8 steps, so its state matters
FP16 = ("parallel.precision=fp16-mixed", "parallel.loss_scale_growth_interval=8", "model.n_layer=1",
        "model.seq_len=32")


@pytest.mark.parametrize("precision", [FP32, BF16, FP16], ids=lambda overrides: overrides[0].split("=")[1])
def test_single_resumes_bit_identically(tmp_path, precision):
    assert_bit_identical(tmp_path, [in_process(straight_and_resumed, tmp_path, "single", *precision)], STEPS)


# compressing from step 5, so the checkpoint at 10 holds its Q factors and error feedback
POWERSGD = ("parallel.ddp.grad_compression=powersgd", "parallel.ddp.powersgd_start_step=5",
            "parallel.ddp.bucket_mb=0.2")


@pytest.mark.parametrize(("strategy", "precision"), [("ddp", FP32), ("fsdp", FP32), ("ddp", BF16), ("fsdp", FP16),
                                                     ("zero1", BF16), ("ddp", POWERSGD)],
                         ids=["ddp-fp32", "fsdp-fp32", "ddp-bf16-mixed", "fsdp-fp16-mixed", "zero1-bf16-mixed",
                              "ddp-powersgd"])
def test_resume_is_bit_identical_on_2_ranks(tmp_path, strategy, precision):
    assert_bit_identical(tmp_path, run_ranks(straight_and_resumed, 2, tmp_path, strategy, *precision), STEPS)
    if precision == POWERSGD:
        last = checkpoint_dir(tmp_path / "resumed") / f"step-{STEPS:08d}"
        manifest = json.loads((last / "manifest.json").read_text())
        assert "bucket0.q" in manifest["rank_state"] and "bucket0.error0" in manifest["rank_state"]


# How many pieces of an entry a checkpoint stores: one per distinct part held (a tensor shard per
# tp rank, qkv's q, k and v rows apart), one for an entry held whole by several ranks.
STORED_PIECES = {
    "pipeline": {"model.tok_emb.weight": 1, "optimizer.tok_emb.weight.exp_avg": 1,  # on both stages
                 "model.blocks.1.mlp.up.weight": 1},
    "tensor": {"model.blocks.0.attn.qkv.weight": 6, "optimizer.blocks.0.attn.qkv.weight.exp_avg_sq": 6,
               "model.blocks.0.mlp.down.weight": 2, "model.ln_f.weight": 1, "model.tok_emb.weight": 1},
}


@pytest.mark.parametrize("strategy", STORED_PIECES)
def test_a_split_model_resumes_bit_identically_on_2_ranks(tmp_path, strategy):
    assert_bit_identical(tmp_path, run_ranks(straight_and_resumed, 2, tmp_path, strategy), STEPS)
    metadata = safe_reader(checkpoint_dir(tmp_path / "resumed") / f"step-{STEPS:08d}").read_metadata()
    for name, pieces in STORED_PIECES[strategy].items():
        assert sum(index.fqn == name for index in metadata.storage_data) == pieces, name


# --- resharding --------------------------------------------------------------------------

# Global batch 8: 4 micro-steps on 1 rank (or one model replica), 2 on 2, 1 on 4; a pipeline
# splits each micro-batch of 2 into 2. Another strategy sums in another order, so the losses are
# held to single's within 1e-5: SGD with momentum (its state resharded like Adam's moments), since
# Adam turns the rounding noise of a near-zero gradient into a full step, which a loss spike (this
# model has them) shows at well above 1e-5.
RESHARD = ("train.micro_batch=2", "parallel.pipeline.micro_batches=2", "train.optimizer=sgd", "train.lr=0.1")


def save_then_crash(ctx: DistContext, out: Path, strategy: str, *overrides: str) -> None:
    with pytest.raises(Crash):
        crash_at(Trainer(cfg_for(out, strategy, ctx.world_size, *RESHARD, *overrides), ctx), CRASH_AT).fit()


def resume(ctx: DistContext, out: Path, strategy: str, *overrides: str) -> None:
    Trainer(cfg_for(out, strategy, ctx.world_size, "run.resume=true", *RESHARD, *overrides), ctx).fit()


def reshard(ctx: DistContext, root: Path, pairs: tuple[tuple[str, str], ...]) -> None:
    for saved_by, loaded_by in pairs:
        save_then_crash(ctx, root / f"{saved_by}-to-{loaded_by}", saved_by)
        resume(ctx, root / f"{saved_by}-to-{loaded_by}", loaded_by)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    out = tmp_path_factory.mktemp("reference")
    in_process(lambda ctx: Trainer(cfg_for(out, "single", 1, *RESHARD), ctx).fit())
    return losses(out)


def assert_continues(run: Path, reference: list[float]) -> None:
    got = losses(run)
    assert len(got) == STEPS
    for step in range(SAVED_AT, STEPS):  # every step after the resume, the first one included
        assert abs(got[step] - reference[step]) / reference[step] <= 1e-5, (run.name, step + 1)


def test_a_checkpoint_reshards_across_strategies_on_2_ranks(tmp_path, reference):
    run_ranks(reshard, 2, tmp_path, (("fsdp", "ddp"), ("zero2", "fsdp"), ("zero1", "zero2")))
    for run in ("fsdp-to-ddp", "zero2-to-fsdp", "zero1-to-zero2"):
        assert_continues(tmp_path / run, reference)


def test_a_split_model_checkpoint_reshards_to_and_from_data_parallel_on_2_ranks(tmp_path, reference):
    run_ranks(reshard, 2, tmp_path, (("tensor", "ddp"), ("fsdp", "pipeline")))
    for run in ("tensor-to-ddp", "fsdp-to-pipeline"):
        assert_continues(tmp_path / run, reference)


def dp2_tensor_to_pp2_tp2_pipeline(ctx: DistContext, out: Path) -> None:
    save_then_crash(ctx, out, "tensor", "parallel.dp=2")
    resume(ctx, out, "pipeline", "parallel.tp=2",
           "parallel.pipeline.micro_batches=1")  # 4 ranks on 2 cores: fewer messages


def test_a_dp2_tp2_checkpoint_resumes_as_2_stages_of_2_tensor_shards(tmp_path, reference):
    run_ranks(dp2_tensor_to_pp2_tp2_pipeline, 4, tmp_path)
    assert_continues(tmp_path, reference)


def test_an_fsdp_checkpoint_from_4_ranks_resumes_on_one(tmp_path, reference):
    run_ranks(save_then_crash, 4, tmp_path, "fsdp")
    saved = checkpoint_dir(tmp_path) / f"step-{SAVED_AT:08d}"
    assert json.loads((saved / "manifest.json").read_text())["world_size"] == 4
    in_process(resume, tmp_path, "single")
    assert_continues(tmp_path, reference)


# --- damaged, foreign and crafted checkpoints ---------------------------------------------

def three_checkpoints(out: Path, *overrides: str) -> Path:
    cfg = cfg_for(out, "single", 1, "train.steps=30", "train.checkpoint_every=10", *overrides)
    in_process(lambda ctx: Trainer(cfg, ctx).fit())
    root = checkpoint_dir(out)
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000010", "step-00000020", "step-00000030"]
    assert (root / "latest").read_text() == "step-00000030"
    return root


def resume_single(out: Path, *overrides: str) -> Trainer:
    cfg = cfg_for(out, "single", 1, "train.steps=40", "run.resume=true", *overrides)
    return in_process(lambda ctx: (trainer := Trainer(cfg, ctx), trainer.fit())[0])


def data_file(checkpoint: Path) -> Path:
    return next(checkpoint.glob("*.distcp"))


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "lose the manifest"])
def test_a_damaged_checkpoint_is_detected_and_the_previous_one_used(tmp_path, capfd, damage):
    root = three_checkpoints(tmp_path)
    newest = root / "step-00000030"
    if damage == "flip a byte":
        data = bytearray(data_file(newest).read_bytes())
        data[len(data) // 2] ^= 0xFF
        data_file(newest).write_bytes(bytes(data))
    elif damage == "truncate":
        data_file(newest).write_bytes(data_file(newest).read_bytes()[:100])
    else:
        (newest / "manifest.json").unlink()
    resume_single(tmp_path)
    err = capfd.readouterr().err
    assert "checkpoint step-00000030 is unusable" in err and "using step-00000020" in err
    assert [r["step"] for r in read_records(tmp_path)] == list(range(1, 41))


def test_no_good_checkpoint_is_a_clear_error(tmp_path):
    root = three_checkpoints(tmp_path)
    for checkpoint in root.glob("step-*"):
        data_file(checkpoint).write_bytes(b"")
    with pytest.raises(CheckpointError, match="no usable checkpoint in .*step-00000030: checksum mismatch"):
        resume_single(tmp_path)


def test_a_checkpoint_of_another_model_names_the_mismatch(tmp_path):
    three_checkpoints(tmp_path)
    with pytest.raises(CheckpointError) as info:
        resume_single(tmp_path, "model.n_layer=3", "model.d_model=32")
    message = str(info.value)
    assert "another model" in message and "missing from the checkpoint: blocks.2." in message
    assert "tok_emb.weight [256, 64] in the checkpoint vs [256, 32] here" in message


class RunsCode:
    def __reduce__(self):
        import os

        return os.system, ("touch pwned",)


def test_a_crafted_pickle_in_the_metadata_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = three_checkpoints(tmp_path)
    newest = root / "step-00000030"
    (newest / ".metadata").write_bytes(pickle.dumps(RunsCode()))
    manifest = json.loads((newest / "manifest.json").read_text())
    from shardwise.checkpoint import _checksums

    manifest["files"] = _checksums(newest)  # so the checksums pass and the load reaches the pickle
    (newest / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="refers to posix.system, which is not allowed; refusing to load it"):
        resume_single(tmp_path)
    assert not (tmp_path / "pwned").exists()


def test_resuming_a_finished_run_says_so(tmp_path):
    three_checkpoints(tmp_path)
    with pytest.raises(CheckpointError, match="step 30 of train.steps = 30; nothing left to resume"):
        in_process(lambda ctx: Trainer(cfg_for(tmp_path, "single", 1, "train.steps=30", "run.resume=true"), ctx).fit())


def state_at_the_checkpoint(ctx: DistContext, out: Path, strategy: str, *overrides: str) -> dict[str, torch.Tensor]:
    trainer = Trainer(cfg_for(out, strategy, ctx.world_size, *RESHARD, *overrides), ctx)
    with pytest.raises(Crash):
        crash_at(trainer, SAVED_AT).fit()  # fails right after saving at step 10
    return trainer.strategy.view.full_state_dict()


def consolidated(run: Path) -> dict[str, torch.Tensor]:
    """`shardwise consolidate` of the run's newest checkpoint, loaded strictly into the plain model
    (every key, no shardwise code); the model's state dict."""
    from shardwise.cli import main
    from shardwise.models import build_model

    out = run / "plain.safetensors"
    assert main(["consolidate", str(run), str(out)]) == 0  # in this process: the command runs in its own
    model = build_model(cfg_for(run, "single", 1).model)
    model.load_state_dict(load_file(str(out)))
    return model.state_dict()


@pytest.mark.parametrize(("strategy", "precision"), [("fsdp", FP32), ("zero1", BF16)],
                         ids=["fsdp-fp32", "zero1-bf16-mixed"])
def test_consolidate_writes_a_plain_fp32_state_dict_of_a_sharded_checkpoint(tmp_path, strategy, precision):
    expected = run_ranks(state_at_the_checkpoint, 2, tmp_path, strategy, *precision)[0]
    cfg_for(tmp_path, strategy, 2, *RESHARD, *precision).save(tmp_path / "config.toml")  # as `train` writes it
    for name, tensor in consolidated(tmp_path).items():  # the fp32 master weights, whatever zero1 computed in
        assert tensor.dtype == torch.float32 and torch.equal(tensor, expected[name]), name


def train_to_a_final_checkpoint(ctx: DistContext, root: Path, strategies: tuple[str, ...]) -> None:
    for strategy in strategies:
        Trainer(cfg_for(root / strategy, strategy, ctx.world_size, "train.steps=4", "train.checkpoint_every=4"),
                ctx).fit()


def test_consolidate_writes_the_plain_model_of_a_pipeline_or_tensor_checkpoint(tmp_path):
    from safetensors.torch import load_model

    from shardwise.models import build_model

    strategies = ("pipeline", "tensor")
    run_ranks(train_to_a_final_checkpoint, 2, tmp_path, strategies)
    for strategy in strategies:
        run = tmp_path / strategy
        cfg_for(run, strategy, 2).save(run / "config.toml")
        expected = build_model(cfg_for(run, "single", 1).model)
        load_model(expected, str(run / "model.safetensors"))  # the weights the run wrote at its end, step 4
        for name, tensor in consolidated(run).items():
            assert torch.equal(tensor, expected.state_dict()[name]), (strategy, name)


# --- SIGTERM ----------------------------------------------------------------------------------

def stopped_by_sigterm_then_resumed(ctx: DistContext, out: Path) -> None:
    """A pipeline whose second stage gets SIGTERM during step 3: both stages save after it and stop;
    then the run resumes to its end."""
    trainer = Trainer(cfg_for(out, "pipeline", ctx.world_size, "train.steps=6"), ctx)
    original = trainer.train_step

    def train_step(k: int) -> torch.Tensor:
        if k == 2 and ctx.rank == 1:
            signal.raise_signal(signal.SIGTERM)
        return original(k)

    trainer.train_step = train_step
    with pytest.raises(SystemExit, match="SIGTERM: saved a checkpoint after step 3"):
        trainer.fit()
    Trainer(cfg_for(out, "pipeline", ctx.world_size, "train.steps=6", "run.resume=true"), ctx).fit()


def test_sigterm_saves_a_pipeline_checkpoint_on_every_stage_and_the_run_resumes(tmp_path):
    run_ranks(stopped_by_sigterm_then_resumed, 2, tmp_path)
    assert (checkpoint_dir(tmp_path) / "latest").read_text() == "step-00000003"
    assert [r["step"] for r in read_records(tmp_path)] == list(range(1, 7))
    assert read_records(tmp_path, "summary")[0]["resumed_at"] == 3
