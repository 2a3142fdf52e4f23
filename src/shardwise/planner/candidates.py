"""The ways to train a config on a world of ranks: strategy, mesh, precision, recomputation and
micro-batch. A candidate exists only if `shardwise train` would accept it: each is checked by the
same validate.py that runs before training starts."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import TypeVar

from shardwise.config.registry import SPECS, StrategySpec, spec
from shardwise.config.schema import CP_MODES, EP_STRATEGIES, MOE_MODELS, Config, ConfigError
from shardwise.validate import check_fixed, validate, validate_varied

# bf16-true only when asked for: it trains differently (updates below a weight's bf16 spacing are
# lost), not just faster, so it is no drop-in choice to recommend.
DEFAULT_PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")


def default_precisions(cfg: Config) -> tuple[str, ...]:
    """The precisions `shardwise plan` weighs unless told: under LoRA also `bf16-true`, a frozen model
    stored in bf16 (no master weights to keep in fp32 for it), what fine-tuning on few GPUs uses."""
    return (*DEFAULT_PRECISIONS, "bf16-true") if cfg.lora.rank > 0 else DEFAULT_PRECISIONS
POLICIES = ("none", "blocks", "every:2", "selective")
SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Candidate:
    strategy: str
    dp: int
    pp: int
    tp: int
    precision: str
    recompute: str
    micro_batch: int  # samples per forward on one model replica (train.micro_batch)
    micro_batches: int = 1  # pipeline: micro-batches per pipeline run (parallel.pipeline.micro_batches)
    schedule: str | None = None  # pipeline: gpipe or 1f1b
    shard: int | None = None  # hsdp: the ranks each parameter is split over (a node's dp ranks); dp / shard replicas
    cp: int = 1  # context parallel: ranks each sequence is split over (each of the dp replicas has cp of them)
    cp_mode: str | None = None  # context parallel: ring or all-to-all
    ep: int = 1  # expert parallel: the dp ranks each MoE layer's experts are split over

    @classmethod
    def of(cls, cfg: Config, world: int) -> Candidate:
        """What `cfg` itself trains on `world` ranks, as a candidate (its strategy, mesh, precision,
        recomputation, micro-batch, pipeline, hsdp's node)."""
        p = cfg.parallel
        dp, pp, tp = p.mesh_shape(world)
        piped = spec(p.strategy).pipelined or pp > 1
        shard = cfg.launch.nproc // (tp * p.cp * pp) if spec(p.strategy).across_nodes else None
        return cls(p.strategy, dp, pp, tp, p.precision, p.recompute, cfg.train.micro_batch,
                   p.pipeline.micro_batches if piped else 1, p.pipeline.schedule if piped else None, shard, p.cp,
                   p.cp_mode if p.cp > 1 else None, p.ep)

    @property
    def spec(self) -> StrategySpec:
        return spec(self.strategy)

    @property
    def mesh(self) -> str:
        """Its strategy and mesh, as the refused meshes are named."""
        context = f" cp{self.cp} {self.cp_mode}" if self.cp > 1 else ""
        experts = f" ep{self.ep}" if self.ep > 1 else ""
        return f"{self.strategy} dp{self.dp} pp{self.pp} tp{self.tp}{context}{experts}"

    @property
    def label(self) -> str:
        mesh = f"dp{self.dp}" + (f" pp{self.pp}" if self.pp > 1 else "") + (f" tp{self.tp}" if self.tp > 1 else "")
        mesh += f" cp{self.cp} {self.cp_mode}" if self.cp > 1 else ""
        mesh += f" ep{self.ep}" if self.ep > 1 else ""
        pipe = f" M{self.micro_batches} {self.schedule}" if self.schedule else ""
        pipe += f" shard{self.shard}" if self.shard else ""
        return f"{self.strategy} {mesh}{pipe} {self.precision} rc={self.recompute} mb={self.micro_batch}"

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def replace(self, **changes: object) -> Candidate:
        """dataclasses.replace(self, **changes) at a quarter of its cost, for the search's loops over
        every candidate: the fields copied as they are (__init__ has nothing else to do)."""
        if not changes.keys() <= self.__dict__.keys():
            raise TypeError(f"Candidate has no field {', '.join(changes.keys() - self.__dict__.keys())}")
        changed = object.__new__(Candidate)
        changed.__dict__.update(self.__dict__, **changes)
        return changed

    def config(self, base: Config, world: int, global_batch: int | None = None) -> Config:
        """`base` set up to train this candidate on `world` ranks (validated: ConfigError if not)."""
        cfg = self.configure(base, global_batch)
        validate(cfg, world_size=world)
        return cfg

    def settings(self) -> list[str]:
        """The candidate as `shardwise train --set` overrides: what `configure` sets, but the global
        batch (the config's own, which the plan was made for) and the ranks a node (the launch's)."""
        mesh = self.spec.splits_model or self.tp > 1 or self.pp > 1
        keys: dict[str, object] = {"parallel.strategy": self.strategy, "parallel.precision": self.precision,
                                   "parallel.recompute": self.recompute, "train.micro_batch": self.micro_batch,
                                   "parallel.cp": self.cp, "parallel.ep": self.ep}
        if mesh:
            keys |= {"parallel.dp": self.dp, "parallel.pp": self.pp, "parallel.tp": self.tp}
        if self.schedule is not None:
            keys |= {"parallel.pipeline.micro_batches": self.micro_batches, "parallel.pipeline.schedule": self.schedule}
        if self.cp_mode is not None:
            keys["parallel.cp_mode"] = self.cp_mode
        return [f"{key}={value}" for key, value in keys.items()]

    def configure(self, base: Config, global_batch: int | None = None) -> Config:
        """`base` set up to train this candidate, not validated."""
        mesh = self.spec.splits_model or self.tp > 1 or self.pp > 1  # the sharded strategies' meshes too
        # Shallow copies, not dataclasses.replace: the planner builds one per candidate, thousands.
        parallel = _copy(base.parallel)
        parallel.strategy, parallel.precision, parallel.recompute = self.strategy, self.precision, self.recompute
        parallel.dp, parallel.pp, parallel.tp = (self.dp, self.pp, self.tp) if mesh else (None, None, None)
        if self.schedule is not None:  # the pipelines, and the sharded strategies over stages
            parallel.pipeline = _copy(base.parallel.pipeline)  # its own: the base's is left as the user set it
            parallel.pipeline.micro_batches, parallel.pipeline.schedule = self.micro_batches, self.schedule
        parallel.cp, parallel.cp_mode = self.cp, self.cp_mode or parallel.cp_mode
        parallel.ep = self.ep
        train = _copy(base.train)
        train.micro_batch, train.global_batch = self.micro_batch, global_batch or base.train.global_batch
        # The other sections are shared with `base`, not copied: nothing else changes them.
        cfg = _copy(base)
        cfg.parallel, cfg.train = parallel, train
        if self.shard:  # hsdp: a node's processes, its shard group of each tp (cp, pp) rank
            cfg.launch = _copy(base.launch)
            cfg.launch.nproc = self.shard * self.tp * self.cp * self.pp
        return cfg


_Section = TypeVar("_Section")


def _copy(section: _Section) -> _Section:
    """copy.copy of a config or one of its sections (plain dataclasses) at a third of its cost,
    without its generic __reduce_ex__ round trip: the planner makes three per candidate."""
    copied = object.__new__(type(section))
    copied.__dict__.update(section.__dict__)
    return copied


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _meshes(world: int, nodes: int) -> Iterator[tuple[str, int, int, int, int, str | None]]:
    """(strategy, dp, pp, tp, cp, cp_mode) for every planned strategy and factorisation of the world
    it can use; hsdp only on several nodes (on one it is fsdp); the sharded strategies over tensor
    parallel within a node, and over pipeline stages; context parallel in both modes over every cp
    dividing what the other dimensions leave, for the strategies it composes with."""
    planned = [s for s in SPECS.values() if s.planned]
    for s in planned:
        if not s.splits_model and (nodes > 1 or not s.across_nodes):
            # The sharded strategies over tensor parallel too, its ranks within a node.
            for tp in _divisors(world // nodes) if s.shards_split_model else [1]:
                yield s.name, world // tp, 1, tp, 1, None
                if s.context_parallel:
                    for cp in _divisors(world // tp)[1:]:
                        for mode in CP_MODES:
                            yield s.name, world // tp // cp, 1, tp, cp, mode
    for pp in _divisors(world):
        for tp in _divisors(world // pp):
            dp = world // pp // tp
            own = "pp" if pp > 1 else "tp" if tp > 1 else None  # the strategy's own dimension takes what is left
            for s in planned:
                staged = own == "pp" and s.shards_split_model  # the sharded strategies over pipeline stages
                if s.mesh_dim != own and not staged:
                    continue
                # hsdp over stages: on several nodes, each holding whole replicas' stages and their tp
                # ranks (its config checks refuse a cp that splits them)
                if staged and s.across_nodes and (nodes == 1 or (world // nodes) % (pp * tp)):
                    continue
                yield s.name, dp, pp, tp, 1, None
                if s.context_parallel:
                    for cp in _divisors(dp)[1:]:
                        for mode in CP_MODES:
                            yield s.name, dp // cp, pp, tp, cp, mode


def micro_batch_options(per_replica: int) -> list[int]:
    """Micro-batches that split a replica's share of the global batch evenly (none if it is 0)."""
    return _divisors(per_replica)


def enumerate_candidates(base: Config, world: int, precisions: tuple[str, ...] = DEFAULT_PRECISIONS,
                         policies: tuple[str, ...] = POLICIES,
                         micro_batches: list[int] | None = None,
                         nodes: int = 1) -> tuple[list[Candidate], dict[str, str]]:
    """Every candidate the trainer accepts for `base` on `world` ranks (`nodes` nodes of them), and
    for each mesh none of whose variants it accepts, why (the first ConfigError)."""
    found: list[Candidate] = []
    refused: dict[str, str] = {}
    # What no candidate changes is checked once, here, not for each of them; if the base fails
    # those checks, every candidate is refused, and the full validate finds which error each meets first.
    try:
        check_fixed(base)
        check = validate_varied
    except ConfigError:
        check = validate
    for strategy, dp, pp, tp, cp, cp_mode, ep in _with_experts(_meshes(world, nodes), base):
        mesh_found = len(found)
        first_error = None
        # An indivisible global batch still gets a candidate, for validate() to name the reason.
        sizes = micro_batches or micro_batch_options(base.train.global_batch // dp) or [1]
        runs = [(micro_batch, _pipeline_runs(strategy, pp, micro_batch)) for micro_batch in sizes]
        shard = world // nodes // (tp * pp) if spec(strategy).across_nodes else None
        for precision in precisions:
            for policy in policies:
                for micro_batch, pipeline_runs in runs:
                    for m, schedule in pipeline_runs:
                        candidate = Candidate(strategy, dp, pp, tp, precision, policy, micro_batch, m, schedule, shard,
                                              cp, cp_mode, ep)
                        try:
                            check(candidate.configure(base), world)
                        except ConfigError as error:
                            first_error = first_error or str(error)
                            continue
                        found.append(candidate)
        if len(found) == mesh_found and first_error:
            refused[candidate.mesh] = first_error
    return found, refused


def _with_experts(meshes: Iterator[tuple[str, int, int, int, int, str | None]],
                  base: Config) -> Iterator[tuple[str, int, int, int, int, str | None, int]]:
    """Each mesh with ep 1 and, for a Mixture-of-Experts model under a strategy that splits
    experts (over data-parallel ranks, with or without context parallel and pipeline stages), with
    every ep dividing both dp and the experts."""
    for strategy, dp, pp, tp, cp, cp_mode in meshes:
        yield strategy, dp, pp, tp, cp, cp_mode, 1
        if base.model.name in MOE_MODELS and strategy in EP_STRATEGIES:
            for ep in _divisors(dp)[1:]:
                if base.model.n_experts % ep == 0:
                    yield strategy, dp, pp, tp, cp, cp_mode, ep


def _pipeline_runs(strategy: str, pp: int, micro_batch: int) -> list[tuple[int, str | None]]:
    """(micro-batches per run, schedule) options: a pipeline's M divides its micro-batch."""
    if not (spec(strategy).pipelined or pp > 1 and spec(strategy).shards_split_model):
        return [(1, None)]
    return [(m, schedule) for m in _divisors(micro_batch) if m > 1 for schedule in SCHEDULES]
