from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardwise.config import Config
from shardwise.dist import init_distributed
from shardwise.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


def read_records(run_dir: Path, event: str = "step") -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


@pytest.fixture
def tiny_config() -> Path:
    return CONFIGS / "gpt-tiny.toml"


def losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_records(run_dir)]


def train_in_process(cfg: Config) -> None:
    """Train `single` in this process as a world of one, with one thread like every worker
    (thread count changes summation order), restoring pytest's thread count after."""
    threads = torch.get_num_threads()
    try:
        Trainer(cfg, init_distributed(threads_per_rank=1)).fit()
    finally:
        torch.set_num_threads(threads)


def assert_same_training(run: Path, reference: Path, steps: int, weights: bool = True) -> None:
    """Per-step losses within 1e-5 relative and, with `weights`, every tensor of the final state
    dict (parameters and buffers) within rtol 1e-5."""
    got, want = losses(run), losses(reference)
    assert len(got) == len(want) == steps
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
    assert worst <= 1e-5, f"{run.name}: loss differs by {worst:.2e} relative from {reference.name}"
    if weights:
        state, expected = load_file(str(run / "model.safetensors")), load_file(str(reference / "model.safetensors"))
        assert state.keys() == expected.keys()
        for key in expected:
            torch.testing.assert_close(state[key], expected[key], rtol=1e-5, atol=1e-6, msg=key)
