"""Every ```python example of docs/*.md runs as written: the blocks of one page in order, in one
namespace, from a fresh folder that sees the repository's committed ``problems/`` (so a user who
copies a page's examples into one script in the repository root gets the same). A block that cannot
run in a test (a full experiment) says so on the line before its fence:
``<!-- not run by the docs test: WHY -->``. docs/architecture.md's examples register names and have
their own tests (tests/architecture/test_architecture_doc.py, tests/run/test_extending.py)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SKIP = re.compile(r"<!-- not run by the docs test: (.+?) -->\n```python\n")
OWN_TESTS = {"architecture.md"}


def blocks(page: Path) -> list[tuple[str, str | None]]:
    """The page's python blocks as ``(code, reason it is not run or None)``."""
    text = page.read_text()
    out = []
    for m in re.finditer(r"```python\n(.*?)```", text, flags=re.S):
        skip = SKIP.search(text, max(0, m.start() - 300), m.start() + len("```python\n"))
        out.append((m.group(1), skip.group(1) if skip and skip.end() == m.start() + len("```python\n") else None))
    return out


#: pages with at least one example that runs here
PAGES = sorted(p.name for p in DOCS.glob("*.md")
               if p.name not in OWN_TESTS and any(reason is None for _, reason in blocks(p)))

#: what each page's examples must leave behind (beyond running without an error)
CHECKS = {
    "core.md": lambda ns: ns["sol"].certificate.certified(),
    "certificates.md": lambda ns: ns["cert"].certified(rel_tol=1e-8),
    "statistics.md": lambda ns: (ns["sol"].certificate.certified()
                                 and all(ns["problem"].objective(ns["atoms"].baseline_point(n, ns["problem"].K))
                                         >= ns["sol"].objective - 1e-9 for n in ns["atoms"].baselines)),
    "baselines.md": lambda ns: (list(ns["merged"]) == list(ns["base"])
                                and set(ns["layer"]) == {"2.weight", "2.bias"}),
    "constraints.md": lambda ns: "EuclideanBall" in ns and ns["K"] == ns["problem"].K,
}


def test_the_pages_have_examples() -> None:
    assert {"core.md", "statistics.md", "baselines.md", "constraints.md", "certificates.md"} <= set(PAGES)
    assert set(CHECKS) <= set(PAGES)


def test_skip_markers_are_read() -> None:
    mnist = blocks(DOCS / "mnist.md")
    assert mnist and mnist[0][1] is not None and "minutes" in mnist[0][1]
    assert all(reason is None for _, reason in blocks(DOCS / "core.md"))
    assert "mnist.md" not in PAGES and "lm.md" not in PAGES   # every example of theirs is a long experiment


def test_examples_not_run_still_compile_and_import() -> None:
    """A long example is not run, but it parses and the names it imports exist."""
    marked = [(page.name, code) for page in sorted(DOCS.glob("*.md")) for code, reason in blocks(page) if reason]
    assert len(marked) >= 2
    for name, code in marked:
        compile(code, f"docs/{name}", "exec")
        imports = "\n".join(line for line in code.splitlines() if line.startswith(("from ", "import ")))
        exec(compile(imports, f"docs/{name} (imports)", "exec"), {})  # noqa: S102


@pytest.mark.parametrize("page", PAGES)
def test_page_examples_run(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    (tmp_path / "problems").symlink_to(ROOT / "problems", target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    namespace: dict = {"__name__": f"docs_{page[:-3]}"}
    ran = 0
    for i, (code, reason) in enumerate(blocks(DOCS / page)):
        if reason is not None:
            continue
        exec(compile(code, f"docs/{page} (python block {i + 1})", "exec"), namespace)  # noqa: S102
        ran += 1
    assert ran > 0
    check = CHECKS.get(page)
    if check is not None:
        assert check(namespace), f"docs/{page}: the examples ran but left a wrong result"
    assert os.getcwd() == str(tmp_path)


def yaml_blocks() -> list[tuple[str, int, str]]:
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    return [(page.name, i, code) for page in pages
            for i, code in enumerate(re.findall(r"```yaml\n(.*?)```", page.read_text(), flags=re.S))]


#: what a fragment of a merge config (a `method:` block, an `output:` line) is completed with
SKELETON = {"base": "./base", "models": [{"path": "./ft_a", "calibration": "./a.jsonl"},
                                      {"path": "./ft_b", "calibration": "./b.jsonl"}], "layers": ["mlp.down_proj"]}


@pytest.mark.parametrize(("page", "index", "code"), yaml_blocks(), ids=lambda v: str(v)[:20])
def test_yaml_examples_are_valid_merge_configs(page: str, index: int, code: str) -> None:
    """Every YAML example (a whole `mergeqp merge` file or a fragment of one) validates as a
    MergeConfig, completed where it is a fragment; a list item written `...` stands for more of
    the same and is left out."""
    import yaml

    from mergeqp.run.schema import MergeConfig

    block = yaml.safe_load(code)
    assert isinstance(block, dict), f"{page} yaml block {index + 1} is not a mapping"
    if isinstance(block.get("models"), list):
        block["models"] = [m for m in block["models"] if m != "..."]
    MergeConfig.model_validate({**SKELETON, **block})


def test_there_are_yaml_examples() -> None:
    assert len(yaml_blocks()) >= 8
