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


def import_graph() -> dict[str, set[str]]:
    """Each kvbridge module's relative imports at any level (top or inside a function), as module names."""
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
    return graph


def test_no_import_cycle_in_the_package():
    """No module imports, at any level (top or inside a function), a module that imports it back."""
    graph = import_graph()
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


# code that runs inside a vLLM engine, and what it must never reach: launchers, benchmarks, the command line
ENGINE = {f"kvbridge.serving.{m}" for m in ("config", "connector", "producer", "store", "hot", "idle", "prewarm",
                                             "middleware", "lmcache_store")}
ABOVE_ENGINE = {f"kvbridge.serving.{m}" for m in ("server", "commands", "bench", "cascade", "quality", "load",
                                                   "lmcache_probe")} | {"kvbridge.cli", "kvbridge.demo",
                                                                        "kvbridge.frontier", "kvbridge.gap"}


def test_engine_code_never_reaches_the_launchers():
    """The layers hold: a module vLLM loads imports (at any depth, at any level) no launcher, benchmark or CLI."""
    graph = import_graph()

    def reachable(start):
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    assert ENGINE <= set(graph), ENGINE - set(graph)
    reached = {m: sorted(reachable(m) & ABOVE_ENGINE) for m in sorted(ENGINE)}
    assert not any(reached.values()), reached


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
