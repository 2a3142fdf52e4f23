"""Parameter-server training over RPC (`param-server`): servers hold the parameters and step the
optimizer; workers compute gradients.

A job of N ranks has S = `parallel.param_server.servers` servers (the last S ranks) and W = N - S workers
(ranks 0..W-1). Each server owns whole parameters, dealt out largest first to the least loaded
server, with their optimizer state. Each worker holds a copy of the model, computes gradients on
its share of each global batch, pushes each server the gradients of that server's parameters,
and copies back the parameters the server answers with. Everything travels by
torch.distributed.rpc (TensorPipe); servers keep their tensors on the CPU.

`parallel.param_server.mode = "sync"`: a step is two round trips. Push: a server sums the W workers' gradients in
worker order and averages them, and when the last one arrives it answers every worker with the
squared norm of its share of the average (or, after launch.timeout_s, fails them all naming the
workers that never pushed). The shares add up to the global norm, so every worker computes the
same clipping factor. Update: the first worker to send it makes the server clip and step; every
worker gets the new parameters. This is one process training on the global batch, exactly.

`parallel.param_server.mode = "async"`: a push carries the version (updates applied so far) of the parameters its
gradients were computed on. The server applies it at once if it is at most `parallel.param_server.max_staleness`
updates old, drops it otherwise, and answers with its current parameters and version. Workers
clip their own gradients and never wait for each other, so one that dies costs only its pushes;
they share no process group (each evaluates the whole validation set itself). Each server writes
what it applied, by staleness, to OUT/param-server-<s>.json.

The launcher (launch.launch_local, not torchrun) hosts the store and marks each rank's exit
there; a server serves until every worker has finished or exited.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch import nn
from torch.futures import Future

from shardwise.config.schema import Config, ConfigError, ParallelConfig
from shardwise.dist import DistContext, choose_backend, configure_process, job_store, rank_device, seed_everything
from shardwise.gradients import clip_coefficient, squared_norm
from shardwise.materialise import Materialiser, init_context
from shardwise.memory import return_free_memory
from shardwise.models import build_model
from shardwise.precision import make_precision
from shardwise.strategies.base import OptimizerFactory, Strategy, block_class

# An RPC waits this much longer than a server waits for the workers of a round, so that the
# server's error, which names the missing workers, is what a worker sees.
RPC_MARGIN_S = 15.0


def server_name(index: int) -> str:
    return f"ps{index}"


def assign_servers(sizes: list[int], servers: int) -> list[int]:
    """For each parameter (by element count), the server that owns it: largest first, each to the
    server holding the fewest elements so far (the lowest index on a tie)."""
    load = [0] * servers
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        owner[i] = min(range(servers), key=lambda s: load[s])
        load[owner[i]] += sizes[i]
    return owner


def server_share(params: list[nn.Parameter], servers: int, index: int) -> list[nn.Parameter]:
    """The parameters server `index` owns, in model order."""
    owner = assign_servers([param.numel() for param in params], servers)
    return [param for param, s in zip(params, owner, strict=True) if s == index]


def join(cfg: Config, make_optimizer: OptimizerFactory) -> DistContext | None:
    """Join the job. A server serves it to the end (`serve`) and returns None; a worker joins RPC,
    and in sync mode one process group of the workers (for the loss and the fp16 skip), and
    returns its context."""
    launch, p = cfg.launch, cfg.parallel
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    workers = world - p.param_server.servers
    configure_process(launch.threads_per_rank, launch.debug_collectives)
    if rank >= workers:
        serve(cfg, rank - workers, workers, make_optimizer)
        return None
    _init_rpc(f"worker{rank}", cfg)
    backend = choose_backend(launch.backend)
    device = rank_device(backend, rank)
    if p.param_server.mode == "sync" and workers > 1:
        store = dist.PrefixStore("workers", job_store(launch.timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=workers,
                                timeout=timedelta(seconds=launch.timeout_s))
    return DistContext(rank, workers, rank, device, backend)


def _init_rpc(name: str, cfg: Config) -> None:
    """Join RPC; returns once every rank of the job has (a rendezvous through the store)."""
    options = rpc.TensorPipeRpcBackendOptions(init_method="env://", rpc_timeout=cfg.launch.timeout_s + RPC_MARGIN_S)
    rpc.init_rpc(name, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                 rpc_backend_options=options)


def expendable_ranks(cfg: Config) -> frozenset[int]:
    """Ranks the job may finish without: under `async`, a lost worker, except rank 0, which writes
    the run (the launcher, launch.launch_local, goes on without them)."""
    workers = cfg.parallel.mesh_shape(cfg.world_size)[0]
    return frozenset(range(1, workers)) if cfg.parallel.param_server.mode == "async" else frozenset()


def leave(ctx: DistContext, cfg: Config) -> None:
    """A worker is done: tell the servers (through the store) and close RPC: in sync mode together
    with every rank, in async mode at once, as other workers may be gone."""
    job_store(cfg.launch.timeout_s).set(f"finished/{ctx.rank}", "1")
    rpc.shutdown(graceful=cfg.parallel.param_server.mode == "sync")


class _Round:
    """One sync step's gradients as they arrive, and the workers waiting for the answer."""

    def __init__(self) -> None:
        self.grads: dict[int, list[torch.Tensor]] = {}
        self.waiting: list[Future] = []
        self.timer: threading.Timer | None = None


class ParameterServer:
    """One server's parameters and optimizer, and both protocols. RPC threads call it concurrently;
    one lock orders everything."""

    def __init__(self, index: int, params: list[nn.Parameter], optimizer: torch.optim.Optimizer, workers: int,
                 cfg: ParallelConfig, wait_s: float) -> None:
        self.name = server_name(index)
        self.params = params
        self.optimizer = optimizer
        self.workers = workers
        self.max_staleness = cfg.param_server.max_staleness
        self.wait_s = wait_s
        self.lock = threading.Lock()
        self.version = 0  # updates applied
        self.rounds: dict[int, _Round] = {}  # sync: gradients being gathered, by round
        self.updated_round = -1  # sync: the last round whose update is applied
        self.staleness: Counter[int] = Counter()  # async: pushes applied, by staleness
        self.dropped = 0  # async: pushes too stale to apply

    def pull(self) -> tuple[list[torch.Tensor], int]:
        with self.lock:
            return self._copies(), self.version

    def push(self, round_: int, worker: int, grads: list[torch.Tensor]) -> Future:
        """sync: add `worker`'s gradients to round `round_`; the future is this server's share of the
        squared norm of the averaged gradient, once every worker has pushed."""
        answer: Future = Future()
        with self.lock:
            gathering = self.rounds.get(round_)
            if gathering is None:
                gathering = self.rounds[round_] = _Round()
                gathering.timer = threading.Timer(self.wait_s, self._expire, (round_,))
                gathering.timer.daemon = True
                gathering.timer.start()
            gathering.grads[worker] = grads
            gathering.waiting.append(answer)
            if len(gathering.grads) < self.workers:
                return answer
            del self.rounds[round_]
            gathering.timer.cancel()
            norm_sq = self._average(gathering.grads)
        for waiting in gathering.waiting:
            waiting.set_result(norm_sq)
        return answer

    def _average(self, grads: dict[int, list[torch.Tensor]]) -> float:
        for i, param in enumerate(self.params):
            total = grads[0][i].clone()
            for worker in range(1, self.workers):
                total += grads[worker][i]
            param.grad = (total / self.workers).to(param.dtype)
        return squared_norm([param.grad for param in self.params], self.params[0].device).item()

    def _expire(self, round_: int) -> None:
        with self.lock:
            gathering = self.rounds.pop(round_, None)
        if gathering is None:
            return
        missing = ", ".join(str(w) for w in range(self.workers) if w not in gathering.grads)
        error = RuntimeError(f"{self.name}, step {round_ + 1} of the servers: no gradients from worker {missing} "
                             f"within {self.wait_s:g} s (launch.timeout_s): it is stalled or gone")
        for waiting in gathering.waiting:
            waiting.set_exception(error)

    def update(self, round_: int, lr: float, clip_coef: float) -> list[torch.Tensor]:
        """sync: step on round `round_`'s averaged gradients (once, whoever asks first); the new values."""
        with self.lock:
            if self.updated_round < round_:
                self._step(lr, clip_coef)
                self.updated_round = round_
            return self._copies()

    def push_async(self, worker: int, version: int, grads: list[torch.Tensor],
                   lr: float) -> tuple[list[torch.Tensor], int, int | None]:
        """async: apply `grads` if computed at most max_staleness updates ago; answer the current
        values, their version, and the push's staleness (None: dropped)."""
        with self.lock:
            staleness = self.version - version
            applied = staleness <= self.max_staleness
            if applied:
                for param, grad in zip(self.params, grads, strict=True):
                    param.grad = grad.to(param.dtype)
                self._step(lr, 1.0)
                self.staleness[staleness] += 1
            else:
                self.dropped += 1
            return self._copies(), self.version, staleness if applied else None

    def _step(self, lr: float, clip_coef: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if clip_coef < 1.0:
            for param in self.params:
                param.grad.mul_(clip_coef)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1

    def _copies(self) -> list[torch.Tensor]:
        # RPC serialises a result after the lock is released, when an async push may be updating.
        return [param.detach().clone() for param in self.params]

    def stats(self, mode: str) -> dict[str, object]:
        return {"server": self.name, "mode": mode, "parameters": sum(p.numel() for p in self.params),
                "updates": self.version, "max_staleness": self.max_staleness,
                "staleness": {str(k): n for k, n in sorted(self.staleness.items())}, "dropped": self.dropped}


_server: ParameterServer | None = None  # this process's server: an RPC names a function, not an object


def _pull() -> tuple[list[torch.Tensor], int]:
    return _server.pull()


@rpc.functions.async_execution
def _push(round_: int, worker: int, grads: list[torch.Tensor]) -> Future:
    return _server.push(round_, worker, grads)


def _update(round_: int, lr: float, clip_coef: float) -> list[torch.Tensor]:
    return _server.update(round_, lr, clip_coef)


def _push_async(worker: int, version: int, grads: list[torch.Tensor],
                lr: float) -> tuple[list[torch.Tensor], int, int | None]:
    return _server.push_async(worker, version, grads, lr)


def serve(cfg: Config, index: int, workers: int, make_optimizer: OptimizerFactory) -> None:
    """Server `index`'s whole life: build the model as the workers do and keep its share, then
    join RPC (so no worker can call before the share exists), answer pushes until every worker
    has finished or exited, and write its statistics."""
    global _server
    p, launch = cfg.parallel, cfg.launch
    seed_everything(cfg.train.seed)
    mine = list(server_parameters(cfg, index).values())
    _server = ParameterServer(index, mine, make_optimizer(mine), workers, p, launch.timeout_s)
    _init_rpc(server_name(index), cfg)
    store = job_store(launch.timeout_s)
    while not all(store.check([f"finished/{w}"]) or store.check([f"exited/{w}"]) for w in range(workers)):
        time.sleep(0.2)
    stats = _server.stats(p.param_server.mode)
    out = Path(cfg.run.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"param-server-{index}.json").write_text(json.dumps(stats, indent=1) + "\n")
    print(f"{_server.name}: {stats['updates']} updates, staleness {stats['staleness']}, dropped {stats['dropped']}",
          flush=True)
    rpc.shutdown(graceful=p.param_server.mode == "sync")


def server_parameters(cfg: Config, index: int) -> dict[str, nn.Parameter]:
    """Server `index`'s share of the model's parameters by name, in model order, with the initial
    values every strategy gives them, in the storage dtype: the model is built on the meta device
    and materialised one group at a time, keeping this server's parameters only."""
    p = cfg.parallel
    with init_context():
        model = build_model(cfg.model)
    owned = {id(param) for param in server_share(list(model.parameters()), p.param_server.servers, index)}
    names = [name for name, param in model.named_parameters() if id(param) in owned]
    materialiser = Materialiser(model, block_class(model, p.block), cfg.train.seed)
    dtype = make_precision(p.precision, p.sharding.reduce_dtype).param_dtype
    kept: dict[str, nn.Parameter] = {}
    for group in materialiser.groups:
        wanted = [name for name in group.names if name in names]
        if wanted:
            values = materialiser.initial_values(group, torch.device("cpu"))
            kept |= {name: nn.Parameter(values.pop(name).to(dtype)) for name in wanted}
            del values
            return_free_memory()
    return {name: kept[name] for name in names}


def _result(future: Future) -> object:
    """A server's answer. A sync round that failed arrives as the exception object itself (RPC
    passes an async_execution future's error on as its value), so it is raised here."""
    value = future.wait()
    if isinstance(value, Exception):
        raise value
    return value


class RemoteOptimizer(torch.optim.Optimizer):
    """What a worker's trainer steps: it holds the learning rate the trainer sets and no state
    (that lives on the servers); `step()` pushes the gradients and pulls the new parameters."""

    def __init__(self, strategy: ParamServer, params: list[nn.Parameter]) -> None:
        super().__init__(params, {"lr": 0.0})
        self.strategy = strategy

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        self.strategy.exchange(self.param_groups[0]["lr"])


class ParamServer(Strategy):
    """A worker's side of parameter-server training (the servers run `serve`)."""

    @classmethod
    def check_config(cls, cfg: Config, world: int) -> None:
        """Servers plus workers on one machine, under our own launcher."""
        p = cfg.parallel
        if world <= p.param_server.servers:
            raise ConfigError(f"world size {world}: param-server needs parallel.param_server.servers = "
                              f"{p.param_server.servers} server "
                              f"rank(s) plus at least one worker; e.g. --nproc {p.param_server.servers + 2}")
        if cfg.launch.nnodes != 1:
            raise ConfigError(f"launch.nnodes = {cfg.launch.nnodes}: param-server runs on one machine (its launcher "
                              "hosts the store and watches every rank)")
        if (p.dp, p.pp, p.tp) != (None, None, None):
            raise ConfigError("parallel.dp / pp / tp: param-server's replicas are its workers, "
                              "launch.nproc - parallel.param_server.servers; leave them unset")

    def __init__(self, ctx: DistContext, cfg: ParallelConfig) -> None:
        super().__init__(ctx, cfg)
        self.sync = cfg.param_server.mode == "sync"
        self.round = 0  # sync: steps exchanged, the servers' round number
        self.versions = [0] * cfg.param_server.servers  # async: each server's version of our parameters
        self.norm_sq: float | None = None  # sync: this round's pushed gradient, its squared global norm
        self.clip_coef = 1.0
        # A worker's share of the global batch: its rank among the workers (their group's).
        self.data_rank, self.data_size = ctx.rank, ctx.world_size

    def _distribute(self, part: nn.Module) -> nn.Module:
        self.module = part
        params = list(self.module.parameters())
        servers = self.cfg.param_server.servers
        self.shards = [server_share(params, servers, index) for index in range(servers)]
        for index, future in enumerate(self._call_servers(_pull, lambda index: ())):
            values, self.versions[index] = future.wait()
            self._load(index, values)
        return self.module

    def optimizer(self, make: OptimizerFactory) -> torch.optim.Optimizer:
        self.optim = RemoteOptimizer(self, self.local_parameters())
        return self.optim

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """sync: the norm of the averaged gradient, from the servers' shares; async: this worker's own."""
        if not self.sync:
            return super().clip_grad_norm_(max_norm)
        norm = torch.tensor(self._push()).sqrt()
        self.clip_coef = clip_coefficient(norm, max_norm).item()
        return norm

    def exchange(self, lr: float) -> None:
        """Send this step's gradients, load the parameters the servers answer with."""
        if self.sync:
            if self.norm_sq is None:
                self._push()
            futures = self._call_servers(_update, lambda index: (self.round, lr, self.clip_coef))
            for index, future in enumerate(futures):
                self._load(index, future.wait())
            self.round += 1
            self.norm_sq, self.clip_coef = None, 1.0
            return
        futures = self._call_servers(_push_async, lambda index: (self.ctx.rank, self.versions[index],
                                                                 self._grads(index), lr))
        for index, future in enumerate(futures):
            values, self.versions[index], _ = future.wait()
            self._load(index, values)

    def _push(self) -> float:
        futures = self._call_servers(_push, lambda index: (self.round, self.ctx.rank, self._grads(index)))
        self.norm_sq = sum(_result(future) for future in futures)
        return self.norm_sq

    def _call_servers(self, function: Callable, args: Callable[[int], tuple]) -> list[Future]:
        return [rpc.rpc_async(server_name(index), function, args=args(index)) for index in range(len(self.versions))]

    def _grads(self, index: int) -> list[torch.Tensor]:
        return [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().cpu() for p in self.shards[index]]

    def _load(self, index: int, values: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for param, value in zip(self.shards[index], values, strict=True):
                param.copy_(value)
