"""`train.optimizer = "muon"` (issue 70, its first step): Muon for the blocks' matrices, AdamW for
the rest, equal to torch.optim.Muon and torch.optim.AdamW on the same split under single, and under
dp (2 replicas), ddp and ddp-native on 2 ranks equal to single (Newton-Schulz in fp32 there, so
that rounding cannot hide a wrong assembly); what it does not compose with yet is refused before
launch."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from helpers import assert_states_close, gpt_tiny, read_records, train_in_process, train_runs
from safetensors.torch import load_file
from torch import nn
from torch.distributed.tensor import DTensor

from shardwise.checkpoint import load_checkpoint
from shardwise.config.load import load_config
from shardwise.config.schema import ConfigError
from shardwise.dist import init_distributed
from shardwise.muon import MatrixLayout, orthogonalized
from shardwise.planner.candidates import Candidate
from shardwise.trainer import Trainer
from shardwise.validate import MUON_STRATEGIES

STEPS = 10
MUON = ("train.optimizer=muon", "train.lr=0.02", "train.min_lr=0.02", "train.warmup_steps=0", "train.grad_clip=0",
        "train.micro_batch=4")
LLAMA = ("model.name=hf-llama", "model.n_head=4", "model.n_kv_head=2")


def cfg_for(out, strategy: str, world: int, *overrides: str):
    return gpt_tiny(out, strategy, world, *MUON, *overrides, steps=STEPS)


class TorchsMuonAndAdamW(torch.optim.Optimizer):
    """The reference: torch.optim.Muon on the matrices of the blocks, torch.optim.AdamW on the
    rest (weight decay on matrices and embeddings), stepped together."""

    def __init__(self, model: torch.nn.Module, block: str, lr: float, weight_decay: float) -> None:
        blocks = {id(p) for m in model.modules() if type(m).__name__ == block for p in m.parameters()}
        params = list(model.parameters())
        self.muon = torch.optim.Muon([p for p in params if id(p) in blocks and p.dim() == 2], lr=lr,
                                     weight_decay=weight_decay)
        rest = [p for p in params if not (id(p) in blocks and p.dim() == 2)]
        self.adamw = torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2], "weight_decay": weight_decay},
                                        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                                       lr=lr, betas=(0.9, 0.95))
        super().__init__(params, {"lr": lr})
        self.param_groups = [*self.muon.param_groups, *self.adamw.param_groups]

    def step(self, closure: None = None) -> None:
        self.muon.step()
        self.adamw.step()


def test_single_muon_equals_torchs_muon_and_adamw_on_the_same_split(tmp_path):
    """A Llama of 2-D matrices, Newton-Schulz in bf16 as torch computes it: the same weights."""
    ours, theirs = (load_config(None, [f"run.out={tmp_path / name}", "data.name=synthetic-tokens", *LLAMA, *MUON,
                                       f"train.steps={STEPS}", "train.global_batch=4", "train.eval_every=0",
                                       *(("train.optimizer=adamw",) if name == "theirs" else ())])
                    for name in ("ours", "theirs"))
    train_in_process(ours)
    threads = torch.get_num_threads()
    try:
        trainer = Trainer(theirs, init_distributed(threads_per_rank=1))
        trainer.optimizer = TorchsMuonAndAdamW(trainer.strategy.module, trainer.strategy.cfg.block, 0.02, 0.1)
        trainer.fit()
    finally:
        torch.set_num_threads(threads)
    got, want = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("ours", "theirs"))
    assert got.keys() == want.keys()
    assert_states_close(got, want, rtol=1e-6, atol=0)
    assert read_records(tmp_path / "ours", "summary")[0]["optimizer"] == "muon"


FP32 = ("train.muon.ns_dtype=fp32",)
SPLIT = ("tensor", "pipeline", "fsdp-tp2")  # the matrices split over tp, or the model into stages
SAVED_AT = 5
MOE = "model.name=gpt-moe"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("muon")
    train_in_process(cfg_for(root / "single", "single", 1, *FP32))
    train_in_process(cfg_for(root / "dp", "dp", 1, *FP32))  # 2 replicas in threads of this process
    train_in_process(cfg_for(root / "single-llama", "single", 1, *FP32, *LLAMA))
    train_in_process(cfg_for(root / "single-moe", "single", 1, *FP32, MOE))
    two = {name: (name, *FP32) for name in ("ddp", "ddp-native", "zero1", "zero2", "fsdp", "tensor", "pipeline")}
    two["fsdp-ep2-moe"] = ("fsdp", "parallel.ep=2", MOE, *FP32)
    two |= {f"{name}-llama": (name, *LLAMA, *FP32) for name in ("zero2", "tensor", "pipeline")}
    run_ranks(train_runs, 2, root, two, cfg_for)
    (saved,) = [state for state in run_ranks(four_rank_runs, 4, root) if state is not None]
    return root, saved


def four_rank_runs(ctx, root):
    """hsdp on 2 "nodes" of 2 processes (as tests/multinode/test_hsdp.py runs it); fsdp over tp 2,
    of the GPT and of a Llama; fsdp over tp 2 saved at step 5 and resumed under zero2 (dp 4), which
    returns (rank 0) its optimizer state as loaded, gathered whole."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        Trainer(cfg_for(root / "hsdp", "hsdp", ctx.world_size, *FP32, "train.micro_batch=2"), ctx).fit()
    finally:
        os.environ["LOCAL_WORLD_SIZE"] = str(ctx.world_size)
    tp2 = ("parallel.tp=2", "train.micro_batch=2", "train.checkpoint_async=false", *FP32)
    Trainer(cfg_for(root / "fsdp-tp2", "fsdp", ctx.world_size, *tp2), ctx).fit()
    Trainer(cfg_for(root / "fsdp-tp2-llama", "fsdp", ctx.world_size, *tp2, *LLAMA), ctx).fit()
    Trainer(cfg_for(root / "resumed", "fsdp", ctx.world_size, *tp2, f"train.steps={SAVED_AT}",
                    f"train.checkpoint_every={SAVED_AT}"), ctx).fit()
    resumed = Trainer(cfg_for(root / "resumed", "zero2", ctx.world_size, "train.micro_batch=2", *FP32,
                              "run.resume=true"), ctx)
    load_checkpoint(resumed)
    loaded = {key: value.full_tensor() if isinstance(value, DTensor) else value.clone()
              for key, value in resumed.strategy.view.state_dict()["optimizer"].items()}
    resumed.fit()
    return loaded if ctx.is_main else None


@pytest.mark.parametrize("strategy", ["dp", "ddp", "ddp-native", "zero1", "zero2", "fsdp", "hsdp", *SPLIT,
                                      "zero2-llama", "tensor-llama", "pipeline-llama", "fsdp-tp2-llama",
                                      "fsdp-ep2-moe"])
def test_muon_under_every_strategy_equals_single(runs, strategy):
    """GPT-tiny, whose fused qkv is orthogonalized part by part (under ZeRO, over tensor parallel and
    both by the matrix's owner rank, from every rank's part of it), a Llama (grouped-query
    attention: its key and value heads split over tp too) under zero2, tensor, pipeline and fsdp
    over tp 2, and gpt-moe (each expert its own matrix, its rank's experts
    sharded over the ranks holding them) under fsdp with ep 2: every step's loss within 1e-5
    relative, and the final weights within 2e-5. Why that much: the replicas' gradients are summed
    in another order (1e-7 relative), and Newton-Schulz multiplies a direction of small singular
    value by up to 3.4445**5 ~ 484, so after 10 steps weights differ by about 1e-6 (1.3e-6 seen
    under dp, whose replicas run in threads); one step moves an element by lr/sqrt(64) = 2.5e-3,
    and orthogonalizing the fused qkv whole instead moves the weights by 4e-2."""
    root, _ = runs
    single = "single-" + strategy.rpartition("-")[2] if strategy.endswith(("llama", "moe")) else "single"
    got, want = (read_records(root / name) for name in (strategy, single))
    assert len(got) == len(want) == STEPS
    for ours, theirs in zip(got, want, strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
    state, expected = (load_file(str(root / name / "model.safetensors")) for name in (strategy, single))
    assert_states_close(state, expected, rtol=1e-5, atol=2e-5)


def test_a_checkpoint_of_fsdp_over_tp_resumes_under_zero2(runs, tmp_path):
    """Saved under fsdp x tp 2 at step 5 and loaded under zero2 on 4 ranks: Muon's momentum and
    AdamW's moments, gathered whole, equal what was saved exactly; steps 6..10 equal fsdp x tp 2's
    uninterrupted run within 1e-5, its weights within 2e-5 (the test above says why)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root, loaded = runs
    (checkpoint,) = [p for p in (root / "resumed" / "checkpoints").iterdir() if p.name.startswith("step")]
    dcp_to_torch_save(checkpoint, tmp_path / "saved.pt")
    saved = torch.load(tmp_path / "saved.pt", weights_only=False)["optimizer"]
    assert loaded.keys() == saved.keys() and any(key.endswith("momentum_buffer") for key in saved)
    assert_states_close(loaded, saved, rtol=0, atol=0)
    got, want = (read_records(root / name) for name in ("resumed", "fsdp-tp2"))
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for ours, theirs in zip(got[SAVED_AT:], want[SAVED_AT:], strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
    state, expected = (load_file(str(root / name / "model.safetensors")) for name in ("resumed", "fsdp-tp2"))
    assert_states_close(state, expected, rtol=1e-5, atol=2e-5)


def test_a_fused_matrix_is_orthogonalized_part_by_part_and_experts_one_by_one():
    torch.manual_seed(0)
    qkv = torch.randn(12, 4)
    layout = MatrixLayout(parts=3)
    from shardwise.muon import _matrices

    parts = _matrices(qkv, layout)
    assert [tuple(p.shape) for p in parts] == [(4, 4)] * 3 and all(p.data_ptr() >= qkv.data_ptr() for p in parts)
    whole = orthogonalized(qkv, 5, torch.float32)
    each = torch.cat([orthogonalized(p, 5, torch.float32) for p in parts])
    assert not torch.allclose(whole, each, atol=1e-3)  # another update: the parts are not the whole
    experts = torch.randn(3, 4, 6)
    assert len(_matrices(experts, MatrixLayout(experts=True))) == 3
    # Newton-Schulz makes the singular values of a matrix near 1 (torch's quintic: within about 0.3)
    singular = torch.linalg.svdvals(orthogonalized(torch.randn(8, 16), 5, torch.float32))
    assert singular.min() > 0.6 and singular.max() < 1.3


@pytest.mark.parametrize("overrides, words", [
    (("parallel.strategy=fsdp-native", "launch.nproc=2"),
     "train.optimizer = 'muon': not under parallel.strategy = 'fsdp-native'"),
    (("parallel.strategy=zero2", "launch.nproc=2", "parallel.sharding.offload=optimizer"),
     "not with parallel.sharding.offload = 'optimizer'"),
    (("lora.rank=4",), "not with LoRA adapters yet"),
    (("parallel.strategy=param-server", "launch.nproc=3"), "not under parallel.strategy = 'param-server'"),
    (("parallel.precision=fp16-mixed",), "not with fp16's loss scaler yet"),
    (("train.muon.ns_steps=0",), "train.muon.ns_steps = 0"),
    (("model.name=mlp", "data.name=digits"), "model.name = 'mlp' has none"),
])
def test_what_muon_does_not_compose_with_yet_is_refused_before_launch(tmp_path, overrides, words):
    with pytest.raises(ConfigError) as error:
        cfg_for(tmp_path, "single", 1, *overrides)
    assert words in str(error.value) and "\n" not in str(error.value)


PLANNED = {**{name: Candidate(name, 2, 1, 1, "fp32", "none", 4) for name in ("ddp", "zero1", "zero2", "fsdp")},
           "tensor": Candidate("tensor", 1, 1, 2, "fp32", "none", 4),
           "pipeline": Candidate("pipeline", 1, 2, 1, "fp32", "none", 4, micro_batches=4, schedule="1f1b")}


@pytest.mark.parametrize("strategy", list(PLANNED))
def test_the_planner_predicts_muons_optimizer_bytes_to_the_byte(runs, strategy):
    """A momentum for each matrix of the blocks (its padded shard under ZeRO, its tp shard under
    tensor, a stage's under pipeline), AdamW's two moments and step for the rest: what the run's
    summary counted on rank 0, predicted exactly."""
    from shardwise.planner.memory_model import predict_memory

    root, _ = runs
    candidate = PLANNED[strategy]
    predicted = predict_memory(candidate, candidate.config(cfg_for(root / "plan", strategy, 2), 2))[0]
    (summary,) = read_records(root / strategy, "summary")
    assert summary["memory"]["optimizer"] == predicted.optimizer
    adamw = predict_memory(candidate, candidate.config(cfg_for(root / "plan", strategy, 2,
                                                               "train.optimizer=adamw"), 2))[0].optimizer
    assert predicted.optimizer < adamw  # a matrix's one momentum against AdamW's two moments


def test_the_planner_plans_muon_with_newton_schulz_and_refuses_named_parameters_in_one_line(tmp_path):
    """Every strategy Muon runs under is planned, its optimizer step costing Newton-Schulz's matmuls
    on top of AdamW's elementwise work (shared among tensor parallel's owners)."""
    from shardwise.planner import PlanError, load_profile, make_plan
    from shardwise.planner.timing import predict_step_time

    device = load_profile("cpu")
    plan = make_plan(cfg_for(tmp_path, "ddp", 2), 2, device)
    assert plan.recommended is not None and plan.recommended.candidate.strategy in MUON_STRATEGIES
    assert not any("muon" in why for why in plan.refused.values())  # tensor and pipeline meshes too
    for candidate in (Candidate("ddp", 2, 1, 1, "fp32", "none", 4), Candidate("tensor", 1, 1, 2, "fp32", "none", 8)):
        muon, adamw = (predict_step_time(candidate, cfg_for(tmp_path, candidate.strategy, 2, *more), device, 2)
                       for more in ((), ("train.optimizer=adamw",)))
        assert muon.optimizer_s > adamw.optimizer_s and muon.compute_s == adamw.compute_s
    with pytest.raises(PlanError, match=r"train.muon.params = \['blocks.\*'\]: the planner counts Muon's default"):
        make_plan(cfg_for(tmp_path, "ddp", 2, "train.muon.params=['blocks.*']"), 2, device)


def test_a_muon_run_resumes_from_its_checkpoint_exactly(tmp_path):
    """Muon's momentum and AdamW's moments saved at step 3 and loaded: steps 4..6 as the straight run's."""
    def config(out, steps: int, *more: str):
        return cfg_for(out, "single", 1, f"train.steps={steps}", "train.checkpoint_every=3",
                       "train.checkpoint_async=false", *more)

    train_in_process(config(tmp_path / "straight", 6))
    train_in_process(config(tmp_path / "resumed", 3))
    train_in_process(config(tmp_path / "resumed", 6, "run.resume=true"))
    got, want = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("resumed", "straight"))
    assert_states_close(got, want, rtol=0, atol=0)
    resumed = read_records(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == list(range(1, 7))  # steps 4..6 after the load, none again
    assert [r["loss"] for r in resumed] == [r["loss"] for r in read_records(tmp_path / "straight")]


def exchange_against_local(ctx, dtype: torch.dtype) -> None:
    """ShardedMatrices against LocalMatrices on the same whole values: parameters whose rows do not
    divide by the ranks (padded shards), an expert stack folded to be split within its experts, and
    a function of the whole value; every rank's rows of every result bit for bit."""
    from shardwise.parallel.shard import ShardGroup, Sharding
    from shardwise.parallel.whole_matrices import LocalMatrices, ShardedMatrices

    torch.manual_seed(0)
    dense = [nn.Parameter(torch.randn(shape)) for shape in ((5, 4), (8, 6), (3, 7), (6, 6))]
    experts = [nn.Parameter(torch.randn(1, 6, 4))]
    group, world, rank = dist.group.WORLD, ctx.world_size, ctx.rank
    sharding = Sharding(3, torch.device("cpu"), torch.float32, torch.float32, torch.float32)
    sharding.add(ShardGroup(group, world, rank, None, ()), [nn.Parameter(p.detach().clone()) for p in dense])
    sharding.add(ShardGroup(group, world, rank, None, (), experts=True),
                 [nn.Parameter(p.detach().clone()) for p in experts])
    shards = sharding.shards()
    wholes = [*dense, *experts]

    def function(index: int, whole: torch.Tensor) -> torch.Tensor:
        return whole * whole.square().sum() + index

    sharded = ShardedMatrices(sharding, LocalMatrices())
    got, want = {}, {}
    sharded.apply(shards, lambda i: shards[i].detach() * 2, function, dtype, got.__setitem__)  # shard-shaped values
    LocalMatrices().apply(wholes, lambda i: (wholes[i].detach() * 2).to(dtype), function, dtype, want.__setitem__)
    assert sorted(got) == sorted(want) == list(range(len(wholes)))
    for index, shard in enumerate(shards):
        ours, theirs = got[index], want[index]
        rows, shape = sharding.split_of(sharded.whole_of(shard))
        padded = torch.zeros(world * rows, *shape[1:], dtype=dtype)
        padded[: shape[0]] = theirs.reshape(shape)
        assert ours.dtype == dtype and ours.shape == shard.shape
        assert torch.equal(ours, padded[rank * rows : (rank + 1) * rows])
    assert sharding.bytes_moved > 0


def tensor_exchange_against_local(ctx, dtype: torch.dtype) -> None:
    """TensorMatrices against LocalMatrices: a fused column of 3 parts (each split on its own), a
    row-parallel matrix and one every tp rank holds whole; every rank's shard of every result bit
    for bit, and the whole shapes."""
    from shardwise.parallel.tensor_group import TensorShard
    from shardwise.parallel.whole_matrices import LocalMatrices, TensorMatrices

    torch.manual_seed(0)
    wholes = [torch.randn(12, 4), torch.randn(6, 8), torch.randn(5, 3)]
    splits = [TensorShard(0, parts=3), TensorShard(1), None]
    local = [nn.Parameter(w if split is None else split.take(w, ctx.rank, ctx.world_size))
             for w, split in zip(wholes, splits, strict=True)]
    matrices = TensorMatrices(dist.group.WORLD, {id(p): s for p, s in zip(local, splits, strict=True) if s})
    assert [matrices.shape_of(p) for p in local] == [w.shape for w in wholes]

    def function(index: int, whole: torch.Tensor) -> torch.Tensor:
        return whole * whole.square().sum() + index

    got, want = {}, {}
    matrices.apply(local, lambda i: local[i].detach(), function, dtype, got.__setitem__)
    LocalMatrices().apply(wholes, lambda i: wholes[i].to(dtype), function, dtype, want.__setitem__)
    for index, split in enumerate(splits):
        expected = want[index] if split is None else split.take(want[index], ctx.rank, ctx.world_size)
        assert torch.equal(got[index].to(dtype), expected), index


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_owner_rank_computes_each_whole_matrix_and_every_rank_gets_its_part(dtype):
    run_ranks(exchange_against_local, 2, dtype)
    run_ranks(tensor_exchange_against_local, 2, dtype)


def test_owners_take_the_heaviest_matrices_first_each_to_the_least_loaded_rank():
    from shardwise.parallel.whole_matrices import owners

    # 5 to rank 0; 3 to rank 1; 3 to rank 1 again (3 < 5); 1 to rank 0 (5 < 6)
    assert owners([1.0, 5.0, 3.0, 3.0], 2) == [0, 0, 1, 1]
    assert owners([2.0, 2.0], 4) == [0, 1]
