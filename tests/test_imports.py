"""The import graph of the package: no cycles, and dependencies pointing one way.

Read from the source with `ast` (every import statement, including those under TYPE_CHECKING and
inside functions), so a cycle fails here even when import order happens to hide it at run time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"sonar_fx": REPO / "sonar_fx", "sonar_fx.passes": REPO / "passes"}  # pyproject package-dir


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for prefix, root in ROOTS.items():
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([prefix, *parts])] = path
    return found


MODULES = _modules()


def _target(name: str) -> str | None:
    """The project module an import of `name` executes (the longest known prefix), or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(_target(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                # `from pkg import mod` imports the submodule; `from mod import name` only mod.
                full = f"{base}.{alias.name}"
                targets.add(full if full in MODULES else _target(base))
    return {t for t in targets if t is not None and t != module}


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read_from_the_source():
    # Guards the parser itself: edges it must see (absolute, relative, `from pkg import module`).
    assert "sonar_fx.trainer.plan" in GRAPH["sonar_fx.trainer.loop"]
    assert "sonar_fx.data" in GRAPH["sonar_fx.trainer.plan"]
    assert "sonar_fx.api" in GRAPH["sonar_fx.methods"]
    assert len(MODULES) > 40


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


# The layers, bottom first: a module imports only modules of its own layer or of layers below it. Every
# module belongs to exactly one layer (the longest prefix that names it), so a new module must be placed.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("log filters", ("sonar_fx.log_filters",)),  # other libraries' noise, filtered at import: torch only
    ("errors", ("sonar_fx.errors",)),
    ("runtime", ("sonar_fx.runtime",)),  # the in-graph op and its weak registry
    ("passes", ("sonar_fx.passes",)),  # the graph passes: torch and their own files only
    ("data", ("sonar_fx.data",)),
    ("config", ("sonar_fx.config", "sonar_fx.config_options")),
    ("experts", ("sonar_fx.experts",)),  # discovery, expert kernels, the discovery report
    ("models", ("sonar_fx.models",)),
    ("measurement", ("sonar_fx.memory", "sonar_fx.memory_live", "sonar_fx.measure", "sonar_fx.environment",
                     "sonar_fx.workload")),
    ("optim", ("sonar_fx.optim",)),  # the update math and SonarOptimizer
    ("backend", ("sonar_fx.backend", "sonar_fx.compiled")),
    ("api", ("sonar_fx.api", "sonar_fx")),  # sonar_fx.compile / prepare, and the package's exports
    ("distributed", ("sonar_fx.distributed",)),
    ("engines", ("sonar_fx.engines",)),
    ("methods", ("sonar_fx.methods",)),
    ("planner", ("sonar_fx.planner",)),  # a method's real step on a fake model, under torch's MemTracker
    ("integrations", ("sonar_fx.integrations",)),
    ("trainer", ("sonar_fx.trainer",)),
    ("demo", ("sonar_fx.demo",)),
    ("cli", ("sonar_fx.cli", "sonar_fx.__main__")),
)  # fmt: skip


def _layer(module: str) -> int | None:
    """Index in LAYERS of the longest prefix naming `module` (None: no layer names it). "sonar_fx" names
    the package's `__init__` only, so a new top-level module is never placed by default."""
    naming = [
        (len(prefix), index)
        for index, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or (prefix != "sonar_fx" and module.startswith(prefix + "."))
    ]
    return max(naming)[1] if naming else None


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a module from a higher layer, as "a (layer) imports b (layer)"."""
    names = [name for name, _ in LAYERS]
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            mine, theirs = _layer(module), _layer(target)
            if mine is not None and theirs is not None and theirs > mine:
                found.append(f"{module} ({names[mine]}) imports {target} ({names[theirs]})")
    return found


def test_every_module_belongs_to_a_layer():
    unplaced = sorted(m for m in MODULES if _layer(m) is None)
    assert not unplaced, f"place these modules in LAYERS: {unplaced}"
    assert _layer("sonar_fx.experts.report") < _layer("sonar_fx.models.families")  # type: ignore[operator]
    assert _layer("sonar_fx") == _layer("sonar_fx.api") and _layer("sonar_fx.new_module") is None


def test_the_layer_check_finds_an_upward_import():
    assert _upward({"sonar_fx.experts.report": {"sonar_fx.models.families"}}) == [
        "sonar_fx.experts.report (experts) imports sonar_fx.models.families (models)"
    ]
    assert _upward({"sonar_fx.trainer.loop": {"sonar_fx.methods", "sonar_fx.trainer.plan"}}) == []


# Exports the package's `__getattr__` imports on first use from a layer above it (`sonar_fx.plan`): never
# at import time (checked below), so `import sonar_fx` loads none of them.
LAZY_EXPORTS = {"sonar_fx": {"sonar_fx.planner"}}


def test_imports_point_down_the_layers():
    graph = {m: targets - LAZY_EXPORTS.get(m, set()) for m, targets in GRAPH.items()}
    upward = _upward(graph)
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_lazy_exports_are_imported_inside_functions_only():
    for module, lazy in LAZY_EXPORTS.items():
        top_level = ast.parse(MODULES[module].read_text()).body
        eager = {
            _target(f"{n.module}.{a.name}")
            for n in top_level
            if isinstance(n, ast.ImportFrom)
            for a in n.names
        }
        eager |= {_target(a.name) for n in top_level if isinstance(n, ast.Import) for a in n.names}
        assert lazy <= GRAPH[module] and not lazy & eager, (module, lazy & eager)


@pytest.mark.parametrize("package", ["sonar_fx.passes", "sonar_fx.runtime", "sonar_fx.data"])
def test_self_contained_packages_import_only_themselves(package):
    """The passes name the update op through torch.ops; the runtime is the bottom layer; the data
    pipeline knows nothing of training."""
    for module in (m for m in MODULES if m == package or m.startswith(package + ".")):
        outside = sorted(t for t in GRAPH[module] if not (t == package or t.startswith(package + ".")))
        assert not outside, f"{module} imports {outside}"
