"""Mixed precision: the fp16 loss scaler agrees across ranks, bf16 trains like fp32 with fp32
master weights, sharded strategies compute and gather in the compute dtype beside fp32 master
shards, and every strategy trains in bf16 with recomputation."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from helpers import CONFIGS, read_records, train_in_process
from safetensors.torch import load_file

from shardwise.config.load import load_config
from shardwise.dist import DistContext, init_distributed
from shardwise.gradients import local_grads, squares_one_by_one, squares_together
from shardwise.memory import optimizer_state_tensors
from shardwise.precision import LossScaler
from shardwise.trainer import Trainer


def test_loss_scaler_halves_on_overflow_and_doubles_after_clean_steps():
    scaler = LossScaler(init_scale=1024.0, growth_interval=3)
    grads = [torch.full((4,), 2048.0), torch.ones(2, 2)]
    assert scaler.unscale_(grads) is False
    assert torch.equal(grads[0], torch.full((4,), 2.0))  # divided by the scale in place
    scaler.update(False)
    scaler.update(False)
    assert scaler.scale == 1024.0
    scaler.update(False)
    assert scaler.scale == 2048.0 and scaler.clean_steps == 0
    assert scaler.unscale_([torch.tensor([1.0, float("nan")])]) is True
    scaler.update(True)
    assert scaler.scale == 1024.0
    restored = LossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict() == {"scale": 1024.0, "growth_interval": 3, "clean_steps": 0}


# fp16 on CPU is ~20x slower than fp32: a one-layer, 32-token GPT.
FP16_TINY = ("parallel.precision=fp16-mixed", "model.n_layer=1", "model.seq_len=32", "train.global_batch=4",
             "train.micro_batch=2", "train.eval_every=0")
INJECT_AT = 2


def steps_with_an_inf_on_rank_1(ctx: DistContext, out: Path, strategy: str, *overrides: str) -> list[dict]:
    cfg = load_config(CONFIGS / "gpt-tiny.toml", [
        *FP16_TINY, f"parallel.strategy={strategy}", f"run.out={out}", f"launch.nproc={ctx.world_size}",
        "parallel.loss_scale_growth_interval=2", *overrides])
    trainer = Trainer(cfg, ctx)
    log = []
    for step in range(6):
        before = [p.detach().clone() for p in trainer.strategy.local_parameters()]
        trainer.forward_backward(step)
        if step == INJECT_AT and ctx.rank == 1:  # after synchronisation: only this rank's gradient has it
            local_grads(trainer.strategy.local_parameters())[0].view(-1)[0] = float("inf")
        stepped = trainer.optimizer_step()
        after = trainer.strategy.local_parameters()
        log.append({"stepped": stepped, "scale": trainer.scaler.scale,
                    "changed": any(not torch.equal(a, b) for a, b in zip(after, before, strict=True)),
                    "finite": all(bool(p.isfinite().all()) for p in after)})
        trainer.optimizer.zero_grad(set_to_none=True)
    return log


def test_the_gpus_one_foreach_sum_of_squares_is_the_cpus_gradient_by_gradient_one():
    # clipping's two ways (gradients.py): the foreach kernels, a GPU's, run here too; bf16 squares summed in fp32
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=generator) * scale for shape, scale in
             (((300, 70), 1.0), ((70,), 1e-3), ((5, 7, 11), 30.0))]
    for dtype in (torch.float32, torch.bfloat16):
        cast = [grad.to(dtype) for grad in grads]
        together, one_by_one = squares_together(cast), squares_one_by_one(cast)
        assert together.dtype == one_by_one.dtype == torch.float32
        assert torch.allclose(together, one_by_one, rtol=1e-6, atol=0)


@pytest.mark.parametrize("strategy", [
    ("ddp",), ("zero1",), ("zero2",), ("fsdp",),
    # rank 1 is the second stage, or the second tensor shard: a rank that holds other parameters
    ("pipeline", "model.n_layer=2", "parallel.pipeline.micro_batches=2"), ("tensor",),
    # a split backward on a V: rank 1 holds the middle stages 1 and 2, its weight gradients run last
    ("pipeline", "model.n_layer=4", "parallel.pipeline.micro_batches=2", "parallel.pipeline.schedule=zbv"),
], ids=["ddp", "zero1", "zero2", "fsdp", "pipeline", "tensor", "pipeline-zbv"])
def test_an_inf_on_one_rank_skips_that_step_on_every_rank(tmp_path, strategy):
    for rank, log in enumerate(run_ranks(steps_with_an_inf_on_rank_1, 2, tmp_path, *strategy)):
        assert [entry["stepped"] for entry in log] == [True, True, False, True, True, True], rank
        assert not log[INJECT_AT]["changed"] and all(e["changed"] for i, e in enumerate(log) if i != INJECT_AT)
        # 2 clean steps double the scale; the overflow halves it; 2 more clean steps double it again
        assert [entry["scale"] for entry in log] == [65536.0, 131072.0, 65536.0, 65536.0, 131072.0, 131072.0]
        assert all(entry["finite"] for entry in log)


def test_skipped_steps_are_logged(tmp_path):
    cfg = load_config(CONFIGS / "gpt-tiny.toml", [*FP16_TINY, f"run.out={tmp_path}", "train.steps=3",
                                                  "parallel.loss_scale=1e38"])  # overflows at once, then halves
    threads = torch.get_num_threads()
    try:
        summary = Trainer(cfg, init_distributed(threads_per_rank=1)).fit()
    finally:
        torch.set_num_threads(threads)
    records = read_records(tmp_path)
    assert records[0]["skipped"] is True and records[0]["loss_scale"] == 5e37
    assert summary["skipped_steps"] == sum(r["skipped"] for r in records) >= 1


def train_single(out: Path, precision: str, steps: int) -> Trainer:
    cfg = load_config(CONFIGS / "gpt-tiny.toml", [f"parallel.precision={precision}", f"train.steps={steps}",
                                                  f"run.out={out}", "train.eval_every=0"])
    threads = torch.get_num_threads()
    try:
        trainer = Trainer(cfg, init_distributed(threads_per_rank=1))
        compute = []
        trainer.model.head.register_forward_hook(lambda m, args, output: compute.append(output.dtype))
        trainer.fit()
        trainer.head_dtypes = set(compute)
        return trainer
    finally:
        torch.set_num_threads(threads)


def test_bf16_mixed_ends_within_3_percent_of_fp32_over_200_steps(tmp_path):
    fp32 = train_single(tmp_path / "fp32", "fp32", 200)
    bf16 = train_single(tmp_path / "bf16", "bf16-mixed", 200)
    assert bf16.head_dtypes == {torch.bfloat16} and fp32.head_dtypes == {torch.float32}
    assert {p.dtype for p in bf16.model.parameters()} == {torch.float32}  # master weights
    assert {t.dtype for t in optimizer_state_tensors(bf16.optimizer) if t.dim()} == {torch.float32}
    final = {name: read_records(tmp_path / name)[-1]["loss"] for name in ("fp32", "bf16")}
    assert final["bf16"] != final["fp32"]  # it really computed in bf16
    assert abs(final["bf16"] - final["fp32"]) / final["fp32"] < 0.03


SPLIT, SPLIT_STEPS = ("pipeline", "tensor"), 20


def split_model_in_bf16(ctx: DistContext, root: Path) -> dict[tuple[str, str], dict[str, set[torch.dtype]]]:
    """`pipeline` (2 stages) and `tensor` (2 shards) trained in bf16-mixed and bf16-true: on this
    rank, the dtypes a block's MLP computed in and its parameters and optimizer state are stored in."""
    out = {}
    for precision in ("bf16-mixed", "bf16-true"):
        for strategy in SPLIT:
            cfg = load_config(CONFIGS / "gpt-tiny.toml", [
                f"parallel.precision={precision}", f"train.steps={SPLIT_STEPS}", "train.eval_every=0",
                f"parallel.strategy={strategy}", f"launch.nproc={ctx.world_size}",
                f"run.out={root / precision / strategy}"])
            trainer = Trainer(cfg, ctx)
            computed: set[torch.dtype] = set()
            block = next(m for m in trainer.strategy.module.modules() if type(m).__name__ == "Block")
            block.mlp.up.register_forward_hook(
                lambda m, args, output, seen=computed: seen.add(output.dtype))
            trainer.fit()
            out[precision, strategy] = {
                "computed": computed, "params": {p.dtype for p in trainer.strategy.local_parameters()},
                "optimizer": {t.dtype for t in optimizer_state_tensors(trainer.optimizer) if t.dim()}}
    return out


@pytest.fixture(scope="module")
def split_in_bf16(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("split-bf16")
    return root, run_ranks(split_model_in_bf16, 2, root)


def test_pipeline_and_tensor_train_in_bf16_mixed_as_one_device_does(split_in_bf16, tmp_path):
    root, ranks = split_in_bf16
    train_single(tmp_path, "bf16-mixed", SPLIT_STEPS)
    single = [r["loss"] for r in read_records(tmp_path)]
    for strategy in SPLIT:
        for rank in ranks:  # computes in bf16; master weights and optimizer state in fp32
            assert rank["bf16-mixed", strategy] == {"computed": {torch.bfloat16}, "params": {torch.float32},
                                                    "optimizer": {torch.float32}}
        # Splitting changes where bf16 rounds (2 partial sums, micro-batches): measured 6e-5 at worst,
        # about the gap between one device's own bf16-mixed and fp32 runs over these steps.
        got = [r["loss"] for r in read_records(root / "bf16-mixed" / strategy)]
        worst = max(abs(a - b) / b for a, b in zip(got, single, strict=True))
        assert worst < 5e-4, strategy


def test_pipeline_and_tensor_in_bf16_true_store_parameters_and_optimizer_state_in_bf16(split_in_bf16):
    root, ranks = split_in_bf16
    for strategy in SPLIT:
        for rank in ranks:
            assert rank["bf16-true", strategy] == {"computed": {torch.bfloat16}, "params": {torch.bfloat16},
                                                   "optimizer": {torch.bfloat16}}
        losses = [r["loss"] for r in read_records(root / "bf16-true" / strategy)]
        assert losses[-1] < losses[0] - 0.5  # it learns


def test_bf16_true_stores_parameters_gradients_and_optimizer_state_in_bf16(tmp_path):
    trainer = train_single(tmp_path, "bf16-true", 30)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    assert {t.dtype for t in optimizer_state_tensors(trainer.optimizer) if t.dim()} == {torch.bfloat16}
    losses = [r["loss"] for r in read_records(tmp_path)]
    assert losses[-1] < losses[0] - 0.5  # it learns


SHARDED = ("zero1", "zero2", "fsdp")


def sharded_dtypes_and_bytes(ctx: DistContext, out: Path) -> dict:
    result = {}
    for strategy in SHARDED:
        for precision, reduce in (("fp32", "fp32"), ("bf16-mixed", "fp32"), ("bf16-mixed", "bf16")):
            cfg = load_config(CONFIGS / "gpt-tiny.toml", [
                f"parallel.strategy={strategy}", f"parallel.precision={precision}",
                                                          f"parallel.sharding.reduce_dtype={reduce}",
                f"launch.nproc={ctx.world_size}", f"run.out={out}"])
            trainer = Trainer(cfg, ctx)
            computed: list[torch.dtype] = []
            trainer.model.blocks[0].register_forward_pre_hook(
                lambda m, args, seen=computed: seen.append(m.attn.qkv.weight.dtype))
            trainer.train_step(0)
            moved, gathered = trainer.strategy.sharding.bytes_moved, trainer.strategy.sharding.bytes_gathered
            trainer.train_step(1)
            result[strategy, precision, reduce] = {
                "moved_per_step": trainer.strategy.sharding.bytes_moved - moved,
                "gathered_per_step": trainer.strategy.sharding.bytes_gathered - gathered,
                "computed_with": set(computed), "kept": {p.dtype for p in trainer.model.parameters()},
                "shards": {s.dtype for s in trainer.strategy.local_parameters()},
                "shard_grads": {g.dtype for g in local_grads(trainer.strategy.local_parameters())},
                "optimizer": {t.dtype for t in optimizer_state_tensors(trainer.optimizer) if t.dim()},
            }
    return result


def test_sharded_strategies_compute_and_gather_in_bf16_and_keep_fp32_master_shards():
    result = run_ranks(sharded_dtypes_and_bytes, 2, Path("unused"))[0]
    for strategy in SHARDED:
        fp32, bf16, all_bf16 = (result[strategy, *dtypes] for dtypes in (("fp32", "fp32"), ("bf16-mixed", "fp32"),
                                                                         ("bf16-mixed", "bf16")))
        assert fp32["computed_with"] == {torch.float32}
        assert bf16["computed_with"] == all_bf16["computed_with"] == {torch.bfloat16}, strategy
        for r in (fp32, bf16, all_bf16):  # master weights, their gradients and the optimizer state
            assert r["shards"] == r["shard_grads"] == r["optimizer"] == {torch.float32}, strategy
        if strategy != "fsdp":  # the whole parameters zero1 and zero2 keep between steps
            assert fp32["kept"] == {torch.float32} and bf16["kept"] == {torch.bfloat16}, strategy
        # all-gathers move half the bytes in bf16; every byte moved halves with bf16 reductions too
        assert bf16["gathered_per_step"] * 2 == fp32["gathered_per_step"] > 0, strategy
        assert all_bf16["moved_per_step"] * 2 == fp32["moved_per_step"], strategy
        assert all_bf16["moved_per_step"] < bf16["moved_per_step"] < fp32["moved_per_step"], strategy


BF16_STEPS = 20


def train_sharded_in_bf16(ctx: DistContext, root: Path) -> None:
    for strategy in SHARDED:
        for micro_batch in (4, 2):  # with accumulation, the whole gradients are summed in bf16 between micro-steps
            cfg = load_config(CONFIGS / "gpt-tiny.toml", [
                "parallel.precision=bf16-mixed", f"parallel.strategy={strategy}", f"train.steps={BF16_STEPS}",
                "train.global_batch=8", f"train.micro_batch={micro_batch}", "train.eval_every=0",
                f"launch.nproc={ctx.world_size}", f"run.out={root / f'{strategy}-mb{micro_batch}'}"])
            Trainer(cfg, ctx).fit()


def test_zero1_and_zero2_in_bf16_mixed_train_as_fsdp_and_as_one_device_does(tmp_path):
    """zero1, zero2 and fsdp compute with the same bf16 parameters (cast from the same fp32 master
    shards) and reduce the same bf16 gradients: the same losses and weights, exactly. All three
    differ from one device's bf16-mixed, which keeps the residual stream in fp32 (its embeddings
    are fp32), by as little as pipeline and tensor do: measured 1.8e-4 (avx2, avx512) and 2.3e-4
    (ATEN_CPU_CAPABILITY=default) at worst."""
    run_ranks(train_sharded_in_bf16, 2, tmp_path)
    train_in_process(load_config(CONFIGS / "gpt-tiny.toml", [
        "parallel.precision=bf16-mixed", f"train.steps={BF16_STEPS}", "train.global_batch=8", "train.micro_batch=4",
        "train.eval_every=0", f"run.out={tmp_path / 'single'}"]))
    single = [r["loss"] for r in read_records(tmp_path / "single")]
    for micro_batch in (4, 2):
        fsdp = tmp_path / f"fsdp-mb{micro_batch}"
        for strategy in ("zero1", "zero2"):
            run = tmp_path / f"{strategy}-mb{micro_batch}"
            assert [r["loss"] for r in read_records(run)] == [r["loss"] for r in read_records(fsdp)], run.name
            weights, expected = load_file(str(run / "model.safetensors")), load_file(str(fsdp / "model.safetensors"))
            assert all(torch.equal(weights[key], expected[key]) for key in expected), run.name
        worst = max(abs(a - b) / b for a, b in zip((r["loss"] for r in read_records(fsdp)), single, strict=True))
        assert worst < 5e-4, micro_batch


BF16_BLOCKS = ("parallel.precision=bf16-mixed", "parallel.recompute=blocks", "train.steps=5", "train.eval_every=0")
MULTI_RANK = ("ddp", "zero1", "zero2", "fsdp", "ddp-native", "fsdp-native", "pipeline", "tensor")


def train_bf16_with_block_recomputation(ctx: DistContext, root: Path) -> None:
    for strategy in MULTI_RANK:
        cfg = load_config(CONFIGS / "gpt-tiny.toml", [*BF16_BLOCKS, f"parallel.strategy={strategy}",
                                                      f"launch.nproc={ctx.world_size}", f"run.out={root / strategy}"])
        Trainer(cfg, ctx).fit()


@pytest.fixture(scope="module")
def bf16_with_block_recomputation(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bf16-blocks")
    run_ranks(train_bf16_with_block_recomputation, 2, root)
    train_in_process(load_config(CONFIGS / "gpt-tiny.toml", [*BF16_BLOCKS, f"run.out={root / 'single'}"]))
    return root


@pytest.mark.parametrize("strategy", ["single", *MULTI_RANK])
def test_bf16_mixed_with_block_recomputation_trains_under_every_strategy(bf16_with_block_recomputation, strategy):
    summary = read_records(bf16_with_block_recomputation / strategy, "summary")[0]
    assert (summary["precision"], summary["recompute"]) == ("bf16-mixed", "blocks")
    assert math.isfinite(summary["final_loss"]) and summary["final_loss"] < math.log(256)
