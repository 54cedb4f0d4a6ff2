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


# Layers below the trainer never import it (nor the command line, the demo, or the training methods).
UPPER = ("sonar_fx.cli", "sonar_fx.demo", "sonar_fx.trainer", "sonar_fx.methods")
LOWER = ("sonar_fx.api", "sonar_fx.backend", "sonar_fx.eager", "sonar_fx.optim", "sonar_fx.runtime",
         "sonar_fx.experts", "sonar_fx.models", "sonar_fx.passes", "sonar_fx.config", "sonar_fx.data",
         "sonar_fx.memory")  # fmt: skip


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _within(m, LOWER)))
def test_lower_layers_never_import_the_trainer(module):
    upward = sorted(t for t in GRAPH[module] if _within(t, UPPER))
    assert not upward, f"{module} imports {upward}"


def test_data_imports_no_training_code():
    for module in (m for m in MODULES if _within(m, ("sonar_fx.data",))):
        outside = sorted(t for t in GRAPH[module] if not _within(t, ("sonar_fx.data",)))
        assert not outside, f"{module} imports {outside}"
