"""What the tests share: paths, the configs parity runs train, running and reading runs, and the
parity assertions. Test modules import from here, never from each other (conftest.py holds the
shared fixtures)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file

from shardwise.config.load import load_config
from shardwise.config.schema import Config
from shardwise.dist import DistContext, init_distributed
from shardwise.memory import local_tensor
from shardwise.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
# What parity runs train with (assert_same_training says why not AdamW): on gpt-tiny it brings the loss
# from 5.57 to 3.58 in 20 steps, as AdamW at 3e-3 does (3.55).
SGD = ("train.optimizer=sgd", "train.lr=0.1", "train.momentum=0.9")
# CLI runs held to single's losses: 20 steps. gpt-tiny's loss jumps at step 20 (a hard batch), and
# AdamW carries each order of summation's rounding through the jump to about 1e-5 by step 30.
COMPARED_STEPS = 20


def gpt_tiny(out: Path, strategy: str, world: int, *overrides: str, steps: int) -> Config:
    """configs/gpt-tiny.toml as a test trains it: into `out`, `steps` steps of a global batch of 8,
    no evaluation on the way, `strategy` on `world` ranks; then `overrides` (section.key=value)."""
    return load_config(CONFIGS / "gpt-tiny.toml", [
        f"run.out={out}", f"train.steps={steps}", "train.global_batch=8", "train.eval_every=0",
        f"parallel.strategy={strategy}", f"launch.nproc={world}", *overrides])


def train_runs(ctx: DistContext, root: Path, runs: dict[str, tuple[str, ...]], cfg_for) -> None:
    """On these ranks (a pooled test call), each of `runs` (name -> strategy, *overrides) into
    root/NAME, configured by the test module's `cfg_for(out, strategy, world, *overrides)`."""
    for name, (strategy, *overrides) in runs.items():
        Trainer(cfg_for(root / name, strategy, ctx.world_size, *overrides), ctx).fit()


def counted_memory(ctx: DistContext, cases: list[tuple]) -> list[dict]:
    """What `memory` in metrics.jsonl reports on this rank after one step of each (planner
    candidate, base config): what the planner's predictions are held to (a pooled test call)."""
    out = []
    for candidate, base in cases:
        trainer = Trainer(candidate.config(base, ctx.world_size), ctx)
        trainer.train_step(0)
        out.append(trainer.strategy.memory(trainer.activation_bytes).as_dict())
    return out


def read_records(run_dir: Path, event: str = "step") -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


@contextlib.contextmanager
def inductor_cache_lock() -> Iterator[None]:
    """Held while a test compiles gpt-tiny's blocks at a micro-batch of 4 into inductor's cache on
    disk (test_compile.py's single run, test_commands.py's compiled line), for which the other
    waits: two pytest workers compiling the same kernels at once each compile all of them (on a
    fresh machine's empty cache the commands test's line took 35 s beside test_compile's); one
    after the other, the second finds them in the cache."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    directory = Path(cache_dir())
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "shardwise-tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_records(run_dir)]


def shardwise(*args: str, env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """The `shardwise` command, run to completion in `cwd`."""
    return subprocess.run(
        [sys.executable, "-m", "shardwise.cli", *args], cwd=cwd, capture_output=True, text=True,
        env={**os.environ, **(env or {})}, timeout=300,
    )


def train_in_process(cfg: Config) -> None:
    """Train `single` in this process as a world of one, with one thread like every worker
    (thread count changes summation order), restoring pytest's thread count after."""
    threads = torch.get_num_threads()
    try:
        Trainer(cfg, init_distributed(threads_per_rank=1)).fit()
    finally:
        torch.set_num_threads(threads)


class Crash(RuntimeError):
    """What `crash_at` raises."""


def crash_at(trainer: Trainer, step: int) -> Trainer:
    """Make the trainer fail when it reaches `step`, as a killed run would."""
    original = trainer.train_step

    def train_step(at: int) -> torch.Tensor:
        if at == step:
            raise Crash(f"crashed at step {step}")
        return original(at)

    trainer.train_step = train_step
    return trainer


def optimizer_tensors(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This rank's optimizer state, copied."""
    return {k: local_tensor(v).clone() for k, v in trainer.strategy.view.state_dict()["optimizer"].items()}


def in_process(fn, *args):
    """`fn(ctx, *args)` in this process as a world of one, with one thread like every worker."""
    threads = torch.get_num_threads()
    try:
        return fn(init_distributed(threads_per_rank=1), *args)
    finally:
        torch.set_num_threads(threads)


def assert_bit_identical(root: Path, optimizer_states: list[dict], steps: int) -> None:
    """root/resumed (crashed, resumed) ended as root/straight did: the same losses and weights, bit
    for bit, and every rank's optimizer state (`optimizer_states`: straight and resumed, per rank)."""
    assert losses(root / "resumed") == losses(root / "straight")  # the same losses, exactly
    assert [r["step"] for r in read_records(root / "resumed")] == list(range(1, steps + 1))
    weights, expected = load_file(str(root / "resumed" / "model.safetensors")), load_file(
        str(root / "straight" / "model.safetensors"))
    for key in expected:
        assert torch.equal(weights[key], expected[key]), key
    for state in optimizer_states:
        assert state["resumed"].keys() == state["straight"].keys() and state["straight"]
        for key in state["straight"]:
            assert torch.equal(state["resumed"][key], state["straight"][key]), key


CNN_STEPS = 20  # what cnn_config trains


def cnn_config(out: Path, strategy: str, nproc: int, sync: bool) -> Config:
    """The CNN with BatchNorm on digits, a global batch of 32 split over `nproc` ranks.
    SGD (assert_same_training says why), and gently: BatchNorm takes out each channel's mean and
    scale, so a convolution's weight gradient is a difference of nearly equal terms and carries
    their rounding error. At lr 0.05 this CNN's steps amplify it, to 1.2e-5 in the losses and
    3.4e-4 in the weights after 20 steps (ATEN_CPU_CAPABILITY=default against AVX-512); at 0.02
    they stay within 2e-7 on every kernel set tried."""
    return load_config(None, [
        "model.name=cnn", "model.width=8", "data.name=digits", f"run.out={out}", f"train.steps={CNN_STEPS}",
        "train.optimizer=sgd", "train.global_batch=32", f"train.micro_batch={32 // nproc}", "train.lr=0.02",
        "train.eval_every=0",
        f"parallel.strategy={strategy}", f"launch.nproc={nproc}", f"parallel.sync_batchnorm={str(sync).lower()}",
    ])


def assert_same_training(run: Path, reference: Path, steps: int, weights: bool = True) -> None:
    """Per-step losses within 1e-5 relative and, with `weights`, every tensor of the final state
    dict (parameters and buffers) within rtol 1e-5.

    Runs whose summation orders differ (ranks, micro-batches, split matrices) differ by rounding,
    and by a different amount on each CPU's kernels. Under SGD that noise stays of its own size in
    the weights, so rtol 1e-5 holds anywhere. AdamW divides each gradient by its running RMS, so
    where a gradient is about zero (the key bias of attention, a dead unit) the noise becomes a
    full step of either sign: weights trained by AdamW are not compared here (their losses are: a
    weight whose gradient is about zero moves the loss by about nothing)."""
    got, want = losses(run), losses(reference)
    assert len(got) == len(want) == steps
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
    assert worst <= 1e-5, f"{run.name}: loss differs by {worst:.2e} relative from {reference.name}"
    if weights:
        optimizers = {read_records(r, "summary")[0]["optimizer"] for r in (run, reference)}
        assert optimizers == {"sgd"}, f"weights compared after {optimizers}: train parity runs with SGD"
        state, expected = load_file(str(run / "model.safetensors")), load_file(str(reference / "model.safetensors"))
        assert state.keys() == expected.keys()
        assert_states_close(state, expected, rtol=1e-5, atol=1e-6)


def assert_states_close(got: dict, want: dict, rtol: float, atol: float, prefix: str = "") -> None:
    """Every tensor of `want` in `got` (under `prefix`) within the tolerance; a failure names the
    tensor and keeps torch's mismatch numbers, which CI's log is all there is to read."""
    for key, value in want.items():
        torch.testing.assert_close(got[prefix + key], value, rtol=rtol, atol=atol,
                                   msg=lambda message, key=key: f"{key}: {message}")


def assert_matches_single(run: Path, single: Path, steps: int) -> None:
    """Step losses and final parameters as `assert_same_training`, and the validation loss, which
    a pipeline computes through its stages and broadcasts."""
    assert_same_training(run, single, steps)
    (got,), (want,) = read_records(run, "summary"), read_records(single, "summary")
    assert abs(got["val_loss"] - want["val_loss"]) <= 1e-5 * want["val_loss"]
