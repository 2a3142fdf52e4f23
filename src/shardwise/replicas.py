"""Replica groups that heal without restarting the job (`launch.replica_groups`), on torchft.

`shardwise train --replica-groups N` starts torchft's Lighthouse and N groups of launch.nproc ranks
each, on this machine, every rank forked from one server that imported torch and shardwise once
(launch.py); the launcher restarts a failed group as torchrun's agent would a job. Across N nodes
(`--nnodes N`), each node's launcher runs one group, node 0's hosting the Lighthouse. Each group is one
replica: a whole copy of the model, trained by its own strategy over its own ranks (ddp; or zero1,
zero2, fsdp, which shard it over the group's ranks: torchft's HSDP), with a share of each global
batch of its own. Across the groups, torchft's Manager does the rest, step by step:

- **A quorum** at the start of each step: the groups alive now (the Lighthouse's heartbeat).
- **Averaging.** After backward (and a sharded strategy's reduce-scatter within the group), each
  rank averages its gradients (its shards') and its loss with the same rank of every group in the
  quorum, in one all-reduce over a Gloo group the Manager remakes whenever the quorum changes.
- **Commit or roll back.** The optimizer steps only if every group in the quorum finished the
  step without an error (`should_commit`); otherwise no group applies it, and the step is tried
  again with the next quorum. A committed step is never applied twice.
- **Healing.** A group whose process died is restarted by the launcher, forked again
  (`launch.max_restarts`); the others do not stop. It joins the next quorum behind the others,
  and the Manager copies the model, optimizer and step from a live peer (over HTTP), not from a
  checkpoint; it then steps in lockstep with them. One whose restart outlasted the rest of the
  run finds every other group ended, and stops (NoPeerToHeal): there is no one to heal from.

**A bad step** (health.py: a non-finite loss or gradient, a loss spike) is re-run within its
group, before the groups average; a transient one costs the others only the wait. One that is
bad again is skipped by every group, or stops every group (`train.bad_step`): each group learns
of it in the same all-reduce, from one flag per group, so they stay equal. Stragglers are named
within a group.

While a group is missing, a step's global batch is the shares of the groups present, and the
average is over them: those steps differ from an uninterrupted run's. Every group writes its own
run directory, `RUN/replica-G/` (metrics.jsonl, checkpoints, final weights); their final weights
are equal. Checkpoints (`train.checkpoint_every`) are for the whole job's restart (`run.resume`):
each group resumes from its own newest, and the first quorum heals a group whose newest is older
from one whose is newest. A group restarted alone heals from a live one without reading them.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch

from shardwise.checkpoint import ensure_optimizer_state, training_state
from shardwise.config.schema import LaunchConfig
from shardwise.dist import DistContext, restart_count
from shardwise.fork_server import start_fork_server
from shardwise.gradients import local_grads
from shardwise.health import WatchedRun, checked_step, give_up
from shardwise.launch import ForkedRank, Stopped, signals_noted, stop_processes
from shardwise.memory import local_tensor

GROUP_ENV = "SHARDWISE_REPLICA_GROUP"  # which replica group a worker belongs to, set by the launcher
GROUPS_ENV = "SHARDWISE_REPLICA_GROUPS"  # how many there are
START_ENV = "SHARDWISE_REPLICA_START"  # HOST:PORT of the launcher's store, where the groups meet to start
ENDED_KEY = "ended"  # in that store, ENDED_KEY/G: group G has ended for good (its exit code)


def replica_group() -> int | None:
    """This worker's replica group, where the launcher started it as one (None otherwise)."""
    group = os.environ.get(GROUP_ENV)
    return int(group) if group is not None else None


def others_ended_keys(group: int) -> list[str]:
    """The keys of the launcher's start store that say every group but `group` has ended for good."""
    return [f"{ENDED_KEY}/{g}" for g in range(int(os.environ[GROUPS_ENV])) if g != group]


def replica_dir(out: str | Path, group: int) -> Path:
    return Path(out) / f"replica-{group}"


def launch_replica_groups(launch: LaunchConfig, entry: list[str]) -> list[int]:
    """Start a Lighthouse and launch.replica_groups groups of launch.nproc ranks each, running module
    entry[0] as a script with arguments entry[1:]; wait for them all and return the groups that
    failed for good (their restarts spent). Every group's ranks, and their restarts, are forked from
    one server that imported the entry module once. SIGTERM or SIGINT is passed on to every group
    and raises Stopped.

    Across nodes (launch.nnodes > 1) each node's launcher runs one group, its node rank's: node 0's
    hosts the Lighthouse (at the rendezvous port + 1) and the store where the groups meet (at the
    rendezvous endpoint), and outlives its own group until every group has ended (or
    launch.timeout_s has passed since), so that no group loses them while it trains."""
    from torch.distributed import TCPStore
    from torchft.coordination import LighthouseServer

    os.environ["OMP_NUM_THREADS"] = str(launch.threads_per_rank)  # the server's, so its ranks' too
    script = start_fork_server(entry[0])
    across = launch.nnodes > 1
    host, port = launch.rdzv_endpoint.rsplit(":", 1) if across else ("127.0.0.1", "0")
    hosting = not across or launch.node_rank == 0
    lighthouse = LighthouseServer(bind=f"[::]:{int(port) + 1 if across else 0}", min_replicas=1,
                                  join_timeout_ms=1000) if hosting else None
    # where the groups meet to start (a client's connection waits for node 0's to listen)
    start = TCPStore(host, int(port), is_master=hosting, wait_for_workers=False,
                     timeout=timedelta(seconds=launch.timeout_s))
    address = f"http://{host}:{int(port) + 1}" if across else lighthouse.address()
    # Across nodes a group is reached at its node's name: torchft's Manager advertises its store
    # (MASTER_ADDR) to the other groups, and its checkpoint server as socket.gethostname().
    own = (launch.node_addr or socket.gethostname()) if across else "127.0.0.1"
    env = dict(os.environ, TORCHFT_LIGHTHOUSE=address,
               **{START_ENV: f"{host}:{start.port}", GROUPS_ENV: str(launch.replica_groups)})
    groups = [launch.node_rank] if across else range(launch.replica_groups)
    running = {group: GroupRanks(group, launch, script, entry[1:], env, own) for group in groups}
    failed: list[int] = []
    try:  # the store and the Lighthouse live as long as the groups
        with signals_noted() as signalled:
            while running and not signalled:
                for group, ranks in list(running.items()):
                    code = ranks.poll()
                    if code is None:
                        continue
                    del running[group]
                    start.set(f"{ENDED_KEY}/{group}", str(code))  # a restarted group with no one left stops (begin)
                    if code:
                        print(f"replica group {group} failed for good (exit code {code}); the others go on",
                              file=sys.stderr, flush=True)
                        failed.append(group)
                time.sleep(0.1)
            if signalled:
                raise Stopped(f"stopped by signal {signalled[0].name}; every replica group was sent it too")
            if across and hosting:
                _outlast_the_groups(start, launch, signalled)
    finally:
        stop_processes([rank for ranks in running.values() for rank in ranks.ranks.values()],
                       launch.shutdown_timeout_s)
        if lighthouse is not None:
            lighthouse.shutdown()
    return failed


def _outlast_the_groups(start: Any, launch: LaunchConfig, signalled: list) -> None:
    """Node 0's launcher, its own group ended: wait until every other node's has (their launchers
    say so in the start store), or launch.timeout_s, or a signal."""
    keys = [f"{ENDED_KEY}/{group}" for group in range(launch.replica_groups)]
    deadline = time.monotonic() + launch.timeout_s
    while not start.check(keys) and time.monotonic() < deadline and not signalled:
        time.sleep(0.2)


class GroupRanks:
    """The ranks of one replica group, forked from the launcher's server; when one fails, the
    group's others are stopped and the whole group is started again (TORCHELASTIC_RESTART_COUNT
    one higher, a fresh rendezvous store), up to launch.max_restarts times: what torchrun's agent
    does for a job, here for every group in the launcher's one process. A restart is a fork, not
    an interpreter importing torch and shardwise again."""

    def __init__(self, group: int, launch: LaunchConfig, script: str, argv: list[str], env: dict[str, str],
                 address: str = "127.0.0.1") -> None:
        self.group, self.launch, self.script, self.argv, self.env = group, launch, script, argv, env
        self.address = address  # where the other groups reach this one's store (its node's name across nodes)
        self.restarts = 0
        self._start()

    def _start(self) -> None:
        from torch.distributed import TCPStore

        # one store each start: restarted Gloo groups meeting in a store that held the dead ones'
        # keys sometimes reach a dead peer's address or hang (launch.py)
        self.store = TCPStore(self.address, 0, is_master=True, wait_for_workers=False)
        n = self.launch.nproc
        env = dict(self.env, MASTER_ADDR=self.address, MASTER_PORT=str(self.store.port), WORLD_SIZE=str(n),
                   LOCAL_WORLD_SIZE=str(n), TORCHELASTIC_USE_AGENT_STORE="True",  # every rank a client of it
                   TORCHELASTIC_RESTART_COUNT=str(self.restarts), **{GROUP_ENV: str(self.group)})
        self.ranks = {rank: ForkedRank(self.script, self.argv, dict(env, RANK=str(rank), LOCAL_RANK=str(rank)))
                      for rank in range(n)}

    def poll(self) -> int | None:
        """None while the group runs (restarting it first if a rank failed and restarts are left);
        else its exit code: 0 once every rank ended well, a failed rank's once restarts are spent."""
        codes = {rank: process.poll() for rank, process in self.ranks.items()}
        failures = {rank: code for rank, code in codes.items() if code not in (None, 0)}
        if not failures:
            return 0 if all(code == 0 for code in codes.values()) else None
        stop_processes(list(self.ranks.values()), self.launch.shutdown_timeout_s)
        rank, code = next(iter(failures.items()))
        if self.restarts == self.launch.max_restarts:
            return code
        self.restarts += 1
        print(f"replica group {self.group}: rank {rank} exited with code {code}; restarting the group "
              f"({self.restarts} of {self.launch.max_restarts})", file=sys.stderr, flush=True)
        self._start()
        return None


class NoPeerToHeal(RuntimeError):
    """A restarted replica group found every other group ended: there is no one to heal from."""


class ReplicaGroups:
    """This rank's part in the replica groups: the torchft Manager of its group, which averages
    with the same rank of the other groups, commits or rolls back each step, and heals this group
    from a peer. `state` and `load`: the training state as a dict of tensors, and how to put one
    into the live model and optimizer."""

    def __init__(self, ctx: DistContext, group: int, timeout_s: float, state: Callable[[], dict[str, Any]],
                 load: Callable[[dict[str, Any]], None]) -> None:
        from torch.distributed import TCPStore
        from torchft import Manager, ProcessGroupGloo

        timeout = timedelta(seconds=timeout_s)
        self.group = group
        self.restarted = restart_count() > 0  # after a failure: it heals rather than starting with the others
        # A restarted group commits no step without a live one beside it: on a loaded machine the
        # Lighthouse can make it a quorum of its own (the others slower to ask than its join
        # timeout), and training on alone from step 0 it would never heal.
        fewest = 2 if self.restarted and int(os.environ[GROUPS_ENV]) > 1 else 1  # groups a commit needs
        self.manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=fewest, load_state_dict=load,
                               state_dict=state, replica_id=f"group{group}", use_async_quorum=False, timeout=timeout,
                               quorum_timeout=timeout, connect_timeout=timeout, rank=ctx.rank,
                               world_size=ctx.world_size)
        self.healed_at: list[int] = []  # the steps this group joined at by copying a peer's state
        host, port = os.environ[START_ENV].rsplit(":", 1)
        self._start = TCPStore(host, int(port), is_master=False, timeout=timeout)  # the launcher's
        if not self.restarted:
            self._meet(ctx.world_size, timeout)

    def _meet(self, ranks_per_group: int, timeout: timedelta) -> None:
        """At the first start, wait until every rank of every group is ready: the first quorum is then
        all of them, whichever group finished starting first (a restarted group does not wait)."""
        everyone = int(os.environ[GROUPS_ENV]) * ranks_per_group
        arrived = self._start.add("ready", 1)
        deadline = time.monotonic() + timeout.total_seconds()
        while arrived < everyone and time.monotonic() < deadline:
            time.sleep(0.01)
            arrived = self._start.add("ready", 0)

    def _check_a_peer_is_left(self) -> None:
        """Before a restarted group has healed: raise NoPeerToHeal if every other group has ended.
        Its restart may take longer than what the others had left to train (on a loaded machine,
        near a run's end); it would otherwise wait for a peer for ever, since it commits no step alone."""
        if self._start.check(others_ended_keys(self.group)):
            raise NoPeerToHeal(f"replica group {self.group} was restarted, but every other group had ended by "
                               "the time it was ready to heal from one; it stops without training further "
                               "(the others' directories hold the job's final weights)")

    def resume_at(self, step: int) -> None:
        """After this group loaded its checkpoint of `step` steps: the step it offers the next quorum,
        where a group that resumed from an older checkpoint (or none) heals from the newest."""
        self.manager.load_state_dict({"step": step, "batches_committed": self.manager.batches_committed()})

    def begin(self) -> int:
        """Start a step: the quorum of groups alive, this group healed from a peer if it is behind.
        Returns the steps committed so far, the step to take next."""
        if self.restarted and not self.healed_at:
            self._check_a_peer_is_left()
        before = self.manager.current_step()
        self.manager.start_quorum()
        step = self.manager.current_step()
        if step != before:
            self.healed_at.append(step)
        return step

    @property
    def participants(self) -> int:
        return self.manager.num_participants()

    @torch.no_grad()
    def average(self, tensors: list[torch.Tensor]) -> None:
        """Average `tensors` with the same rank of every group in the quorum, in place, in one
        all-reduce (packed). An error here is remembered by the Manager and rolls the step back."""
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        self.manager.allreduce(flat).wait()
        for tensor, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
            tensor.copy_(part.view_as(tensor))

    def commit(self) -> bool:
        """Whether every group in the quorum finished the step: apply it if so, else drop it."""
        return self.manager.should_commit()

    def close(self) -> None:
        self.manager.shutdown(wait=False)


class ReplicatedRun(WatchedRun, Protocol):
    """What a replica group's step needs of the trainer (its watch, `health`, may be None)."""

    replicas: ReplicaGroups
    committed: bool

    def staged(self) -> None: ...


def replicated_step(trainer: ReplicatedRun, step: int) -> torch.Tensor:
    """The trainer's step `step` in a replica group: its gradients and loss averaged with the other
    groups', applied only if every group in the quorum finished it (torchft's commit). Under the
    watch (health.py) a bad step is re-run within its group first; one that is bad again in any
    group is skipped by every group (or stops every group), so that they stay equal."""
    if trainer.health is None:
        loss, found = trainer.ctx.all_reduce_mean(trainer.forward_backward(step) / trainer.accum), None
    else:
        loss, found = checked_step(trainer, step)
    bad = torch.zeros(trainer.cfg.launch.replica_groups)  # which groups found the step bad again
    bad[trainer.replicas.group] = found is not None
    trainer.replicas.average([*local_grads(trainer.strategy.local_parameters()), loss, bad])
    trainer.committed = trainer.replicas.commit()
    if not trainer.committed:  # rolled back: tried again with the next quorum
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.last_step_skipped = True
        return loss
    if bad.any():
        groups = ", ".join(str(g) for g in bad.nonzero().flatten().tolist())
        if found is None:  # another group's: logged here too, each group's metrics saying what it did
            found = f"a bad step in replica group {groups}"
            trainer.health_events.append({"event": "bad_step", "step": step + 1, "found": found,
                                          "verdict": "deterministic", "action": trainer.cfg.train.bad_step,
                                          "replica_group": trainer.replicas.group})
            if trainer.ctx.is_main:
                print(f"replica group {trainer.replicas.group}, step {step + 1}: {found}; "
                      f"{trainer.cfg.train.bad_step}", file=sys.stderr)
        else:
            found = f"{found} in replica group {trainer.replicas.group}"
        give_up(trainer, step, found)
    else:
        trainer.last_step_skipped = not trainer.optimizer_step()
        if trainer.health is not None:
            trainer.health.accept(loss.item())
    trainer.skipped_steps += trainer.last_step_skipped
    return loss


def replica_state(trainer: ReplicatedRun) -> dict[str, Any]:
    """What a group healing from this one copies: model and optimizer state, this rank's part of
    each (live tensors: a sharded strategy's shards, which the same rank of every group holds alike)."""
    state = training_state(trainer, trainer.ctx.world_size, with_rng=False)
    return {part: {name: local_tensor(t) for name, t in entries.items()} for part, entries in state.items()}


def load_replica_state(trainer: ReplicatedRun, state: dict[str, Any]) -> None:
    """Put a peer group's state (`replica_state`'s) into this group's model and optimizer. A peer
    that has not stepped yet has no optimizer state (it is made lazily): neither then, for AdamW's
    step count would otherwise differ. A save in flight has copied what this overwrites first."""
    trainer.staged()
    if state["optimizer"]:
        ensure_optimizer_state(trainer.optimizer)
    else:
        trainer.optimizer.state.clear()
    live = replica_state(trainer)
    with torch.no_grad():
        for part in ("model", "optimizer"):
            for name, tensor in live[part].items():
                tensor.copy_(state[part][name])
    trainer.strategy.view.after_load()
