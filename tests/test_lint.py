"""The house style holds: `ruff check` (rules in pyproject.toml) is clean, so CI fails on a lint error."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean():
    ruff = shutil.which("ruff")
    if ruff is None:  # installed by the README's install command (the `dev` extra); elsewhere say so
        pytest.skip("ruff is not installed: pip install -e '.[dev]'")
    run = subprocess.run([ruff, "check", "src", "tests"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def _module_name(path: Path, package: Path) -> str:
    return ".".join(path.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__")


def _imports(path: Path, module: str):
    """``(target, names)`` of each kvbridge import of one file at any level (top or inside a function): relative
    imports resolved against ``module``, absolute ``from kvbridge... import`` and ``import kvbridge...`` as they are."""
    import ast

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")
                base = parts if path.name == "__init__.py" else parts[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "kvbridge" or target.startswith("kvbridge."):
                yield target, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "kvbridge" or a.name.startswith("kvbridge."):
                    yield a.name, []


def import_graph() -> dict[str, set[str]]:
    """Each kvbridge module's imports of kvbridge modules, relative or absolute, at any level (top or inside a
    function), as module names (``from . import x`` of a submodule ``x``: that submodule)."""
    package = ROOT / "src" / "kvbridge"
    paths = {_module_name(path, package): path for path in package.rglob("*.py")}
    graph = {}
    for module, path in paths.items():
        deps = set()
        for target, names in _imports(path, module):
            subs = {f"{target}.{n}" for n in names} & set(paths)
            deps |= subs or {target}
            if len(subs) < len(names):  # names that are attributes of ``target``, not submodules
                deps.add(target)
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


# The layers, bottom first: a module imports only from its own layer or the layers before it. errors and version
# are leaves every layer may import; the family's loaders sit on the core (the measurements, the card and the
# serving benchmarks load the embedded family), its trainers beside fit and measure (they use the evaluation).
LAYERS = (
    ("kvbridge.errors", "kvbridge.version", "kvbridge.core"),
    ("kvbridge.family",),
    ("kvbridge.fit", "kvbridge.measure", "kvbridge.release", "kvbridge.family.training", "kvbridge"),
    ("kvbridge.serving", "kvbridge.serving.engine", "kvbridge.serving.store"),
    ("kvbridge.serving.launch", "kvbridge.serving.bench"),
    ("kvbridge.cli", "kvbridge.__main__"),
)


def layer_of(module: str) -> int | None:
    """The layer of ``module``: that of the longest prefix in LAYERS (a package and everything in it; the top
    package ``kvbridge``, its __init__ with the public names, holds only itself)."""
    best = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or (prefix != "kvbridge" and module.startswith(prefix + "."))) and (
                    best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    return None if best is None else best[1]


def test_every_module_has_a_layer():
    """A new module (or package) is placed in LAYERS before it is checked."""
    unplaced = sorted(m for m in import_graph() if layer_of(m) is None)
    assert not unplaced, unplaced


def test_the_layers_hold():
    """core ← family ← fit, measure, release (and the family's trainers) ← serving.engine, serving.store ←
    serving.launch, serving.bench ← cli: no module imports (at any level, relative or absolute) a module of a layer
    after its own, so the core never reaches a measurement and code inside a vLLM engine never reaches a launcher,
    a benchmark or the command line."""
    graph = import_graph()
    wrong = sorted(f"{m} (layer {layer_of(m)}) imports {d} (layer {layer_of(d)})"
                   for m, deps in graph.items() for d in deps if d in graph and layer_of(d) > layer_of(m))
    assert not wrong, wrong


def test_the_layers_see_absolute_imports(tmp_path, monkeypatch):
    """The import graph reads absolute ``kvbridge.`` imports as well as relative ones (a layer broken by an absolute
    import is not missed)."""
    package = tmp_path / "src" / "kvbridge"
    (package / "core").mkdir(parents=True)
    (package / "cli").mkdir()
    for name in ("__init__.py", "core/__init__.py", "cli/__init__.py", "cli/app.py"):
        (package / name).write_text("")
    (package / "core" / "mapper.py").write_text("def f():\n    from kvbridge.cli.app import main\n")
    (package / "core" / "models.py").write_text("from ..cli import app\nimport kvbridge.cli\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    graph = import_graph()
    assert graph["kvbridge.core.mapper"] == {"kvbridge.cli.app"}
    assert graph["kvbridge.core.models"] == {"kvbridge.cli.app", "kvbridge.cli"}
    with pytest.raises(AssertionError, match="kvbridge.core.mapper .layer 0. imports kvbridge.cli.app"):
        test_the_layers_hold()


# code that runs inside a vLLM engine (every module of serving/engine and serving/store), and what it must never
# reach, even within the layers: launchers, benchmarks, the command line (every module of serving/bench and cli),
# and the measurements that fit mappers (demo, frontier and its report, gap)
ENGINE_PACKAGES = ("kvbridge.serving.engine", "kvbridge.serving.store")
ABOVE_ENGINE_PACKAGES = ("kvbridge.serving.bench", "kvbridge.cli")
ABOVE_ENGINE_MODULES = {"kvbridge.serving.launch", "kvbridge.measure.demo", "kvbridge.measure.frontier",
                        "kvbridge.measure.frontier_report", "kvbridge.measure.gap"}


def _in(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


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

    engine = {m for m in graph if _in(m, ENGINE_PACKAGES)}
    above = {m for m in graph if _in(m, ABOVE_ENGINE_PACKAGES)} | ABOVE_ENGINE_MODULES
    assert len(engine) >= 15 and {"kvbridge.serving.engine.connector", "kvbridge.serving.engine.producer"} <= engine
    assert ABOVE_ENGINE_MODULES <= set(graph) and "kvbridge.cli.registry" in above, ABOVE_ENGINE_MODULES - set(graph)
    reached = {m: sorted(reachable(m) & above) for m in sorted(engine)}
    assert not any(reached.values()), reached


def test_every_relative_import_names_something_that_exists():
    """`from .module import name` anywhere in the package (function-level imports included, which only fail
    when that function runs; absolute `from kvbridge.module import name` too) names an attribute the module has: a
    function moved to another module breaks here, not in a user's script."""
    import importlib

    package = ROOT / "src" / "kvbridge"
    missing = []
    for path in package.rglob("*.py"):
        module = _module_name(path, package)
        for target, names in _imports(path, module):
            imported = importlib.import_module(target)
            missing += [f"{module}: {target}.{name}" for name in names
                        if name != "*" and not hasattr(imported, name)
                        and importlib.util.find_spec(f"{target}.{name}") is None]
    assert not missing, missing
