"""Elastic node ranges: a job of `launch.min_nnodes` to `launch.nnodes` nodes (torchrun's --nnodes
MIN:MAX) that goes on when a node is lost and grows again when one comes back.

torchrun's agent does the membership: a worker that loses a peer fails its collective, every node's
agent stops its workers and meets the others at the rendezvous again, which closes once the fewest
nodes have gathered and no more arrive for `LAST_CALL_S` (or all of them have); a node that comes back
waits there, and the running agents restart their workers to take it in. The workers start again at
the size the rendezvous made and resume from the newest checkpoint: they reshard to any world size,
and the sampler's global batches do not depend on it, so every step trains on the uninterrupted
run's samples; only each replica's accumulation changes (global batch / (dp x micro-batch)).

So the range is checked before launch at every size in it, as validate checks one: the mesh (tp,
pp, cp dividing it) and the global batch dividing into every size's replicas' micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable

from shardwise.config.registry import spec
from shardwise.config.schema import Config, ConfigError, LaunchConfig

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


def check_range(cfg: Config, validate_at: Callable[[Config, int], None]) -> None:
    """An elastic range (launch.min_nnodes set) a job can run over: from fewer nodes to more, under
    torchrun's agent (not replica groups, nor a strategy with a launcher of its own), restarting its
    workers (launch.max_restarts), and every size in it a world `validate_at(cfg, world)` accepts."""
    launch = cfg.launch
    if launch.min_nnodes is None:
        return
    what = f"launch.min_nnodes = {launch.min_nnodes} (--nnodes {launch.min_nnodes}:{launch.nnodes})"
    if not 1 <= launch.min_nnodes <= launch.nnodes:
        raise ConfigError(f"{what}: the fewest nodes must be between 1 and launch.nnodes = {launch.nnodes}, the "
                          "most")
    if launch.replica_groups > 1 or spec(cfg.parallel.strategy).own_launcher:
        other = f"launch.replica_groups = {launch.replica_groups}" if launch.replica_groups > 1 else \
            f"parallel.strategy = {cfg.parallel.strategy!r}"
        raise ConfigError(f"{what}: elastic jobs run under torchrun's agent; not with {other}, which starts its "
                          "ranks with a launcher of its own")
    if not launch.max_restarts:
        raise ConfigError(f"{what}: a lost node restarts the others' workers at the smaller size; give "
                          "launch.max_restarts >= 1 (--max-restarts R)")
    for nodes in sizes(launch)[:-1]:  # the most nodes: the world validate checks
        world = launch.nproc * nodes
        try:
            validate_at(cfg, world)
        except ConfigError as error:
            raise ConfigError(f"{what}: on {nodes} node(s), a world of {world}: {error}") from None
