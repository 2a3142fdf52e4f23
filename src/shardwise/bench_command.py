"""`shardwise bench NAME`: the benches of the checkout this shardwise runs from (bench/ beside src/,
not part of the installed package: they measure it), each started as bench/__init__.py's BENCHES
says, on its ranks or as a driver that starts its own jobs."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from shardwise.config.schema import ConfigError, LaunchConfig


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("bench", help="ours vs PyTorch native, or an option's variants, alternating in one run",
                            description="ddp, fsdp, pipeline, tensor: ours against PyTorch's own; mesh: fsdp over "
                            "tensor parallel (2 x 2) against FSDP2 over DTensor's; collectives: our "
                            "ring all-reduce against the backend's, and ddp's gradient compression against plain "
                            "ddp; recompute, precision: each policy or precision against the plain one; checkpoint: "
                            "save and load against a plain write of the same bytes, and async save; context: context "
                            "parallel at cp 1, 2 and 4 in both modes against sequence length; hardware: this "
                            "machine's matmul throughput per dtype and collective bandwidths, as a device profile "
                            "for `shardwise plan`; planner: the planner's predictions against real runs (the scenarios "
                            "with a slowed link between the ranks run over network namespaces, as root); ps: the "
                            "parameter server (sync, async), dp and ddp, whole jobs on the same model and workers; "
                            "multinode: ddp, fsdp and hsdp over 2 nodes (network namespaces; needs root) at 3 link "
                            "rates, communication share measured and predicted; scale: the largest GPT single, ddp, "
                            "zero2, fsdp and fsdp-native train within a memory budget, as whole jobs; gpu (CUDA only): "
                            "the device's ceilings, gpt-2-124m's tokens/s and MFU under single, ddp, zero2, fsdp "
                            "and fsdp-native, and fsdp, zero2, hsdp and pipeline as rank 0 of fake worlds of 8 and "
                            "64 against single; gpu-scale "
                            "(CUDA only): Llama-3-8B sharded 8, 16 and 64 ways on one GPU through the fake process "
                            "group, ours and FSDP2, against the planner; data: your own "
                            "corpus (data.path) prepared (on 1 process and on one per core) and read at 1 MiB and "
                            "1 GiB, against the demo model's step. Writes bench/results/NAME.json (and --json FILE).")
    p.add_argument("name", choices=list(benches()) or None, help="which benchmark (from a checkout of the "
                   "repository: bench/ lives beside src/)")
    p.add_argument("--steps", type=int, help="measured steps per variant, default 12 (checkpoint: rounds; scale: "
                   "steps each job trains, default 2; float8: steps each precision trains, default 300)")
    p.add_argument("--quick", action="store_true", help="the bench's shortest run, every part of it once, in "
                   "seconds: a check that it runs on this checkout, not a measurement (bench/results is left as "
                   "it was; --json still writes)")
    p.add_argument("--json", "--out", dest="json", help="also write the result to this file (for hardware: "
                   "the device profile `shardwise plan --device FILE` reads)")
    p.add_argument("--nproc", type=int, help="hardware: ranks to measure the collectives over (default 2)")
    p.add_argument("--budget-gib", type=float, help="scale: the memory of all of a job's ranks together (default 16)")
    p.add_argument("--parts", help="scale: search (the largest model per strategy), end (a 1B+ model's whole run, "
                   "every phase against the planner, and consolidate), or search,end (default)")
    p.add_argument("--end-of-run", metavar="STRATEGY:WIDTH", help="scale: the whole run to measure (default "
                   "fsdp:1792, a 1.23B GPT)")
    p.add_argument("--end-budget-gib", type=float, help="scale: the memory of the whole run's ranks together "
                   "(default 20)")


def checkout() -> Path | None:
    """The repository this shardwise runs from, where it holds bench/ beside src/ (the benches are
    not part of the installed package: they measure it from a checkout); None for an installed copy."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "bench" / "__init__.py").is_file() else None


def benches() -> dict[str, Any]:
    """The checkout's benches (bench/__init__.py's BENCHES: name -> Bench(module, ranks, quick)), read
    from that file alone, this process's import path left as it is; none without a checkout."""
    root = checkout()
    if root is None:
        return {}
    spec = importlib.util.spec_from_file_location("bench", root / "bench" / "__init__.py")
    registry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(registry)
    return registry.BENCHES


def run(args: argparse.Namespace) -> int:
    """`shardwise bench NAME`: its module under torchrun on its ranks, or its driver as one process."""
    from shardwise.launch import WorkerFailed, launch_workers

    root = checkout()
    if root is None:
        raise ConfigError("the benches run from a checkout of the shardwise repository (bench/ beside src/, after "
                          "`make setup`); this shardwise is an installed copy without them")
    every = benches()
    chosen = every[args.name]
    if args.quick and chosen.quick is None:
        quick = [name for name, other in every.items() if other.quick is not None]
        raise ConfigError(f"--quick: bench {args.name} has no short form; these have: {', '.join(quick)}")
    if args.nproc is not None and args.name != "hardware":
        raise ConfigError(f"--nproc {args.nproc}: only `bench hardware` takes a world size; "
                          f"{args.name} runs on {chosen.ranks}")
    scale_only = {"--budget-gib": args.budget_gib, "--parts": args.parts, "--end-of-run": args.end_of_run,
                  "--end-budget-gib": args.end_budget_gib}
    for flag, value in scale_only.items():
        if value is not None and args.name != "scale":
            raise ConfigError(f"{flag} {value}: only `bench scale` takes it")
    if args.name in ("gpu", "gpu-scale"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"bench {args.name} measures a GPU and no CUDA device is here; `python -m "
                              f"{chosen.module} --help` says how to run its jobs on the CPU to check the harness, "
                              "with no device figures")
    # The bench modules import `bench` from the checkout: in this process (the ranks' fork server is forked
    # from it, or started with its sys.path) and in every process a bench starts (PYTHONPATH).
    sys.path.insert(0, str(root))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    entry = [chosen.module, *flags(args, chosen, root)]
    if chosen.ranks == 0:  # a driver that launches its own jobs
        return subprocess.run([sys.executable, "-m", *entry]).returncode
    try:
        launch_workers(LaunchConfig(nproc=args.nproc or chosen.ranks), entry)
    except WorkerFailed as failure:
        print(f"shardwise bench: {failure}", file=sys.stderr)
        return 1
    return 0


def flags(args: argparse.Namespace, chosen: Any, root: Path) -> list[str]:
    """What `shardwise bench` passes the bench's module: where its result goes (the checkout `root`'s
    bench/results/NAME.json, which a quick run leaves alone: it measures nothing worth keeping), its
    steps, then the flags the user gave."""
    passed = []
    if args.quick:
        passed += chosen.quick
    else:
        passed += ["--json", str(root / "bench" / "results" / f"{args.name}.json")]
        own_steps = ("scale", "gpu", "gpu-scale", "faults", "crash", "float8")  # their own default steps
        if args.steps is None and args.name not in own_steps:
            passed += ["--steps", "12"]
    if args.steps is not None:
        passed += ["--steps", str(args.steps)]
    for flag in ("--budget-gib", "--parts", "--end-of-run", "--end-budget-gib"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            passed += [flag, str(value)]
    if args.json:
        passed += ["--json", args.json]
    return passed
