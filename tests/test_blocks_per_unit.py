"""Units of several blocks (`parallel.sharding.blocks_per_unit`), the host-bound step's lever: on 2
Gloo ranks the same training as a unit a block, bit for bit, with the collectives and hooks a step
counted (one all-gather and one reduce-scatter, and one hook each way, per unit rather than per
block), and the memory the planner predicts for them."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch
from distributed import run_ranks
from helpers import SGD, gpt_tiny, losses
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from shardwise.config.schema import ConfigError
from shardwise.dist import DistContext
from shardwise.parallel.shard import GatherHooks, Sharding
from shardwise.planner.candidates import Candidate
from shardwise.planner.model import fsdp_gathered_bytes, in_units, model_facts, model_shape
from shardwise.planner.phases import predict_setup_bytes
from shardwise.trainer import Trainer
from shardwise.validate import validate

STEPS = 10
BLOCKS = 4
PER_UNIT = (1, 2, 4)
STRATEGIES = ("zero2", "fsdp")
HEALTH_ROWS = 1  # the trainer's all-gather a step: each rank's loss, finiteness and time (health.py)


def cfg_for(out: Path, strategy: str, per_unit: int, *overrides: str):
    return gpt_tiny(out, strategy, 2, f"model.n_layer={BLOCKS}", *SGD, "train.micro_batch=2",
                    f"parallel.sharding.blocks_per_unit={per_unit}", *overrides, steps=STEPS)


class Collectives(TorchDispatchMode):
    """The collectives this process issues, by operator."""

    def __init__(self) -> None:
        super().__init__()
        self.issued: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func.overloadpacket.__name__
            self.issued[name] = self.issued.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


HOOKS = {"before_forward": (GatherHooks, "_before_unit_forward"), "after_forward": (GatherHooks, "_after_unit_forward"),
         "before_backward": (GatherHooks, "_before_unit_backward"), "grad_ready": (Sharding, "grad_ready")}


def one_step_counted(trainer: Trainer, step: int) -> dict[str, int]:
    """The collectives issued and the hooks fired in one optimizer step (no accumulation)."""
    calls = dict.fromkeys(HOOKS, 0)
    patches = []
    for name, (owner, method) in HOOKS.items():
        original = getattr(owner, method)

        def counted(*args, name=name, original=original, **kwargs):
            calls[name] += 1
            return original(*args, **kwargs)

        patches.append(mock.patch.object(owner, method, counted))
    collectives = Collectives()
    with patches[0], patches[1], patches[2], patches[3], collectives:
        trainer.run_step(step)
    return {**calls, **collectives.issued}


def units_runs(ctx: DistContext, root: Path) -> dict:
    """Every strategy and unit size trained into root/STRATEGY-K (2 micro-steps a step); then under
    fsdp without accumulation, each unit size's second step counted, its gathered peak and its
    setup's peak."""
    for strategy in STRATEGIES:
        for per_unit in PER_UNIT:
            Trainer(cfg_for(root / f"{strategy}-{per_unit}", strategy, per_unit), ctx).fit()
    found = {}
    for strategy in STRATEGIES:
        for per_unit in PER_UNIT:
            trainer = Trainer(cfg_for(root / f"counted-{strategy}-{per_unit}", strategy, per_unit,
                                      "train.micro_batch=4"), ctx)
            trainer.run_step(0)
            found[strategy, per_unit] = {
                "step": one_step_counted(trainer, 1), "units": len(trainer.strategy.sharding.units),
                "gathered_peak": trainer.strategy.sharding.peak_gathered_bytes,
                "setup": trainer.strategy.setup_peak_bytes}
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("units")
    return root, run_ranks(units_runs, 2, root)[0]


@pytest.mark.parametrize("per_unit", PER_UNIT[1:])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_units_of_several_blocks_train_as_a_unit_a_block_does_bit_for_bit(runs, strategy, per_unit):
    """The same shards gathered, the same gradients summed element by element (2 ranks: a + b in
    either packing): every step's loss and every final weight equal."""
    root, _ = runs
    assert losses(root / f"{strategy}-{per_unit}") == losses(root / f"{strategy}-1")
    got, want = (load_file(str(root / f"{strategy}-{k}" / "model.safetensors")) for k in (per_unit, 1))
    assert got.keys() == want.keys() and all(torch.equal(got[key], want[key]) for key in want)


@pytest.mark.parametrize("per_unit", PER_UNIT)
def test_fsdp_issues_a_gather_and_a_reduce_scatter_per_unit_and_a_hook_each_way(runs, per_unit):
    """gpt of 4 blocks, one micro-batch a step: the root's all-gather, each unit's before its forward
    and again before its backward (and the health check's of one row a rank); a reduce-scatter per
    unit and the root's; one hook before and one after each unit's forward, one as its backward
    starts. A gradient's hook still fires per parameter (autograd accumulates them one by one), but
    does a unit's work only at its last."""
    _, found = runs
    units = BLOCKS // per_unit
    step = found["fsdp", per_unit]["step"]
    assert found["fsdp", per_unit]["units"] == units + 1
    assert step["_allgather_base_"] == 1 + 2 * units + HEALTH_ROWS
    assert step["_reduce_scatter_base_"] == units + 1
    assert (step["before_forward"], step["after_forward"], step["before_backward"]) == (units, units, units)
    assert step["grad_ready"] == found["fsdp", 1]["step"]["grad_ready"] > 0


@pytest.mark.parametrize("per_unit", PER_UNIT)
def test_zero2_reduces_and_regathers_a_unit_at_a_time(runs, per_unit):
    """zero2: a reduce-scatter per unit in backward, an all-gather per unit after the step."""
    _, found = runs
    units = BLOCKS // per_unit
    step = found["zero2", per_unit]["step"]
    assert step["_reduce_scatter_base_"] == step["_allgather_base_"] - HEALTH_ROWS == units + 1


@pytest.mark.parametrize("per_unit", PER_UNIT)
def test_the_planner_predicts_the_gathered_and_setup_peaks_of_each_unit_size(runs, tmp_path, per_unit):
    """fsdp's gathered peak (the root, the unit computing, the next one's gather buffer) to the byte,
    but with a single unit, where none is issued ahead: its own buffer then, as it is copied out; its
    setup's (the shards made so far and one unit's blocks whole) within 10%."""
    _, found = runs
    base = cfg_for(tmp_path, "fsdp", per_unit, "train.micro_batch=4")
    facts = in_units(model_facts(model_shape(base.model)), per_unit)
    got = found["fsdp", per_unit]
    own_buffer = 4 * facts.unit_padded(2)[0] if facts.n_layer == 1 else 0
    assert got["gathered_peak"] == fsdp_gathered_bytes(facts, 2, base.parallel.sharding.prefetch, True, 4,
                                                       False) + own_buffer
    predicted = predict_setup_bytes(Candidate("fsdp", 2, 1, 1, "fp32", "none", 4), base)
    assert predicted == pytest.approx(got["setup"], rel=0.1)
    if per_unit > 1:
        assert got["gathered_peak"] > found["fsdp", 1]["gathered_peak"]


def test_a_unit_size_that_does_not_divide_the_blocks_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"blocks_per_unit = 3: must divide the model's blocks \(model.n_layer = 4\)"):
        validate(cfg_for(tmp_path, "fsdp", 3))
    validate(cfg_for(tmp_path, "ddp", 3))  # no units to group: as prefetch, it does not apply
