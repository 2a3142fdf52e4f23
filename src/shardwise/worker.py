"""The worker entry point, one per rank, under torchrun:

    torchrun --nproc-per-node N -m shardwise.worker CONFIG [--set section.key=value ...]

`shardwise train` starts this through torch.distributed.run, each rank forked from a server that
imported it (launch.launch_workers). A worker names its process `shardwise rRANK`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from shardwise.config.load import load_config
from shardwise.config.registry import spec
from shardwise.dist import init_distributed, leave_process, name_worker, restart_count, shutdown_distributed
from shardwise.elastic import NODE_ADDR, lost_peer, reform
from shardwise.metrics import format_summary
from shardwise.peer_checkpoints import PeerCheckpoints, node_directory
from shardwise.replicas import replica_group
from shardwise.stalls import explain, is_collective_failure
from shardwise.strategies import param_server
from shardwise.trainer import Trainer, optimizer_factory
from shardwise.validate import validate


@record
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m shardwise.worker", description=__doc__)
    parser.add_argument("config", help="TOML config file")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args(argv)
    name_worker(int(os.environ.get("RANK", 0)), replica_group())
    cfg = load_config(args.config, args.set)
    launch = cfg.launch
    # The world the launcher actually made is what counts, whatever the file's launch.nproc says (and
    # an elastic job's nodes: those the rendezvous gathered, this node's rank among them).
    cfg.launch.nproc = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.launch.nproc))
    if cfg.launch.min_nnodes is not None and "GROUP_WORLD_SIZE" in os.environ:
        cfg.launch.nnodes, cfg.launch.node_rank = int(os.environ["GROUP_WORLD_SIZE"]), int(os.environ["GROUP_RANK"])
    validate(cfg, world_size=int(os.environ.get("WORLD_SIZE", 1)))
    servers = spec(cfg.parallel.strategy).parameter_servers
    if servers:
        ctx = param_server.join(cfg, optimizer_factory(cfg.train))
        if ctx is None:  # a parameter server, done serving
            return
    else:
        ctx = init_distributed(launch.backend, launch.timeout_s, launch.threads_per_rank, launch.debug_collectives)
    if (restart_count() > 0 or cfg.launch.min_nnodes is not None) and replica_group() is None:
        # The group was restarted after a failure: go on from the last checkpoint (a replica group heals
        # from a live one instead: replicas.py). An elastic job's workers start again at every change of
        # its nodes, a returning node's with no restart counted: every start goes on from the newest.
        cfg.run.resume = True
    if ctx.is_main:
        cfg.save(Path(cfg.run.out) / "config.toml")
    # An elastic job re-forms its world over the workers' rendezvous store when a node is lost: kept
    # here, since the process group that holds it (rank 0 serving it) is destroyed then.
    store = dist.distributed_c10d._get_default_store() if launch.min_nnodes is not None else None
    # An elastic job's memory checkpoints, in the node's shared memory: they outlive the process (a re-forming
    # in it, a restart by the agents, the world's growth), not the node
    peer_checkpoints = PeerCheckpoints(node_directory(cfg.run.out, os.environ.get(NODE_ADDR)), launch.nproc,
                                       fresh=not (Path(cfg.run.out) / "metrics.jsonl").exists()) \
        if cfg.train.memory_checkpoint_every else None
    generation = 0
    while True:
        trainer = None
        try:
            trainer = Trainer(cfg, ctx, peer_checkpoints)
            summary = trainer.fit()
            break
        except RuntimeError as error:
            lost = lost_peer(error) if store is not None else None
            if not (is_collective_failure(error) or lost):
                raise
            where = f"step {trainer.step + 1}" if trainer else "while setting up"
            if not lost:
                raise explain(error, ctx, launch.timeout_s, where) from error
            print(f"rank {ctx.rank}: a peer was lost at {where} ({lost})", file=sys.stderr, flush=True)
            reformed = reform(ctx, launch, store, generation, trainer.longest_step_s if trainer else 0.0)
            if reformed is None:
                raise explain(error, ctx, launch.timeout_s, where) from error
            print(f"rank {ctx.rank}: going on as rank {reformed.rank} of {reformed.world_size}", file=sys.stderr,
                  flush=True)
            ctx, generation = reformed, generation + 1
            launch.nnodes, launch.node_rank = ctx.world_size // launch.nproc, ctx.rank // launch.nproc
    if ctx.is_main:
        print(format_summary(summary), flush=True)
    if servers:
        param_server.leave(ctx, cfg)
    if peer_checkpoints is not None:
        peer_checkpoints.close()
    # Reached only on success: after a failure another rank may be gone, and a barrier would hang.
    shutdown_distributed()


if __name__ == "__main__":
    main()
    leave_process()
