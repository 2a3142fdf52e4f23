"""Our ring all-reduce against the backend's, and `ddp`'s ring and gradient compression against
plain `ddp` and `single`, on real Gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from helpers import CONFIGS, SGD, assert_same_training, losses, read_records, train_in_process

from shardwise.config.load import load_config
from shardwise.dist import DistContext
from shardwise.models import build_model
from shardwise.parallel import comm as collectives
from shardwise.parallel.comm import ring_all_reduce, ring_bytes_sent
from shardwise.trainer import Trainer

# 0 and 1 element, primes, sizes divisible by none of 2, 3, 4 and by all of them
SIZES = (0, 1, 2, 3, 5, 7, 12, 64, 1001, 4099, 65_537)
DTYPES = (torch.int64, torch.int32, torch.float32, torch.bfloat16, torch.float16)
# Groups of 2, 3 and 4 of a 4-rank world: group ranks differ from global ranks in (1, 3) and (1, 2, 3).
GROUPS = ((0, 1), (1, 3), (0, 1, 2), (1, 2, 3), (0, 1, 2, 3))


def rank_input(size: int, dtype: torch.dtype, rank: int) -> torch.Tensor:
    """What `rank` contributes: reproducible anywhere, so every rank can compute the exact sum."""
    generator = torch.Generator().manual_seed(size * 100 + rank)
    if dtype.is_floating_point:
        return torch.randn(size, generator=generator).to(dtype)
    return torch.randint(-10**6, 10**6, (size,), generator=generator, dtype=dtype)


def compare_with_backend(ctx: DistContext, segment_sizes: dict[int, tuple[int, ...]]) -> list[dict]:
    """Every (segment size, group, dtype, size, sum or mean): ours and the backend's all_reduce on
    the same input. Integers must be equal; for floats, `error_ratio` is the largest difference
    over its bound: summing N values in another order moves each result by at most N - 1
    roundings of a running sum no larger than sum |x_i| (one more for a mean's division), so ours
    and the backend's differ by at most 2 (N - 1) eps sum |x_i| (/ N for a mean)."""
    # every rank makes every group; the whole world is the default group
    groups = {members: dist.new_group(list(members)) if len(members) < 4 else None for members in GROUPS}
    cases = []
    for segment_bytes, sizes in segment_sizes.items():
        collectives.SEGMENT_BYTES = segment_bytes
        for members, group in groups.items():
            if ctx.rank not in members:
                continue
            n = len(members)
            for dtype in DTYPES:
                for size in sizes:
                    for average in (False, True) if dtype.is_floating_point else (False,):
                        ours, theirs = rank_input(size, dtype, ctx.rank), rank_input(size, dtype, ctx.rank)
                        sent = ring_all_reduce(ours, group, average)
                        dist.all_reduce(theirs, op=dist.ReduceOp.AVG if average else dist.ReduceOp.SUM, group=group)
                        case = dict(members=members, dtype=dtype, size=size, average=average, segment=segment_bytes,
                                    sent=sent, rank=dist.get_rank(group), equal=torch.equal(ours, theirs))
                        if dtype.is_floating_point and size:
                            info = torch.finfo(dtype)
                            abs_sum = sum(rank_input(size, dtype, r).double().abs() for r in members)
                            # plus what rounding among subnormals can lose, where eps is no longer relative
                            bound = 2 * (n - 1) * info.eps * abs_sum / (n if average else 1) + n * info.tiny * info.eps
                            case["error_ratio"] = ((ours.double() - theirs.double()).abs() / bound).max().item()
                        cases.append(case)
    return cases


@pytest.fixture(scope="module")
def ring_cases() -> list[dict]:
    """One 4-rank world: the whole matrix with the default segment size, and the sizes up to 1001
    again with 40-byte segments (5 int64 or fp32, 10 bf16 elements), so that a chunk arrives in
    many segments, the last one short, through the two alternating buffers."""
    settings = {collectives.SEGMENT_BYTES: SIZES, 40: SIZES[:-2]}
    return [case for rank in run_ranks(compare_with_backend, 4, settings) for case in rank]


def cases_count(dtypes: int, modes: int) -> int:
    return dtypes * modes * (2 * len(SIZES) - 2) * sum(len(members) for members in GROUPS)


def test_ring_all_reduce_equals_the_backends_exactly_for_integers(ring_cases):
    integer_cases = [c for c in ring_cases if not c["dtype"].is_floating_point]
    assert len(integer_cases) == cases_count(dtypes=2, modes=1)
    for case in integer_cases:
        assert case["equal"], {k: case[k] for k in ("members", "dtype", "size", "segment")}


def test_ring_all_reduce_equals_the_backends_within_rounding_for_floats(ring_cases):
    float_cases = [c for c in ring_cases if c["dtype"].is_floating_point]
    assert len(float_cases) == cases_count(dtypes=3, modes=2)
    for case in float_cases:
        if case["size"]:
            assert case["error_ratio"] <= 1.0, case
    # On 2 ranks both add the same two numbers: equal to the bit.
    assert all(c["equal"] for c in float_cases if len(c["members"]) == 2)


def test_ring_all_reduce_counts_the_bytes_it_sends(ring_cases):
    for case in ring_cases:
        itemsize = torch.empty(0, dtype=case["dtype"]).element_size()
        assert case["sent"] == ring_bytes_sent(case["size"], itemsize, len(case["members"]), case["rank"])


def test_ring_sends_2_n_minus_1_over_n_of_the_tensor():
    for world in (2, 3, 4, 8):
        for numel in (0, 1, 7, 1000, 1001):
            per_rank = [ring_bytes_sent(numel, 4, world, rank) for rank in range(world)]
            assert sum(per_rank) == 2 * (world - 1) * numel * 4  # every chunk crosses 2 (N - 1) links
            assert max(per_rank) - min(per_rank) <= 2 * 4  # uneven chunks differ by one element
    assert ring_bytes_sent(1001, 2, 2, 0) == ring_bytes_sent(1001, 2, 2, 1) == 2002  # N = 2: the whole tensor


def test_ring_all_reduce_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="contiguous"):
        ring_all_reduce(torch.zeros(4, 4).T)
    with pytest.raises(TypeError, match="torch.int64 cannot hold a mean"):
        ring_all_reduce(torch.zeros(4, dtype=torch.int64), average=True)


# --- ddp with our ring and with compression ------------------------------------------------

PARITY_STEPS = 20
ACCURACY_STEPS = 200


def ddp_cfg(out: Path, steps: int, *overrides: str):
    return load_config(CONFIGS / "gpt-tiny.toml", [
        f"run.out={out}", f"train.steps={steps}", "train.eval_every=0", "parallel.strategy=ddp", "launch.nproc=2",
        *overrides,
    ])


def train_variants(ctx: DistContext, root: Path, runs: dict[str, tuple]) -> dict[str, int]:
    """Train each run in this world; return each one's bytes sent by this rank."""
    sent = {}
    for name, (steps, *overrides) in runs.items():
        trainer = Trainer(ddp_cfg(root / name, steps, *overrides), ctx)
        trainer.fit()
        sent[name] = trainer.strategy.bytes_sent
    return sent


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> tuple[Path, list[dict[str, int]]]:
    root = tmp_path_factory.mktemp("collectives")
    runs = {
        "plain": (PARITY_STEPS, *SGD),
        "ring": (PARITY_STEPS, *SGD, "parallel.ddp.all_reduce=ring", "parallel.ddp.bucket_mb=0.1"),  # several buckets
        "fp16": (PARITY_STEPS, *SGD, "parallel.ddp.grad_compression=fp16"),
        "bf16": (PARITY_STEPS, *SGD, "parallel.ddp.grad_compression=bf16", "parallel.ddp.all_reduce=ring"),
        "plain-200": (ACCURACY_STEPS,),
        "powersgd-200": (ACCURACY_STEPS, "parallel.ddp.grad_compression=powersgd", "parallel.ddp.bucket_mb=0.1"),
    }
    sent = run_ranks(train_variants, 2, root, runs)
    train_in_process(ddp_cfg(root / "single", PARITY_STEPS, *SGD, "parallel.strategy=single", "launch.nproc=1"))
    return root, sent


def gradient_elements() -> int:
    return sum(p.numel() for p in build_model(load_config(CONFIGS / "gpt-tiny.toml").model).parameters())


def test_ddp_with_our_ring_matches_ddp_and_single_device(ddp_runs):
    root, sent = ddp_runs
    assert_same_training(root / "ring", root / "plain", PARITY_STEPS)
    assert_same_training(root / "ring", root / "single", PARITY_STEPS)
    # On 2 ranks each rank sends the whole gradient once per step, in fp32, either way.
    for rank in sent:
        assert rank["ring"] == rank["plain"] == PARITY_STEPS * gradient_elements() * 4


@pytest.mark.parametrize("dtype, tolerance", [("fp16", 1e-5), ("bf16", 1e-4)])
def test_16_bit_compression_halves_the_bytes_and_trains_like_fp32(ddp_runs, dtype, tolerance):
    root, sent = ddp_runs
    for rank in sent:
        assert rank[dtype] * 2 == rank["plain"] == PARITY_STEPS * gradient_elements() * 4
    got, want = losses(root / dtype), losses(root / "plain")
    worst = max(abs(a - b) / b for a, b in zip(got, want, strict=True))
    assert worst <= tolerance, f"{dtype}: loss {worst:.1e} relative from fp32 within {PARITY_STEPS} steps"
    assert got[-1] < got[0] - 1.0  # and it does train


def test_powersgd_reaches_the_uncompressed_loss_within_5_percent_after_200_steps(ddp_runs):
    root, _ = ddp_runs
    compressed, plain = (read_records(root / run, "summary")[0] for run in ("powersgd-200", "plain-200"))
    for key in ("final_loss", "val_loss"):
        assert compressed[key] <= 1.05 * plain[key], f"{key}: {compressed[key]:.4f} vs {plain[key]:.4f} uncompressed"
    assert compressed["val_loss"] < 3.0  # it learned (a byte-level model starts near ln 256 = 5.5)


def test_powersgd_sends_rank_r_factors_instead_of_matrices(ddp_runs):
    """After its 10 plain steps, a compressed matrix of n x m costs r (n + m) numbers, a vector n."""
    _, sent = ddp_runs
    cfg = load_config(CONFIGS / "gpt-tiny.toml")
    rank, start = cfg.parallel.ddp.powersgd_rank, cfg.parallel.ddp.powersgd_start_step
    per_step = 0
    for param in build_model(cfg.model).parameters():
        rows, columns = param.shape[0], param[0].numel()
        compressed = param.dim() >= 2 and 2 * rank * (rows + columns) <= rows * columns
        per_step += rank * (rows + columns) if compressed else param.numel()
    plain_step = gradient_elements()
    for bytes_sent in sent:
        assert bytes_sent["powersgd-200"] == 4 * (start * plain_step + (ACCURACY_STEPS - start) * per_step)
        assert per_step * 8 < plain_step  # gpt-tiny's matrices are 64 wide: rank 4 sends 1/8 or less
