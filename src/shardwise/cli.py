"""`shardwise` commands: parse, validate, hand off. No training logic lives here."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from shardwise import bench_command, slurm
from shardwise.config.registry import NAMES, spec
from shardwise.config.schema import HF_MODELS, PRECISIONS, Config, ConfigError

# What reads a config (config.load, whose checks import torch) is imported by the commands that
# read one: `shardwise report` and `--help` start in a fraction of a second, not torch's second and more.


def _add_train_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "train",
        help="train a model from a TOML config",
        description="Validate the config, then start the workers through torch.distributed.run. "
        "Flags override --set, which overrides the file.",
    )
    p.add_argument("config", nargs="?", help="TOML config file, e.g. configs/gpt-tiny.toml; optional when "
                   "--hf-config, the flags and --set say everything (the rest keeps its defaults)")
    p.add_argument("--hf-config", metavar="CONFIG.JSON", help="model.hf_config: train the model a transformers "
                   "config.json (or the directory holding it) describes, any causal-LM family transformers builds, "
                   "of its sizes; sets model.name too")
    p.add_argument("--weights", metavar="PATH", help="model.weights: start from these safetensors weights, a file "
                   "or a directory of them (what from_pretrained reads)")
    p.add_argument("--strategy", choices=NAMES, help="parallel.strategy")
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
    p.add_argument("--replica-groups", type=int, metavar="N",
                   help="launch.replica_groups: N groups of --nproc ranks (ddp, zero1, zero2, fsdp), averaged and "
                   "healed by torchft (a group restarted after a failure copies a live one's state; the others go on)")
    p.add_argument("--tensorboard", action="store_true", default=None,
                   help="run.tensorboard: also write the metrics as TensorBoard scalars to OUT/tensorboard "
                   "(needs the tensorboard package: pip install 'shardwise[tensorboard]')")
    p.add_argument("--debug-collectives", action="store_true", default=None,
                   help="launch.debug_collectives: check before every collective that all ranks make the same "
                   "call, and fail naming both calls at the first mismatch (slow; for hunting hangs)")
    p.add_argument("--dp", type=int, help="parallel.dp: model replicas (pipeline, model-parallel, tensor)")
    p.add_argument("--pp", type=int, help="parallel.pp: pipeline stages per replica")
    p.add_argument("--tp", type=int, help="parallel.tp: tensor-parallel ranks per stage")
    p.add_argument("--ep", type=int, help="parallel.ep: expert-parallel ranks each MoE layer's experts are split over")
    p.add_argument("--nnodes", metavar="N|MIN:MAX", help="launch.nnodes: nodes in the job; MIN:MAX, an elastic "
                   "job going on from MIN to MAX nodes (launch.min_nnodes; needs --max-restarts)")
    p.add_argument("--node-rank", type=int, help="launch.node_rank: this node's rank")
    p.add_argument("--rdzv-endpoint", help="launch.rdzv_endpoint: HOST:PORT of node 0's rendezvous")
    p.add_argument("--node-addr", metavar="ADDR", help="launch.node_addr: this node's IP address on the network "
                   "the nodes share; the launcher and Gloo are set up to use the interface that holds it")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any config key, e.g. --set train.lr=3e-4 (repeatable)")


def _train_config(args: argparse.Namespace) -> Config:
    from shardwise.config.load import hf_config_overrides, load_config
    from shardwise.elastic import node_range

    if args.config is None and args.hf_config is None and not args.set:
        raise ConfigError("give a CONFIG file, or say what to train with --hf-config and --set, e.g. shardwise "
                          "train --hf-config MODEL/config.json --weights MODEL --set data.path=corpus.jsonl")
    fewest_nodes, nodes = node_range(args.nnodes) if args.nnodes else (None, None)
    flags = {
        "model.weights": args.weights,
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
        "launch.replica_groups": args.replica_groups,
        "launch.debug_collectives": args.debug_collectives,
        "run.tensorboard": args.tensorboard,
        "parallel.dp": args.dp,
        "parallel.pp": args.pp,
        "parallel.tp": args.tp,
        "parallel.ep": args.ep,
        "launch.min_nnodes": fewest_nodes,
        "launch.nnodes": nodes,
        "launch.node_rank": args.node_rank,
        "launch.rdzv_endpoint": args.rdzv_endpoint,
        "launch.node_addr": args.node_addr,
    }
    # Under srun, the step's nodes, this node's rank and the rendezvous host, unless flags say otherwise
    flags |= {key: value for key, value in slurm.slurm_launch(os.environ, args.nproc).items() if flags[key] is None}
    return load_config(args.config, [*hf_config_overrides(args.hf_config), *args.set], flags)


def train(args: argparse.Namespace) -> int:
    from shardwise.launch import Stopped, WorkerFailed, launch_local, launch_workers

    cfg = _train_config(args)
    rank = slurm.rank_environment(os.environ)  # under srun, several tasks a node: this task is a rank
    if rank is not None:
        slurm.check_task_per_rank(cfg)
    _check_before_launch(cfg)  # before anything is written or any worker starts
    config_path = Path(cfg.run.out) / "config.toml"
    cfg.save(config_path)
    if rank is not None:
        return slurm.train_as_rank(cfg, config_path, rank)
    entry = ["shardwise.worker", str(config_path)]
    try:
        strategy = spec(cfg.parallel.strategy)
        if cfg.launch.replica_groups > 1:
            from shardwise.replicas import launch_replica_groups

            failed = launch_replica_groups(cfg.launch, entry)
            if len(failed) == cfg.launch.replica_groups:
                print("shardwise train: every replica group failed; their errors are above", file=sys.stderr)
                return 1
            if failed:
                print(f"shardwise train: finished without replica group(s) {', '.join(map(str, failed))}",
                      file=sys.stderr)
        elif strategy.own_launcher:
            from shardwise.strategies.param_server import expendable_ranks  # the one strategy with its own launcher

            lost = launch_local(cfg.launch, entry, expendable_ranks(cfg))
            if lost:
                print(f"shardwise train: finished without worker rank(s) {', '.join(map(str, lost))}", file=sys.stderr)
        else:
            launch_workers(cfg.launch, entry)
    except WorkerFailed as failure:
        print(f"shardwise train: {failure}", file=sys.stderr)
        return 1
    except Stopped as stopped:
        print(f"shardwise train: {stopped}; continue with --resume", file=sys.stderr)
        return 143
    return 0


def _check_writable(what: str, directory: Path) -> None:
    """`directory`, or the nearest of its parents that exists, is a directory this process may
    write in; else ConfigError naming `what`. Nothing is made."""
    existing = directory
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{what} {str(directory)!r} cannot be made: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {str(directory)!r} cannot be written: no write permission on {existing}")


def _check_stage_boundaries(cfg: Config) -> None:
    """Where the model's pipeline stages would meet, it passes activations alone (stages.py's
    `check_stage_boundaries`), seen in a forward of two of its blocks on fake tensors; PlanError."""
    import torch

    from shardwise.models.hf import tp_plan_of
    from shardwise.models.plans import PlanError, locate, plan_for
    from shardwise.parallel.pipeline.stages import check_stage_boundaries
    from shardwise.planner.fake_forward import fake_model

    try:
        with fake_model(cfg.model, 2) as model:
            check_stage_boundaries(locate(model, plan_for(model, split=False)),
                                   torch.zeros(1, cfg.model.seq_len, dtype=torch.long))
    except PlanError:
        raise
    except Exception as error:  # noqa: BLE001 - the forward of a family fake tensors cannot follow
        family = tp_plan_of(cfg.model)[0] if cfg.model.name in HF_MODELS else cfg.model.name
        raise PlanError(f"{family}: shardwise cannot check where its pipeline stages would meet, on "
                        f"fake tensors ({type(error).__name__}: {str(error).splitlines()[0][:160]}); train it under "
                        "fsdp, or split it over tp") from None


def _check_before_launch(cfg: Config) -> None:
    """What would otherwise fail inside every worker, after a cluster's start-up: pretrained weights
    that do not fit the model (read from the files' headers against the model built on the meta
    device), LoRA targets that name no layer of it, a rank too large for one or a layer too narrow for
    NF4, a checkpoint to resume whose adapters differ from the run's, a tokenizer larger than the
    vocabulary, a corpus too short for one sequence, a run directory or checkpoint directory that
    cannot be written, an elastic range whose smallest world does not fit this node's GPU as the
    planner predicts it. Each raises ConfigError, one line."""
    _check_writable("run.out", Path(cfg.run.out))
    if cfg.launch.min_nnodes is not None:
        import torch

        from shardwise.planner.search import check_smallest_fits

        if torch.cuda.is_available():  # this node's GPU, less what its runtime takes before training (1 GiB)
            check_smallest_fits(cfg, torch.cuda.get_device_properties(0).total_memory - 2**30)
    if cfg.train.checkpoint_every:
        from shardwise.checkpoint import checkpoint_dir

        _check_writable(f"train.checkpoint_every = {cfg.train.checkpoint_every}: its directory",
                        checkpoint_dir(Path(cfg.run.out)))
    # `hf`, a family of no table of ours: whether transformers builds it, and its checkpoints' layout
    if cfg.model.weights is not None or cfg.lora.rank > 0 or cfg.model.name == "hf":
        from shardwise.hub_layout import HubLayout, UnsupportedLayout
        from shardwise.lora import LoraError, apply_lora
        from shardwise.materialise import Materialiser, check_one_device_kind, init_context
        from shardwise.models import build_model
        from shardwise.models.hf import decoder_layer_class
        from shardwise.models.plans import PlanError, locate, plan_for
        from shardwise.nf4 import QuantizeError, check_shape
        from shardwise.weights import WeightsError, check_weights

        try:
            with init_context():
                model = build_model(cfg.model)
        except Exception as error:  # transformers' own refusal of a family it cannot build here (a kernel missing)
            if cfg.model.name != "hf":
                raise
            raise ConfigError(f"model.hf_config = {cfg.model.hf_config!r}: transformers cannot build it "
                              f"({type(error).__name__}: {error})") from None
        if cfg.model.name == "hf" and cfg.model.weights is None:  # made from scratch: every tensor initialised
            try:
                check_one_device_kind(model, f"model.hf_config = {cfg.model.hf_config!r}")
                Materialiser(model, decoder_layer_class(model), cfg.train.seed).check_initialisable()
            except ValueError as error:
                raise ConfigError(f"model.hf_config = {cfg.model.hf_config!r}: shardwise cannot initialise it from "
                                  f"scratch ({error}); start from its pretrained weights (model.weights)") from None
        alone: tuple[str, ...] = ()  # layers tensor parallel splits on their own, which take no adapters
        _, pp, tp = cfg.parallel.mesh_shape(cfg.world_size)
        if pp > 1 or tp > 1:  # its plan fits the model built (not just its file)
            try:
                plan = locate(model, plan_for(model, split=tp > 1)).plan
                if pp > 1:
                    _check_stage_boundaries(cfg)
            except PlanError as error:
                raise ConfigError(f"parallel.strategy = {cfg.parallel.strategy!r}: {error}") from None
            alone = plan.gathered + plan.split_input if tp > 1 else ()
        try:
            HubLayout.of(model)  # a family whose checkpoints cannot be read and written a part at a time
            if cfg.model.weights is not None:
                check_weights(model, cfg.model.weights)
            if cfg.lora.rank > 0:  # its targets and rank against the model's layers
                adapted = apply_lora(model, cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.targets,
                                     cfg.train.seed, cfg.lora.train)
                if cfg.lora.quantize == "nf4":
                    for name in adapted:
                        check_shape(name, model.get_submodule(name).in_features)
                split_alone = [name for name in adapted if any(name.endswith(f".{layer}") for layer in alone)]
                if split_alone:
                    raise LoraError(f"lora.targets: {split_alone[0]} is split over tp on its own (its family's plan), "
                                    "which shardwise does not do with adapters yet; leave it out of lora.targets")
        except (WeightsError, LoraError, QuantizeError, UnsupportedLayout) as error:
            raise ConfigError(str(error)) from None
    if cfg.run.resume:
        from shardwise.checkpoint import LATEST, MANIFEST, CheckpointError, check_lora, checkpoint_dir

        latest = checkpoint_dir(Path(cfg.run.out)) / LATEST
        saved = latest.parent / latest.read_text().strip() if latest.is_file() else None
        try:  # a LoRA checkpoint resumed as a full fine-tune, or the reverse
            if saved is not None and (saved / MANIFEST).is_file():
                check_lora(saved, cfg.lora if cfg.lora.rank > 0 else None)
        except CheckpointError as error:
            raise ConfigError(str(error)) from None
    if _prepare_own_data(cfg) is not None:
        from shardwise.data import make_datasets

        make_datasets(cfg)  # reads no more than the prepared corpus's sizes; a short one is refused


def _prepare_own_data(cfg: Config, workers: int | None = None) -> Path | None:
    """data.path's corpus tokenized into the cache (a no-op once it is there) on `workers` processes
    (default: one per core, at most 8), or None without one."""
    if cfg.data.path is None:
        return None
    from shardwise.data import prepare

    prepare.check_vocabulary(cfg)
    if cfg.data.val_path is not None:  # what it names, checked before data.path's corpus is prepared
        prepare.sources_of(cfg.data, cfg.data.val_path, held_out=True)
    seq_len = cfg.model.seq_len
    out = prepare.prepare(cfg.data, cfg.data.path, progress=sys.stderr.isatty(), workers=workers, seq_len=seq_len)
    if cfg.data.val_path is not None:
        prepare.prepare(cfg.data, cfg.data.val_path, progress=sys.stderr.isatty(), workers=workers, held_out=True,
                        seq_len=seq_len)
    return out


def prepare_data(args: argparse.Namespace) -> int:
    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"--workers {args.workers}: must be at least 1")
    from shardwise.config.load import load_config

    cfg = load_config(args.config, args.set)
    out = _prepare_own_data(cfg, args.workers)
    if out is None:
        raise ConfigError(f"data.path is unset in {args.config}: the built-in corpus {cfg.data.name!r} needs no "
                          "preparing (set data.path, or --set data.path=FILE)")
    facts = json.loads((out / "manifest.json").read_text())
    print(f"{facts['path']}: {facts['documents']:,} documents, {facts['tokens']:,} tokens "
          f"({facts['tokenizer']}, vocabulary {facts['vocab_size']:,}) in {out}")
    return 0


def sample(args: argparse.Namespace) -> int:
    from shardwise.config.schema import LaunchConfig
    from shardwise.launch import WorkerFailed, launch_workers
    from shardwise.sampling import run_config, sample_here

    run = Path(args.run_dir)
    if args.nproc is None:
        if args.strategy is not None:
            raise ConfigError(f"--strategy {args.strategy}: sampling under a strategy runs on ranks; give --nproc N")
        print(sample_here(run, args.prompt, args.tokens, args.seed))
        return 0
    run_config(run, args.strategy, args.nproc)  # refuses what cannot run before any rank starts
    entry = ["shardwise.sampling", str(run), "--prompt", args.prompt, "--tokens", str(args.tokens),
             "--seed", str(args.seed), *(["--strategy", args.strategy] if args.strategy else [])]
    try:
        launch_workers(LaunchConfig(nproc=args.nproc), entry)
    except WorkerFailed as failure:
        print(f"shardwise sample: {failure}", file=sys.stderr)
        return 1
    return 0


def consolidate(args: argparse.Namespace) -> int:
    from shardwise.checkpoint import CheckpointError, consolidate

    try:
        used = consolidate(Path(args.run_dir), Path(args.out), progress=sys.stderr.isatty())
    except CheckpointError as error:
        print(f"shardwise consolidate: {error}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} from {used}")
    return 0


def export(args: argparse.Namespace) -> int:
    from shardwise.checkpoint import CheckpointError
    from shardwise.export import export_merged, export_peft
    from shardwise.weights import WeightsError

    try:
        if args.merged:
            used = export_merged(Path(args.run_dir), Path(args.out), progress=sys.stderr.isatty())
        else:
            used = export_peft(Path(args.run_dir), Path(args.out))
    except (CheckpointError, WeightsError) as error:
        print(f"shardwise export: {error}", file=sys.stderr)
        return 1
    what = "the merged model" if args.merged else "peft's adapter_config.json and adapter_model.safetensors"
    print(f"wrote {args.out} ({what}) from {used}")
    return 0


def report(args: argparse.Namespace) -> int:
    from shardwise.report import ReportError, write_report

    try:
        out = write_report([Path(d) for d in args.run_dirs], Path(args.out) if args.out else None)
    except ReportError as error:
        print(f"shardwise report: {error}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def _add_plan_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "plan", help="predict per-rank memory and step time of every strategy, ranked, with one recommended",
        description="Builds the model on the meta device, traces what it saves for backward on fake tensors, "
        "and for the strategies, meshes, precisions, recomputations and micro-batches the trainer accepts on this "
        "world size predicts each rank's bytes (params, grads, optimizer, activations, buffers, margin) and the "
        "step time (compute, communication, overlap); ranks those that fit and recommends one. Candidates that "
        "cannot win are pruned before they are costed (--all costs every one). Nothing is allocated or run.")
    p.add_argument("config", nargs="?", help="TOML config file (model and train sections are what matter); "
                   "optional with --hf-config")
    p.add_argument("--hf-config", metavar="CONFIG.JSON", help="plan the model a transformers config.json (or the "
                   "directory holding it) describes (any causal-LM family; read offline): sets model.name and "
                   "model.hf_config, whose sizes the model takes")
    world = p.add_mutually_exclusive_group()
    world.add_argument("--nproc", type=int, help="ranks on one node (default: the config's launch.nproc x nnodes)")
    world.add_argument("--nodes", type=int, help="nodes, each with --gpus-per-node ranks")
    p.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node with --nodes (default 8)")
    p.add_argument("--device", help="a preset (h100-sxm, h200, a100-80gb, cpu) or a profile JSON from "
                   "`shardwise bench hardware`; default: this machine's GPU if it is a preset, else cpu")
    p.add_argument("--memory-gb", type=float, help="GiB one rank may use (default: the device's memory less "
                   "what its runtime reserves)")
    p.add_argument("--margin", type=float, default=0.1, help="fraction added to every prediction for the "
                   "allocator (default 0.1)")
    p.add_argument("--precision", action="append", choices=PRECISIONS,
                   help="consider only these (repeatable; default fp32, bf16-mixed, fp16-mixed: bf16-true trains "
                   "differently, so only when named, or under [lora], whose frozen model it stores in bf16)")
    p.add_argument("--recompute", action="append", metavar="POLICY",
                   help="consider only these policies: none, blocks, every:K, selective (repeatable)")
    p.add_argument("--micro-batch", action="append", type=int, metavar="N",
                   help="consider only these micro-batches (default: every divisor of a replica's share)")
    p.add_argument("--max-batch", action="store_true",
                   help="also find each strategy's largest micro-batch that fits")
    p.add_argument("--measure", type=int, metavar="K", help="then train the K fastest-predicted candidates that "
                   "fit for a few steps on this machine's ranks, show predicted beside measured, and recommend "
                   "from the measurement")
    p.add_argument("--measure-steps", type=int, default=6, metavar="N", help="measured steps per candidate (default 6)")
    p.add_argument("--top", type=int, default=15, help="candidates shown in the table (default 15): the fastest "
                   "that fit, which the search costs before it stops")
    p.add_argument("--all", action="store_true", help="cost every candidate instead of pruning those that cannot "
                   "win (slower; --plot implies it)")
    p.add_argument("--json", help="write every number to this file (schema in docs/planner.md)")
    p.add_argument("--plot", metavar="FILE.png", help="draw step time against memory per rank for every "
                   "candidate, the device's memory as a line, the Pareto front marked (needs matplotlib)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any config key, e.g. --set train.global_batch=64 (repeatable)")


def _default_device() -> str:
    import torch

    from shardwise.planner import PRESETS

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name().lower()
        for preset in PRESETS:
            if preset.split("-")[0] in name:
                return preset
    return "cpu"


def plan(args: argparse.Namespace) -> int:
    from shardwise.config.load import hf_config_overrides, load_config
    from shardwise.planner import PlanError, format_plan, load_profile, make_plan, plan_json
    from shardwise.planner.candidates import POLICIES, default_precisions
    from shardwise.planner.table import format_measured
    from shardwise.recompute import parse_policy

    try:
        if args.config is None and args.hf_config is None:
            raise ConfigError("give a CONFIG file, --hf-config CONFIG.JSON, or both")
        cfg = load_config(args.config, [*hf_config_overrides(args.hf_config), *args.set])
        if args.nodes is not None:
            nodes, world = args.nodes, args.nodes * args.gpus_per_node
        else:
            nodes, world = 1, args.nproc if args.nproc is not None else cfg.world_size
        for policy in args.recompute or []:
            parse_policy(policy)
        result = make_plan(
            cfg, world, load_profile(args.device or _default_device()), nodes=nodes, memory_gb=args.memory_gb,
            margin=args.margin, precisions=tuple(args.precision or default_precisions(cfg)),
            policies=tuple(args.recompute or POLICIES), micro_batches=args.micro_batch, max_batch=args.max_batch,
            top=max(args.top, args.measure or 0), exhaustive=args.all or bool(args.plot))
    except (PlanError, ValueError) as error:
        print(f"shardwise plan: {error}", file=sys.stderr)
        return 2
    print(format_plan(result, args.top))
    if args.plot:
        from shardwise.planner.plot import write_plot

        try:
            write_plot(result, Path(args.plot))
        except PlanError as error:
            print(f"shardwise plan: {error}", file=sys.stderr)
            return 2
    if args.measure:
        from shardwise.measure import measure_plan

        try:
            measured = measure_plan(result, args.measure, args.measure_steps)
        except PlanError as error:
            print(f"shardwise plan: {error}", file=sys.stderr)
            return 1
        print(format_measured(measured))
    if args.json:
        document = plan_json(result)
        if args.measure:
            document["measured"] = measured
            document["recommended_measured"] = measured[0]
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(document, indent=1) + "\n")
    return 0 if result.recommended is not None else 1


def parser() -> argparse.ArgumentParser:
    """Every `shardwise` command's arguments."""
    parser = argparse.ArgumentParser(prog="shardwise", description="Distributed training for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_train_parser(commands)
    _add_plan_parser(commands)
    p = commands.add_parser("sample", help="generate text from a trained GPT run",
                            description="Continues a prompt with the run's final weights (RUN_DIR/model.safetensors): "
                            "in this process, or with --nproc on that many ranks under the run's strategy (or "
                            "--strategy), each rank holding its part of the model, as in training.")
    p.add_argument("run_dir", help="a run directory written by `shardwise train`")
    p.add_argument("--prompt", default="\n", help="text to continue")
    p.add_argument("--tokens", type=int, default=200,
                   help="tokens to generate (bytes, unless the run trained with a data.tokenizer)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nproc", type=int, help="ranks to sample on, under the run's strategy (default: this process)")
    p.add_argument("--strategy", choices=NAMES, help="with --nproc: the strategy to sample under (default: the run's)")
    bench_command.add_parser(commands)
    slurm.add_parser(commands)
    p = commands.add_parser("prepare-data", help="tokenize a config's own corpus (data.path) into the cache",
                            description="Reads data.path (.txt, .jsonl, .parquet, .arrow or .feather files, a "
                            "directory of them or a glob, or a Hugging Face dataset saved to disk) and writes its "
                            "token ids with data.tokenizer into a file in the cache ($SHARDWISE_CACHE, default "
                            "~/.cache/shardwise), with a manifest of its inputs, on a pool of processes; again, a "
                            "no-op until an input changes. `shardwise train` does this itself before its workers "
                            "start (docs/data.md).")
    p.add_argument("config", help="TOML config file with data.path")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value, e.g. --set data.path=corpus.jsonl (repeatable)")
    p.add_argument("--workers", type=int, metavar="N", help="processes that tokenize (default: one per core, at "
                   "most 8); the token file is the same for any N")
    p = commands.add_parser("consolidate", help="write a run's newest checkpoint as one plain safetensors file, or "
                            "an hf-* run's as a transformers model directory",
                            description="Reads the newest good checkpoint of RUN_DIR, whatever strategy and world "
                            "size saved it, in one process, a tensor at a time, and writes its model: to "
                            "OUT.safetensors every key of its state dict; for an hf-* run, to a directory OUT what "
                            "from_pretrained loads (model.safetensors under transformers' names, config.json, the "
                            "tokenizer's files).")
    p.add_argument("run_dir", help="a run directory with checkpoints/")
    p.add_argument("out", help="the .safetensors file to write, or (hf-* runs) the directory")
    p = commands.add_parser("export", help="a LoRA run's adapters in peft's format, or its merged model",
                            description="Reads the adapters of RUN_DIR's newest good checkpoint (a LoRA run's: "
                            "docs/finetuning.md), whatever strategy and world size saved them, and writes OUT, a "
                            "directory peft.PeftModel.from_pretrained loads onto the base model: "
                            "adapter_config.json and adapter_model.safetensors. With --merged it writes the merged "
                            "model instead, each adapter merged into the pretrained weight the run started from "
                            "(model.weights), a tensor at a time: OUT.safetensors, or for an hf-* run a directory "
                            "from_pretrained loads.")
    p.add_argument("run_dir", help="a LoRA run directory with checkpoints/")
    p.add_argument("out", help="the directory to write (--merged: a .safetensors file, or an hf-* run's directory)")
    p.add_argument("--merged", action="store_true", help="write the merged model, not the adapters")
    p = commands.add_parser("report", help="one HTML page of plots and a table comparing runs",
                            description="Reads each RUN_DIR's metrics.jsonl and writes one self-contained HTML "
                            "page (plots embedded as PNG, no network, no JavaScript): loss and validation loss "
                            "against step and training time, throughput, MFU, memory per rank by category, and "
                            "for pipeline runs each stage's busy and idle time in the last step; a summary table "
                            "above them. Needs matplotlib (pip install 'shardwise[plot]').")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories written by `shardwise train`")
    p.add_argument("--out", help="the HTML file to write (default: report.html beside the first RUN_DIR, "
                   "e.g. runs/report.html for runs/demo)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    handlers = {"train": train, "sample": sample, "bench": bench_command.run, "consolidate": consolidate, "plan": plan,
                "report": report, "prepare-data": prepare_data, "export": export, "slurm": slurm.run}
    try:
        return handlers[args.command](args)
    except ConfigError as error:
        print(f"shardwise {args.command}: config error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
