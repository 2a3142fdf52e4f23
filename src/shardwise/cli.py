"""`shardwise` commands: parse, validate, hand off. No training logic lives here."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shardwise.bench import BENCHES
from shardwise.config import PRECISIONS, STRATEGIES, Config, ConfigError, load_config


def _add_train_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "train",
        help="train a model from a TOML config",
        description="Validate the config, then start the workers through torch.distributed.run. "
        "Flags override --set, which overrides the file.",
    )
    p.add_argument("config", help="TOML config file, e.g. configs/gpt-tiny.toml")
    p.add_argument("--strategy", choices=STRATEGIES, help="parallel.strategy")
    p.add_argument("--nproc", type=int, help="launch.nproc: worker processes on this node")
    p.add_argument("--steps", type=int, help="train.steps")
    p.add_argument("--out", help="run.out: run directory (metrics.jsonl, config.toml, model.safetensors)")
    p.add_argument("--seed", type=int, help="train.seed")
    p.add_argument("--precision", choices=PRECISIONS, help="parallel.precision")
    p.add_argument("--recompute", metavar="POLICY",
                   help="parallel.recompute: none, blocks, every:K or selective (activation checkpointing)")
    p.add_argument("--checkpoint-every", type=int, metavar="N", help="train.checkpoint_every: save every N steps")
    p.add_argument("--keep", type=int, metavar="K", help="train.keep_checkpoints: keep the newest K checkpoints")
    p.add_argument("--resume", action="store_true", default=None,
                   help="run.resume: continue from the newest good checkpoint in the run directory")
    p.add_argument("--max-restarts", type=int, metavar="K",
                   help="launch.max_restarts: restart the group up to K times after a worker dies; it resumes")
    p.add_argument("--debug-collectives", action="store_true", default=None,
                   help="launch.debug_collectives: check before every collective that all ranks make the same "
                   "call, and fail naming both calls at the first mismatch (slow; for hunting hangs)")
    p.add_argument("--dp", type=int, help="parallel.dp: model replicas (pipeline, model-parallel, tensor)")
    p.add_argument("--pp", type=int, help="parallel.pp: pipeline stages per replica")
    p.add_argument("--tp", type=int, help="parallel.tp: tensor-parallel ranks per stage")
    p.add_argument("--nnodes", type=int, help="launch.nnodes: nodes in the job")
    p.add_argument("--node-rank", type=int, help="launch.node_rank: this node's rank")
    p.add_argument("--rdzv-endpoint", help="launch.rdzv_endpoint: HOST:PORT of node 0's rendezvous")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any config key, e.g. --set train.lr=3e-4 (repeatable)")


def _train_config(args: argparse.Namespace) -> Config:
    flags = {
        "parallel.strategy": args.strategy,
        "launch.nproc": args.nproc,
        "train.steps": args.steps,
        "run.out": args.out,
        "train.seed": args.seed,
        "parallel.precision": args.precision,
        "parallel.recompute": args.recompute,
        "train.checkpoint_every": args.checkpoint_every,
        "train.keep_checkpoints": args.keep,
        "run.resume": args.resume,
        "launch.max_restarts": args.max_restarts,
        "launch.debug_collectives": args.debug_collectives,
        "parallel.dp": args.dp,
        "parallel.pp": args.pp,
        "parallel.tp": args.tp,
        "launch.nnodes": args.nnodes,
        "launch.node_rank": args.node_rank,
        "launch.rdzv_endpoint": args.rdzv_endpoint,
    }
    return load_config(args.config, args.set, flags)


def train(args: argparse.Namespace) -> int:
    from shardwise.launch import Stopped, WorkerFailed, launch_workers

    cfg = _train_config(args)
    config_path = Path(cfg.run.out) / "config.toml"
    cfg.save(config_path)
    try:
        launch_workers(cfg.launch, ["shardwise.worker", str(config_path)])
    except WorkerFailed as failure:
        print(f"shardwise train: {failure}", file=sys.stderr)
        return 1
    except Stopped as stopped:
        print(f"shardwise train: {stopped}; continue with --resume", file=sys.stderr)
        return 143
    return 0


def sample(args: argparse.Namespace) -> int:
    import torch
    from safetensors.torch import load_model

    from shardwise.models import GPT, build_model

    run = Path(args.run_dir)
    weights = run / "model.safetensors"
    if not weights.is_file():
        raise ConfigError(f"{weights}: not found; train a run into {run} first")
    cfg = load_config(run / "config.toml")
    model = build_model(cfg.model)
    if not isinstance(model, GPT):
        raise ConfigError(f"model.name = {cfg.model.name!r} in {run}: only a GPT generates text")
    load_model(model, str(weights))
    prompt = torch.tensor([list(args.prompt.encode())], dtype=torch.long)
    out = model.eval().generate(prompt, args.tokens, generator=torch.Generator().manual_seed(args.seed))
    print(bytes(out[0].tolist()).decode(errors="replace"))
    return 0


def bench(args: argparse.Namespace) -> int:
    from shardwise.config import LaunchConfig
    from shardwise.launch import WorkerFailed, launch_workers

    module, ranks = BENCHES[args.name]
    entry = [module, "--steps", str(args.steps), "--json", f"bench/results/{args.name}.json"]
    if args.json:
        entry += ["--json", args.json]
    try:
        launch_workers(LaunchConfig(nproc=ranks), entry)
    except WorkerFailed as failure:
        print(f"shardwise bench: {failure}", file=sys.stderr)
        return 1
    return 0


def consolidate(args: argparse.Namespace) -> int:
    from shardwise.checkpoint import CheckpointError, consolidate

    try:
        used = consolidate(Path(args.run_dir), Path(args.out))
    except CheckpointError as error:
        print(f"shardwise consolidate: {error}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} from {used}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shardwise", description="Distributed training for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_train_parser(commands)
    p = commands.add_parser("sample", help="generate text from a trained GPT run")
    p.add_argument("run_dir", help="a run directory written by `shardwise train`")
    p.add_argument("--prompt", default="\n", help="text to continue")
    p.add_argument("--tokens", type=int, default=200, help="bytes to generate")
    p.add_argument("--seed", type=int, default=0)
    p = commands.add_parser("bench", help="ours vs PyTorch native, or an option's variants, alternating in one run",
                            description="ddp, fsdp, pipeline, tensor: ours against PyTorch's own; collectives: our "
                            "ring all-reduce against the backend's, and ddp's gradient compression against plain "
                            "ddp; recompute, precision: each policy or precision against the plain one; checkpoint: "
                            "save and load against a plain write of the same bytes, and async save. Writes "
                            "bench/results/NAME.json (and --json FILE).")
    p.add_argument("name", choices=list(BENCHES), help="which benchmark")
    p.add_argument("--steps", type=int, default=12, help="measured steps per variant (checkpoint: rounds)")
    p.add_argument("--json", help="also write the result to this file")
    p = commands.add_parser("consolidate", help="write a run's newest checkpoint as one plain safetensors file",
                            description="Reads the newest good checkpoint of RUN_DIR, whatever strategy and world "
                            "size saved it, in one process, and writes its full model state dict.")
    p.add_argument("run_dir", help="a run directory with checkpoints/")
    p.add_argument("out", help="the .safetensors file to write")
    args = parser.parse_args(argv)
    handlers = {"train": train, "sample": sample, "bench": bench, "consolidate": consolidate}
    try:
        return handlers[args.command](args)
    except ConfigError as error:
        print(f"shardwise {args.command}: config error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
