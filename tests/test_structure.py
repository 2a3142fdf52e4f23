"""The house's proportions, measured: what issue 41 asked of its modules and classes, held."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "shardwise"


def modules() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}


def test_no_module_over_600_lines_and_no_class_over_300():
    parsed = modules()
    assert len(parsed) > 60
    long_modules = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in parsed}
    assert max(long_modules.values()) > 400  # it measures
    assert {p: n for p, n in long_modules.items() if n > 600} == {}
    classes = {f"{p.relative_to(PACKAGE)}:{node.name}": node.end_lineno - node.lineno + 1
               for p, tree in parsed.items() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    assert {c: n for c, n in classes.items() if n > 300} == {}


def test_the_strategy_interface_has_at_most_12_methods_besides_its_constructor():
    """What the trainer calls: at most 12 public methods. Besides them, the steps of `wrap`, the one
    composition order, which a strategy overrides (protected: only `wrap` calls them)."""
    tree = ast.parse((PACKAGE / "strategies" / "base.py").read_text())
    strategy = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Strategy")
    methods = [f.name for f in strategy.body if isinstance(f, ast.FunctionDef) and f.name != "__init__"]
    public = [name for name in methods if not name.startswith("_")]
    assert "wrap" in public and len(public) <= 12, public
    assert [name for name in methods if name.startswith("_")] == ["_cut", "_split", "_distribute"]


def test_every_strategy_is_composed_by_the_one_order():
    """No strategy has a `wrap` of its own: each is composed by Strategy.wrap's order (settle, cut,
    split, compile and recompute, replicate or shard), overriding its steps."""
    own = [f"{path.relative_to(PACKAGE)}:{node.name}" for path, tree in modules().items()
           if path.parent.name == "strategies" for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
           and node.name != "Strategy" and any(isinstance(f, ast.FunctionDef) and f.name == "wrap" for f in node.body)]
    assert own == []


def test_no_two_modules_of_the_package_share_a_name():
    names = Counter(p.stem for p in PACKAGE.rglob("*.py") if p.stem != "__init__")
    assert {name: n for name, n in names.items() if n > 1} == {}


# State a process must keep by name: torch.distributed.rpc calls a server by a function's module path,
# never an object, so the parameter server's functions find this process's server here.
NAMED_BY_RPC = {"strategies/param_server.py:_server"}
MUTABLE_CALLS = {"list", "dict", "set", "defaultdict", "OrderedDict", "Counter", "deque", "local"}


def _is_mutable(value: ast.expr | None) -> bool:
    """A list, dict or set (display, comprehension or call) or a thread-local."""
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    return isinstance(value, ast.Call) and getattr(value.func, "attr", getattr(value.func, "id", None)) in MUTABLE_CALLS


def test_no_module_level_mutable_state():
    """No module keeps state of its own: no lower-case name bound at module level to a list, dict or
    set (display or call) or a thread-local, and no function rebinding a module's name (`global`);
    upper-case names are constant tables, and `__all__` a module's public names. A context variable
    (memory.py's open counters) is state of the thread that sets it, not of the module."""
    found = set()
    for path, tree in modules().items():
        where = str(path.relative_to(PACKAGE))
        for node in tree.body:
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AnnAssign):
                targets = [node.target]
            else:
                continue
            if _is_mutable(node.value):
                found |= {f"{where}:{t.id}" for t in targets
                          if isinstance(t, ast.Name) and not t.id.isupper() and not t.id.startswith("__")}
        found |= {f"{where}:{name}" for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names}
    assert found == NAMED_BY_RPC


def test_no_strategy_is_made_inside_another():
    """A strategy only composes libraries (issue 69): sharding pipeline stages composes the sharding
    library over the stages' modules (parallel/sharded_model.py), not a strategy object held inside
    the pipeline. So no module of strategies/ calls a Strategy subclass by name (classes.py makes
    the configured one through the registry)."""
    trees = {p: ast.parse(p.read_text()) for p in sorted((PACKAGE / "strategies").glob("*.py"))}
    bases = {node.name: {b.id for b in node.bases if isinstance(b, ast.Name)}
             for tree in trees.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    strategies = {"Strategy"}
    while grown := {name for name, of in bases.items() if of & strategies} - strategies:
        strategies |= grown
    assert {"ShardedDataParallel", "Pipeline", "TensorParallel", "DDP"} <= strategies  # it finds them
    made = {f"{p.name}: {name.id}" for p, tree in trees.items() for node in ast.walk(tree) if isinstance(node, ast.Call)
            for name in ast.walk(node.func) if isinstance(name, ast.Name) and name.id in strategies}
    assert made == set()
