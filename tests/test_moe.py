"""Mixture-of-Experts: the layer computes what routing each token through its experts one by one
computes; its auxiliary loss and bias balancing do what they say; and expert parallel (experts
split over ep data-parallel ranks, tokens sent to them by all-to-all) trains as one device does,
holds 1/ep of the experts, and checkpoints to any ep size and to `single`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from helpers import CONFIGS, SGD, assert_same_training, gpt_tiny, losses, read_records, train_in_process

from shardwise.config.load import load_config
from shardwise.config.schema import ConfigError
from shardwise.dist import DistContext
from shardwise.models import build_model
from shardwise.models.moe import MoE, MoEConfig, loss_scale
from shardwise.parallel.dims import MeshShape
from shardwise.trainer import Trainer

STEPS, SAVED_AT = 10, 5
MOE_SIZES = ("model.n_experts=8", "model.top_k=2", "model.d_expert=64")
BIAS = ("model.balance=bias", "model.balance_rate=0.01")
# transformers' own MoE models, their code unchanged: experts of width d_ff (Mixtral), 64 (Qwen3-MoE)
MIXTRAL = ("model.name=hf-mixtral", "model.n_kv_head=1")
QWEN3_MOE = ("model.name=hf-qwen3-moe", "model.n_kv_head=1")
# DeepSeek-V3's architecture at a tiny size: MLA attention, a dense first block, group-limited sigmoid
# routing, a shared expert beside the routed ones (which are the ones ep splits)
TINY_DEEPSEEK_V3 = Path(__file__).parent / "deepseek-v3-tiny.json"
DEEPSEEK_V3 = ("model.name=hf-deepseek-v3", f"model.hf_config={json.dumps(str(TINY_DEEPSEEK_V3))}")
MIXTRAL_MHA = (*MIXTRAL, "model.n_kv_head=2")  # a key/value head for each of 2 tp ranks
# The first whose name a run's name holds is the run's reference (single-NAME) and model.
FAMILIES = {"mixtral-mha": MIXTRAL_MHA, "mixtral": MIXTRAL, "qwen3-moe": QWEN3_MOE, "deepseek-v3": DEEPSEEK_V3,
            "4-blocks": ("model.n_layer=4",), "2-experts": ("model.n_experts=2",)}


def cfg_for(out: Path, strategy: str, world: int, *overrides: str):
    """gpt-moe tiny (2 blocks of 8 experts, top-2) on Shakespeare; global batch 8 in micro-batches of
    2 (accumulated on fewer than 4 ranks); clipping at 0.5 (active). A model with a config.json
    (model.hf_config) has that file's sizes."""
    sizes = () if any(o.startswith("model.hf_config=") for o in overrides) else MOE_SIZES
    return gpt_tiny(out, strategy, world, "train.micro_batch=2", *SGD, "train.grad_clip=0.5", "model.name=gpt-moe",
                    *sizes, *overrides, steps=STEPS)


def layer(cfg: MoEConfig, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(16, cfg)
    for param in moe.parameters():
        torch.nn.init.normal_(param, std=0.3)
    return moe


def token_by_token(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through each of its chosen experts in turn, weighted: the layer's definition."""
    chosen, weights, _ = moe.route(x)
    rows = []
    for token, experts, weight in zip(x, chosen, weights, strict=True):
        row = sum(w * (F.gelu(token @ moe.experts.w_up[e]) @ moe.experts.w_down[e])
                  for e, w in zip(experts.tolist(), weight, strict=True))
        rows.append(row + (moe.shared(token) if moe.shared is not None else 0))
    return torch.stack(rows)


@pytest.mark.parametrize("score,shared", [("softmax", False), ("sigmoid", True)])
def test_the_layer_computes_each_token_through_its_chosen_experts(score, shared):
    """Output and every gradient as the token-by-token definition's: in float64, whose rounding in
    another summation order is far below the tolerance."""
    moe = layer(MoEConfig(6, 2, 24, score, "none", shared_expert=shared)).double()
    x = torch.randn(40, 16, dtype=torch.float64, requires_grad=True)
    got = moe(x)
    got.square().sum().backward()
    grads = [x.grad, *(p.grad for p in moe.parameters())]
    x.grad = None
    moe.zero_grad()
    want = token_by_token(moe, x)
    want.square().sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    for g, w in zip(grads, [x.grad, *(p.grad for p in moe.parameters())], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)


def test_the_auxiliary_loss_gets_the_gradient_it_would_have_had_in_the_loss():
    """Under loss_scale(s), backward of s x L gives the router the gradient of s x (L + aux), aux =
    coef x E x sum_e f_e P_e over the micro-batch's tokens, with f_e counted (no gradient)."""
    cfg = MoEConfig(4, 2, 8, "softmax", "aux-loss", aux_loss_coef=0.5)
    moe, x = layer(cfg), torch.randn(30, 16)
    with loss_scale(moe, 0.25):
        (0.25 * moe(x).sum()).backward()
    injected = moe.router.weight.grad.clone()
    moe.zero_grad()
    chosen, _, scores = moe.route(x)
    fraction = torch.bincount(chosen.flatten(), minlength=4).float() / chosen.numel()
    aux = 0.5 * 4 * (fraction * scores.mean(0)).sum()
    moe.eval()  # no auxiliary loss of its own
    (0.25 * (moe(x).sum() + aux)).backward()
    torch.testing.assert_close(injected, moe.router.weight.grad, rtol=1e-5, atol=1e-7)
    assert injected.abs().sum() > 0


def test_bias_balancing_moves_choices_towards_the_least_used_experts():
    """One update moves each bias by the rate against its load's side of the mean; repeated, it
    spreads tokens that all chose expert 0 over all four."""
    moe = layer(MoEConfig(4, 1, 8, "sigmoid", "bias", balance_rate=0.02))
    with torch.no_grad():
        moe.router.weight[0] = 0.5  # every token's first choice, by far
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(0)) + 1
    moe(x)
    routed = moe.routed.clone()
    assert routed.tolist() == [64, 0, 0, 0]
    moe.update_balance(routed)
    torch.testing.assert_close(moe.balance_bias, torch.tensor([-0.02, 0.02, 0.02, 0.02]))
    assert moe.routed is None
    for _ in range(100):
        moe(x)
        moe.update_balance(moe.routed)
    assert torch.bincount(moe.route(x)[0].flatten(), minlength=4).max() <= 2 * 64 / 4


def test_recomputed_blocks_count_their_tokens_once(tmp_path):
    """A checkpointed block's forward runs again in backward; the router's counts are not doubled."""
    counts = []
    for recompute in ("none", "blocks"):
        torch.manual_seed(0)
        model = build_model(cfg_for(tmp_path, "single", 1).model)
        if recompute == "blocks":
            from shardwise.recompute import apply_recompute

            apply_recompute(model, "blocks", "Block")
        model(torch.randint(0, 256, (2, 64))).float().mean().backward()
        counts.append([block.mlp.routed.tolist() for block in model.blocks])
    assert counts[0] == counts[1]
    assert sum(counts[0][0]) == 2 * 64 * 2


def test_gpt_moe_counts_its_active_parameters():
    """Of 8 experts, a token goes through 2: the FLOPs count 2 of 8 experts' weights."""
    model = build_model(cfg_for(Path("."), "single", 1).model)
    expert = 2 * 64 * 64  # w_up and w_down of one expert
    assert model.num_params() - model.active_params() == 2 * 6 * expert  # 2 layers x 6 idle experts


@pytest.mark.parametrize("overrides,message", [
    (("model.top_k=9",), "model.top_k = 9: each token is routed to top_k of the model.n_experts = 8"),
    (("parallel.ep=3",), "parallel.ep = 3: must divide model.n_experts = 8"),
    (("parallel.ep=4",), "parallel.ep = 4: the expert-parallel ranks are data-parallel ranks, so ep must divide dp = 2"
     ),
    (("model.name=gpt", "parallel.ep=2"), "parallel.ep = 2: splits the experts of Mixture-of-Experts layers"),
    (("parallel.strategy=model-parallel", "parallel.ep=2"),
     "parallel.strategy = 'model-parallel' does not split experts yet"),
    # 2 nodes of 3: an expert group of 2 would span both
    (("parallel.strategy=hsdp", "parallel.ep=2", "launch.nnodes=2", "launch.nproc=3", "train.global_batch=12"),
     "parallel.ep = 2: hsdp shards within a node, over its 3 data-parallel ranks, and an expert group must lie "
     "within them too; ep must divide 3"),
    (("parallel.strategy=fsdp", "parallel.ep=2", "model.n_experts=6", "launch.nproc=4"),
     "fsdp shards each ep rank's 3 experts over the dp / ep = 2 ranks that hold the same ones; they must divide "
     "evenly, or be fewer"),
    (("parallel.strategy=fsdp", "parallel.tp=2", "parallel.sequence_parallel=true"),
     "with model.balance = 'aux-loss': each tp rank routes its part of the sequence"),
    (("parallel.cp=2",), "model.balance = 'aux-loss' with parallel.cp = 2"),
    (("parallel.strategy=dp", "launch.nproc=1"), "dp's replicas would each route their part of a micro-batch"),
])
def test_bad_expert_settings_are_refused_before_any_worker_starts(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cfg_for(Path("."), "ddp", 2, *overrides)


# --- expert parallel on real ranks -------------------------------------------------------------

def ep_layer_with_idle_experts(ctx: DistContext) -> dict[str, torch.Tensor]:
    """A layer of 4 experts split over 2 ranks, routed so that rank 1's experts (2, 3) get no token
    from anyone: outputs and gradients on every rank, to compare with the whole layer's."""
    from shardwise.parallel.dims import Mesh
    from shardwise.parallel.experts import ExpertParallel

    moe = layer(MoEConfig(4, 2, 8, "softmax", "none"))
    with torch.no_grad():
        moe.router.weight[2:] = -100.0 * moe.router.weight[:2].abs().sum(0)  # never chosen
    model = torch.nn.Sequential(moe)
    experts = ExpertParallel(Mesh.of(ctx, MeshShape(dp_replicate=2, ep=2)), model)
    experts.split(model)
    x = torch.rand(8, 16, generator=torch.Generator().manual_seed(ctx.rank)).add(0.1).requires_grad_()
    y = model(x)
    y.square().sum().backward()
    experts.average_gradients()
    return {"y": y.detach(), "x_grad": x.grad, "router": moe.router.weight.grad,
            "w_up": moe.experts.w_up.grad * 2, "w_down": moe.experts.w_down.grad * 2}  # undo the mean over dp 2


def test_an_expert_no_token_reaches_neither_hangs_nor_breaks_the_result():
    got = run_ranks(ep_layer_with_idle_experts, 2)
    moe = layer(MoEConfig(4, 2, 8, "softmax", "none"))
    with torch.no_grad():
        moe.router.weight[2:] = -100.0 * moe.router.weight[:2].abs().sum(0)
    for rank in range(2):
        x = torch.rand(8, 16, generator=torch.Generator().manual_seed(rank)).add(0.1).requires_grad_()
        y = moe(x)
        y.square().sum().backward()
        torch.testing.assert_close(got[rank]["y"], y.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[rank]["x_grad"], x.grad, rtol=1e-5, atol=1e-6)
    for rank in range(2):  # expert gradients sum both ranks' tokens
        torch.testing.assert_close(got[rank]["w_up"], moe.experts.w_up.grad[2 * rank : 2 * rank + 2], rtol=1e-5,
                                   atol=1e-6)
    assert got[1]["w_up"].abs().sum() == 0 and got[0]["w_up"].abs().sum() > 0


TWO_RANK_RUNS = {
    "fsdp": ("fsdp",),  # experts sharded with the rest of their block, ep 1
    "ddp-ep2": ("ddp", "parallel.ep=2", f"train.checkpoint_every={SAVED_AT}"),
    "zero1-ep2-bias": ("zero1", "parallel.ep=2", *BIAS),
    "mixtral-ddp-ep2": ("ddp", "parallel.ep=2", *MIXTRAL),
    "qwen3-moe-fsdp-ep2": ("fsdp", "parallel.ep=2", *QWEN3_MOE),
    # the auxiliary loss injected on each stage, scaled as the pipeline scales a micro-batch's loss; it
    # is over a micro-batch's tokens, so the pipeline's micro-batches are single's (4 / 2 = 2 samples)
    "pipeline-pp2": ("pipeline", "parallel.pipeline.micro_batches=2", "train.micro_batch=4"),
    # sequence parallel: each tp rank's MoE layers route its half of the sequence, their gradients and
    # the router's counts summed over tp
    "tensor-sp-bias": ("tensor", "parallel.sequence_parallel=true", *BIAS),
}
FOUR_RANK_RUNS = {
    "ddp-ep4": ("ddp", "parallel.ep=4"),
    "ddp-ep2-dp4": ("ddp", "parallel.ep=2"),  # each expert on 2 ranks: its gradient summed over them
    # each ep rank's experts sharded over 2
    "fsdp-ep2": ("fsdp", "parallel.ep=2", f"train.checkpoint_every={SAVED_AT}"),
    # one expert per ep rank, fewer than the 2 ranks sharing it: split within the expert, half each
    "fsdp-ep2-2-experts": ("fsdp", "parallel.ep=2", *FAMILIES["2-experts"], f"train.checkpoint_every={SAVED_AT}"),
    # attention split over tp 2 (gpt-moe's plan), each tp rank's MoE layers whole, their experts over ep 2
    "fsdp-ep2-tp2": ("fsdp", "parallel.ep=2", "parallel.tp=2"),
    "fsdp-ep2-tp2-sp-bias": ("fsdp", "parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true", *BIAS),
    "deepseek-v3-fsdp-ep2": ("fsdp", "parallel.ep=2", *DEEPSEEK_V3),  # each ep rank's experts sharded over 2
    # transformers' Mixtral by its plan: attention split over tp 2, the MoE block whole, experts over ep 2
    "mixtral-mha-fsdp-ep2-tp2": ("fsdp", "parallel.ep=2", "parallel.tp=2", *MIXTRAL_MHA),
    "zero2-ep4-bf16-recompute": ("zero2", "parallel.ep=4", "parallel.precision=bf16-mixed",
                                 "parallel.recompute=blocks"),
    # 2 stages of one block, each stage's experts over its 2 dp ranks (micro-batches of 2, as single's)
    "pipeline-pp2-ep2": ("pipeline", "parallel.dp=2", "parallel.pp=2", "parallel.ep=2",
                         "parallel.pipeline.micro_batches=2",
                         "train.micro_batch=4", f"train.checkpoint_every={SAVED_AT}"),
    # the same stages sharded: fsdp over each stage's 2 dp ranks, the experts of each over ep 2
    "fsdp-pp2-ep2": ("fsdp", "parallel.dp=2", "parallel.pp=2", "parallel.ep=2", "parallel.pipeline.micro_batches=2",
                     "train.micro_batch=4"),
    # each sequence split over cp 2, the experts over ep 2: an expert's gradient summed over its dp and cp ranks
    "ddp-ep2-cp2-bias": ("ddp", "parallel.cp=2", "parallel.ep=2", *BIAS),
    "fsdp-ep2-cp2-bias": ("fsdp", "parallel.cp=2", "parallel.ep=2", *BIAS),  # each ep rank's sharded over cp
    # attention split over tp 2, the MoE layers whole on each tp rank, their experts over ep 2 (ours, transformers')
    "tensor-ep2-tp2": ("tensor", "parallel.dp=2", "parallel.tp=2", "parallel.ep=2"),
    "mixtral-mha-tensor-ep2-tp2": ("tensor", "parallel.dp=2", "parallel.tp=2", "parallel.ep=2", *MIXTRAL_MHA),
    # 2 stages on each rank (interleaved), each stage's experts over ep 2
    "pipeline-interleaved-ep2-4-blocks": ("pipeline", "parallel.dp=2", "parallel.pp=2", "parallel.ep=2",
                                          "parallel.pipeline.schedule=interleaved-1f1b",
                                          "parallel.pipeline.micro_batches=2",
                                          "train.micro_batch=4", "model.n_layer=4"),
}
# What share of every expert each rank holds: 1/ep, and under the sharded strategies 1/dp.
EXPERTS_HELD = {"ddp-ep2": 2, "zero1-ep2-bias": 2, "mixtral-ddp-ep2": 2, "qwen3-moe-fsdp-ep2": 2, "ddp-ep4": 4,
                "ddp-ep2-dp4": 2, "fsdp-ep2": 4, "fsdp-ep2-2-experts": 4, "fsdp-ep2-tp2": 2, "deepseek-v3-fsdp-ep2": 4,
                "fsdp-ep2-tp2-sp-bias": 2,
                "mixtral-mha-fsdp-ep2-tp2": 2, "zero2-ep4-bf16-recompute": 4,
                # half the blocks, 1/ep of theirs
                "pipeline-pp2-ep2": 4, "fsdp-pp2-ep2": 4, "pipeline-interleaved-ep2-4-blocks": 4,
                "tensor-ep2-tp2": 2, "mixtral-mha-tensor-ep2-tp2": 2, "ddp-ep2-cp2-bias": 2, "fsdp-ep2-cp2-bias": 4}


def train_runs(ctx: DistContext, root: Path, runs: dict[str, tuple[str, ...]]) -> dict[str, int]:
    """Each run; the expert elements this rank holds after it (whole, or its shards)."""
    held = {}
    for name, (strategy, *overrides) in runs.items():
        trainer = Trainer(cfg_for(root / name, strategy, ctx.world_size, *overrides), ctx)
        trainer.fit()
        held[name] = sum(p.numel() for n, p in trainer.strategy.view.named_parameters() if ".experts." in n)
    if ctx.world_size == 4:  # ddp ep 2's checkpoint at step 5 (2 ranks), resumed under fsdp, ep 2 x 2 shards
        resume(ctx, root / "ddp-ep2", root / "ddp-ep2-to-fsdp-ep2", "fsdp", "parallel.ep=2")
    return held


def resume(ctx: DistContext, run: Path, out: Path, strategy: str, *overrides: str) -> None:
    saved = f"step-{SAVED_AT:08d}"
    if ctx.is_main:
        shutil.copytree(run / "checkpoints" / saved, out / "checkpoints" / saved)
        (out / "checkpoints" / "latest").write_text(saved)
    if ctx.distributed:
        torch.distributed.barrier()
    Trainer(cfg_for(out, strategy, ctx.world_size, "run.resume=true", *overrides), ctx).fit()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict[str, list[int]]]:
    root = tmp_path_factory.mktemp("moe")
    train_in_process(cfg_for(root / "single", "single", 1))
    train_in_process(cfg_for(root / "single-bias", "single", 1, *BIAS))
    train_in_process(cfg_for(root / "single-bf16", "single", 1, "parallel.precision=bf16-mixed"))
    train_in_process(cfg_for(root / "single-mixtral", "single", 1, *MIXTRAL))
    train_in_process(cfg_for(root / "single-mixtral-mha", "single", 1, *MIXTRAL_MHA))
    train_in_process(cfg_for(root / "single-qwen3-moe", "single", 1, *QWEN3_MOE))
    train_in_process(cfg_for(root / "single-deepseek-v3", "single", 1, *DEEPSEEK_V3))
    train_in_process(cfg_for(root / "single-4-blocks", "single", 1, *FAMILIES["4-blocks"]))
    train_in_process(cfg_for(root / "single-2-experts", "single", 1, *FAMILIES["2-experts"]))
    held = {}
    for world, runs in ((2, TWO_RANK_RUNS), (4, FOUR_RANK_RUNS)):
        ranks = run_ranks(train_runs, world, root, runs, timeout=300)
        held.update({name: [rank[name] for rank in ranks] for name in runs})
    return root, held


@pytest.mark.parametrize("name", [name for name in [*TWO_RANK_RUNS, *FOUR_RANK_RUNS] if "bf16" not in name])
def test_expert_parallel_trains_as_one_device_does(runs, name):
    """Losses within 1e-5 relative and final weights (every expert, gathered) within rtol 1e-5 of
    single's, over 10 steps; with bias balancing, the biases too (they are buffers of the state)."""
    root, _ = runs
    reference = next((f"single-{family}" for family in ("bias", *FAMILIES) if family in name), "single")
    assert_same_training(root / name, root / reference, STEPS)


def test_expert_parallel_in_bf16_with_recomputed_blocks_trains_as_one_device_does(runs):
    """bf16 rounds differently on other batches of rows: the bound the other bf16 tests use. The
    recomputed blocks run their all-to-alls again in backward, on every rank alike."""
    root, _ = runs
    got, want = losses(root / "zero2-ep4-bf16-recompute"), losses(root / "single-bf16")
    assert len(got) == STEPS and max(abs(a - b) / b for a, b in zip(got, want, strict=True)) < 5e-4


def test_bias_balancing_changes_the_routing(runs):
    root, _ = runs
    plain, biased = (read_records(root / name)[-1]["router"]["tokens_per_expert"] for name in ("single", "single-bias"))
    assert plain != biased
    assert sum(plain[0]) == sum(biased[0]) == 8 * 64 * 2  # every pair of the global batch, counted once


def test_a_pipeline_reports_every_stage_s_layers(runs):
    """Rank 0 holds the first stage only; the record holds both blocks' routers, each counting
    every pair of the step's global batch."""
    root, _ = runs
    for record in read_records(root / "pipeline-pp2"):
        assert [sum(layer) for layer in record["router"]["tokens_per_expert"]] == [8 * 64 * 2] * 2


def test_the_ranks_report_the_load_of_each_ep_rank(runs):
    """Each step's pairs per ep rank are those of its experts, and the all-to-alls took time."""
    root, _ = runs
    for record in read_records(root / "fsdp-ep2"):
        router = record["router"]
        for experts, ranks in zip(router["tokens_per_expert"], router["tokens_per_ep_rank"], strict=True):
            assert ranks == [sum(experts[:4]), sum(experts[4:])]
        assert router["all_to_all_s"] > 0


@pytest.mark.parametrize("name", list(EXPERTS_HELD))
def test_each_rank_holds_its_share_of_the_experts(runs, name):
    """1/ep of the experts, and under the sharded strategies 1/(dp / ep) of those: counted."""
    root, held = runs
    family = next((overrides for key, overrides in FAMILIES.items() if key in name), ())
    model = build_model(cfg_for(Path("."), "single", 1, *family).model)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert held[name] == [experts // EXPERTS_HELD[name]] * len(held[name])


@pytest.mark.parametrize(("name", "candidate"), [
    # dp 2 x pp 2 with ep 2 (pp inner): each rank's stage, its experts cut to this ep rank's half, its
    # dense parameters sharded over the stage's 2 dp ranks
    ("fsdp-pp2-ep2", ("fsdp", 2, 2, 1, "fp32", "none", 4, 2, "1f1b")),
    # one expert an ep rank, split within it over the 2 ranks holding it
    ("fsdp-ep2-2-experts", ("fsdp", 4, 1, 1, "fp32", "none", 2)),
])
def test_fsdp_with_experts_holds_what_the_planner_predicts(runs, name, candidate):
    """Each rank's parameter and optimizer bytes, as predicted to the byte."""
    from shardwise.planner.candidates import Candidate
    from shardwise.planner.memory_model import predict_memory

    root, _ = runs
    strategy, *overrides = FOUR_RANK_RUNS[name]
    planned = Candidate(*candidate, ep=2)
    predicted = predict_memory(planned, cfg_for(root, strategy, 4, *overrides))
    for rank, held in enumerate(read_records(root / name)[-1]["memory_by_rank"]):
        stage = predicted[rank % planned.pp]
        assert (held["params"], held["optimizer"]) == (stage.params, stage.optimizer), rank


FAKE_WORLD = """
import json, sys
from bench.fake_world import rank_zero_of
from shardwise.config.load import load_config
from shardwise.planner.candidates import Candidate
from shardwise.planner.memory_model import predict_memory
from shardwise.trainer import Trainer
cfg = load_config(sys.argv[1], sys.argv[2:])
trainer = Trainer(cfg, rank_zero_of(32))  # set up only: a fake all-to-all would route garbage counts
experts = sum(p.numel() for n, p in trainer.strategy.view.named_parameters() if ".experts." in n)
predicted = predict_memory(Candidate("fsdp", 32, 1, 1, "fp32", "none", 1, ep=2), cfg)[0].params
print(json.dumps({"experts": experts, "params": trainer.strategy.memory(0).params, "predicted": predicted}))
"""


def test_8_experts_over_16_ranks_each_are_split_within_the_experts_on_a_fake_world(tmp_path):
    """fsdp at dp 32 with ep 2: each ep rank's 4 experts shared by 16 ranks. Their leading dims
    folded (4 experts x their rows) and split over the 16, each rank holds 1/32 of the experts, not
    a whole expert on 4 of them and padding on 12; and its parameters are what the planner predicts."""
    import subprocess
    import sys

    from helpers import REPO

    cfg = cfg_for(tmp_path, "fsdp", 32, "parallel.ep=2", "train.global_batch=32", "train.micro_batch=1")
    cfg.save(tmp_path / "config.toml")
    done = subprocess.run([sys.executable, "-c", FAKE_WORLD, str(tmp_path / "config.toml")], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    whole = sum(p.numel() for n, p in build_model(cfg.model).named_parameters() if ".experts." in n)
    assert got["experts"] == whole // 32
    assert got["params"] == got["predicted"]


def test_a_checkpoint_reshards_to_another_ep_size_and_to_one_process(runs, tmp_path):
    """ddp ep 2's checkpoint at step 5 (2 ranks) resumed on 4 ranks under fsdp with ep 2 x 2 shards;
    fsdp ep 2's (4 ranks, each expert's rows in pieces), fsdp ep 2's with one expert an ep rank
    (each half an expert: split within it) and pipeline pp 2 x ep 2's (each stage's experts in 2)
    resumed on one process under single: each continues as the straight single run does."""
    from shardwise.dist import init_distributed

    root, _ = runs
    threads = torch.get_num_threads()
    try:
        ctx = init_distributed(threads_per_rank=1)
        resume(ctx, root / "fsdp-ep2", tmp_path / "single", "single")
        resume(ctx, root / "pipeline-pp2-ep2", tmp_path / "single-from-pipeline", "single")
        resume(ctx, root / "fsdp-ep2-2-experts", tmp_path / "single-2-experts", "single", *FAMILIES["2-experts"])
    finally:
        torch.set_num_threads(threads)
    for resumed, straight in ((root / "ddp-ep2-to-fsdp-ep2", "single"), (tmp_path / "single", "single"),
                              (tmp_path / "single-from-pipeline", "single"),
                              (tmp_path / "single-2-experts", "single-2-experts")):
        got, want = losses(resumed), losses(root / straight)[SAVED_AT:]
        assert len(got) == STEPS - SAVED_AT
        for step, (a, b) in enumerate(zip(got, want, strict=True)):
            assert abs(a - b) <= 1e-5 * b, (resumed.name, step + SAVED_AT + 1)


# Published figures (model cards): Mixtral-8x7B 46.7B total, 12.9B active; Qwen3-30B-A3B 30.5B total and
# "3.3B activated", which its shapes make 3.353B (the card gives two digits).
PUBLISHED = {"mixtral-8x7b": (46.7e9, 12.9e9, 0.005), "qwen3-30b-a3b": (30.5e9, 3.35e9, 0.005)}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_the_shipped_moe_configs_count_the_published_parameters(name):
    """Built on the meta device as a run builds them: total parameters, and those a token computes
    with (top_k of n_experts experts, everything else whole)."""
    from shardwise.models.moe import active_parameters

    cfg = load_config(CONFIGS / f"{name}.toml")
    with torch.device("meta"):
        model = build_model(cfg.model)
    total, active, tolerance = PUBLISHED[name]
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(total, rel=tolerance)
    assert active_parameters(model, cfg.model.top_k) == pytest.approx(active, rel=tolerance)
