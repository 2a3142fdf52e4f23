"""Text from a trained GPT run: `shardwise sample RUN`, in this process, or with `--nproc N` on N
ranks under a strategy (the run's own by default), so that a model bigger than one rank is
sampled as it trained: each rank builds the model on the meta device, keeps its part, reads its
part of the run's `model.safetensors` (weights.py) and runs the forward its strategy runs (fsdp
gathers one unit at a time, a pipeline passes activations between stages). Every rank draws the
same token from the same generator; rank 0's is sent to all, so they agree even if their logits
differ in the last bit, and rank 0 prints the text.

    torchrun --nproc-per-node N -m shardwise.sampling RUN [--prompt TEXT] [--tokens N] [--seed S] [--strategy S]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from shardwise.config.load import load_config
from shardwise.config.schema import Config, ConfigError
from shardwise.data.prepare import BYTES, Tokenizer
from shardwise.models import build_model
from shardwise.validate import validate

WEIGHTS = "model.safetensors"


def generate(forward: Callable[[torch.Tensor], torch.Tensor], prompt: torch.Tensor, new_tokens: int, seq_len: int,
             generator: torch.Generator, temperature: float = 0.8, top_k: int = 40,
             agree: Callable[[torch.Tensor], torch.Tensor] = lambda token: token) -> torch.Tensor:
    """`prompt` ([batch, tokens]) continued by `new_tokens` tokens, each drawn from the top `top_k`
    of `forward`'s last logits at `temperature`, the context cut to the last `seq_len` tokens.
    `agree`: makes every rank's token rank 0's."""
    idx = prompt
    for _ in range(new_tokens):
        logits = forward(idx[:, -seq_len:])[:, -1, :].float() / temperature
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, [-1]]
        logits[logits < kth] = -float("inf")
        token = agree(torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator))
        idx = torch.cat([idx, token], dim=1)
    return idx


def run_config(run: Path, strategy: str | None = None, nproc: int = 1) -> Config:
    """The run's config for sampling on `nproc` ranks under `strategy` (the run's own if None), its
    model a GPT with weights written; ConfigError naming what is wrong, before any rank starts."""
    weights = run / WEIGHTS
    if not weights.is_file():
        raise ConfigError(f"{weights}: not found; train a run into {run} first")
    # A prompt is too short to split; its few tokens need no experts split either.
    overrides = ["parallel.cp=1", "parallel.ep=1", f"launch.nproc={nproc}", "launch.nnodes=1"]
    if strategy is not None:
        overrides.append(f"parallel.strategy={strategy}")
    cfg = load_config(run / "config.toml", overrides)
    if cfg.model.name not in ("gpt", "gpt-moe"):
        raise ConfigError(f"model.name = {cfg.model.name!r} in {run}: only a GPT (gpt, gpt-moe) generates text")
    if nproc == 1:
        cfg.parallel.strategy = "single"
    validate(cfg, world_size=nproc)
    return cfg


def sample_here(run: Path, prompt: str, tokens: int, seed: int) -> str:
    """Sample in this process: the whole model, read from the run's weights."""
    from safetensors.torch import load_model

    cfg = run_config(run)
    model = build_model(cfg.model)
    load_model(model, str(run / WEIGHTS))
    with torch.no_grad():
        out = generate(model.eval(), encode(prompt, cfg), tokens, cfg.model.seq_len,
                       torch.Generator().manual_seed(seed))
    return decode(out, cfg)


def tokenizer_of(cfg: Config) -> Tokenizer:
    """What the run was trained with: bytes, or data.path's data.tokenizer."""
    return Tokenizer(cfg.data.tokenizer if cfg.data.path is not None else BYTES)


def encode(prompt: str, cfg: Config) -> torch.Tensor:
    return torch.tensor([tokenizer_of(cfg).ids(prompt).tolist()], dtype=torch.long)


def decode(idx: torch.Tensor, cfg: Config) -> str:
    return tokenizer_of(cfg).decode(idx[0].tolist())


def sample_on_ranks(run: Path, prompt: str, tokens: int, seed: int, strategy: str | None) -> str | None:
    """On every rank of the process group torchrun made: the run's model under its strategy (or
    `strategy`), each rank keeping its part; the text on rank 0, None on the others."""
    import torch.distributed as dist

    from shardwise.dist import init_distributed, shutdown_distributed
    from shardwise.materialise import init_context
    from shardwise.strategies.classes import make_strategy
    from shardwise.weights import ModelNames, load_weights

    ctx = init_distributed(threads_per_rank=1)
    cfg = run_config(run, strategy, ctx.world_size)
    with init_context():
        model = build_model(cfg.model)
    names = ModelNames.of(model)
    runner = make_strategy(cfg.parallel, ctx, cfg.train.seed, lora=cfg.lora)
    wrapped = runner.wrap(model).eval()
    load_weights(runner, run / WEIGHTS, names)

    def forward(idx: torch.Tensor) -> torch.Tensor:
        with runner.precision.autocast(ctx.device):
            return wrapped(idx.to(ctx.device))

    def agree(token: torch.Tensor) -> torch.Tensor:
        token = token.to(ctx.device)
        dist.broadcast(token, src=0)
        return token.cpu()

    with torch.no_grad():
        out = generate(forward, encode(prompt, cfg), tokens, cfg.model.seq_len, torch.Generator().manual_seed(seed),
                       agree=agree)
    shutdown_distributed()
    return decode(out, cfg) if ctx.is_main else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m shardwise.sampling", description=__doc__)
    parser.add_argument("run_dir")
    parser.add_argument("--prompt", default="\n")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strategy")
    args = parser.parse_args(argv)
    text = sample_on_ranks(Path(args.run_dir), args.prompt, args.tokens, args.seed, args.strategy)
    if text is not None:
        print(text, flush=True)


if __name__ == "__main__":
    main()
