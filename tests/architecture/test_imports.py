"""The package's import graph: no module imports another in a cycle, and dependencies run one way
(cli -> config -> run layer -> merge -> stats, solvers -> problem, constraints, certificate -> errors).

Every ``import`` statement of the package counts, at module top or inside a function, except those
under ``if TYPE_CHECKING:`` (annotations only, never executed)."""

from __future__ import annotations

import ast
from pathlib import Path


PACKAGE = Path(__file__).resolve().parents[2] / "mergeqp"

# layer of each top-level unit (a module or a subpackage of mergeqp), low = foundation;
# a module may import only units of a lower or equal layer (equal: within its own unit)
LAYERS: dict[str, int] = {
    "errors": 0, "jsonutil": 0, "formatting": 0, "_lazy": 0, "plugins": 0,
    "io": 1, "matrix_cache": 1, "cholesky": 1,
    "problem": 2, "lower_bounds": 2,
    "constraints": 3,
    "solution": 4, "certificate": 4, "output_metrics": 4,
    "solvers": 5, "lm": 5,
    "stats": 6,
    "merge": 7,
    "run": 8,
    "experiments": 9, "config": 9,  # (experiments build their merges through the run layer: above it)
    "cli": 10, "__main__": 11, "__init__": 11,
}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports_of(path: Path) -> set[str]:
    """Absolute names of the mergeqp modules that ``path`` imports (executed imports only)."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name.split(".")[0] == "mergeqp")
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                if target.split(".")[0] != "mergeqp":
                    continue
                for a in child.names:  # `from . import x` may name a submodule
                    sub = f"{target}.{a.name}"
                    found.add(sub if _exists(sub) else target)
            visit(child)

    visit(tree)
    found = with_parent_packages(mod, found)
    found.discard(mod)
    return found


def with_parent_packages(mod: str, names: set[str]) -> set[str]:
    """``names`` plus the packages they sit in: importing ``mergeqp.a.b`` first runs the package
    ``mergeqp.a`` (its ``__init__``), unless that package encloses ``mod`` (it is then already
    being imported, not run again). The top-level ``mergeqp`` is lazy and left out."""
    out = set(names)
    for name in names:
        parts = name.split(".")
        for i in range(2, len(parts)):
            parent = ".".join(parts[:i])
            if not (mod == parent or mod.startswith(parent + ".")):
                out.add(parent)
    return out


def _exists(name: str) -> bool:
    p = PACKAGE.parent.joinpath(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in sorted(PACKAGE.rglob("*.py"))}


def unit(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_unit_has_a_layer():
    missing = sorted({unit(m) for m in graph()} - set(LAYERS))
    assert not missing, f"add these package units to LAYERS: {missing}"


def find_cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``g`` (module -> imported modules): its strongly connected
    components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in g:
                continue
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in g:
        if v not in index:
            strong(v)
    return cycles


def test_no_import_cycles():
    cycles = find_cycles(graph())
    assert not cycles, f"modules importing each other in a cycle: {cycles}"


def test_a_cycle_through_a_package_init_is_seen():
    """``run.plan`` imports ``experiments.data`` (which first runs ``experiments/__init__``) and
    that ``__init__`` imports ``run.plan``: a cycle, although no module names the other directly."""
    g = {"mergeqp.run.plan": with_parent_packages("mergeqp.run.plan", {"mergeqp.experiments.data"}),
         "mergeqp.experiments": {"mergeqp.run.plan"}, "mergeqp.experiments.data": set()}
    assert find_cycles(g) == [["mergeqp.experiments", "mergeqp.run.plan"]]
    # a module's own package is already being imported: no edge back to it
    assert with_parent_packages("mergeqp.constraints.box", {"mergeqp.constraints.base"}) == {"mergeqp.constraints.base"}
    assert "mergeqp.merge" in graph()["mergeqp.run.plan"]  # run.plan imports mergeqp.merge.registry


def test_dependencies_run_one_way():
    bad = []
    for mod, deps in graph().items():
        for dep in deps:
            a, b = unit(mod), unit(dep)
            if a != b and b != "__init__" and LAYERS[b] > LAYERS[a]:
                bad.append(f"{mod} -> {dep}")
            if b == "__init__" and a != "__init__":
                bad.append(f"{mod} -> {dep} (the lazy top-level package)")
    assert not bad, "imports that run up the layers:\n" + "\n".join(sorted(bad))


def test_the_graph_reader_sees_imports():
    """The reader itself: relative, absolute and deferred imports are found, TYPE_CHECKING ones not."""
    g = graph()
    assert "mergeqp.errors" in g["mergeqp.problem"]
    assert any(d.startswith("mergeqp.solvers") for d in g["mergeqp.cli.solve"])


def deferred_own_imports(path: Path) -> list[str]:
    """``file:line`` of the package's own imports made inside functions, except those whose
    line says why (``# deferred: <reason>``)."""
    text = path.read_text()
    lines = text.splitlines()
    tree = ast.parse(text, filename=str(path))
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            own = (isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").startswith("mergeqp"))) \
                or (isinstance(node, ast.Import) and any(a.name.startswith("mergeqp") for a in node.names))
            if own and "# deferred:" not in lines[node.lineno - 1]:
                out.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return sorted(set(out))


def test_own_imports_at_module_top():
    """Only the CLI defers the package's own imports (so that ``mergeqp --help`` loads no torch;
    see ``mergeqp/cli/__init__.py``); everywhere else they stand at module top, where a cycle
    would show at once, unless the line gives its reason (``# deferred: matplotlib loads only
    when figures are drawn``)."""
    bad = [hit for p in sorted(PACKAGE.rglob("*.py")) if unit(module_name(p)) != "cli"
           for hit in deferred_own_imports(p)]
    assert not bad, "move these imports to the module top:\n" + "\n".join(bad)


def test_no_isinstance_on_constraint_classes_outside_constraints():
    """Solvers, the certificate and the merge path ask a set what it can do (its declared
    capabilities), so a user's own set class works everywhere: no ``isinstance`` on the
    package's concrete set classes outside :mod:`mergeqp.constraints`."""
    import mergeqp.constraints as constraints

    concrete = {name for name, obj in vars(constraints).items()
                if isinstance(obj, type) and issubclass(obj, constraints.ConstraintSet)
                and obj is not constraints.ConstraintSet}
    assert {"Box", "Simplex", "L1Ball"} <= concrete
    bad = []
    for p in sorted(PACKAGE.rglob("*.py")):
        if unit(module_name(p)) == "constraints":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance" \
                    and len(node.args) == 2:
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)}
                if names & concrete:
                    bad.append(f"{p.relative_to(PACKAGE.parent)}:{node.lineno}: {sorted(names & concrete)}")
    assert not bad, "isinstance on constraint classes (ask the set's capabilities instead):\n" + "\n".join(bad)
