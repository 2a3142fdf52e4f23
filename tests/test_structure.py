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
    tree = ast.parse((PACKAGE / "strategies" / "base.py").read_text())
    strategy = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Strategy")
    methods = [f.name for f in strategy.body if isinstance(f, ast.FunctionDef) and f.name != "__init__"]
    assert "wrap" in methods and len(methods) <= 12, methods


def test_no_two_modules_of_the_package_share_a_name():
    names = Counter(p.stem for p in PACKAGE.rglob("*.py") if p.stem != "__init__")
    assert {name: n for name, n in names.items() if n > 1} == {}
