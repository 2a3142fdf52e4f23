"""The import graph of shardwise's modules: no cycles, and layers that stay apart.

Every import counts, wherever it stands (at the top, inside a function, or under TYPE_CHECKING),
and so does an import by name: a string that names one of the package's modules (a lazy
attribute's home, `importlib.import_module("shardwise.x")`) or an f-string that names one of a
package's (`f"shardwise.strategies.{name}"`: all of them). A cycle hidden in a function or behind
a registry is still a cycle a reader must untangle. A package's own `__init__` loaded on the way
to one of its modules is not an edge, as in pydeps or import-linter.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def imported_by_name(node: ast.AST, files: dict[str, Path]) -> set[str]:
    """The package's modules a string or f-string names (see above)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value and node.value in files:
        return {node.value}
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        prefix = str(node.values[0].value)
        if prefix.startswith("shardwise.") and prefix.endswith("."):
            return {module for module in files if module.startswith(prefix)}
    return set()


def import_graph() -> dict[str, set[str]]:
    files = {".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__"): path
             for path in (SRC / "shardwise").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from a.b import c` imports module a.b.c where there is one, else a name of a.b.
                imported.update(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in files
                                else node.module for alias in node.names)
            else:
                imported |= imported_by_name(node, files)
        graph[module] = {name for name in imported if name in files and name != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as the modules along it, or None (depth-first search, three colours)."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[module] = "done"
        path.pop()
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, stack = set(), [start]
    while stack:
        for target in graph[stack.pop()] - seen:
            seen.add(target)
            stack.append(target)
    return seen


def test_the_import_graph_has_no_cycles():
    graph = import_graph()
    assert len(graph) > 60 and "shardwise.strategies.fsdp" in graph["shardwise.strategies.pipeline"]  # it sees imports
    assert "shardwise.strategies.ddp" in graph["shardwise.strategies.classes"]  # and imports by name
    assert "shardwise.api" in graph["shardwise"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_config_imports_no_strategy_or_parallelism_and_the_planner_never_trains():
    graph = import_graph()
    # config/ (the schema, the registry of strategies' facts, the loader) imports nothing from strategies/
    # or parallel/, so no import runs back up; the schema reaches none of them at all. What needs a
    # strategy's class (validate.py: a strategy's own checks) stands above both.
    config = [m for m in graph if m.startswith("shardwise.config")]
    assert "shardwise.config.registry" in config and graph["shardwise.config.registry"] == set()
    for module in config:
        assert not {m for m in graph[module] if m.startswith(("shardwise.strategies", "shardwise.parallel"))}, module
    assert not {m for m in reachable(graph, "shardwise.config.schema")
                if m.startswith(("shardwise.strategies", "shardwise.parallel"))}
    for module in (m for m in graph if m.startswith("shardwise.strategies")):
        assert not {"shardwise.config.load", "shardwise.validate"} & reachable(graph, module), module
    for module in (m for m in graph if m.startswith("shardwise.planner")):
        assert "shardwise.trainer" not in reachable(graph, module), f"{module} reaches the trainer"


def test_the_parallelisms_know_no_strategy_config_or_trainer():
    """parallel/ is the libraries: each takes the mesh and the model as arguments."""
    graph = import_graph()
    above = ("shardwise.strategies", "shardwise.config", "shardwise.trainer", "shardwise.api", "shardwise.cli")
    for module in (m for m in graph if m.startswith("shardwise.parallel")):
        reached = {m for m in reachable(graph, module) if m.startswith(above)}
        assert not reached, f"{module} reaches {sorted(reached)}"


def test_the_commands_that_read_no_model_start_without_torch(tmp_path):
    """`shardwise --help` and `shardwise report` import no torch (over a second on a CPU like CI's):
    the CLI imports what reads a config inside the commands that read one."""
    import subprocess
    import sys

    (tmp_path / "run").mkdir()
    code = ("import sys; from shardwise.cli import main\n"
            "try: main(['report', sys.argv[1]])\nexcept SystemExit: pass\n"
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True,
                            timeout=60)
    assert result.stdout.strip() == "False", result.stderr
    assert "metrics.jsonl" in result.stderr  # the run it was given has none: said, not a traceback
