"""docs/architecture.md's worked examples run as written: a constraint set and a solver defined
in a user's script are registered, solved and certified (the doc's own asserts compare them with
the built-in box and solver). The parametrisation / method / mode example of the same page is run
by the merge tests, which merge models with it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mergeqp.constraints import CONSTRAINT_SETS
from mergeqp.solvers.registry import SOLVERS

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def section_code(title: str) -> str:
    text = DOC.read_text().split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, f"no python block under '## {title}'"
    return "\n".join(blocks)


@pytest.fixture
def in_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)
    yield
    CONSTRAINT_SETS.pop("interval", None)
    SOLVERS.pop("pgd", None)


def test_constraint_set_and_solver_examples_run(in_repo_root):
    namespace: dict = {}
    exec(compile(section_code("Add a constraint set"), "docs/architecture.md", "exec"), namespace)  # noqa: S102
    assert "interval" in CONSTRAINT_SETS
    exec(compile(section_code("Add a solver"), "docs/architecture.md", "exec"), namespace)  # noqa: S102
    assert namespace["sol"].solver == "pgd" and namespace["sol"].certificate.certified()


def test_every_layer_named_in_the_map_exists():
    table = DOC.read_text().split("## The layers", 1)[1].split("## The registries", 1)[0]
    paths = set(re.findall(r"`(mergeqp/[\w/.]+)`", table))
    assert len(paths) >= 15
    missing = [p for p in sorted(paths) if not (ROOT / p).exists()]
    assert not missing, missing
