"""The numerical core's import graph: no cycles, dependencies one way (solvers -> certificate ->
constraints -> lower_bounds -> errors), own-package imports at module top, and no solver or set
class asked about by ``isinstance`` outside the set's own module."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "mergeqp"
CORE = ("constraints", "solvers", "certificate", "lower_bounds", "problem", "solution", "errors")
SET_CLASSES = ("Box", "Simplex", "GlobalSimplex", "L1Ball", "SignConsensus", "UserConstraints",
               "Unconstrained", "Intersection")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _core_files() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).parts
        if rel[0].removesuffix(".py") in CORE:
            out[_module_name(path)] = path
    return out


FILES = _core_files()
ALL = {_module_name(p) for p in ROOT.rglob("*.py")}


def _imports(name: str, path: Path, top_level_only: bool) -> set[str]:
    """The package's own modules that ``name`` imports (``from X import Y`` counts Y when it is a
    module); with ``top_level_only``, only imports outside functions and ``TYPE_CHECKING``."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in ALL else target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in ALL and m != name}


def test_the_core_has_no_import_cycle() -> None:
    graph = {name: _imports(name, path, top_level_only=True) & set(FILES) for name, path in FILES.items()}
    # a package's __init__ re-exports its modules; a module importing its own package's
    # __init__ would close a cycle through it, which the search below sees
    seen: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state = seen.get(node, 0)
        if state == 1:
            pytest.fail("import cycle: " + " -> ".join(trail[trail.index(node):] + [node]))
        if state == 2:
            return
        seen[node] = 1
        for nxt in sorted(graph[node]):
            visit(nxt, trail + [node])
        seen[node] = 2

    for name in sorted(graph):
        visit(name, [])


@pytest.mark.parametrize(("lower", "higher"), [
    ("mergeqp.constraints", "mergeqp.solvers"), ("mergeqp.constraints", "mergeqp.certificate"),
    ("mergeqp.lower_bounds", "mergeqp.constraints"), ("mergeqp.certificate", "mergeqp.solvers"),
    ("mergeqp.problem", "mergeqp.constraints"), ("mergeqp.problem", "mergeqp.solvers"),
])
def test_dependencies_run_one_way(lower: str, higher: str) -> None:
    for name, path in FILES.items():
        if name == lower or name.startswith(lower + "."):
            bad = {m for m in _imports(name, path, top_level_only=False) if m == higher or m.startswith(higher + ".")}
            assert not bad, f"{name} imports {sorted(bad)}, a layer above it"


def test_own_modules_are_imported_at_module_top() -> None:
    for name, path in FILES.items():
        deferred = _imports(name, path, top_level_only=False) - _imports(name, path, top_level_only=True)
        typing_only = "TYPE_CHECKING" in path.read_text()
        if typing_only:  # annotations only (solution -> certificate)
            continue
        assert not deferred, f"{name} defers imports of {sorted(deferred)}"


def test_no_isinstance_on_set_classes_outside_their_modules() -> None:
    pattern = re.compile(r"isinstance\([^)]*\b(" + "|".join(SET_CLASSES) + r")\b")
    for name, path in FILES.items():
        if name.startswith("mergeqp.constraints"):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            assert not pattern.search(line), f"{path}:{i} asks a set's class instead of its capability: {line.strip()}"
