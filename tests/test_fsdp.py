"""Sharded data parallel, ours (`zero1`, `zero2`, `fsdp`) and PyTorch's FSDP2 (`fsdp-native`),
on real Gloo ranks, held to parity with `single` and to the ZeRO memory accounting."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from helpers import (
    CNN_STEPS,
    CONFIGS,
    SGD,
    assert_same_training,
    cnn_config,
    gpt_tiny,
    read_records,
    train_in_process,
    train_runs,
)

from shardwise.config.load import load_config
from shardwise.dist import DistContext
from shardwise.gradients import local_grads
from shardwise.memory import optimizer_state_tensors, storage_bytes, storage_key
from shardwise.models import build_model
from shardwise.parallel.shard import HOST, copy_in, copy_out, sharded_shape
from shardwise.strategies.classes import make_strategy
from shardwise.trainer import Trainer

STEPS = 20
SHARDED = ("zero1", "zero2", "fsdp", "fsdp-native")
# Sizes no world size of 2 or 4 divides evenly: shards are padded.
ODD_GPT = ("model.d_model=34", "model.n_head=2", "model.seq_len=30")


def cfg_for(out: Path, strategy: str, nproc: int, *overrides: str):
    return gpt_tiny(out, strategy, nproc, "train.lr=3e-3", "train.grad_clip=0", *overrides, steps=STEPS)


# Clipping at 0.5 really clips here (the gradient norm of these steps is larger).
VARIANTS = {"plain": (*SGD, "train.micro_batch=4"), "accum2-clip": (*SGD, "train.micro_batch=2", "train.grad_clip=0.5")}


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fsdp2")
    runs = {f"{s}-{v}": (s, *o) for s in SHARDED for v, o in VARIANTS.items()}
    run_ranks(train_runs, 2, root, runs, cfg_for)
    for variant, overrides in VARIANTS.items():
        train_in_process(cfg_for(root / f"single-{variant}", "single", 1, *overrides))
    return root


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("strategy", SHARDED)
def test_sharded_matches_single_device_over_20_steps_on_2_ranks(two_rank_runs, strategy, variant):
    assert_same_training(two_rank_runs / f"{strategy}-{variant}", two_rank_runs / f"single-{variant}", STEPS)


def test_clipping_was_active(two_rank_runs):
    plain = [r["loss"] for r in read_records(two_rank_runs / "single-plain")]
    clipped = [r["loss"] for r in read_records(two_rank_runs / "single-accum2-clip")]
    # the same first step (one micro-batch of 8 or two of 4: the loss summed in another order), then
    # clipping's smaller steps: 4.59 against 5.21 at step 6
    assert plain[0] == pytest.approx(clipped[0], rel=1e-6) and clipped[5] - plain[5] > 0.1


def test_sharded_matches_single_on_4_ranks_with_padded_shards(tmp_path):
    runs = {s: (s, *SGD, "train.micro_batch=2", *ODD_GPT) for s in ("zero1", "zero2", "fsdp")}
    run_ranks(train_runs, 4, tmp_path, runs, cfg_for)
    train_in_process(cfg_for(tmp_path / "single", "single", 1, *SGD, "train.micro_batch=2", *ODD_GPT))
    for strategy in runs:
        assert_same_training(tmp_path / strategy, tmp_path / "single", STEPS)


# --- memory -----------------------------------------------------------------------------

def memory_by_strategy(ctx: DistContext, root: Path) -> dict:
    out = {}
    for precision in ("fp32", "bf16-mixed"):
        for strategy in ("zero1", "zero2", "fsdp"):
            cfg = cfg_for(root / strategy, strategy, ctx.world_size, "train.micro_batch=2", "train.steps=2",
                          f"parallel.precision={precision}", *ODD_GPT)
            out[strategy, precision] = Trainer(cfg, ctx).fit()["memory"]
    return out


def expected_bytes(world: int) -> dict[str, int]:
    """Elements (not bytes) of the model, of one rank's padded shards, ..., and the optimizer's bytes."""
    cfg = load_config(None, list(ODD_GPT))
    model = build_model(cfg.model)
    params = list(model.parameters())  # the tied head counted once
    full = sum(p.numel() for p in params)
    shard = sum(math.ceil(p.shape[0] / world) * p[0].numel() for p in params)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    block_gather = world * sum(math.ceil(p.shape[0] / world) * p[0].numel() for p in model.blocks[0].parameters())
    root = full - block * len(model.blocks)
    root_params = [p for p in params if all(p is not q for q in model.blocks.parameters())]
    root_gather = world * sum(math.ceil(p.shape[0] / world) * p[0].numel() for p in root_params)
    # AdamW: two fp32 moments per shard element, and a 4-byte step counter per parameter tensor
    return {"full": full, "shard": shard, "padded": world * shard, "optimizer": 8 * shard + 4 * len(params),
            "block": block, "root": root, "block_gather": block_gather, "root_gather": root_gather}


@pytest.mark.parametrize("world", [2, 4])
def test_per_rank_bytes_follow_the_zero_accounting(tmp_path, world):
    memory = run_ranks(memory_by_strategy, world, tmp_path)[0]
    e = expected_bytes(world)
    assert e["padded"] - e["full"] < e["full"] * 0.05  # padding is small (and present on 4 ranks)
    for precision in ("fp32", "bf16-mixed"):
        z1, z2, z3 = (memory[strategy, precision] for strategy in ("zero1", "zero2", "fsdp"))
        for m in (z1, z2, z3):
            assert m["optimizer"] == e["optimizer"]  # fp32 optimizer state ~1/N in every stage
            assert m["host"] is None  # nothing offloaded
        assert z3["params"] == z3["grads"] == 4 * e["shard"]  # fp32 master shards and their gradients
        assert z2["grads"] == 4 * e["shard"]
        if precision == "fp32":
            # The whole parameters (padded), the shards views into them; zero1's whole gradients,
            # which hold its shard gradients after the reduce-scatter.
            assert z1["params"] == z2["params"] == 4 * e["padded"]
            assert z1["grads"] == 4 * e["padded"]
        else:
            # The whole parameters and zero1's whole gradients in bf16, beside fp32 master shards;
            # zero1's fp32 shard gradients fit in its bf16 gradient buffer.
            assert z1["params"] == z2["params"] == 2 * e["padded"] + 4 * e["shard"]
            assert z1["grads"] == 2 * e["padded"]
    fp32 = {strategy: memory[strategy, "fp32"] for strategy in ("zero1", "zero2", "fsdp")}
    # Gathered at once: the root, the running block and one gather buffer: the prefetched block's
    # (prefetch = 1), or its own while it is copied out. Padding makes a gather buffer a little
    # larger than its block.
    assert 4 * (e["root"] + e["block"]) <= fp32["fsdp"]["gathered_peak"] <= 4 * (
        e["root"] + e["block"] + e["block_gather"])
    # zero1/zero2 hold everything whole, plus two units' all-gather buffers after the step
    for strategy in ("zero1", "zero2"):
        assert 4 * e["padded"] < fp32[strategy]["gathered_peak"] <= 4 * (
            e["padded"] + 2 * max(e["block_gather"], e["root_gather"]))


def full_storage_between_units(ctx: DistContext) -> dict:
    cfg = load_config(CONFIGS / "gpt-tiny.toml", ["parallel.strategy=fsdp", "model.n_layer=4",
                                                   f"launch.nproc={ctx.world_size}"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    strategy = make_strategy(cfg.parallel, ctx)
    model = strategy.wrap(model)
    live: list[list[int]] = []
    prefetched: list[list[bool]] = []

    def record(module, args):
        live.append([sum(p.untyped_storage().nbytes() for p in b.parameters()) for b in model.blocks])
        prefetched.append([u.pending_gather is not None for u in strategy.sharding.units[:-1]])

    for block in model.blocks:
        block.register_forward_pre_hook(record)  # runs after the strategy's own gather hook
    loss = model(torch.randint(0, 256, (2, 64))).sum()
    after_forward = [sum(p.untyped_storage().nbytes() for p in b.parameters()) for b in model.blocks]
    strategy.backward(loss)
    after_backward = sum(p.untyped_storage().nbytes() for p in model.parameters())
    block_bytes = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    return {"live": live, "prefetched": prefetched, "after_forward": after_forward,
            "after_backward": after_backward, "block": block_bytes}


def test_fsdp_frees_full_parameters_after_each_unit(tmp_path):
    r = run_ranks(full_storage_between_units, 2)[0]
    block = r["block"]
    for i, per_block in enumerate(r["live"]):
        assert per_block[i] == block  # the running unit is whole
        assert sum(per_block) == block  # every other unit's storage is released
        # while it runs, exactly the next unit's all-gather is in flight (prefetch = 1)
        assert r["prefetched"][i] == [j == i + 1 for j in range(4)]
    assert r["after_forward"] == [0, 0, 0, 0]
    assert r["after_backward"] == 0  # root included: nothing whole between steps


def layout_after_a_step(ctx: DistContext, root: Path) -> dict:
    out = {}
    for strategy in ("zero1", "zero2"):
        for precision in ("fp32", "bf16-mixed"):
            cfg = cfg_for(root / strategy, strategy, ctx.world_size, "train.micro_batch=4",
                          f"parallel.precision={precision}", *ODD_GPT)
            trainer = Trainer(cfg, ctx)
            trainer.train_step(0)
            units = trainer.strategy.sharding.units
            full = {storage_key(unit.full.untyped_storage()) for unit in units}
            grads = {storage_key(unit.grads.untyped_storage()) for unit in units if unit.grads is not None}
            shards = dict(trainer.strategy.view.named_parameters())
            own_rows = []  # this rank's rows of each whole parameter, and its master shard (padding dropped)
            for name, param in trainer.model.named_parameters():
                rows = math.ceil(param.shape[0] / ctx.world_size)
                mine = param.detach()[ctx.rank * rows : (ctx.rank + 1) * rows]
                own_rows.append(torch.equal(mine, shards[name][: mine.shape[0]].detach().to(mine.dtype)))
            out[strategy, precision] = {
                "params_in_full": all(storage_key(p.untyped_storage()) in full for p in trainer.model.parameters()),
                "shards_in_full": {storage_key(s.untyped_storage()) in full for s in shards.values()},
                "shard_grads_in_grads": {storage_key(g.untyped_storage()) in grads
                                         for g in local_grads(trainer.strategy.local_parameters())},
                "whole_is_master": all(own_rows),
            }
    return out


def test_zero1_zero2_parameters_are_views_into_one_buffer_and_fp32_shards_views_into_it(tmp_path):
    layout = run_ranks(layout_after_a_step, 2, tmp_path)
    for rank in layout:
        for (strategy, precision), got in rank.items():
            assert got["params_in_full"] and got["whole_is_master"], (strategy, precision)
            # fp32: the master shards are this rank's rows of the whole parameters; bf16: fp32 of their own
            assert got["shards_in_full"] == {precision == "fp32"}, (strategy, precision)
            # zero1's shard gradients live in its whole gradients' buffer, in both precisions
            assert got["shard_grads_in_grads"] == {strategy == "zero1"}, (strategy, precision)


def offloaded_or_not(ctx: DistContext, root: Path) -> dict:
    out = {}
    for strategy in ("zero1", "zero2", "fsdp"):
        for precision in ("fp32", "bf16-mixed"):
            for offload in ("none", "optimizer"):
                cfg = cfg_for(root / strategy, strategy, ctx.world_size, "train.micro_batch=2", "train.grad_clip=0.5",
                              f"parallel.precision={precision}", f"parallel.sharding.offload={offload}", *ODD_GPT)
                trainer = Trainer(cfg, ctx)
                losses = [trainer.run_step(step) for step in range(3)]
                trainer.train_step(3)  # gradients alive, as the trainer counts them
                strategy_ = trainer.strategy
                offloaded = [*strategy_.local_parameters(), *local_grads(strategy_.local_parameters()),
                             *optimizer_state_tensors(trainer.optimizer)]
                full = [unit.full for unit in strategy_.sharding.units if unit.full is not None]
                out[strategy, precision, offload] = {
                    "losses": losses, "weights": strategy_.view.full_state_dict(),
                    "memory": strategy_.memory(0).as_dict(),
                    "master_device": strategy_.sharding.master_device, "devices": {t.device for t in offloaded},
                    "host_bytes": storage_bytes(offloaded),
                    "device_params": storage_bytes(full), "device_grads": storage_bytes(
                        [unit.grads for unit in strategy_.sharding.units if unit.grads is not None]),
                    "shards_in_full": any(storage_key(s.untyped_storage()) in {storage_key(f.untyped_storage())
                                                                               for f in full}
                                          for s in strategy_.local_parameters()),
                }
    return out


def test_offload_keeps_master_shards_gradients_and_optimizer_state_on_the_host_and_steps_alike(tmp_path):
    """On a CPU the host is the device: what can be checked is where each tensor is put and
    counted, and that the step is the same computation (equal losses and weights, exactly)."""
    result = run_ranks(offloaded_or_not, 2, tmp_path)[0]
    for strategy in ("zero1", "zero2", "fsdp"):
        for precision in ("fp32", "bf16-mixed"):
            kept, offloaded = result[strategy, precision, "none"], result[strategy, precision, "optimizer"]
            assert offloaded["losses"] == kept["losses"], (strategy, precision)
            assert all(torch.equal(offloaded["weights"][k], kept["weights"][k]) for k in kept["weights"])
            assert offloaded["master_device"] == HOST and offloaded["devices"] == {HOST}
            assert not offloaded["shards_in_full"]  # a host buffer of their own, even where fp32 could share
            memory = offloaded["memory"]
            assert memory["host"] == offloaded["host_bytes"] > kept["memory"]["optimizer"] > 0
            assert memory["optimizer"] == 0 and kept["memory"]["host"] is None
            # the device keeps only zero1's and zero2's whole parameters and zero1's gradient buffer
            assert (memory["params"], memory["grads"]) == (offloaded["device_params"], offloaded["device_grads"])
            assert (memory["params"] > 0) == (strategy != "fsdp") and (memory["grads"] > 0) == (strategy == "zero1")


def test_cli_fsdp_on_2_processes_matches_single(tmp_path, cli_single_compared):
    from helpers import COMPARED_STEPS, shardwise

    result = shardwise("train", str(CONFIGS / "gpt-tiny.toml"), "--strategy", "fsdp", "--nproc", "2", "--steps",
                       str(COMPARED_STEPS), "--out", str(tmp_path / "fsdp"))
    assert result.returncode == 0, result.stderr
    assert_same_training(tmp_path / "fsdp", cli_single_compared, steps=COMPARED_STEPS, weights=False)


def train_cnn_sharded(ctx: DistContext, root: Path) -> None:

    for strategy in ("zero2", "fsdp"):
        Trainer(cnn_config(root / strategy, strategy, ctx.world_size, sync=True), ctx).fit()


def test_sync_batchnorm_works_under_sharding(tmp_path):

    run_ranks(train_cnn_sharded, 2, tmp_path)
    train_in_process(cnn_config(tmp_path / "single", "single", 1, sync=False))
    for strategy in ("zero2", "fsdp"):  # running statistics included
        assert_same_training(tmp_path / strategy, tmp_path / "single", CNN_STEPS)


# --- shards as DTensors -------------------------------------------------------------------

# d_model 33: rows of 33 and 99 split 17 + 16 over 2 ranks, so one shard carries a padding row.
PADDED_ON_2 = ("model.d_model=33", "model.n_head=3", "model.seq_len=30")


def save_sharded_with_dcp(ctx: DistContext, root: Path, strategy_name: str) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    trainer = Trainer(cfg_for(root / "run", strategy_name, ctx.world_size, "train.micro_batch=4",
                              "train.steps=3", *PADDED_ON_2), ctx)
    for step in range(3):  # the shards move away from their initial values
        trainer.train_step(step)
        trainer.optimizer.zero_grad(set_to_none=True)
    state = trainer.strategy.view.state_dict()["model"]
    dcp.save(state, checkpoint_id=root / "dcp")
    return trainer.strategy.view.full_state_dict()


@pytest.mark.parametrize("strategy", ["zero1", "fsdp"])
def test_shards_are_dim0_dtensors_that_dcp_saves_and_loads_unsharded(tmp_path, strategy):
    import torch.distributed.checkpoint as dcp

    full = run_ranks(save_sharded_with_dcp, 2, tmp_path, strategy)[0]
    plain = build_model(cfg_for(tmp_path, "single", 1, *PADDED_ON_2).model)
    state = plain.state_dict()
    state.pop("head.weight")  # tied to tok_emb.weight, saved once under that name
    for tensor in state.values():
        tensor.zero_()
    dcp.load(state, checkpoint_id=tmp_path / "dcp")  # one process, no process group: resharded 2 -> 1
    assert set(state) == set(full) - {"head.weight"}
    for name, tensor in state.items():
        assert torch.equal(tensor, full[name]), name
    assert plain.head.weight.data_ptr() == plain.tok_emb.weight.data_ptr()


def test_a_0_dim_parameter_is_refused_by_name():
    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = torch.nn.Parameter(torch.tensor(1.0))

    cfg = load_config(None, ["parallel.strategy=fsdp", "launch.nproc=2"])
    strategy = make_strategy(cfg.parallel, DistContext(0, 1, 0, torch.device("cpu"), "gloo"))
    with pytest.raises(ValueError, match="gain are 0-dim"):
        strategy.wrap(Scaled())


@pytest.mark.parametrize(("shape", "world", "fold"), [((12, 3), 4, False), ((10, 3), 4, False), ((5,), 8, False),
                                                    ((3, 2, 2), 64, False), ((64,), 64, False), ((2, 8, 3), 4, True),
                                                    ((3, 2, 2), 64, True)])
def test_shards_pack_and_unpack_as_torch_chunk_cuts_them(shape, world, fold):
    # each rank's shard is its torch.chunk of dim 0, zero-padded to ceil(rows / world) rows; some ranks
    # hold padding only (3 rows over 64 ranks), and the copies run per whole ranks, not per rank.
    # Folded (experts fewer than the ranks), dims 0 and 1 are one: 2 experts of 8 rows over 4 ranks, 4 rows each.
    split = sharded_shape(shape, world, fold)
    assert split == ((16, 3) if shape == (2, 8, 3) else (6, 2) if fold else shape)
    full = torch.randn(shape)
    rows = math.ceil(split[0] / world)
    numel = rows * math.prod(split[1:])
    packed = torch.full((world, 1 + numel + 2), float("nan"))  # another parameter's shard on each side
    copy_in(packed, split, rows, 1, full)
    chunks = torch.chunk(full.view(split), world)
    for rank in range(world):
        expected = torch.zeros(rows, *split[1:])
        if rank < len(chunks):
            expected[: len(chunks[rank])] = chunks[rank]
        assert torch.equal(packed[rank, 1 : 1 + numel], expected.view(-1)), rank
    assert packed[:, 0].isnan().all() and packed[:, -2:].isnan().all()  # nothing written beside it
    back = torch.full(shape, float("nan"))
    copy_out(back, split, rows, 1, packed)
    assert torch.equal(back, full)
