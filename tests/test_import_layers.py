"""The merge path's layers import one way: ``cli -> config -> run -> merge -> stats``; no cycles.

Reads the import statements of the modules (top level and inside functions alike), so a
deferred import cannot hide a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "mergeqp"


def _module(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The ``mergeqp`` modules ``path`` imports (relative imports resolved; ``from X import name``
    counts ``X.name`` when that is a module)."""
    mod = _module(path)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("mergeqp"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("mergeqp"):
                continue
            out.add(target)
            for a in node.names:
                sub = f"{target}.{a.name}"
                if (PKG.parent / Path(*sub.split("."))).with_suffix(".py").exists():
                    out.add(sub)
    return out


def _graph(prefixes: tuple[str, ...]) -> dict[str, set[str]]:
    mods = {_module(p): p for p in PKG.rglob("*.py")}
    chosen = {m for m in mods if m.startswith(prefixes)}
    return {m: {t for t in _imports(mods[m]) if t in chosen and t != m} for m in chosen}


LAYERS = ("mergeqp.config", "mergeqp.run", "mergeqp.merge", "mergeqp.stats.parametrisation",
          "mergeqp.stats.bases", "mergeqp.stats.basis")


def test_merge_never_reads_the_config_or_the_run_layer():
    graph = _graph(("mergeqp.",))
    for mod, targets in graph.items():
        if mod.startswith(("mergeqp.merge", "mergeqp.stats")):
            bad = sorted(t for t in targets if t.startswith(("mergeqp.config", "mergeqp.run", "mergeqp.cli")))
            assert not bad, f"{mod} imports {bad} (merge/stats must not depend on the layers above them)"
        if mod.startswith("mergeqp.stats"):
            bad = sorted(t for t in targets if t.startswith("mergeqp.merge"))
            assert not bad, f"{mod} imports {bad} (stats is below merge)"


def test_no_import_cycle_in_the_merge_path():
    graph = _graph(LAYERS)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycle = stack[stack.index(t):] + [t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert "mergeqp.run.plan" in graph and "mergeqp.run.pipeline" in graph


def test_the_checker_sees_relative_and_deferred_imports():
    imports = _imports(PKG / "run" / "pipeline.py")
    assert {"mergeqp.run.plan", "mergeqp.merge.modes", "mergeqp.config"} <= imports
