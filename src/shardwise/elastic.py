"""Elastic node ranges: a job of `launch.min_nnodes` to `launch.nnodes` nodes (torchrun's --nnodes
MIN:MAX) that goes on when a node is lost and grows again when one comes back.

A lost node: the collective each surviving worker is in fails (its peer closed or reset the
connection, or never answered within launch.timeout_s). The survivors re-form the world in the
processes they are (`reform`): each destroys its process groups, so that every rank still waiting on
it fails at once, and one still computing at its next collective; they meet at the workers'
rendezvous store (rank 0's, kept alive through the groups' end) until all but one node's ranks are
there (else until none has arrived for SETTLE_S or a step's time); the first to have settled names
the members; and they make a world of them, ranks in their old order, and build the trainer again
at that size. No new process, no import, no rendezvous of the agents. Where that cannot be (node 0,
which holds the store, lost; survivors that are not whole nodes, or too few), the worker fails as
before and torchrun's agents restart the workers at the nodes their rendezvous gathers (it closes
once the fewest have met and no more arrive for LAST_CALL_S).

A node that comes back joins the agents' rendezvous; the running agents stop their workers (which
save a checkpoint at the end of the step, as on any SIGTERM, and a memory checkpoint before it where
the job keeps them) and start them again with it.

Every start, and every re-forming, goes on from the newest checkpoint (the newest the nodes hold
whole in memory, where the job keeps memory checkpoints: peer_checkpoints.py): checkpoints reshard
to any world size and the sampler's global batches do not depend on it, so every step trains on the
uninterrupted run's samples; only each replica's accumulation changes (global batch / (dp x
micro-batch)). So the range is checked before launch at every size in it, as validate checks one: the mesh
(tp, pp, cp dividing it) and the global batch dividing into every size's replicas' micro-batches.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from shardwise.config.registry import own_launcher_setting
from shardwise.config.schema import Config, ConfigError, LaunchConfig
from shardwise.dist import DistContext

# This node's launch.node_addr, as its launcher tells its workers: their config file (the run directory's,
# which every node's launcher writes) may hold another node's. Names the node's memory checkpoints.
NODE_ADDR = "SHARDWISE_NODE_ADDR"
# How long the rendezvous waits for more nodes once the fewest have gathered: the survivors of a lost
# node start again this much later; a node slower than this to join at the start joins at a restart.
LAST_CALL_S = 3


def node_range(text: str) -> tuple[int | None, int]:
    """`--nnodes N` or `--nnodes MIN:MAX` (torchrun's syntax) -> (min_nnodes or None, nnodes)."""
    fewest, _, most = text.rpartition(":")
    try:
        return (int(fewest) if fewest else None), int(most)
    except ValueError:
        raise ConfigError(f"--nnodes {text}: expected a number of nodes, or MIN:MAX for an elastic job "
                          "(e.g. 2:3)") from None


def sizes(launch: LaunchConfig) -> range:
    """The numbers of nodes the job may run on."""
    return range(launch.min_nnodes or launch.nnodes, launch.nnodes + 1)


def range_setting(launch: LaunchConfig) -> str:
    """An elastic range as a refusal names it."""
    return f"launch.min_nnodes = {launch.min_nnodes} (--nnodes {launch.min_nnodes}:{launch.nnodes})"


def check_range(cfg: Config, validate_at: Callable[[Config, int], None]) -> None:
    """An elastic range (launch.min_nnodes set) a job can run over: from fewer nodes to more, under
    torchrun's agent (not replica groups, nor a strategy with a launcher of its own), which may restart
    its workers (launch.max_restarts), and every size in it a world `validate_at(cfg, world)` accepts;
    memory checkpoints only in such a job, of two nodes or more."""
    launch, every = cfg.launch, cfg.train.memory_checkpoint_every
    if launch.min_nnodes is None:
        if every:
            raise ConfigError(f"train.memory_checkpoint_every = {every}: memory checkpoints restore the survivors of "
                              "a lost node in their own processes, an elastic job's: give a node range "
                              "(--nnodes MIN:MAX)")
        return
    what = range_setting(launch)
    if every and launch.nnodes < 2:
        raise ConfigError(f"train.memory_checkpoint_every = {every}: each rank's copy is kept on another node; "
                          f"{what} has one at most")
    if not 1 <= launch.min_nnodes <= launch.nnodes:
        raise ConfigError(f"{what}: the fewest nodes must be between 1 and launch.nnodes = {launch.nnodes}, the "
                          "most")
    own = own_launcher_setting(cfg.parallel.strategy, launch.replica_groups)
    if own is not None:
        raise ConfigError(f"{what}: elastic jobs run under torchrun's agent; not with {own}, which starts its "
                          "ranks with a launcher of its own")
    if not launch.max_restarts:
        raise ConfigError(f"{what}: where the others cannot go on in their own processes (node 0 lost), their "
                          "agents restart them at the smaller size; give launch.max_restarts >= 1 (--max-restarts R)")
    for nodes in sizes(launch)[:-1]:  # the most nodes: the world validate checks
        world = launch.nproc * nodes
        try:
            validate_at(cfg, world)
        except ConfigError as error:
            raise ConfigError(f"{what}: on {nodes} node(s), a world of {world}: {error}") from None


# --- re-forming the world in the surviving processes ------------------------------------------

# Survivors arrive at the store as their collectives fail; where more than one node's ranks are missing,
# the world is formed once none has arrived for this long, or a step's time if longer (a rank waiting on
# one that re-forms fails at once: that rank closed its connections; one computing, at its next collective).
SETTLE_S = 2.0
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting", "Read error")


def lost_peer(error: BaseException) -> str | None:
    """Gloo's words for a collective whose peer is gone (it closed or reset the connection, or never
    answered), where `error` is one."""
    if not isinstance(error, RuntimeError):
        return None
    return next((words for words in LOST_PEER if words in str(error)), None)


def reform(ctx: DistContext, launch: LaunchConfig, store: dist.Store, generation: int,
           step_s: float = 0.0) -> DistContext | None:
    """After a collective failed on a lost peer: this rank's process groups destroyed (every rank still
    waiting on it fails at once, one computing at its next collective: within a step, `step_s` at the
    longest), the survivors counted at `store` (the workers' rendezvous store, kept alive through the
    groups' end) until all but one node's ranks have arrived, or else none has for SETTLE_S or a step,
    whichever is longer, and whole nodes enough to go on have (launch.min_nnodes; at most
    launch.timeout_s), and a world of them made in this process, ranks in their old order. None where
    that cannot be: the survivors are not whole nodes, or fewer than launch.min_nnodes, or the store is
    gone with its node (then the agents restart the workers, as on any failure)."""
    dist.destroy_process_group()
    prefix = f"shardwise/elastic/{generation}"
    settle_s, fewest = max(SETTLE_S, step_s), (launch.min_nnodes or launch.nnodes) * launch.nproc
    try:
        store.set(f"{prefix}/rank/{ctx.rank}", "1")
        arrived, since = store.add(f"{prefix}/arrived", 1), time.monotonic()
        deadline = since + launch.timeout_s
        # All but one node's ranks: a node was lost, the rest are here. Fewer: wait for the others
        while arrived < ctx.world_size - launch.nproc and \
                (time.monotonic() - since < settle_s or (arrived < fewest and time.monotonic() < deadline)):
            time.sleep(0.1)
            now = store.add(f"{prefix}/arrived", 0)
            if now != arrived:
                arrived, since = now, time.monotonic()
        present = ",".join(str(r) for r in range(ctx.world_size) if store.check([f"{prefix}/rank/{r}"]))
        # The first to have settled names the world; one that arrives later is not in it (its agent restarts it)
        survivors = [int(r) for r in store.compare_set(f"{prefix}/members", "", present).decode().split(",")]
    except (RuntimeError, dist.DistStoreError):
        return None
    if ctx.rank not in survivors:
        return None
    nproc = launch.nproc
    nodes = sorted({r // nproc for r in survivors})
    if len(survivors) != len(nodes) * nproc or len(nodes) < (launch.min_nnodes or launch.nnodes):
        return None
    rank, world = survivors.index(ctx.rank), len(survivors)
    dist.init_process_group(ctx.backend, store=dist.PrefixStore(f"{prefix}/group", store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=launch.timeout_s))
    # What the rest of the process reads of its world (the node's size, its rank) says the new one
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), GROUP_RANK=str(rank // nproc),
                      GROUP_WORLD_SIZE=str(len(nodes)))
    return DistContext(rank, world, ctx.local_rank, ctx.device, ctx.backend)
