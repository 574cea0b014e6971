"""The house style holds: `ruff check` (rules in pyproject.toml) is clean, so CI fails on a lint error."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    ruff = shutil.which("ruff")
    if ruff is None:  # installed by the README's install command (the `dev` extra); elsewhere say so
        pytest.skip("ruff is not installed: pip install -e '.[dev]'")
    run = subprocess.run([ruff, "check", "src", "tests"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr



def test_no_import_cycle_in_the_package():
    """No module imports, at any level (top or inside a function), a module that imports it back."""
    import ast

    package = ROOT / "src" / "kvbridge"
    graph = {}
    for path in package.rglob("*.py"):
        module = ".".join(path.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__")
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level:
                parts = module.split(".")
                base = parts if path.name == "__init__.py" else parts[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                deps |= {f"{target}.{a.name}" for a in node.names} if node.module is None else {target}
        graph[module] = deps
    modules = set(graph)

    def reachable(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt in modules and nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    cycles = sorted({tuple(sorted((a, b))) for a in modules for b in graph[a] & modules
                     if a != b and a in reachable(b)})
    assert not cycles, cycles


def test_every_relative_import_names_something_that_exists():
    """`from .module import name` anywhere in the package (function-level imports included, which only fail
    when that function runs) names an attribute the module has: a function moved to another module breaks here,
    not in a user's script."""
    import ast
    import importlib

    package = ROOT / "src" / "kvbridge"
    missing = []
    for path in package.rglob("*.py"):
        module = ".".join(path.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level and node.module:
                parts = module.split(".")
                base = parts if path.name == "__init__.py" else parts[:-1]
                target = ".".join(base[: len(base) - (node.level - 1)] + [node.module])
                imported = importlib.import_module(target)
                missing += [f"{module}: {target}.{a.name}" for a in node.names
                            if a.name != "*" and not hasattr(imported, a.name)
                            and importlib.util.find_spec(f"{target}.{a.name}") is None]
    assert not missing, missing
