"""Models built on the meta device, and made real one group of modules at a time, every tensor
initialised to the same values whatever the strategy, the world size or the order.

`init_context()` is where a model is built without memory: its parameters and buffers are meta
tensors, shapes and dtypes only. A strategy then materialises what its rank keeps (`Materialiser`):

- By groups (`Group`): each module of class `parallel.block` (the GPT's `Block`, a transformers
  decoder layer) with everything under it, in model order, then the root, every other module.
  These are the units the sharded strategies gather and free as one, so `fsdp` can materialise
  one unit, keep its shard and free the rest before the next; every other strategy materialises
  every group, by the same groups, so the values agree.
- Initialising a group: its tensors are allocated whole and filled with NaN (so that one no
  init wrote is caught, and named), then each of its modules, children before parents, is
  initialised by its own init: the `_init_weights` of the transformers model it belongs to, the
  `init_module` of a shardwise model it belongs to (the GPT's), else its own `reset_parameters()`.
  Each module's init runs under a generator seeded from the seed and the module's name alone,
  and sees the tensors of other groups hidden (meta tensors, which writes leave alone), so a
  tensor's values depend on nothing but the seed, its module's name and its group.

A tensor held by several modules (a tied weight) is one tensor, named by its first name in the
model, in the group of the first unit that holds it (the root if none does), as `fsdp` groups it.
"""

from __future__ import annotations

import hashlib
import inspect
import math
from collections.abc import Callable, Collection, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch
import torch.utils.deterministic as deterministic_mode
from torch import nn

from shardwise.memory import return_free_memory

NAN_CHECK_ELEMENTS = 1 << 18  # elements checked for NaN at once: a temporary of 256 KiB whatever the tensor


def init_context() -> AbstractContextManager:
    """Inside it, modules are built on the meta device: shapes and dtypes, no memory, no init.
    Pass the model to a strategy (or `run.prepare`), which materialises what each rank keeps."""
    return torch.device("meta")


def named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer by its first name (a tied one once)."""
    yield from model.named_parameters()
    yield from model.named_buffers()


def state_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers that are the model's state (its state dict's), by name: not those a module
    registers as not persistent (rotary frequencies), which are made anew with the model."""
    state = model.state_dict(keep_vars=True)
    return [(name, buffer) for name, buffer in model.named_buffers() if name in state]


def check_one_device_kind(model: nn.Module, what: str) -> bool:
    """Whether `model` is meta-built (every tensor on the meta device) rather than ordinary (none
    is); a model that is partly both is an error naming one tensor of each kind."""
    meta = [name for name, t in named_tensors(model) if t.is_meta]
    real = [f"{name} ({t.device})" for name, t in named_tensors(model) if not t.is_meta]
    if meta and real:
        raise ValueError(f"{what}: the model is partly on the meta device ({meta[0]}, {len(meta)} tensor(s)) and "
                         f"partly real ({real[0]}, {len(real)} tensor(s)); build all of it under "
                         "shardwise.init_context() or none of it")
    return bool(meta)


def build_on_meta(factory: Callable[[], nn.Module], what: str) -> nn.Module:
    """`factory()` under `init_context()`, refused if it made a tensor on a real device (an
    explicit `device=`, weights loaded), which the meta context cannot see to."""
    with init_context():
        model = factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"{what}: the model factory returned {type(model).__name__}, not a torch.nn.Module")
    real = [(name, t.device) for name, t in named_tensors(model) if not t.is_meta]
    if real:
        name, device = real[0]
        raise ValueError(f"{what}: the model factory built {name} on {device}, not on the meta device "
                         f"({len(real)} such tensor(s)); under shardwise.init_context() build the modules without "
                         "a device and load no weights (pretrained weights: run.prepare(..., weights=PATH))")
    return model


def allocate(model: nn.Module, device: torch.device | str) -> nn.Module:
    """A meta-built model made real on `device` with nothing initialised, for a load to fill: every
    tensor allocated once (a tie stays a tie, which `to_empty` does not keep)."""
    Materialiser(model, None, 0).materialise_all(torch.device(device), None, initialise=False)
    return model


def seed_for(seed: int, name: str) -> int:
    """The generator seed of module `name`'s init: a function of the two alone."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


@dataclass(frozen=True)
class Slot:
    """Where a tensor is held: `module._parameters[key]` or `module._buffers[key]`."""

    module: nn.Module
    buffer: bool
    key: str

    def get(self) -> torch.Tensor:
        return (self.module._buffers if self.buffer else self.module._parameters)[self.key]

    def set(self, tensor: torch.Tensor) -> None:
        (self.module._buffers if self.buffer else self.module._parameters)[self.key] = tensor


@dataclass
class Group:
    """Modules initialised together and the tensors they own."""

    block: nn.Module | None  # the unit's block module; None: the root
    modules: list[tuple[str, nn.Module]]  # by name, children before parents
    names: list[str]  # the tensors it owns, by their first names, in model order
    scope: list[tuple[Slot, str]]  # every slot its modules reach, with the tensor's name


def _post_order(module: nn.Module, prefix: str, seen: set[int]) -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        if id(child) not in seen:
            yield from _post_order(child, f"{prefix}.{name}" if prefix else name, seen)
    if id(module) not in seen:
        seen.add(id(module))
        yield prefix, module


class Materialiser:
    """The groups of a meta-built model and their initial values. Built from the model before any
    strategy changes it (its slots are looked up again when used: fully_shard replaces them)."""

    def __init__(self, model: nn.Module, block: str | None, seed: int) -> None:
        self.model = model
        self.seed = seed
        first: dict[int, str] = {}
        for name, tensor in named_tensors(model):
            first.setdefault(id(tensor), name)
        self.slots: dict[str, list[Slot]] = {}
        self.is_buffer: dict[str, bool] = {}
        seen_slots: set[tuple[int, bool, str]] = set()
        for _, module in model.named_modules(remove_duplicate=False):
            for buffer, table in ((False, module._parameters), (True, module._buffers)):
                for key, tensor in table.items():
                    if tensor is None or (id(module), buffer, key) in seen_slots:
                        continue
                    seen_slots.add((id(module), buffer, key))
                    name = first[id(tensor)]
                    self.slots.setdefault(name, []).append(Slot(module, buffer, key))
                    self.is_buffer[name] = buffer
        # Shapes and dtypes as built (copies: a strategy may cast the meta model before it materialises).
        self.meta = {name: torch.empty_like(slots[0].get(), device="meta") for name, slots in self.slots.items()}
        self.groups = self._make_groups(block)
        self._initialisers = self._find_initialisers()

    def _make_groups(self, block: str | None) -> list[Group]:
        names = list(self.slots)
        name_of = {id(slots[0].get()): name for name, slots in self.slots.items()}
        owned: set[str] = set()
        groups, in_blocks = [], set()
        for module_name, module in self.model.named_modules():
            if type(module).__name__ != block or id(module) in in_blocks:
                continue
            subtree = list(_post_order(module, module_name, set()))
            in_blocks.update(id(m) for _, m in subtree)
            mine = {name_of[id(t)] for _, m in subtree for t in [*m._parameters.values(), *m._buffers.values()]
                    if t is not None} - owned
            if mine:
                owned |= mine
                groups.append(Group(module, subtree, [n for n in names if n in mine], self._scope(subtree)))
        root = [(n, m) for n, m in _post_order(self.model, "", set()) if id(m) not in in_blocks]
        rest = [n for n in names if n not in owned]
        return [*groups, Group(None, root, rest, self._scope(list(_post_order(self.model, "", set()))))]

    def _scope(self, modules: list[tuple[str, nn.Module]]) -> list[tuple[Slot, str]]:
        ids = {id(m) for _, m in modules}
        return [(slot, name) for name, slots in self.slots.items() for slot in slots if id(slot.module) in ids]

    def _find_initialisers(self) -> dict[int, Callable[[nn.Module, str], None]]:
        """For each module, its init: that of the innermost model around it (itself included) that
        initialises its modules (a transformers model's `_init_weights`, a shardwise model's
        `init_module`), else its own `reset_parameters`; for a module its class builds without
        arguments, then its constructor's values for what that init left blank (`_then_defaults`)."""
        found: dict[int, Callable[[nn.Module, str], None]] = {}

        def visit(module: nn.Module, prefix: str, owner: Callable[[nn.Module, str], None] | None) -> None:
            if callable(getattr(module, "init_module", None)):
                owner = _relative(module.init_module, prefix)
            elif callable(getattr(module, "_init_weights", None)):
                owner = _ignoring_name(module._init_weights)
            init = owner or _reset
            found.setdefault(id(module), _then_defaults(init) if _built_without_arguments(module) else init)
            for name, child in module.named_children():
                visit(child, f"{prefix}.{name}" if prefix else name, owner)

        visit(self.model, "", None)
        return found

    def parameters(self, group: Group) -> list[nn.Parameter]:
        """The group's parameters as the model holds them now, in model order."""
        return [self.slots[name][0].get() for name in group.names if not self.is_buffer[name]]

    # --- making a group real ---------------------------------------------------------------

    def initial_values(self, group: Group, device: torch.device) -> dict[str, torch.Tensor]:
        """The group's tensors, whole, on `device`, initialised, in their dtypes as built; the model
        is left as it was (its slots hold what they held)."""
        values = {name: self._blank(name, device) for name in group.names}
        self._initialise(group, values, device)
        self._check_initialised(values)
        return values

    def _initialise(self, group: Group, values: dict[str, torch.Tensor], device: torch.device) -> None:
        """Run the group's inits on `values`, installed in its slots (each module's seeded by its name)."""
        with self._installed(group, values):
            for name, module in group.modules:
                with seeded(seed_for(self.seed, name), device), torch.no_grad():
                    self._initialisers[id(module)](module, name)

    def _check_initialised(self, values: dict[str, torch.Tensor]) -> None:
        """ValueError naming the first of `values` an init left blank (NaN)."""
        for name, value in values.items():
            if value.is_floating_point() and _has_nan(value):
                raise ValueError(self._not_initialised(name))

    def materialise(self, group: Group, device: torch.device, dtype: torch.dtype | None,
                    initialise: bool = True, names: Collection[str] | None = None) -> None:
        """Put the group's tensors (or those of them in `names`) into the model for good: real, on
        `device`, floating ones in `dtype` (None: as built), initialised (or, with
        `initialise=False`, left empty for a load to fill). The group is initialised whole either
        way (a module's init may draw for several tensors from one generator); those not in
        `names` are freed."""
        if initialise:
            values = self.initial_values(group, device)
        else:
            values = {name: torch.empty_like(self.meta[name], device=device) for name in group.names}
        for name in group.names:
            value = values.pop(name)  # the built dtype's copy is freed as soon as it is cast
            if names is not None and name not in names:
                continue
            if dtype is not None and value.is_floating_point():
                value = value.to(dtype)
            self._install(name, value)

    def release(self, group: Group, holder: nn.Module) -> None:
        """After a strategy replaced some of the group's modules by what it keeps of them (tensor
        parallel's shards of a layer): the group's tensors `holder` no longer holds go back to the
        meta device, so that the replaced modules, which this materialiser still reaches, keep no
        memory."""
        held = {id(tensor) for _, tensor in named_tensors(holder)}
        for name in group.names:
            if id(self.slots[name][0].get()) not in held:
                for slot in self.slots[name]:
                    meta = torch.empty_like(self.meta[name], device="meta")
                    slot.set(meta if slot.buffer else nn.Parameter(meta, requires_grad=False))

    def materialise_all(self, device: torch.device, dtype: torch.dtype | None, initialise: bool = True) -> None:
        for group in self.groups:
            self.materialise(group, device, dtype, initialise)

    def distribute(self, group: Group, device: torch.device) -> None:
        """Fill the group's tensors where the model holds them as DTensors (FSDP2's after
        `to_empty`): each rank copies its own part of each initial value; plain ones whole."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        values = self.initial_values(group, device)
        for name in group.names:
            held, value = self.slots[name][0].get(), values.pop(name)
            with torch.no_grad():
                if isinstance(held, DTensor):
                    part = distribute_tensor(value, held.device_mesh, held.placements, src_data_rank=None)
                    held.to_local().copy_(part.to_local())
                else:
                    held.copy_(value)
        del values
        return_free_memory()

    def _blank(self, name: str, device: torch.device) -> torch.Tensor:
        like = self.meta[name]
        if like.is_floating_point() or like.is_complex():
            return torch.full(like.shape, math.nan, dtype=like.dtype, device=device)
        return torch.zeros(like.shape, dtype=like.dtype, device=device)

    def _install(self, name: str, value: torch.Tensor) -> None:
        """`value` into every slot that held tensor `name`, as a parameter where it was one
        (keeping its attributes and requires_grad: one Parameter, so a tie stays a tie)."""
        held = self.slots[name][0].get()
        if isinstance(held, nn.Parameter):
            value = nn.Parameter(value, requires_grad=held.requires_grad)
            value.__dict__.update(held.__dict__)
        for slot in self.slots[name]:
            slot.set(value)

    @contextmanager
    def _installed(self, group: Group, values: dict[str, torch.Tensor]) -> Iterator[None]:
        """The group's slots hold `values` (as parameters where they hold parameters), every other
        slot its modules reach a meta tensor; everything is put back after."""
        saved = [(slot, slot.get()) for slot, _ in group.scope]
        standing: dict[tuple[str, bool], torch.Tensor] = {}
        for slot, name in group.scope:
            key = (name, slot.buffer)
            if key not in standing:
                value = values[name] if name in values else torch.empty_like(self.meta[name], device="meta")
                standing[key] = value if slot.buffer else nn.Parameter(value, requires_grad=False)
            slot.set(standing[key])
        try:
            yield
        finally:
            for slot, tensor in saved:
                slot.set(tensor)

    def check_initialisable(self) -> None:
        """ValueError naming a tensor `materialise` would find no init for (the one it raises once a
        worker makes the model real), found on the CPU in a moment: each group as `initial_values`
        initialises it (one block of each make: blocks alike are initialised alike), its tensors
        NaN-filled stand-ins (`_stand_in`). An init that cannot take a stand-in (an index past a
        cut shape) tells nothing and is passed over: only a tensor certainly left as it was is named."""
        seen: set[tuple[str, ...]] = set()
        for group in self.groups:
            make = tuple(f"{name.rpartition('.')[2]}:{type(module).__name__}" for name, module in group.modules)
            if make in seen:
                continue
            seen.add(make)
            values = {name: self._stand_in(name) for name in group.names}
            try:
                self._initialise(group, values, torch.device("cpu"))
            except Exception:  # noqa: BLE001 - an init that needs the real shapes: nothing known
                continue
            self._check_initialised(values)

    def _stand_in(self, name: str) -> torch.Tensor:
        """Tensor `name` blank on the CPU, whole up to 2**20 elements (an init may compare its shape
        with its neighbours'), else cut to at most 8 along each dimension."""
        like = self.meta[name]
        shape = like.shape if like.numel() <= 2**20 else tuple(min(size, 8) for size in like.shape)
        fill = math.nan if like.is_floating_point() or like.is_complex() else 0
        return torch.full(shape, fill, dtype=like.dtype)

    def _not_initialised(self, name: str) -> str:
        slot = self.slots[name][0]
        module = type(slot.module).__name__
        return (f"materialising the model: {name} was not initialised by its module's init ({module} has no "
                "reset_parameters(), and no model around it initialises it); give it a reset_parameters(), or build "
                "the model outside shardwise.init_context()")


def _relative(init: Callable[[nn.Module, str], None], prefix: str) -> Callable[[nn.Module, str], None]:
    """`init(module, name)` with `name` relative to the model at `prefix` that defines it."""
    return lambda module, name: init(module, name[len(prefix) + 1:] if prefix else name)


def _ignoring_name(init: Callable[[nn.Module], None]) -> Callable[[nn.Module, str], None]:
    return lambda module, name: init(module)


def _built_without_arguments(module: nn.Module) -> bool:
    """Whether `module` holds tensors of its own and its class takes no argument it must be given."""
    if not any(t is not None for t in (*module._parameters.values(), *module._buffers.values())):
        return False
    try:
        parameters = list(inspect.signature(type(module).__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters)


def _then_defaults(init: Callable[[nn.Module, str], None]) -> Callable[[nn.Module, str], None]:
    """`init`, then the module's own tensors it left blank (NaN) as a fresh instance of the module's
    class holds them: constants its constructor computes and no init rewrites (Apertus' xIELU
    activation's learned scales)."""
    def run(module: nn.Module, name: str) -> None:
        init(module, name)
        own = {**module._parameters, **module._buffers}
        blank = [key for key, t in own.items() if t is not None and t.is_floating_point() and _has_nan(t)]
        if blank:
            fresh = _built_blank(type(module))
            for key in blank:
                value = getattr(fresh, key, None)
                if isinstance(value, torch.Tensor) and value.shape == own[key].shape:
                    own[key].copy_(value)
    return run


def _built_blank(module_class: type[nn.Module]) -> nn.Module:
    """An instance of `module_class`, built without arguments, on the CPU, whatever memory its
    constructor leaves uninitialised (torch.empty's) filled with NaN: no value it did not compute."""
    deterministic, warn_only = torch.are_deterministic_algorithms_enabled(), \
        torch.is_deterministic_algorithms_warn_only_enabled()
    fill = deterministic_mode.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    deterministic_mode.fill_uninitialized_memory = True
    try:
        with torch.device("cpu"):
            return module_class()
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
        deterministic_mode.fill_uninitialized_memory = fill


def _reset(module: nn.Module, name: str) -> None:
    """A module's own init, for one no model around it initialises."""
    if callable(getattr(module, "reset_parameters", None)):
        module.reset_parameters()


@contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """The global generators (the CPU's and the device's) seeded with `seed` inside, restored after."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        # Not torch.manual_seed on the CPU: where CUDA is not in use it queues the seed for CUDA too,
        # with the caller's stack formatted (0.3 ms a call, one call a module materialised).
        (torch.manual_seed if devices else torch.default_generator.manual_seed)(seed)
        yield


def _has_nan(tensor: torch.Tensor) -> bool:
    flat = tensor.reshape(-1)
    return any(chunk.isnan().any() for chunk in flat.split(NAN_CHECK_ELEMENTS))
